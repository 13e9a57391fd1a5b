"""CausalConvVerify + conv_roll (plugins/conv/): the reference against conv1d / a naive loop; the ONNX body in
ORT == the reference; the CPU torch ops == the reference; launcher checks; on a GPU the kernels vs the float64
reference; the layer-batched conv_roll (CPU op and GPU kernel) == HostDevice, also replayed from a CUDA graph."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dflash_trt.plugins.conv import launch
from dflash_trt.plugins.conv.reference import conv_roll, conv_verify
from dflash_trt.plugins.opspec import KernelError, ShapeError
from dflash_trt.runtime.devices.host import HostDevice

from op_helpers import close, record_err, roll_case, run_op

DEV = "cuda"


@pytest.fixture(scope="module", autouse=True)
def _ops():
    import dflash_trt.plugins.torch_ops  # noqa: F401  (registers dflash::*)


@pytest.mark.parametrize("W", [2, 4])
@pytest.mark.parametrize("T", [1, 3, 16])
def test_conv_verify_and_roll_reference(T, W):
    B, C = 3, 5
    x = torch.randn(B, T, C, dtype=torch.float64)
    st = torch.randn(B, C, W - 1, dtype=torch.float64)
    w = torch.randn(C, W, dtype=torch.float64)
    x0, st0 = x.clone(), st.clone()
    y = conv_verify(x, st, w)
    full = torch.cat([st, x.transpose(1, 2)], -1)
    ref = F.silu(F.conv1d(full, w[:, None, :], groups=C))  # valid conv over [state|x]: T outputs
    assert y.shape == (B, T, C)
    assert torch.allclose(y, ref.transpose(1, 2), rtol=1e-12, atol=1e-12)
    # Same via padded conv1d on x alone with zero state (checks the causal alignment).
    yz = conv_verify(x, torch.zeros_like(st), w)
    refz = F.silu(F.conv1d(x.transpose(1, 2), w[:, None, :], groups=C, padding=W - 1)[..., :T])
    assert torch.allclose(yz, refz.transpose(1, 2), rtol=1e-12, atol=1e-12)
    for n0 in range(T + 1):
        n = torch.tensor([(n0 + b) % (T + 1) for b in range(B)])
        new = conv_roll(st, x, n)
        for b in range(B):
            cols = [st[b, :, j] for j in range(W - 1)] + [x[b, t] for t in range(int(n[b]))]
            naive = torch.stack(cols[-(W - 1):], -1)
            assert torch.equal(new[b], naive)
    assert torch.equal(x, x0) and torch.equal(st, st0)


@pytest.mark.parametrize("T", [1, 16, 33])
@pytest.mark.parametrize("W", [2, 4])
def test_onnx_body_causal_conv_verify(T, W):
    pytest.importorskip("onnxruntime")
    rng = np.random.default_rng(T + W)
    B, C = 3, 24
    feeds = dict(x=rng.standard_normal((B, T, C)).astype(np.float32),
                 conv_state=rng.standard_normal((B, C, W - 1)).astype(np.float32),
                 weight=rng.standard_normal((C, W)).astype(np.float32))
    close(run_op("CausalConvVerify", feeds)["y"], conv_verify(*map(torch.from_numpy, feeds.values())))


def test_onnx_single_op_model_rejects_unknown_inputs():
    from dflash_trt.plugins.onnx_functions import single_op_model

    with pytest.raises(ValueError, match="takes inputs"):
        single_op_model("CausalConvVerify", {"x": np.zeros((1, 1, 2), np.float32)})


def test_launcher_validates_before_launch():
    with pytest.raises(KernelError, match="W=9"):
        launch.conv_verify(0, 0, 0, 0, 0, B=1, T=1, C=8, W=9)
    with pytest.raises(KernelError, match="W=9"):
        launch.conv_roll(0, 0, 0, 0, B=1, T=1, C=8, W=9, L=2, num_slots=1)


def test_cpu_conv_ops_equal_reference():
    B, T, C, W = 3, 6, 10, 4
    x, pool, w = torch.randn(B, T, C), torch.randn(5, C, W - 1), torch.randn(C, W)
    slot = torch.tensor([1, 4, 0])
    y = torch.ops.dflash.conv_verify(x, pool, w, slot)
    torch.testing.assert_close(y, conv_verify(x, pool[slot.long()], w), rtol=0, atol=0)
    n = torch.tensor([0, 2, 6])
    p2 = pool.clone()
    torch.ops.dflash.conv_roll(p2[None], slot, x[None], n)  # one layer
    want = conv_roll(pool[slot.long()], x, n)
    torch.testing.assert_close(p2[slot.long()], want, rtol=0, atol=0)
    assert torch.equal(p2[[2, 3]], pool[[2, 3]])


@pytest.mark.parametrize("L,B,T,W", [(1, 1, 1, 2), (3, 4, 16, 4), (2, 5, 2, 4)])
def test_cpu_conv_roll_all_layers_equals_host_device(L, B, T, W):
    pool, cols, slot, n = roll_case(L, B, T, 12, W, slots=B + 2, seed=L * 7 + B + T)
    want = pool.copy()
    HostDevice().conv_roll(want, slot, cols, n)
    got = torch.from_numpy(pool.copy())
    torch.ops.dflash.conv_roll(got, torch.from_numpy(slot), torch.from_numpy(cols), torch.from_numpy(n))
    assert np.array_equal(got.numpy(), want)  # a copy of columns: exact


def test_cpu_conv_roll_checks_shapes():
    pool, cols, slot, n = (torch.from_numpy(a) for a in roll_case(2, 3, 4, 8, 4, slots=4, seed=0))
    with pytest.raises(ShapeError, match="x"):
        torch.ops.dflash.conv_roll(pool, slot, cols[:1], n)


# ------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 4, 16, 128])
@pytest.mark.parametrize("B", [1, 8, 64])
def test_conv_verify_and_roll_kernels(B, T):
    C, W = 320, 4
    gen = torch.Generator().manual_seed(B * 7 + T)
    x = torch.randn(B, T, C, generator=gen).bfloat16().to(DEV)
    pool = torch.randn(B + 2, C, W - 1, generator=gen).bfloat16().to(DEV)
    w = (torch.randn(C, W, generator=gen) * 0.5).bfloat16().to(DEV)
    slot = torch.randperm(B + 2, device=DEV)[:B].int()
    d = lambda *ts: [t.double() for t in ts]  # noqa: E731
    y = torch.ops.dflash.conv_verify(x, pool, w, slot)
    record_err("conv_verify (bf16)", y, conv_verify(*d(x, pool[slot.long()], w)), 1e-2)
    xs = x.float()
    ps = pool.float()
    y32 = torch.ops.dflash.conv_verify(xs, ps, w.float(), slot)
    record_err("conv_verify (fp32)", y32, conv_verify(*d(xs, ps[slot.long()], w)), 1e-5)
    n = torch.randint(0, T + 1, (B,), device=DEV, dtype=torch.int32)
    p2 = pool.clone()
    torch.ops.dflash.conv_roll(p2[None], slot, x[None], n)
    want = conv_roll(pool[slot.long()], x, n)
    assert torch.equal(p2[slot.long()], want)
    mask = torch.ones(B + 2, dtype=torch.bool, device=DEV)
    mask[slot.long()] = False
    assert torch.equal(p2[mask], pool[mask])


@pytest.mark.gpu
@pytest.mark.parametrize("L,B,T,W", [(1, 1, 1, 2), (4, 8, 16, 4), (3, 64, 5, 8)])
def test_conv_roll_all_layers_kernel_equals_host_device(L, B, T, W):
    pool, cols, slot, n = roll_case(L, B, T, 320, W, slots=B + 2, seed=L + B + T + W)
    want = pool.copy()
    HostDevice().conv_roll(want, slot, cols, n)
    got = torch.from_numpy(pool).to(DEV)
    torch.ops.dflash.conv_roll(got, *(torch.from_numpy(a).to(DEV) for a in (slot, cols, n)))
    assert np.array_equal(got.cpu().numpy(), want)
    # bf16 pool and columns: the kernel == the CPU op (the reference) bit for bit
    gb, xb = torch.from_numpy(pool).bfloat16(), torch.from_numpy(cols).bfloat16()
    cpu = gb.clone()
    torch.ops.dflash.conv_roll(cpu, torch.from_numpy(slot), xb, torch.from_numpy(n))
    gpu = gb.to(DEV)
    torch.ops.dflash.conv_roll(gpu, torch.from_numpy(slot).to(DEV), xb.to(DEV), torch.from_numpy(n).to(DEV))
    assert torch.equal(gpu.cpu(), cpu)


@pytest.mark.gpu
def test_cuda_graph_replays_layer_batched_roll_with_new_n():
    L, B, T, W = 3, 4, 8, 4
    pool, cols, slot, n = roll_case(L, B, T, 64, W, slots=B + 1, seed=5)
    t = lambda a: torch.from_numpy(a).to(DEV)  # noqa: E731
    work, dslot, dn, dx = t(pool), t(slot).int(), t(n).int(), t(cols)
    torch.ops.dflash.conv_roll(work.clone(), dslot, dx, dn)  # warm-up: module load outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.ops.dflash.conv_roll(work, dslot, dx, dn)
    for new_n in (n, np.array([T, 1, 0, 3]), np.zeros(B, np.int64)):
        want = pool.copy()
        HostDevice().conv_roll(want, slot, cols, new_n)
        work.copy_(t(pool))
        dn.copy_(t(new_n).int())
        graph.replay()
        torch.cuda.synchronize()
        assert np.array_equal(work.cpu().numpy(), want)
