"""gemv (plugins/gemv): the decode- and verify-step projection kernel (1-16 rows of x). CPU: which calls the dispatcher (modeling.fuse.linear)
sends to it, the kernel limits, and that every other call stays F.linear. GPU: the kernel against an fp64 matmul
of the same rounded inputs over ragged N and K (tails of the 2048-column pass), both 16-bit dtypes, fp32 logits
(fp32_out), row views of a fused buffer, an input at an odd offset (served by F.linear), a row's result equal bit
for bit whatever rows came with it, a CUDA-graph replay == eager bit for bit, and a bad call refused in one line
before any launch.

Tolerance: |got - ref| <= 2^-7 |ref| + 2^-16 sum_k |x_k w_k| (one rounding of y to bf16 / fp16, fp32 sums)."""
import pytest
import torch
import torch.nn.functional as F
from op_helpers import assert_bulk_stream_is_register_stream

from dflash_trt.modeling import fuse
from dflash_trt.plugins.gemv import spec
from dflash_trt.plugins.opspec import KernelError


def test_usable_limits():
    assert spec.usable(1, 2048, "bfloat16") and spec.usable(1, 8, "float16") and spec.usable(16, 2048, "bfloat16")
    assert not spec.usable(17, 2048, "bfloat16")         # more rows: cuBLAS
    assert not spec.usable(0, 2048, "bfloat16")
    assert not spec.usable(1, 2044, "bfloat16")          # not 16-byte chunks
    assert not spec.usable(1, 2048, "float32")           # fp32 stays cuBLAS
    assert not spec.usable(1, spec.MAX_K + 8, "bfloat16")


def test_narrow_deep_projections_take_16_warps():
    """N <= 2048 rows of w with K >= 2048 (fewer CTAs than SMs, each streaming long rows): 16 warps, U = 4; wider or
    shallower projections 8 warps. The choice depends on (N, K) only: the same kernel at 1 and 16 rows."""
    assert spec.kernel_name(1, 2048, 6144, "bfloat16") == "mma_n1_u4_w16_bf16"
    assert spec.kernel_name(16, 16, 2048, "float16") == "mma_n2_u4_w16_f16"
    assert spec.kernel_name(1, 2049, 4096, "bfloat16") == "mma_n1_u8_w8_bf16"
    assert spec.kernel_name(1, 12352, 2048, "bfloat16") == "mma_n1_u4_w8_bf16"
    assert spec.kernel_name(9, 2048, 1024, "bfloat16") == "mma_n2_u4_w8_bf16"
    with pytest.raises(KernelError, match="multiple of 8"):
        spec.check(1, 16, 12, "bfloat16")


def test_cpu_and_grad_calls_stay_f_linear(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.ops.dflash, "gemv", lambda *a: calls.append(a), raising=False)
    x, w = torch.randn(1, 64, dtype=torch.bfloat16), torch.randn(32, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        torch.testing.assert_close(fuse.linear(x, w), F.linear(x, w))  # CPU: the exported graphs' MatMul
    assert not calls
    lin = fuse.Linear(64, 32, bias=False)
    assert isinstance(lin, torch.nn.Linear) and set(lin.state_dict()) == {"weight"}


def test_cpu_op_is_the_reference():
    x, w = torch.randn(3, 40), torch.randn(24, 40)
    torch.testing.assert_close(torch.ops.dflash.gemv(x, w), x @ w.T)


def _check(got, x, w):
    ref = x.double() @ w.double().T
    mag = x.double().abs() @ w.double().abs().T
    err = (got.double() - ref).abs()
    bound = 2.0 ** -7 * ref.abs() + 2.0 ** -16 * mag + 1e-30
    assert bool((err <= bound).all()), f"max err {err.max().item():.3e}, worst ratio {(err / bound).max().item():.2f}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M", [1, 3, 9, 16])
@pytest.mark.parametrize("N,K", [(1, 8), (7, 264), (16, 2048), (2048, 512), (2049, 4096), (333, 2056), (64, 6144),
                                 (40, 1032)])
def test_kernel_vs_fp64(dtype, M, N, K):
    g = torch.Generator(device="cuda").manual_seed(M * 1000 + N + K)
    x = torch.randn(M, K, device="cuda", generator=g).to(dtype)
    w = (torch.randn(N, K, device="cuda", generator=g) * 0.05).to(dtype)
    with torch.no_grad():
        y = fuse.linear(x, w)
    assert y.shape == (M, N) and y.dtype == dtype
    _check(y, x, w)


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 16, 40])
def test_fp32_out_keeps_the_fp32_sums(M):
    """Logits (fuse.linear(..., fp32_out=True)): 1 and 16 rows through the kernel, 40 rows through cuBLAS, all fp32 y
    within the fp32-sum bound alone (no 2^-7 term: the sums are not rounded to bf16), and off bf16's grid."""
    g = torch.Generator(device="cuda").manual_seed(M)
    x = torch.randn(M, 2048, device="cuda", generator=g).bfloat16()
    w = (torch.randn(4099, 2048, device="cuda", generator=g) * 0.05).bfloat16()
    with torch.no_grad():
        y = fuse.linear(x, w, fp32_out=True)
    assert y.dtype == torch.float32 and y.shape == (M, 4099)
    ref = x.double() @ w.double().T
    err = (y.double() - ref).abs()
    assert bool((err <= 2.0 ** -16 * (x.double().abs() @ w.double().abs().T) + 1e-30).all()), err.max().item()
    assert not torch.equal(y, y.bfloat16().float())


@pytest.mark.gpu
def test_leading_dims_and_views():
    w_all = torch.randn(96, 256, device="cuda", dtype=torch.bfloat16)
    w = w_all[32:64]  # a fused buffer's row view, as fuse_linears leaves the layers' weights
    x = torch.randn(1, 1, 256, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        y = fuse.linear(x, w)
    assert y.shape == (1, 1, 32)
    _check(y[0], x[0], w)


@pytest.mark.gpu
def test_odd_offset_input_falls_back():
    buf = torch.randn(1, 264, device="cuda", dtype=torch.bfloat16)
    x, w = buf[:, 1:257], torch.randn(8, 256, device="cuda", dtype=torch.bfloat16)  # x starts 2 bytes in
    with torch.no_grad():
        torch.testing.assert_close(torch.ops.dflash.gemv(x, w), F.linear(x, w))


@pytest.mark.gpu
@pytest.mark.parametrize("N,K", [(4099, 2048), (96, 256), (2048, 6144), (77, 520)])
def test_a_row_does_not_depend_on_the_rows_beside_it(N, K):
    """The verify step (K rows) and the decode step of the same token (1 row) must project it identically: any
    window of a 16-row call equals the call on that window alone, bit for bit, in both output dtypes."""
    g = torch.Generator(device="cuda").manual_seed(N + K)
    x = torch.randn(16, K, device="cuda", generator=g).bfloat16()
    w = (torch.randn(N, K, device="cuda", generator=g) * 0.05).bfloat16()
    with torch.no_grad():
        for fp32 in (False, True):
            full = torch.ops.dflash.gemv(x, w, fp32)
            for i, m in ((0, 1), (5, 1), (15, 1), (3, 7), (8, 8), (2, 9), (0, 16)):
                assert torch.equal(torch.ops.dflash.gemv(x[i:i + m].clone(), w, fp32), full[i:i + m]), (i, m, fp32)


@pytest.mark.gpu
@pytest.mark.parametrize("N,K", [(7, 264), (333, 2056), (4099, 2048), (5120, 17408), (2 * 17408, 5120)])
def test_shared_memory_stream_is_the_register_stream_bit_for_bit(N, K, monkeypatch):
    """bulk.cuh (weights through shared memory, sm_90+) adds the register kernel's products in its order: the same
    bits for plain, fp32 and fused SwiGLU outputs, over ragged passes and tiles."""
    w = (torch.randn(N, K, device="cuda") * 0.02).bfloat16()
    calls = [lambda x: torch.ops.dflash.gemv(x, w), lambda x: torch.ops.dflash.gemv(x, w, True)]
    if N % 2 == 0:
        calls.append(lambda x: torch.ops.dflash.gemv_swiglu(x, w))
    assert_bulk_stream_is_register_stream(calls, K, monkeypatch)


@pytest.mark.gpu
def test_graph_replay_is_bitwise_eager():
    x = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, 2048, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        eager = torch.ops.dflash.gemv(x, w)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            torch.ops.dflash.gemv(x, w)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = torch.ops.dflash.gemv(x, w)
        x.mul_(-1)
        graph.replay()
        torch.cuda.synchronize()
    assert torch.equal(out, -eager)  # the replay read x in place (negated: every dot product negates exactly)


@pytest.mark.gpu
def test_bad_call_is_one_line_before_any_launch():
    x = torch.randn(17, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(KernelError, match="needs 1 to 16 rows of x"):
        torch.ops.dflash.gemv(x, torch.randn(16, 64, device="cuda", dtype=torch.bfloat16))
