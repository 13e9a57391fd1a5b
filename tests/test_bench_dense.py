"""`bench e2e --model random-27b [--fp8] [--layers N]` on CPU (its timings need a GPU): the Qwen3.5-27B config the
preset builds, the drafter's taps, the FP8 skip list, the FP8 model built at tiny width (which layers are FP8, its
weights' scale), the floor's byte accounting (fp8 bytes + fp32 scales as stored) and the flags' refusals."""
import math

import pytest
import torch

from dflash_trt.config import DrafterConfig, TargetConfig
from dflash_trt.modeling.fp8 import Fp8Linear
from dflash_trt.tools import bench_dense as B

pytestmark = pytest.mark.usefixtures("one_thread")
TINY = dict(hidden=256, inter=256, heads=2, kv_heads=1, head_dim=64, gdn_k=2, gdn_v=4, gdn_dim=64, vocab=512,
            d_heads=2, d_kv_heads=1, d_head_dim=64)


def test_27b_config_shapes_and_taps():
    t = TargetConfig.from_dict(B.dense_target_config())
    assert (t.hidden_size, t.intermediate_size, t.vocab_size, len(t.layer_types)) == (5120, 17408, 248320, 64)
    assert [i for i, k in enumerate(t.layer_types) if k == "full_attention"] == list(range(3, 64, 4))
    assert set(t.layer_types) == {"full_attention", "linear_attention"} and not t.tie_word_embeddings
    raw = B.dense_target_config()
    assert (raw["num_attention_heads"], raw["num_key_value_heads"], raw["head_dim"]) == (24, 4, 256)
    assert (raw["linear_num_key_heads"], raw["linear_num_value_heads"], raw["linear_key_head_dim"]) == (16, 48, 128)
    assert raw["rope_parameters"]["partial_rotary_factor"] == 0.25
    d = DrafterConfig.from_dict(B.dense_drafter_config())
    assert d.num_layers == 5 and d.hidden_size == 5120 and d.target_layer_ids == [1, 16, 31, 46, 61]
    assert B.taps(8) == [1, 2, 3, 4, 5] and B.taps(2) == [1] and B.dense_target_config(6)["num_hidden_layers"] == 6


def test_dflash2_drafter_of_the_27b_shape():
    """--dflash2: the same drafter with the DFlash2 fields; at tiny width it builds and drafts a block."""
    d = DrafterConfig.from_dict(B.dense_drafter_config(dflash2=True))
    assert (d.conv_kernel_size, d.conv_group_size, d.selector_rank, d.selector_top_k) == (4, 128, 256, 8)
    assert d.hidden_size == 5120 and d.num_layers == 5
    target, drafter = B.build_random_dense(torch.float32, "cpu", layers=4, dims=TINY, dflash2=True)
    names = {n for n, _ in drafter.named_parameters()}
    assert any("candidate_selector" in n for n in names) and any("attention_conv" in n for n in names)


def test_fp8_skip_list():
    q = B.fp8_config()
    kept = ["lm_head", "model.embed_tokens", "model.layers.0.linear_attn.in_proj_a",
            "model.layers.0.linear_attn.in_proj_b"]
    fp8 = ["model.layers.0.linear_attn.in_proj_qkv", "model.layers.0.linear_attn.in_proj_z",
           "model.layers.0.linear_attn.out_proj", "model.layers.3.self_attn.q_proj", "model.layers.3.self_attn.o_proj",
           "model.layers.0.mlp.gate_proj", "model.layers.0.mlp.down_proj"]
    assert not any(q.converts(m) for m in kept) and all(q.converts(m) for m in fp8)


@pytest.fixture(scope="module")
def tiny_fp8():
    return B.build_random_dense(torch.bfloat16, "cpu", layers=4, fp8=True, dims=TINY)


def test_fp8_model_converts_what_the_release_converts(tiny_fp8):
    target, drafter = tiny_fp8
    fp8 = {n for n, m in target.named_modules() if isinstance(m, Fp8Linear)}
    linears = {n for n, m in target.named_modules() if isinstance(m, torch.nn.Linear)}
    assert fp8 and all(n.rsplit(".", 1)[-1] in ("in_proj_a", "in_proj_b", "lm_head") for n in linears)
    assert "layers.3.self_attn.k_proj" in fp8 and "layers.0.linear_attn.in_proj_qkv" in fp8
    # the drafter as load_runtime makes it beside an FP8 target: every projection FP8, norms 16-bit
    assert {n for n, m in drafter.named_modules() if isinstance(m, Fp8Linear)} >= {"fc", "layers.0.mlp.down_proj"}
    assert not any(isinstance(m, torch.nn.Linear) for m in drafter.modules())
    assert drafter.dtype == torch.bfloat16
    lin = target.layers[0].mlp.gate_proj
    assert lin.weight.dtype == torch.float8_e4m3fn and lin.weight_scale_inv.dtype == torch.float32
    W = lin.dequantized(torch.float32)
    assert 0.015 < W.std().item() < 0.025 and bool((lin.weight_scale_inv == 0.02 / B.FP8_TYPICAL).all())
    assert target.embed_tokens.weight.dtype == target.lm_head.weight.dtype == torch.bfloat16
    with torch.no_grad():
        assert torch.isfinite(target.forward_full(torch.tensor([[1, 2, 3]]))["logits"]).all()


def test_floor_counts_the_bytes_as_stored(tiny_fp8):
    target, _ = tiny_fp8
    want = 0
    for m in target.modules():
        if isinstance(m, Fp8Linear):
            scales = math.ceil(m.out_features / 128) * math.ceil(m.in_features / 128)
            want += m.out_features * m.in_features + 4 * scales
        elif m is not target.embed_tokens:
            want += sum(2 * p.numel() for p in m.parameters(recurse=False))
    pools = {"gdn_pool": torch.empty(3, 2, 4, 64, 64), "conv_pool": torch.empty(3, 2, 3, 640, dtype=torch.bfloat16),
             "kv_pool": torch.empty(1, 8, 2, 16, 1, 64, dtype=torch.bfloat16)}
    K, ctx = 4, 100
    state = 3 * 4 * 64 * 64 * 4 + 3 * 3 * 640 * 2 + 1 * 2 * (ctx + K) * 1 * 64 * 2
    assert B.floor_bytes(target, pools, ctx, K) == want + K * 256 * 2 + state


def test_flags_belong_to_the_preset():
    from dflash_trt.runtime.load import UsageError
    from dflash_trt.tools.bench_e2e import main

    with pytest.raises(UsageError, match="random-27b"):
        main(["--model", "random-0.9b", "--fp8"])
    with pytest.raises(UsageError, match="--layers"):
        main(["--model", "random-27b", "--layers", "0"])
    with pytest.raises(UsageError, match="--layers builds the random-27b and random-moe-35b-a3b presets only"):
        main(["--model", "random-0.9b", "--layers", "4"])
