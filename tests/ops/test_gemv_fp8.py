"""gemv_fp8 (plugins/gemv_fp8): the W8A16 projection kernel of decode and verify steps. CPU: the limits, the kernel
choice, the CPU op == the fp32 dequantized reference, the fake impls, which calls the FP8 layers send to the kernel,
and FP8 projection fusion (weights and scales stacked as row views). GPU: the kernel against an fp64 matmul of the
exactly dequantized weight over rows 1-16 and ragged / real-27B (N, K), every e4m3 byte converted exactly, fp32
logits, a row's result independent of the rows beside it, the fused SwiGLU, the FP8 layers' dispatch, a CUDA-graph
replay == eager, and the odd-offset fallback.

Tolerance: |got - ref| <= 2^-7 |ref| + 2^-16 sum_k |x_k W_k| (one rounding of y to bf16 / fp16, fp32 sums)."""
import pytest
import torch
import torch.nn.functional as F
from op_helpers import assert_bulk_stream_is_register_stream

from dflash_trt.modeling import fuse
from dflash_trt.modeling.fp8 import Fp8Linear
from dflash_trt.plugins import torch_ops  # noqa: F401  (registers dflash::gemv_fp8)
from dflash_trt.plugins.gemv_fp8 import reference, spec
from dflash_trt.plugins.opspec import KernelError, ShapeError

FP8 = torch.float8_e4m3fn
REAL_27B = [(17408, 5120), (5120, 17408), (12288, 5120), (5120, 6144), (10240, 5120)]


def fp8_weight(N, K, device="cpu", seed=0):
    """Random e4m3 weights (N(0, 1) * 64: the full e4m3 range incl. subnormals) and positive block scales."""
    g = torch.Generator(device=device).manual_seed(seed)
    w = (torch.randn(N, K, device=device, generator=g) * 64).clamp(-448, 448).to(FP8)
    s = torch.rand(*spec.scale_shape(N, K), device=device, generator=g) * 1e-3 + 1e-4
    return w, s


def _check(got, x, w, s, w_rounded=False):
    """The kernels: exact products, fp32 accumulation, one output rounding. w_rounded: the dequantizing path, whose
    16-bit W (fp8 x fp32 scale rounded to x's dtype, relative 2^-8 for bf16) bounds the error by 2^-8 of sum |x W|."""
    W = reference.dequantize_blockwise(w, s, (128, 128)).double()
    ref = x.double() @ W.T
    mag = x.double().abs() @ W.abs().T
    err = (got.double() - ref).abs()
    bound = 2.0 ** -7 * ref.abs() + 2.0 ** (-8 if w_rounded else -16) * mag + 1e-30
    assert bool((err <= bound).all()), f"max err {err.max().item():.3e}, worst ratio {(err / bound).max().item():.2f}"


def test_limits_and_kernel_choice(monkeypatch):
    assert spec.usable(1, 16, "bfloat16") and spec.usable(16, 5120, "float16")
    assert spec.usable(64, 5120, "bfloat16") and not spec.usable(65, 5120, "bfloat16")  # 16-row slices up to 64
    assert not spec.usable(1, 5128, "bfloat16")  # K % 16
    assert not spec.usable(1, 5120, "float32")
    assert spec.swiglu_usable(2 * 17408) and not spec.swiglu_usable(2 * 1000)
    assert spec.kernel_name(1, 17408, 5120, "bfloat16") == "fp8_n1_u4_w8_bf16"
    assert spec.kernel_name(16, 17408, 5120, "bfloat16") == "fp8_n2_u4_w8_bf16"   # U, warps: (N, K) alone
    assert spec.kernel_name(9, 1024, 5120, "float16", True) == "fp8_n2_u2_w16_f16_swiglu"
    assert spec.kernel_name(1, 64, 256, "bfloat16") == "fp8_n1_u1_w8_bf16"
    assert spec.kernel_name(1, 5120, 17408, "bfloat16", bulk_stream=True) == "fp8b_n1_u2_w16_bf16"
    monkeypatch.setenv("DFLASH_TRT_BULK_STREAM", "1")
    assert spec.bulk((9, 0)) and spec.bulk((10, 0)) and not spec.bulk((8, 9)) and not spec.bulk((12, 0))
    monkeypatch.setenv("DFLASH_TRT_BULK_STREAM", "0")
    assert not spec.bulk((9, 0))
    # 16 rows of one pass (16 warps x 2 chunks x 64 columns, + 64 bytes a row) per stage, two barriers a stage
    assert spec.bulk_smem(5120, 17408) == 3 * (16 * (2048 + 64) + 16)  # 3 stages fit 128 KB
    assert {spec.kernel_name(m, n, k, d, b) for m in (1, 16) for n in (16, 5120) for k in (16, 512, 2048, 17408)
            for d in spec.DTYPES for b in (False, True)} <= set(spec.kernel_variants())
    with pytest.raises(KernelError, match="multiple of 16"):
        spec.check(1, 16, 24, "bfloat16")
    with pytest.raises(ShapeError, match="scale_inv"):
        spec.SPEC.check_shapes([(1, 256), (130, 256), (1, 2)])


def test_cpu_op_is_the_fp32_dequantized_reference():
    w, s = fp8_weight(130, 272)
    x = torch.randn(3, 272).bfloat16()
    W = w.float() * s.repeat_interleave(128, 0)[:130].repeat_interleave(128, 1)[:, :272]
    torch.testing.assert_close(torch.ops.dflash.gemv_fp8(x, w, s, True), x.float() @ W.T, rtol=1e-6, atol=1e-6)
    assert torch.ops.dflash.gemv_fp8(x, w, s).dtype == torch.bfloat16
    w2, s2 = fp8_weight(256, 272)
    gate, up = reference.gemv_fp8(x, w2, s2).chunk(2, dim=-1)
    torch.testing.assert_close(torch.ops.dflash.gemv_fp8_swiglu(x, w2, s2), F.silu(gate) * up)


def test_fake_impls_give_the_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x, w, s = torch.empty(2, 3, 256, dtype=torch.float16), torch.empty(300, 256, dtype=FP8), torch.empty(3, 2)
        y = torch.ops.dflash.gemv_fp8(x, w, s)
        y32 = torch.ops.dflash.gemv_fp8(x, w, s, True)
        sw = torch.ops.dflash.gemv_fp8_swiglu(x, torch.empty(512, 256, dtype=FP8), torch.empty(4, 2))
    assert y.shape == (2, 3, 300) and y.dtype == torch.float16 and y32.dtype == torch.float32
    assert sw.shape == (2, 3, 256)


def test_cpu_fp8_layers_keep_the_dequantizing_path(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.ops.dflash, "gemv_fp8", lambda *a: calls.append(a), raising=False)
    lin = Fp8Linear(256, 64, (128, 128))
    lin.weight.data, lin.weight_scale_inv.data = fp8_weight(64, 256)
    x = torch.randn(1, 256).bfloat16()
    with torch.no_grad():
        torch.testing.assert_close(lin(x), F.linear(x, lin.dequantized(torch.bfloat16)))
    assert not calls and not fuse.fp8_takes(x)


def test_wide_calls_launch_16_row_slices(monkeypatch):
    """More than 16 rows: one launch per 16-row slice, x and y advanced by whole rows (16-bit x; y 16-bit, fp32, or
    half as wide for SwiGLU)."""
    from dflash_trt.plugins.gemv_fp8 import launch

    seen = []
    monkeypatch.setattr(launch, "_launch", lambda w, sc, x, y, M, *a: seen.append((x, y, M)))
    launch.gemv_fp8(0, 0, 1000, 5000, M=40, N=300, K=512)
    assert seen == [(1000, 5000, 16), (1000 + 16 * 1024, 5000 + 16 * 600, 16), (1000 + 32 * 1024, 5000 + 32 * 600, 8)]
    seen.clear()
    launch.gemv_fp8(0, 0, 0, 0, M=17, N=256, K=512, y_fp32=True)
    assert seen == [(0, 0, 16), (16 * 1024, 16 * 1024, 1)]
    seen.clear()
    launch.gemv_fp8(0, 0, 0, 0, M=20, N=512, K=512, swiglu=True)
    assert seen == [(0, 0, 16), (16 * 1024, 16 * 512, 4)]
    with pytest.raises(KernelError, match="1 to 64 rows"):
        launch.gemv_fp8(0, 0, 0, 0, M=65, N=256, K=512)


def test_fp8_layers_take_the_kernel_for_steps_of_up_to_64_rows():
    """fuse.fp8_takes on (a stand-in for) CUDA bf16 x: 1-16 rows of any shape; 17-64 rows only as steps (at most
    abi.MAX_K rows a sequence: decode / verify / drafter blocks of several sequences), never a wider prefill chunk."""
    class CudaX:
        is_cuda, dtype = True, torch.bfloat16

        def __init__(self, *shape):
            self.shape = shape

        def numel(self):
            return int(torch.tensor(self.shape).prod())

        def dim(self):
            return len(self.shape)

    with torch.no_grad():
        takes = [fuse.fp8_takes(CudaX(*shape)) for shape in ((16, 512), (4, 16, 512), (64, 1, 512), (17, 512),
                                                                (2, 32, 512), (5, 16, 512), (1, 16, 520))]
    assert takes == [True, True, True, False, False, False, False]


def _fp8_pair(out_a, out_b, K=256):
    owner = torch.nn.Module()
    for i, (name, n) in enumerate((("gate_proj", out_a), ("up_proj", out_b))):
        lin = Fp8Linear(K, n, (128, 128))
        lin.weight.data, lin.weight_scale_inv.data = fp8_weight(n, K, seed=i)
        setattr(owner, name, lin)
    return owner


def test_fp8_groups_fuse_on_scale_block_boundaries():
    names = ("gate_proj", "up_proj")
    owner = _fp8_pair(256, 256)
    x = torch.randn(2, 256).bfloat16()
    with torch.no_grad():
        want = fuse.swiglu(owner, names, x)
        fuse.fuse_linears(owner, names)
        w, s = getattr(owner, fuse.BUFFER + "gate_proj"), getattr(owner, fuse.BUFFER + "gate_proj" + fuse.SCALES)
        assert w.shape == (512, 256) and s.shape == (4, 2)
        assert owner.up_proj.weight.data_ptr() == w[256:].data_ptr()
        assert owner.up_proj.weight_scale_inv.data_ptr() == s[2:].data_ptr()
        assert set(owner.state_dict()) == {f"{n}.{p}" for n in names for p in ("weight", "weight_scale_inv")}
        torch.testing.assert_close(fuse.swiglu(owner, names, x), want, rtol=0, atol=0)
    ragged = _fp8_pair(200, 256)  # gate ends mid-block: scale rows cannot stack
    fuse.fuse_linears(ragged, names)
    assert not hasattr(ragged, fuse.BUFFER + "gate_proj")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M", [1, 2, 8, 9, 16])
@pytest.mark.parametrize("N,K", [(1, 16), (7, 272), (16, 2048), (130, 1040), (333, 2064), (1000, 4096),
                                 (2048, 6144), (4099, 2048)])
def test_kernel_vs_fp64(dtype, M, N, K):
    w, s = fp8_weight(N, K, "cuda", seed=M * 1000 + N + K)
    x = torch.randn(M, K, device="cuda").to(dtype)
    with torch.no_grad():
        y = torch.ops.dflash.gemv_fp8(x, w, s)
    assert y.shape == (M, N) and y.dtype == dtype
    _check(y, x, w, s)


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 16])
@pytest.mark.parametrize("N,K", REAL_27B)
def test_real_27b_shapes(M, N, K):
    w, s = fp8_weight(N, K, "cuda", seed=N + K)
    x = torch.randn(M, K, device="cuda").bfloat16()
    with torch.no_grad():
        _check(torch.ops.dflash.gemv_fp8(x, w, s), x, w, s)
        y32 = torch.ops.dflash.gemv_fp8(x, w, s, True)
    W = reference.dequantize_blockwise(w, s, (128, 128)).double()
    err = (y32.double() - x.double() @ W.T).abs()
    assert y32.dtype == torch.float32 and bool((err <= 2.0 ** -16 * (x.double().abs() @ W.abs().T) + 1e-30).all())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_e4m3_byte_converts_exactly(dtype):
    """w[n, k] = byte (n + k) % 256 (NaN bytes -> 0): one-hot rows of x read single columns, so the fp32 output is
    fp32(w) * scale exactly, for every byte (subnormals, -0) at 16 column positions across the lanes."""
    N = K = 256
    b = (torch.arange(N)[:, None] + torch.arange(K)[None, :]) % 256
    b[(b == 0x7F) | (b == 0xFF)] = 0
    w = b.to(torch.uint8).view(FP8).cuda()
    s = torch.tensor([[0.5, 2.0 ** -3], [3.0, 1.0]], device="cuda")
    cols = torch.arange(16) * 17 % K
    x = torch.zeros(16, K, device="cuda", dtype=dtype)
    x[torch.arange(16), cols] = 1
    with torch.no_grad():
        y = torch.ops.dflash.gemv_fp8(x, w, s, True)
    W = reference.dequantize_blockwise(w, s, (128, 128))
    assert torch.equal(y, W[:, cols.cuda()].T)


@pytest.mark.gpu
@pytest.mark.parametrize("N,K", [(4099, 2048), (130, 1040), (2048, 6144), (17408, 5120)])
def test_a_row_does_not_depend_on_the_rows_beside_it(N, K):
    w, s = fp8_weight(N, K, "cuda", seed=N)
    x = torch.randn(16, K, device="cuda").bfloat16()
    with torch.no_grad():
        for fp32 in (False, True):
            full = torch.ops.dflash.gemv_fp8(x, w, s, fp32)
            for i, m in ((0, 1), (5, 1), (15, 1), (3, 7), (8, 8), (2, 9), (0, 16)):
                assert torch.equal(torch.ops.dflash.gemv_fp8(x[i:i + m].clone(), w, s, fp32), full[i:i + m]), (i, m)


@pytest.mark.gpu
@pytest.mark.parametrize("M", [17, 40, 64])
def test_wide_calls_are_their_16_row_slices(M):
    """17-64 rows (16-row slices): each row's sums are those of a call on its own slice, bit for bit, for plain,
    fp32 and SwiGLU outputs, and within the bound of the fp64 product."""
    N, K = 2 * 1024, 2064
    w, s = fp8_weight(N, K, "cuda", seed=M)
    x = torch.randn(M, K, device="cuda").bfloat16()
    with torch.no_grad():
        for op in (lambda v: torch.ops.dflash.gemv_fp8(v, w, s), lambda v: torch.ops.dflash.gemv_fp8(v, w, s, True),
                   lambda v: torch.ops.dflash.gemv_fp8_swiglu(v, w, s)):
            assert torch.equal(op(x), torch.cat([op(x[i:i + 16].clone()) for i in range(0, M, 16)]))
        _check(torch.ops.dflash.gemv_fp8(x, w, s), x, w, s)


@pytest.mark.gpu
@pytest.mark.parametrize("N,K", [(7, 272), (333, 2064), (4099, 2048), (5120, 17408), (2 * 17408, 5120)])
def test_shared_memory_stream_is_the_register_stream_bit_for_bit(N, K, monkeypatch):
    """bulk.cuh (weights through shared memory, sm_90+) adds the register kernel's products in its order: the same
    bits for plain, fp32 and fused SwiGLU outputs, over ragged passes (K not a whole pass) and ragged tiles."""
    w, s = fp8_weight(N, K, "cuda", seed=K)
    calls = [lambda x: torch.ops.dflash.gemv_fp8(x, w, s), lambda x: torch.ops.dflash.gemv_fp8(x, w, s, True)]
    if spec.swiglu_usable(N):
        calls.append(lambda x: torch.ops.dflash.gemv_fp8_swiglu(x, w, s))
    assert_bulk_stream_is_register_stream(calls, K, monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M,I,K", [(1, 256, 1040), (16, 128, 2048), (3, 17408, 5120)])
def test_swiglu_vs_unfused(dtype, M, I, K):
    """The fused kernel rounds as the unfused MLP (both projections by this kernel, then torch's silu * up)."""
    w, s = fp8_weight(2 * I, K, "cuda", seed=I + K)
    x = torch.randn(M, K, device="cuda").to(dtype)
    with torch.no_grad():
        got = torch.ops.dflash.gemv_fp8_swiglu(x, w, s)
        gate = torch.ops.dflash.gemv_fp8(x, w[:I], s[:I // 128])
        up = torch.ops.dflash.gemv_fp8(x, w[I:], s[I // 128:])
    assert got.shape == (M, I) and got.dtype == dtype
    torch.testing.assert_close(got, F.silu(gate) * up, rtol=0, atol=0)


@pytest.mark.gpu
def test_fp8_layers_dispatch_to_the_kernel(monkeypatch):
    """Fp8Linear and a fused FP8 gate/up on CUDA: 1-16 rows and a 4 x 16-row verify block through the kernels, 40
    rows of one sequence through the dequantizing path (W8A16 forced: where the block-scaled GEMM runs, wider calls
    take W8A8 by default, tests/test_fp8_w8a8.py); the results agree within the bound either way."""
    from dflash_trt.modeling import fp8_gemm

    monkeypatch.setattr(fp8_gemm, "MODE", "w8a16")
    owner = _fp8_pair(256, 256, K=512).cuda()
    names = ("gate_proj", "up_proj")
    fuse.fuse_linears(owner, names)
    seen = []
    real = torch.ops.dflash.gemv_fp8_swiglu
    monkeypatch.setattr(torch.ops.dflash, "gemv_fp8_swiglu", lambda *a: seen.append(1) or real(*a), raising=False)
    with torch.no_grad():
        for shape in ((1, 512), (16, 512), (40, 512), (4, 16, 512)):
            x = torch.randn(*shape, device="cuda").bfloat16()
            _check(owner.gate_proj(x).view(-1, 256), x.view(-1, 512), owner.gate_proj.weight,
                   owner.gate_proj.weight_scale_inv, w_rounded=shape[0] == 40)
            y = fuse.swiglu(owner, names, x)
            assert y.shape == (*shape[:-1], 256)
    assert len(seen) == 3


@pytest.mark.gpu
def test_graph_replay_is_bitwise_eager_and_odd_offsets_fall_back():
    w, s = fp8_weight(4096, 2048, "cuda")
    x = torch.randn(1, 2048, device="cuda").bfloat16()
    with torch.no_grad():
        eager = torch.ops.dflash.gemv_fp8(x, w, s)
        st = torch.cuda.Stream()
        st.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(st):
            torch.ops.dflash.gemv_fp8(x, w, s)
        torch.cuda.current_stream().wait_stream(st)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = torch.ops.dflash.gemv_fp8(x, w, s)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
        buf = torch.randn(1, 2064, device="cuda").bfloat16()
        xo = buf[:, 1:2049]  # 2 bytes in: the kernel's 16-byte loads cannot read it
        torch.testing.assert_close(torch.ops.dflash.gemv_fp8(xo, w, s), reference.gemv_fp8(xo, w, s))
