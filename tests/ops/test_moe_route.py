"""MoE router top-k (dflash::moe_route, plugins/moe): softmax in fp32 -> top-k -> renormalise -> cast, the routing
of modeling/mlp.py SparseMoE. CPU (no GPU): the op's CPU kernel and SparseMoE.route's CPU path are reference.route, the
fake impl under opcheck and an aot_eager trace, the kernel limits raised before any driver call, moe_route in the
PTX. GPU: the one-CTA-per-row kernel against reference.route on torch's CUDA ops (ids exact on tie-free logits;
weights fp32 rtol 1e-6, bf16 within 1 ulp: both round one fp32 value, a few fp32 ulps apart, once), ties to the
lowest id, SparseMoE.route on CUDA, a CUDA-graph replay and k > E refused before the launch."""
import pytest
import torch
import torch.nn.functional as F

import op_helpers
from dflash_trt.plugins import torch_ops  # noqa: F401  registers torch.ops.dflash.moe_route
from dflash_trt.plugins.moe import launch, reference, spec
from dflash_trt.plugins.opspec import KernelError, ShapeError

SHAPES = [(256, 8), (512, 10), (64, 4)]  # (E, k): Qwen3.6-35B-A3B, a Qwen3-Next-like 512 / top-10, a small one


def distinct_logits(N, E, dtype, device="cpu", seed=0):
    """Rows of a random permutation of (i - E/2) / 16: distinct values, exact in bf16 for E <= 512 (integers of
    magnitude <= 256 times 2^-4), so the probabilities are distinct and the top-k order has no ties."""
    assert dtype == torch.float32 or E <= 512
    gen = torch.Generator().manual_seed(seed)
    rows = torch.stack([torch.randperm(E, generator=gen) for _ in range(N)])
    return ((rows - E // 2).float() / 16).to(dtype).to(device)


def sparse_moe(E, k, norm):
    from dflash_trt.config import TargetConfig
    from dflash_trt.modeling.mlp import SparseMoE
    from dflash_trt.tools.tiny import TINY_MOE, tiny_target_config

    cfg = TargetConfig.from_dict(tiny_target_config(**dict(TINY_MOE, num_experts=E, num_experts_per_tok=k,
                                                           norm_topk_prob=norm)))
    block = SparseMoE(cfg)
    with torch.no_grad():
        block.gate.weight.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(E + k))
    return block


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", [True, False])
def test_cpu_op_and_sparse_moe_route_are_the_reference(dtype, norm):
    logits = torch.randn(9, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
    idx, w = torch.ops.dflash.moe_route(logits, 4, norm)
    ref_idx, ref_w = reference.route(logits, 4, norm)
    assert idx.dtype == torch.int64 and w.dtype == dtype and idx.shape == w.shape == (9, 4)
    assert torch.equal(idx, ref_idx) and torch.equal(w, ref_w)
    if norm:
        torch.testing.assert_close(w.float().sum(-1), torch.ones(9), rtol=0, atol=1e-2)
    block = sparse_moe(64, 4, norm).to(dtype)
    x = torch.randn(9, block.gate.weight.shape[1], generator=torch.Generator().manual_seed(2)).to(dtype)
    got = block.route(x)
    want = reference.route(F.linear(x, block.gate.weight), 4, norm)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_fake_impl_opcheck_and_aot_eager_trace():
    logits = distinct_logits(5, 64, torch.float32)
    torch.library.opcheck(torch.ops.dflash.moe_route.default, (logits, 4, True))
    compiled = torch.compile(lambda t: torch.ops.dflash.moe_route(t, 4, False), backend="aot_eager", fullgraph=True)
    got, want = compiled(logits), reference.route(logits, 4, False)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        idx, w = torch.ops.dflash.moe_route(torch.empty(3, 256, dtype=torch.bfloat16), 8, True)
    assert idx.shape == w.shape == (3, 8) and idx.dtype == torch.int64 and w.dtype == torch.bfloat16


def test_limits_raised_before_any_driver_call():
    """No GPU here: a KernelError (not a cuda-python / driver failure) proves the checks run before the launch."""
    args = dict(N=2, E=8, norm=True, l_dtype="float32", w_dtype="float32")
    with pytest.raises(KernelError, match=r"top_k 9 must be in 1\.\.8"):
        launch.moe_route(0, 0, 0, k=9, **args)
    with pytest.raises(KernelError, match=r"top_k 0 must be in 1\.\.8"):
        launch.moe_route(0, 0, 0, k=0, **args)
    with pytest.raises(KernelError, match="experts"):
        launch.moe_route(0, 0, 0, **dict(args, E=spec.MAX_EXPERTS + 1), k=8)
    with pytest.raises(KernelError, match="float64"):
        launch.moe_route(0, 0, 0, **dict(args, l_dtype="float64"), k=2)
    with pytest.raises(KernelError, match=r"top_k 5 must be in 1\.\.4"):
        torch.ops.dflash.moe_route(torch.zeros(2, 4), 5, True)
    with pytest.raises(ShapeError, match=r"\[N,E\]"):
        torch.ops.dflash.moe_route(torch.zeros(2, 3, 4), 2, True)
    assert [spec.route_threads(E) for E in (1, 4, 33, 64, 256, 512, 4096)] == [32, 32, 64, 64, 256, 256, 256]


def test_kernel_in_the_ptx():
    from dflash_trt.plugins import nvrtc

    assert ".entry moe_route(" in nvrtc.compile_source("moe", "compute_90", use_cache=False).decode()


# ---------------------------------------------------------------- GPU ----------------------------------------------

def _check_against_reference(logits, k, norm, name):
    idx, w = torch.ops.dflash.moe_route(logits, k, norm)
    ref_idx, ref_w = reference.route(logits, k, norm)  # torch's CUDA softmax + topk
    torch.cuda.synchronize()
    assert idx.dtype == torch.int64 and w.dtype == logits.dtype and idx.shape == w.shape == ref_w.shape
    assert torch.equal(idx, ref_idx), name
    op_helpers.record_err(f"moe_route {name}", w, ref_w, 1e-2)
    if logits.dtype == torch.float32:
        torch.testing.assert_close(w, ref_w, rtol=1e-6, atol=0)
    else:  # positive weights: adjacent bf16 values are adjacent int16 bit patterns
        ulps = (w.view(torch.int16).int() - ref_w.view(torch.int16).int()).abs().max().item()
        assert ulps <= 1, f"{name}: {ulps} bf16 ulps"


@pytest.mark.gpu
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("E,k", SHAPES)
@pytest.mark.parametrize("N", [1, 16, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_matches_reference(dtype, N, E, k, norm):
    logits = distinct_logits(N, E, dtype, "cuda", seed=N + E + k)
    _check_against_reference(logits, k, norm, f"{str(dtype)[6:]} N={N} E={E} k={k} norm={norm}")


@pytest.mark.gpu
@pytest.mark.parametrize("E,k", [(4, 2), (100, 7), (300, 300), (spec.MAX_EXPERTS, 16)])
def test_gpu_odd_shapes(E, k):
    """E below one warp, not a multiple of 32, k = E, the largest E (blockDim min(256, 32*ceil(E/32)))."""
    _check_against_reference(distinct_logits(33, E, torch.float32, "cuda", seed=E), k, True, f"fp32 E={E} k={k}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_random_normal_logits(dtype):
    """Router-like logits (fp32 randn: ties improbable; bf16 has ties, so compare the selected weights by rank)."""
    logits = (torch.randn(64, 256, generator=torch.Generator().manual_seed(3)) * 2).to(dtype).cuda()
    if dtype == torch.float32:
        _check_against_reference(logits, 8, True, "fp32 randn")
    else:
        w, ref_w = torch.ops.dflash.moe_route(logits, 8, True)[1], reference.route(logits, 8, True)[1]
        op_helpers.record_err("moe_route bf16 randn", w, ref_w, 1e-2)


@pytest.mark.gpu
def test_gpu_ties_go_to_the_lowest_id():
    logits = torch.zeros(3, 64, device="cuda")
    logits[1, [40, 7, 20]] = 1.0  # three equal maxima, then 61 equal zeros
    idx, w = torch.ops.dflash.moe_route(logits, 4, False)
    torch.cuda.synchronize()
    assert idx.tolist() == [[0, 1, 2, 3], [7, 20, 40, 0], [0, 1, 2, 3]]
    assert torch.equal(w[0], torch.full((4,), 1 / 64, device="cuda"))
    assert torch.equal(torch.ops.dflash.moe_route(logits, 4, True)[1][0], torch.full((4,), 0.25, device="cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("norm", [True, False])
def test_gpu_sparse_moe_route_is_the_kernel(norm, monkeypatch):
    """modeling/mlp.py SparseMoE.route on CUDA without autograd runs the kernel (reference.route is never called) and
    equals reference.route of the same router logits; with autograd on it keeps the differentiable standard ops."""
    block = sparse_moe(256, 8, norm).cuda()
    x = torch.randn(16, block.gate.weight.shape[1], generator=torch.Generator().manual_seed(4)).cuda()
    with torch.no_grad():
        ref_idx, ref_w = reference.route(F.linear(x, block.gate.weight), 8, norm)
    _, w_grad = block.route(x)
    w_grad.sum().backward()
    assert block.gate.weight.grad is not None
    with monkeypatch.context() as m, torch.no_grad():
        m.setattr(reference, "route", lambda *a: pytest.fail("SparseMoE.route on CUDA took the reference path"))
        idx, w = block.route(x)
    assert torch.equal(idx, ref_idx)
    torch.testing.assert_close(w, ref_w, rtol=1e-6, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_cuda_graph_replay_equals_eager(dtype):
    """Captured once on torch's stream, replayed after the logits are overwritten in place: bit-identical to eager."""
    logits = distinct_logits(16, 256, dtype, "cuda", seed=5)
    torch.ops.dflash.moe_route(logits, 8, True)  # warm: module load outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        idx, w = torch.ops.dflash.moe_route(logits, 8, True)
    for seed in (6, 7):
        logits.copy_(distinct_logits(16, 256, dtype, "cuda", seed=seed))
        graph.replay()
        eager_idx, eager_w = torch.ops.dflash.moe_route(logits, 8, True)
        torch.cuda.synchronize()
        assert torch.equal(idx, eager_idx) and torch.equal(w, eager_w), seed


@pytest.mark.gpu
def test_gpu_k_above_e_refused_before_launch():
    logits = torch.randn(4, 8, device="cuda")
    with pytest.raises(KernelError, match=r"moe_route: top_k 9 must be in 1\.\.8 \(the number of experts\)"):
        torch.ops.dflash.moe_route(logits, 9, True)
    torch.cuda.synchronize()  # nothing was launched: no sticky CUDA error either
    _check_against_reference(logits, 8, True, "fp32 after refusal")


@pytest.mark.gpu
def test_gpu_a_row_with_a_nan_or_inf_logit_selects_no_expert():
    """Such a row's probabilities are all NaN: every slot gets id E (moe_experts drops the pair), the other rows
    route as the reference."""
    logits = distinct_logits(4, 64, torch.float32, "cuda", seed=9)
    logits[1, 5], logits[2, 0] = float("nan"), float("inf")
    idx, w = torch.ops.dflash.moe_route(logits, 4, True)
    ref_idx, _ = reference.route(logits[[0, 3]], 4, True)
    assert idx[1].tolist() == idx[2].tolist() == [64] * 4 and bool(w[1:3].isnan().all())
    assert torch.equal(idx[[0, 3]], ref_idx)
