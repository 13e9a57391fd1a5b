"""modeling.target.argmax_chunked (the two-stage argmax CUDA steps use over a large vocabulary) == torch.argmax,
first index among equal maxima included: ties inside one chunk, across chunks, in the padded last chunk."""
import torch

from dflash_trt.modeling.target import ARGMAX_SPLIT, argmax_chunked


def test_two_stage_argmax_is_argmax_with_first_index_ties():
    V = 3 * ARGMAX_SPLIT + 1234  # the last chunk is padded
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, V, generator=g).to(torch.bfloat16)
    x[0, 0, [17, 5 * ARGMAX_SPLIT // 2, V - 1]] = 9.0     # across chunks: the first wins
    x[1, 1, [ARGMAX_SPLIT + 3, ARGMAX_SPLIT + 2]] = 9.0  # inside one chunk: the lower index
    x[2, 2, V - 1] = 9.0                                  # the padded chunk's last real column
    x[3, 0] = 1.5                                         # a row of equal values: index 0
    got = argmax_chunked(x)
    assert torch.equal(got, x.argmax(-1))
    assert got[0, 0] == 17 and got[1, 1] == ARGMAX_SPLIT + 2 and got[2, 2] == V - 1 and got[3, 0] == 0
