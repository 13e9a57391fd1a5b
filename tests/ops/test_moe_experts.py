"""MoeExperts (plugins/moe): the dense-combine reference against a per-(token, expert) loop written as HF's MoE
block computes it; the torch op's CPU kernel, shape checks and kernel limits (no GPU); on the GPU the grouped
kernels against the fp64 reference on random shapes (the real Qwen3.6-35B-A3B per-layer shape among them:
hidden 2048, 256 experts, top-8, moe_intermediate 512; T in {1, 4, 16, 64}), the skewed routings (every token to
the same experts; every pair to a distinct expert) and a CUDA-graph replay with routing changed in place. FP8
experts (moe_experts_fp8, W8A16): the CPU op against the exactly dequantized weights, its shape refusals, and on
the GPU the same checks against the fp64 reference of W = fp8 * scale.

Tolerances (max|got-ref| / max|ref|, the fp64 reference fed the same rounded inputs): fp32 2e-6 (fp32 FMA over
K <= 2048); bf16 / fp16 1e-2 (the kernel rounds h = silu(g)*u to the input dtype once before the down
projection, as torch's bf16 path does at every op; fp32 accumulate everywhere)."""
import pytest
import torch
import torch.nn.functional as F

import op_helpers
from dflash_trt.plugins.moe import reference, spec
from dflash_trt.plugins.opspec import KernelError, ShapeError

TOL = {torch.float32: 2e-6, torch.bfloat16: 1e-2, torch.float16: 1e-2}  # measured max: 2.8e-7, 3.6e-3, 5e-4
REAL = dict(E=256, k=8, H=2048, I=512)  # Qwen3.6-35B-A3B per layer
TINY = dict(E=4, k=2, H=64, I=32)       # tools/tiny.py TINY_MOE


def per_pair(x, idx, w, gate_up, down):
    """HF Qwen3Next/Qwen3.5-MoE experts loop: for each expert, the tokens that chose it, SwiGLU, × weight, index_add."""
    out = torch.zeros_like(x)
    inter = down.shape[-1]
    for e in range(gate_up.shape[0]):
        tok, pos = torch.where(idx == e)
        if tok.numel():
            g, u = F.linear(x[tok], gate_up[e]).split(inter, dim=-1)
            out.index_add_(0, tok, F.linear(F.silu(g) * u, down[e]) * w[tok, pos, None])
    return out


def case(N, E, k, H, I, dtype=torch.float32, device="cpu", seed=0, routing="random"):  # noqa: E741
    gen = torch.Generator(device=device).manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, device=device)  # noqa: E731
    x = r(N, H).to(dtype)
    gate_up = (r(E, 2 * I, H) * H ** -0.5).to(dtype)
    down = (r(E, H, I) * I ** -0.5).to(dtype)
    if routing == "random":
        idx = torch.topk(r(N, E), k, dim=-1).indices
    elif routing == "same":  # every token picks the same k experts: k experts with N pairs each
        idx = torch.topk(r(1, E), k, dim=-1).indices.expand(N, k).contiguous()
    else:  # "distinct": every (token, k) pair its own expert (N*k <= E)
        idx = torch.randperm(E, generator=gen, device=device)[: N * k].reshape(N, k)
    w = torch.softmax(r(N, k), dim=-1).to(dtype)
    return x, idx, w, gate_up, down


def test_reference_is_the_per_expert_loop():
    x, idx, w, gu, dn = (t.double() if t.is_floating_point() else t for t in case(5, 6, 3, 32, 16))
    torch.testing.assert_close(reference.moe_experts(x, idx, w, gu, dn), per_pair(x, idx, w, gu, dn),
                               rtol=1e-12, atol=1e-12)


def test_cpu_op_is_the_reference():
    from dflash_trt.plugins import torch_ops  # noqa: F401

    args = case(7, 8, 2, 32, 32)
    torch.testing.assert_close(torch.ops.dflash.moe_experts(*args), per_pair(*args), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("N,routing,idx_dtype", [(1, "random", torch.int64), (6, "random", torch.int32),
                                                 (5, "same", torch.int64), (3, "distinct", torch.int64)])
def test_onnx_body_is_the_per_expert_loop(N, routing, idx_dtype):
    """The dflash::MoeExperts function body (what ORT runs) against HF's per-expert loop, int32 and int64 ids."""
    pytest.importorskip("onnxruntime")
    x, idx, w, gu, dn = case(N, 8, 2, 32, 16, routing=routing, seed=N)
    feeds = dict(x=x.numpy(), topk_idx=idx.to(idx_dtype).numpy(), topk_w=w.numpy(), gate_up=gu.numpy(), down=dn.numpy())
    got = torch.from_numpy(op_helpers.run_op("MoeExperts", feeds)["y"])
    torch.testing.assert_close(got, per_pair(x, idx, w, gu, dn), rtol=1e-5, atol=1e-6)


def test_bad_shapes_and_limits_named():
    from dflash_trt.plugins import torch_ops  # noqa: F401

    x, idx, w, gu, dn = case(3, 4, 2, 32, 32)
    with pytest.raises(ShapeError, match="down"):
        torch.ops.dflash.moe_experts(x, idx, w, gu, dn[:, :, :16])
    with pytest.raises(ShapeError, match="topk_w"):
        torch.ops.dflash.moe_experts(x, idx, w[:, :1], gu, dn)
    with pytest.raises(KernelError, match="multiples of 32"):
        spec.check_dims(3, 2, 4, 48, 32)
    with pytest.raises(KernelError, match="experts"):
        spec.check_dims(3, 2, spec.MAX_EXPERTS + 1, 64, 32)


def test_fake_impl_shape():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from dflash_trt.plugins import torch_ops  # noqa: F401

    with FakeTensorMode():
        x, idx, w, gu, dn = (torch.empty(4, 64), torch.zeros(4, 2, dtype=torch.int64), torch.empty(4, 2),
                             torch.empty(3, 64, 64), torch.empty(3, 64, 32))
        y = torch.ops.dflash.moe_experts(x, idx, w, gu, dn)
    assert y.shape == (4, 64) and y.dtype == torch.float32


def test_decode_path_choice():
    """The torch op's choice of the decode path (launch.takes_decode_path): few tokens, 16-bit, h in shared memory."""
    from dflash_trt.plugins.moe import launch

    assert launch.takes_decode_path(1, 8, 512, "bfloat16") and launch.takes_decode_path(4, 10, 512, "float16")
    assert not launch.takes_decode_path(spec.DECODE_TOKENS + 1, 8, 512, "bfloat16")
    assert not launch.takes_decode_path(1, 8, 512, "float32")
    assert not launch.takes_decode_path(1, 16, 2048, "bfloat16")  # 64 KiB of h: past the shared-memory limit
    with pytest.raises(KernelError, match="decode path"):
        launch.moe_experts_decode(0, 0, 0, 0, 0, 0, 0, N=8, k=8, E=256, H=2048, I=512)


# ---------------------------------------------------------------- GPU ----------------------------------------------

def _gpu_check(name, N, shape, dtype, routing="random", seed=0, fp8=False):
    """The kernels against the fp64 reference; fp8: FP8 experts (moe_experts_fp8) against their exact weights."""
    from dflash_trt.plugins import torch_ops  # noqa: F401

    if fp8:
        args = fp8_case(N, **shape, dtype=dtype, device="cuda", seed=seed, routing=routing)
        got, ref = torch.ops.dflash.moe_experts_fp8(*args), fp8_reference(*args)
    else:
        args = case(N, **shape, dtype=dtype, device="cuda", seed=seed, routing=routing)
        x, idx, w, gu, dn = args
        got = torch.ops.dflash.moe_experts(*args)
        ref = reference.moe_experts(x.double(), idx, w.double(), gu.double(), dn.double())
    torch.cuda.synchronize()
    assert got.dtype == dtype and got.shape == args[0].shape
    op_helpers.record_err(f"moe {'fp8 ' if fp8 else ''}{name} {str(dtype)[6:]}", got, ref, TOL[dtype])
    return got


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,fp8", [(torch.bfloat16, False), (torch.float32, False), (torch.bfloat16, True),
                                       (torch.float16, True)])
@pytest.mark.parametrize("N", [1, 4, 16, 64])
def test_gpu_real_shape(N, dtype, fp8):
    _gpu_check(f"real T={N}", N, REAL, dtype, seed=N, fp8=fp8)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("N,shape", [(1, TINY), (9, TINY), (64, TINY), (37, dict(E=8, k=2, H=96, I=64)),
                                     (70, dict(E=16, k=4, H=256, I=160)), (5, dict(E=512, k=10, H=512, I=96))])
def test_gpu_random_shapes(N, shape, dtype):
    _gpu_check(f"E{shape['E']} H{shape['H']} I{shape['I']} T={N}", N, shape, dtype, seed=N + shape["E"])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("N", [16, 64, 100])
def test_gpu_all_tokens_to_the_same_experts(N, dtype):
    """k experts with N pairs each: more pairs than one pass of a CTA holds (32 mma / 8 fp32)."""
    _gpu_check(f"same-experts T={N}", N, REAL, dtype, routing="same", seed=3)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("N", [1, 8, 32])
def test_gpu_every_pair_a_distinct_expert(N, dtype):
    """N*k active experts with one pair each (N=32: all 256 slots of the grid active)."""
    _gpu_check(f"distinct T={N}", N, REAL, dtype, routing="distinct", seed=4)


@pytest.mark.gpu
def test_gpu_cuda_graph_replay_follows_new_routing():
    """Captured once, replayed after the routing (and x) are overwritten in place: the grids are static and the plan
    is rebuilt on the device, so the replay equals the reference of the new inputs."""
    from dflash_trt.plugins import torch_ops  # noqa: F401

    x, idx, w, gu, dn = case(16, **REAL, dtype=torch.bfloat16, device="cuda", seed=7)
    torch.ops.dflash.moe_experts(x, idx, w, gu, dn)  # warm: module load outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = torch.ops.dflash.moe_experts(x, idx, w, gu, dn)
    for seed, routing in ((8, "same"), (9, "distinct"), (10, "random")):
        x2, idx2, w2, _, _ = case(16, **REAL, dtype=torch.bfloat16, device="cuda", seed=seed, routing=routing)
        x.copy_(x2), idx.copy_(idx2), w.copy_(w2)
        graph.replay()
        torch.cuda.synchronize()
        ref = reference.moe_experts(x.double(), idx, w.double(), gu.double(), dn.double())
        op_helpers.record_err(f"moe graph replay {routing}", y, ref, TOL[torch.bfloat16])


@pytest.mark.gpu
def test_gpu_sparse_moe_block_matches_dense_path():
    """modeling/mlp.py SparseMoE on CUDA (kernel) == the same block on CPU (dense reference), fp32, real shapes."""
    from dflash_trt.config import TargetConfig
    from dflash_trt.modeling.mlp import SparseMoE
    from dflash_trt.tools.bench_moe import moe_target_config

    cfg = TargetConfig.from_dict(dict(moe_target_config(layers=4), num_experts=64))
    torch.manual_seed(0)
    block = SparseMoE(cfg)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.02)
        x = torch.randn(16, cfg.hidden_size)
        ref = block(x)
        got = block.cuda()(x.cuda()).cpu()
    op_helpers.record_err("moe SparseMoE block fp32", got, ref, TOL[torch.float32])


@pytest.mark.gpu
def test_gpu_batch_invariant():
    """A token's output does not depend on the other tokens of a call on the same path (each pair is its own GEMV,
    or its own mma column with the split-K reduction in a fixed order; the k-combine runs in a fixed order): on the
    decode path (<= spec.DECODE_TOKENS tokens) bit-identical alone and among 4; on the grouped path among 16 and
    among 5. The two paths round differently (fp32 sums in another order), within TOL of the fp64 reference."""
    from dflash_trt.plugins import torch_ops  # noqa: F401

    x, idx, w, gu, dn = case(16, **REAL, dtype=torch.bfloat16, device="cuda", seed=11)
    full = torch.ops.dflash.moe_experts(x, idx, w, gu, dn)
    for n in (0, 7, 15):
        one = torch.ops.dflash.moe_experts(x[n:n + 1], idx[n:n + 1], w[n:n + 1], gu, dn)
        lo = min(n, 12)
        four = torch.ops.dflash.moe_experts(x[lo:lo + 4], idx[lo:lo + 4], w[lo:lo + 4], gu, dn)
        lo = min(n, 11)
        five = torch.ops.dflash.moe_experts(x[lo:lo + 5], idx[lo:lo + 5], w[lo:lo + 5], gu, dn)
        assert torch.equal(one[0], four[n - min(n, 12)]), n
        assert torch.equal(five[n - lo], full[n]), n


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("N", [1, 4])
def test_gpu_decode_path_drops_pairs_outside_the_experts(N, fp8):
    """Decode path: a pair whose id is outside [0, E) adds nothing (as the grouped path and the reference)."""
    from dflash_trt.plugins import torch_ops  # noqa: F401

    x, idx, w, *weights = (fp8_case if fp8 else case)(N, **REAL, dtype=torch.bfloat16, device="cuda", seed=12)
    bad = idx.clone()
    bad[:, 3] = REAL["E"]
    bad[0, 5] = -1
    op = torch.ops.dflash.moe_experts_fp8 if fp8 else torch.ops.dflash.moe_experts
    got = op(x, bad, w, *weights)
    keep = (bad >= 0) & (bad < REAL["E"])
    oracle = fp8_reference if fp8 else lambda x, i, w, gu, dn: reference.moe_experts(x.double(), i, w.double(),
                                                                                      gu.double(), dn.double())
    ref = oracle(x, idx, w * keep, *weights)
    op_helpers.record_err(f"moe {'fp8 ' if fp8 else ''}decode path dropped pairs T={N}", got, ref,
                          TOL[torch.bfloat16])


# ---------------------------------------------------------------- FP8 experts (W8A16) ----------------------------

FP8 = torch.float8_e4m3fn


def fp8_case(N, E, k, H, I, dtype=torch.bfloat16, device="cpu", seed=0, routing="random"):  # noqa: E741
    """case()'s x and routing with e4m3 experts: N(0, 1) * 64 bytes (the e4m3 range, subnormals included) and
    positive block scales [E, rows/128, cols/128], so W = fp8 * scale ~ N(0, 0.035)."""
    x, idx, w, _, _ = case(N, E, k, H, I, dtype=dtype, device=device, seed=seed, routing=routing)
    g = torch.Generator(device=device).manual_seed(seed + 1)
    weights = []
    for rows, cols in ((2 * I, H), (H, I)):
        q = (torch.randn(E, rows, cols, device=device, generator=g) * 64).clamp(-448, 448).to(FP8)
        s = torch.rand(E, rows // 128, cols // 128, device=device, generator=g) * 1e-3 * cols ** -0.5 * 45 + 1e-5
        weights += [q, s]
    return (x, idx, w, *weights)


def fp8_dequantized(q, s):
    return q.double() * s.double().repeat_interleave(128, -2).repeat_interleave(128, -1)


def fp8_reference(x, idx, w, gu, gus, dn, dns):
    """fp64 oracle of the W8A16 experts: the exact W = fp8 * scale, the kernel's rounded inputs."""
    return reference.moe_experts(x.double(), idx, w.double(), fp8_dequantized(gu, gus), fp8_dequantized(dn, dns))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_fp8_op_is_the_exactly_dequantized_reference(dtype):
    from dflash_trt.plugins import torch_ops  # noqa: F401

    args = fp8_case(5, 4, 2, 128, 128, dtype=dtype)
    got = torch.ops.dflash.moe_experts_fp8(*args)
    assert got.dtype == dtype and got.shape == args[0].shape
    want = fp8_reference(*args).to(dtype)
    torch.testing.assert_close(got, want, rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-6)


def test_fp8_shapes_and_dtypes_named():
    from dflash_trt.plugins import torch_ops  # noqa: F401

    x, idx, w, gu, gus, dn, dns = fp8_case(3, 4, 2, 128, 128)
    with pytest.raises(ShapeError, match="down_scale"):
        torch.ops.dflash.moe_experts_fp8(x, idx, w, gu, gus, dn, dns[:, :, :0])
    with pytest.raises(ShapeError, match="float8_e4m3fn"):
        torch.ops.dflash.moe_experts_fp8(x, idx, w, gu.float(), gus, dn, dns)
    with pytest.raises(KernelError, match="multiples of 128"):
        spec.check_fp8(2048, 96, "bfloat16")
    with pytest.raises(KernelError, match="bf16 or f16"):
        spec.check_fp8(2048, 512, "float32")


def test_fp8_fake_impl_and_the_module_keeps_the_cpu_on_its_dequantized_path():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from dflash_trt.modeling.fp8 import Fp8Experts, experts_kernel_takes

    with FakeTensorMode():
        y = torch.ops.dflash.moe_experts_fp8(*fp8_case(4, 4, 2, 128, 128))
    assert y.shape == (4, 128) and y.dtype == torch.bfloat16
    experts = Fp8Experts(4, 128, 128, (128, 128))
    x, idx, w, *weights = fp8_case(4, 4, 2, 128, 128, dtype=torch.float32)
    for name, t in zip(("gate_up_proj", "gate_up_proj_scale_inv", "down_proj", "down_proj_scale_inv"), weights):
        getattr(experts, name).data = t
    with torch.no_grad():
        # a CPU tensor: the dequantized weights and the op seam
        assert not experts_kernel_takes(x, experts)
        torch.testing.assert_close(experts(x, idx, w), fp8_reference(x, idx, w, *weights).float(),
                                   rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("N,routing", [(64, "same"), (100, "same"), (32, "distinct"), (37, "random"),
                                       (1, "random"), (3, "random"), (4, "distinct")])
def test_gpu_fp8_skewed_routings_and_other_shapes(N, routing):
    """The grouped path and (N <= spec.DECODE_TOKENS) the per-pair decode path, on the real and another shape."""
    shape = REAL if routing != "random" else dict(E=16, k=4, H=384, I=256)
    _gpu_check(f"{routing} T={N}", N, shape, torch.bfloat16, routing=routing, seed=5, fp8=True)


@pytest.mark.gpu
def test_gpu_fp8_experts_module_runs_the_kernel_and_agrees_with_its_dequantized_path(monkeypatch):
    """modeling/fp8.py Fp8Experts on CUDA with bf16 x: the fp8 kernel, within TOL of the fp64 oracle and of the
    path it replaces (weights dequantized to bf16 per call, then the 16-bit kernels)."""
    from dflash_trt.modeling import fp8
    from dflash_trt.modeling.fp8 import Fp8Experts

    x, idx, w, *weights = fp8_case(16, **REAL, device="cuda", seed=9)
    experts = Fp8Experts(REAL["E"], REAL["H"], REAL["I"], (128, 128)).cuda()
    for name, t in zip(("gate_up_proj", "gate_up_proj_scale_inv", "down_proj", "down_proj_scale_inv"), weights):
        getattr(experts, name).data = t
    with torch.no_grad():
        assert fp8.experts_kernel_takes(x, experts)
        got = experts(x, idx, w)
        monkeypatch.setattr(fp8, "experts_kernel_takes", lambda *args: False)
        before = experts(x, idx, w)
    ref = fp8_reference(x, idx, w, *weights)
    op_helpers.record_err("moe fp8 module", got, ref, TOL[torch.bfloat16])
    op_helpers.record_err("moe fp8 dequantizing path", before, ref, TOL[torch.bfloat16])


@pytest.mark.gpu
def test_gpu_fp8_cuda_graph_replay_follows_new_routing():
    from dflash_trt.plugins import torch_ops  # noqa: F401

    x, idx, w, *weights = fp8_case(16, **REAL, device="cuda", seed=7)
    torch.ops.dflash.moe_experts_fp8(x, idx, w, *weights)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = torch.ops.dflash.moe_experts_fp8(x, idx, w, *weights)
    for seed, routing in ((8, "same"), (9, "distinct")):
        x2, idx2, w2, *_ = fp8_case(16, **REAL, device="cuda", seed=seed, routing=routing)
        x.copy_(x2), idx.copy_(idx2), w.copy_(w2)
        graph.replay()
        torch.cuda.synchronize()
        op_helpers.record_err(f"moe fp8 graph replay {routing}", y, fp8_reference(x, idx, w, *weights),
                              TOL[torch.bfloat16])
