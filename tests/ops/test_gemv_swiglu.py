"""gemv_swiglu (plugins/gemv): the SwiGLU MLP's fused gate/up projection with silu(gate) * up in the kernel's
epilogue. CPU: the op is eager torch's unfused MLP activation, and the MLP with fused gate/up equals the unfused MLP.
GPU: the kernel equals the plain gemv kernel over [gate; up] then eager F.silu(gate) * up, bit for bit, over ragged
N and K, every kernel variant the MLP shapes pick (8 / 16 warps, 1 / 2 row tiles) and both dtypes; a row's result
does not depend on the rows beside it; a bad shape is one line."""
import pytest
import torch
import torch.nn.functional as F

from dflash_trt.modeling.fuse import fuse_linears
from dflash_trt.modeling.mlp import MLP
from dflash_trt.plugins.gemv import launch, spec
from dflash_trt.plugins.opspec import KernelError, ShapeError


def _pair(M, I, K, dtype, device, seed):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(M, K, device=device, generator=g).to(dtype)
    w = (torch.randn(2 * I, K, device=device, generator=g) * K ** -0.5 * 2).to(dtype)
    return x, w


def test_cpu_op_is_the_eager_unfused_activation():
    x, w = _pair(3, 40, 264, torch.bfloat16, "cpu", 0)
    want = F.silu(F.linear(x, w[:40])) * F.linear(x, w[40:])
    assert torch.equal(torch.ops.dflash.gemv_swiglu(x, w), want)


def test_kernel_names_and_tiles():
    assert spec.kernel_name(1, 12288, 2048, "bfloat16", swiglu=True) == "mma_n1_u4_w8_bf16_swiglu"
    assert spec.kernel_name(16, 2048, 2048, "float16", swiglu=True) == "mma_n2_u4_w16_f16_swiglu"
    assert spec.tiles(12288, swiglu=True) == spec.tiles(12288) == 768
    assert spec.tiles(2 * 77, swiglu=True) == 10 and spec.tiles(2 * 77) == 10


def test_launcher_refuses_an_odd_gate_up_before_any_launch():
    with pytest.raises(KernelError, match=r"gemv_swiglu: w must be \[gate; up\], an even number of rows \(got 63\)"):
        launch.gemv(0, 0, 0, M=1, N=63, K=256, swiglu=True)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_mlp_with_fused_gate_up_matches_the_unfused_mlp(device):
    torch.manual_seed(0)
    ref = MLP(256, 2048).to(device, torch.bfloat16)
    fused = MLP(256, 2048).to(device, torch.bfloat16)
    fused.load_state_dict(ref.state_dict())
    fuse_linears(fused, MLP.PROJECTIONS)
    x = torch.randn(1, 5, 256, device=device).bfloat16()
    with torch.no_grad():
        want = ref(x)
        got = fused(x)
    assert torch.equal(got, want)  # the same dot products and the same roundings


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M", [1, 3, 9, 16])
@pytest.mark.parametrize("I,K", [(6144, 2048), (768, 256), (1024, 256), (77, 520), (1024, 2048), (8, 264), (3, 64)])
def test_kernel_is_gemv_then_eager_swiglu_bit_for_bit(dtype, M, I, K):
    x, w = _pair(M, I, K, dtype, "cuda", M * 1000 + I + K)
    with torch.no_grad():
        got = torch.ops.dflash.gemv_swiglu(x, w)
        gate, up = torch.ops.dflash.gemv(x, w).chunk(2, dim=-1)
        want = F.silu(gate) * up
    assert got.shape == (M, I) and got.dtype == dtype
    assert torch.equal(got, want), (got.float() - want.float()).abs().max().item()


@pytest.mark.gpu
@pytest.mark.parametrize("I,K", [(6144, 2048), (48, 256)])
def test_a_row_does_not_depend_on_the_rows_beside_it(I, K):
    x, w = _pair(16, I, K, torch.bfloat16, "cuda", I + K)
    with torch.no_grad():
        full = torch.ops.dflash.gemv_swiglu(x, w)
        for i, m in ((0, 1), (15, 1), (3, 7), (8, 8), (2, 9)):
            assert torch.equal(torch.ops.dflash.gemv_swiglu(x[i:i + m].clone(), w), full[i:i + m]), (i, m)


@pytest.mark.gpu
def test_bad_shape_is_one_line():
    x, w = _pair(1, 32, 256, torch.bfloat16, "cuda", 1)
    with pytest.raises(ShapeError, match=r"gemv_swiglu: w \(63, 256\) must be \[gate; up\]"):
        torch.ops.dflash.gemv_swiglu(x, w[:63].contiguous())
