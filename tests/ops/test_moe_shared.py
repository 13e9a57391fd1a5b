"""The sparse MoE block's routed and shared experts in one op (dflash::moe_experts_shared, plugins/moe decode path):
the CPU op is the reference (routed experts + sigmoid(gate) * shared expert), its refusals; SparseMoE takes it
exactly where its conditions hold (the choice, then the block's output on the CPU with the choice forced: the
wiring of its arguments, 16-bit and FP8); on the GPU the decode kernels against the fp64 oracle at the real
Qwen3.6-35B-A3B layer (1-4 tokens, bf16 and FP8) and the block against its unfused path."""
from types import SimpleNamespace

import pytest
import torch

import op_helpers
from dflash_trt.modeling import mlp
from dflash_trt.modeling.fuse import fuse_linears
from dflash_trt.modeling.mlp import MLP, SparseMoE
from dflash_trt.plugins import torch_ops  # noqa: F401
from dflash_trt.plugins.moe import reference
from dflash_trt.plugins.opspec import ShapeError
from test_moe_experts import REAL, TOL, case, fp8_case, fp8_dequantized

SMALL = dict(E=8, k=2, H=256, I=128)


def shared_case(N, E, k, H, I, dtype=torch.bfloat16, device="cpu", seed=0, fp8=False):  # noqa: E741
    """A routed case (test_moe_experts) plus a shared expert of the same width and format and its gate logits
    [N,1] (a column of a wider tensor, as the fused router GEMM leaves it)."""
    routed = (fp8_case if fp8 else case)(N, E, k, H, I, dtype=dtype, device=device, seed=seed)
    shared = (fp8_case if fp8 else case)(N, 1, 1, H, I, dtype=dtype, device=device, seed=seed + 7)
    g = torch.Generator(device=device).manual_seed(seed + 3)
    logit = (torch.randn(N, E + 1, generator=g, device=device) * 2).to(dtype)[:, E:]
    if fp8:
        x, idx, w, gu, gus, dn, dns = routed
        sgu, sgus, sdn, sdns = (t[0] for t in shared[3:])
        return (x, idx, w, gu, dn, sgu, sdn, logit, [gus, dns, sgus, sdns])
    x, idx, w, gu, dn = routed
    return (x, idx, w, gu, dn, shared[3][0], shared[4][0], logit, [])


def oracle(x, idx, w, gu, dn, sgu, sdn, logit, scales):
    """fp64: the routed experts on the exact weights plus the shared expert, its sigmoid rounded to x's dtype."""
    if scales:
        gu, dn, sgu, sdn = (fp8_dequantized(q, s) for q, s in zip((gu, dn, sgu, sdn), scales))
    gu, dn, sgu, sdn = (t.double() for t in (gu, dn, sgu, sdn))
    xd = x.double()
    return reference.moe_experts(xd, idx, w.double(), gu, dn) + reference.shared_expert(xd, sgu, sdn, logit)


@pytest.mark.parametrize("fp8", [False, True])
def test_cpu_op_is_routed_plus_shared(fp8):
    args = shared_case(3, **SMALL, dtype=torch.float32, fp8=fp8)
    got = torch.ops.dflash.moe_experts_shared(*args)
    torch.testing.assert_close(got.double(), oracle(*args), rtol=1e-5, atol=1e-6)
    x, idx, w, gu, dn, sgu, sdn, logit, scales = args
    no_shared = torch.ops.dflash.moe_experts_shared(x, idx, w, gu, dn, sgu, sdn, torch.full_like(logit, -1e4), scales)
    routed = (torch.ops.dflash.moe_experts_fp8(x, idx, w, gu, scales[0], dn, scales[1]) if fp8
              else torch.ops.dflash.moe_experts(x, idx, w, gu, dn))
    torch.testing.assert_close(no_shared, routed)  # sigmoid(-1e4) = 0: the shared term drops out


def test_refusals_named():
    x, idx, w, gu, dn, sgu, sdn, logit, _ = shared_case(2, **SMALL)
    with pytest.raises((ShapeError, ValueError), match="shared expert"):
        torch.ops.dflash.moe_experts_shared(x, idx, w, gu, dn, sgu[:128], sdn, logit, [])
    with pytest.raises((ShapeError, ValueError), match="shared_logit"):
        torch.ops.dflash.moe_experts_shared(x, idx, w, gu, dn, sgu, sdn, logit.float(), [])
    with pytest.raises((ShapeError, ValueError), match="scales must be"):
        torch.ops.dflash.moe_experts_shared(x, idx, w, gu, dn, sgu, sdn, logit, [logit])
    f = shared_case(2, **SMALL, fp8=True)
    with pytest.raises((ShapeError, ValueError), match="shared_down_scale"):
        torch.ops.dflash.moe_experts_shared(*f[:8], [*f[8][:3], f[8][3][:, :0]])


def test_fake_impl():
    with torch._subclasses.fake_tensor.FakeTensorMode():
        args = shared_case(2, **SMALL)
        assert torch.ops.dflash.moe_experts_shared(*args).shape == args[0].shape


# ---------------------------------------------------------------- the block's choice ------------------------------

def _block(dtype=torch.float32, fp8=False, shared_inter=None, seed=0):
    """A SparseMoE of SMALL's shape with random weights, gate/up fused as the GPU backend fuses them."""
    E, k, H, I = (SMALL[n] for n in "EkHI")  # noqa: E741
    cfg = SimpleNamespace(hidden_size=H, num_experts=E, num_experts_per_tok=k, moe_intermediate_size=I,
                          shared_expert_intermediate_size=shared_inter or I, norm_topk_prob=True)
    torch.manual_seed(seed)
    block = SparseMoE(cfg)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn_like(p) * p.shape[-1] ** -0.5)
    if fp8:
        from dflash_trt.modeling.fp8 import quantize_modules
        from dflash_trt.quant import Fp8Config

        holder = torch.nn.Module()
        holder.mlp = block
        quantize_modules(holder, Fp8Config(skip=("mlp.gate", "mlp.shared_expert_gate")), "model.")
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, t in block.named_parameters():
                if t.dtype == torch.float8_e4m3fn:
                    t.copy_((torch.randn(t.shape, generator=gen) * 64).clamp(-448, 448).to(t.dtype))
                elif name.endswith("scale_inv"):
                    t.copy_(torch.rand(t.shape, generator=gen) * 1e-3 + 1e-4)
    block = block.to(dtype) if not fp8 else _cast_16bit(block, dtype)
    fuse_linears(block, SparseMoE.GATES)
    fuse_linears(block.shared_expert, MLP.PROJECTIONS)
    return block.eval()


def _cast_16bit(block, dtype):
    for m in block.modules():
        for n, p in list(m.named_parameters(recurse=False)):
            if p.dtype == torch.float32 and not n.endswith("scale_inv"):
                setattr(m, n, torch.nn.Parameter(p.detach().to(dtype), requires_grad=False))
    return block


@pytest.fixture
def on_kernel_device(monkeypatch):
    """The block's conditions as on a GPU (the choice tests run on the CPU tensors): only the device test is off."""
    monkeypatch.setattr(mlp, "kernel_inference", lambda x: not torch.is_grad_enabled())


@pytest.mark.parametrize("fp8", [False, True])
def test_block_takes_the_fused_op_where_it_can(on_kernel_device, fp8):
    block = _block(torch.bfloat16, fp8)
    x = torch.randn(4, SMALL["H"], dtype=torch.bfloat16)
    with torch.no_grad():
        gate_up, down, scales = block.shared_fused(x)
        assert gate_up.shape == (2 * SMALL["I"], SMALL["H"]) and down is block.shared_expert.down_proj.weight
        assert len(scales) == (4 if fp8 else 0)
        assert block.shared_fused(torch.randn(5, SMALL["H"], dtype=torch.bfloat16)) is None  # past the decode path
        assert block.shared_fused(x.float()) is None  # fp32 x: no decode kernel
        if not fp8:
            assert block.shared_fused(x.half()) is None  # weights in another dtype than x
    assert block.shared_fused(x) is None  # autograd on
    assert _block(torch.bfloat16, fp8, shared_inter=256).shared_fused(x) is None  # a wider shared expert
    unfused = _block(torch.bfloat16, fp8)
    for n in [n for n, _ in unfused.shared_expert.named_buffers() if n.startswith("_fused_")]:
        delattr(unfused.shared_expert, n)
    assert unfused.shared_fused(x) is None
    local = _block(torch.bfloat16, fp8)  # a rank's share of the experts (LocalExperts: fewer, one all-zero)
    local.experts.gate_up_proj = torch.nn.Parameter(local.experts.gate_up_proj[:5].clone(), requires_grad=False)
    with torch.no_grad():
        assert local.shared_fused(x) is None


@pytest.mark.parametrize("fp8", [False, True])
def test_block_output_is_the_same_either_way(monkeypatch, fp8):
    """On the CPU with the choice forced, the block through moe_experts_shared (the op's CPU reference) equals its
    unfused path: the op gets the block's experts, its shared expert and gate logit in the right places."""
    block = _block(torch.float32, fp8)
    x = torch.randn(1, 3, SMALL["H"])
    with torch.no_grad():
        want = block(x)
        monkeypatch.setattr(mlp, "kernel_inference", lambda x: True)
        monkeypatch.setattr(mlp.moe_launch, "takes_decode_path", lambda *a, **k: True)
        calls = []
        op = torch.ops.dflash.moe_experts_shared
        monkeypatch.setattr(torch.ops.dflash, "moe_experts_shared", lambda *a: calls.append(a) or op(*a))
        got = block(x)
    assert len(calls) == 1
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- GPU ----------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("N", [1, 2, 4])
def test_gpu_decode_kernels_match_the_oracle(N, fp8):
    args = shared_case(N, **REAL, dtype=torch.bfloat16, device="cuda", seed=N, fp8=fp8)
    got = torch.ops.dflash.moe_experts_shared(*args)
    assert got.dtype == torch.bfloat16 and got.shape == args[0].shape
    op_helpers.record_err(f"moe shared {'fp8 ' if fp8 else ''}T={N}", got, oracle(*args), TOL[torch.bfloat16])


@pytest.mark.gpu
def test_gpu_dropped_pairs_and_f16():
    x, idx, w, *rest = shared_case(3, **REAL, dtype=torch.float16, device="cuda", seed=5)
    bad = idx.clone()
    bad[:, 2], bad[1, 0] = REAL["E"], -1
    got = torch.ops.dflash.moe_experts_shared(x, bad, w, *rest)
    keep = (bad >= 0) & (bad < REAL["E"])
    op_helpers.record_err("moe shared dropped pairs f16", got, oracle(x, idx, w * keep, *rest), TOL[torch.float16])


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
def test_gpu_block_fused_equals_unfused(fp8):
    """A SparseMoE of the real width on the GPU: 1-4 tokens take the fused op; the same block with the choice
    turned off agrees within the bf16 tolerance (the fused sum rounds once, the unfused path at each op)."""
    block = _block(torch.bfloat16, fp8).cuda()
    fuse_linears(block, SparseMoE.GATES)
    x = torch.randn(1, 4, SMALL["H"], dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        assert block.shared_fused(x.reshape(4, -1)) is not None
        got = block(x)
        block.shared_fused = lambda x: None
        want = block(x)
    op_helpers.record_err(f"moe shared block {'fp8' if fp8 else 'bf16'}", got, want, TOL[torch.bfloat16])
