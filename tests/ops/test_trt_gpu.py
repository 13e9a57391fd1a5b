"""GPU: each TensorRT plugin's `enqueue` driven directly, as TensorRT calls it (descriptors, raw device
pointers, workspace, a stream), against the torch references — no TensorRT needed (the H200 has none and
TensorRT-RTX does not run on CC 9.0). Also: a CUDA graph captured around the enqueues replays them with
new input values (no Python state, no allocation, no sync inside enqueue)."""
import pytest
import torch

from dflash_trt.plugins import trt_compat as C
from dflash_trt.plugins import trt_plugins as P
from dflash_trt.plugins.conv import reference as conv_ref
from dflash_trt.plugins.gdn import reference as gdn_ref
from dflash_trt.plugins.paged_attention import reference as attention_ref
from dflash_trt.plugins.paged_attention import spec as attn_spec

from op_helpers import gdn_inputs

pytestmark = pytest.mark.gpu
DEV = "cuda"
RUNTIME = C.TensorRTPhase.RUNTIME


def _plugin(name, attrs):
    return P.creators()[name].create_plugin(name, attrs, RUNTIME)  # dict fields: same path as the parser's


def _descs(ts):
    return [C.tensor_desc(tuple(t.shape), str(t.dtype)) for t in ts]


class Enqueuer:
    """What TensorRT does for one plugin layer: shape change once, workspace, then enqueue on a stream."""

    def __init__(self, plugin, ins, outs):
        self.plugin, self.ins, self.outs = plugin, ins, outs
        plugin.on_shape_change(_descs(ins), _descs(outs))  # shape + kernel-support checks
        dyn = [C.dynamic_desc(tuple(t.shape), str(t.dtype)) for t in ins]
        ws = plugin.get_workspace_size(dyn, [C.dynamic_desc(tuple(t.shape), str(t.dtype)) for t in outs])
        self.ws = torch.empty(max(int(ws), 1), dtype=torch.uint8, device=DEV)
        self.in_desc, self.out_desc = _descs(ins), _descs(outs)

    def __call__(self, stream=None):
        stream = stream or torch.cuda.current_stream()
        self.plugin.enqueue(self.in_desc, self.out_desc, [t.data_ptr() for t in self.ins],
                            [t.data_ptr() for t in self.outs], self.ws.data_ptr(), stream.cuda_stream)


def _err(got, ref):
    ref = ref.double().cpu()
    return ((got.double().cpu() - ref).abs().max() / ref.abs().max().clamp(min=1e-30)).item()


def _gdn_case(B, T, Hk, Hv, dk, dv, dtype, seed=0):
    ins = [t.contiguous() for t in gdn_inputs(B, T, Hk, Hv, dk, dv, dtype, seed, device=DEV)]
    f32 = dict(device=DEV, dtype=torch.float32)
    outs = [torch.empty(B, T, Hv, dv, device=DEV, dtype=dtype), torch.empty(B, Hv, dk, dv, **f32),
            torch.empty(B, T, Hk, dk, **f32), torch.empty(B, T, Hv, dv, **f32), torch.empty(B, T, Hv, **f32),
            torch.empty(B, T, Hv, **f32)]
    return ins, outs


def _gdn_check(ins, outs, scale, dtype):
    ref = gdn_ref.gdn_chunk_wy16(*[t.double().cpu() for t in ins], scale=scale)
    o, st, kh, vf, gf, bf = outs
    assert o.dtype == dtype
    assert _err(o, ref.o) <= (1e-2 if dtype == torch.bfloat16 else 1e-4)
    assert _err(st, ref.state) <= 2e-4
    assert _err(kh, ref.k_hat) <= 1e-5
    assert torch.equal(vf.cpu(), ref.v.float()) and _err(gf, ref.g) <= 1e-6 and _err(bf, ref.beta) <= 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 16, 40])
@pytest.mark.parametrize("dk", [64, 128])
def test_gdn_enqueue(T, dk, dtype):
    ins, outs = _gdn_case(3, T, 2, 4, dk, 64, dtype, seed=T + dk)
    run = Enqueuer(_plugin("GdnChunkWY16", {"scale": dk ** -0.5}), ins, outs)
    run()
    torch.cuda.synchronize()
    _gdn_check(ins, outs, dk ** -0.5, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 16])
def test_conv_enqueue(T, dtype):
    gen = torch.Generator().manual_seed(T)
    B, Cc, W = 2, 96, 4
    ins = [torch.randn(B, T, Cc, generator=gen), torch.randn(B, Cc, W - 1, generator=gen), torch.randn(Cc, W, generator=gen)]
    ins = [t.to(dtype).to(DEV) for t in ins]
    outs = [torch.empty(B, T, Cc, device=DEV, dtype=dtype)]
    Enqueuer(_plugin("CausalConvVerify", {}), ins, outs)()
    torch.cuda.synchronize()
    ref = conv_ref.conv_verify(*[t.double().cpu() for t in ins])
    assert _err(outs[0], ref) <= (1e-2 if dtype == torch.bfloat16 else 1e-5)


def _attn_case(B, T, Hq, Hkv, hd, dtype, idx_dtype, seed=0, L=2, NB=12, BS=16, MB=4):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)
    bt = torch.full((B, MB), -1, dtype=torch.int64)
    for b in range(B):
        bt[b, :3] = torch.randperm(NB, generator=gen)[:3]  # last entry unused (-1): narrowed as -1
    kv_start = torch.tensor([0, 5, 0][:B])
    kv_len = torch.tensor([0, 37, 48][:B])
    ins = [r(B, T, Hq, hd), r(B, T, Hkv, hd), r(B, T, Hkv, hd), r(L, 2, NB, BS, Hkv, hd)]
    ins = [t.to(dtype).to(DEV) for t in ins] + [t.to(idx_dtype).to(DEV) for t in (bt, kv_start, kv_len)]
    return ins, [torch.empty(B, T, Hq, hd, device=DEV, dtype=dtype)]


def _attn_ref(ins, layer, causal, scale):
    q, k, v, pool, bt, ks, kl = [t.cpu() for t in ins]
    return attention_ref.paged_attention_ref(q.double(), k.double(), v.double(), pool.double(), layer, bt.long(),
                                             ks.long(), kl.long(), causal, scale)


@pytest.mark.parametrize("idx_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("causal", [1, 0])
@pytest.mark.parametrize("T", [1, 16])
@pytest.mark.parametrize("hd,dtype", [(64, torch.float32), (128, torch.bfloat16)])
def test_paged_attention_enqueue(T, causal, idx_dtype, hd, dtype):
    ins, outs = _attn_case(3, T, 8, 2, hd, dtype, idx_dtype, seed=T * 7 + causal)
    run = Enqueuer(_plugin("PagedAttention", {"layer": 1, "causal": causal, "scale": hd ** -0.5}), ins, outs)
    q = ins[0].shape  # the split-KV partials' bound, plus room to narrow int64 indices (none for int32 ones)
    narrow = run.ws.numel() - attn_spec.workspace_bound(q[0], q[1], q[2], q[3])
    assert (narrow > 0) == (idx_dtype == torch.int64) and narrow >= 0
    run()
    torch.cuda.synchronize()
    want = _attn_ref(ins, 1, bool(causal), hd ** -0.5)
    assert _err(outs[0], want) <= (1.5e-2 if dtype == torch.bfloat16 else 2e-3)


def test_cuda_graph_replays_enqueues():
    """Capture GDN + attention (int64 indices) enqueues once; new input values, replay, still exact."""
    gins, gouts = _gdn_case(2, 16, 2, 4, 128, 128, torch.float32, seed=1)
    ains, aouts = _attn_case(3, 16, 8, 2, 128, torch.float32, torch.int64, seed=2)
    gdn = Enqueuer(_plugin("GdnChunkWY16", {"scale": 128 ** -0.5}), gins, gouts)
    att = Enqueuer(_plugin("PagedAttention", {"layer": 0, "causal": 1, "scale": 128 ** -0.5}), ains, aouts)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        gdn(s)  # warm-up outside capture: the first launch builds and loads the kernel modules
        att(s)
    s.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=s):
        gdn(s)
        att(s)
    for seed in (3, 4):
        new_g, _ = _gdn_case(2, 16, 2, 4, 128, 128, torch.float32, seed=seed)
        new_a, _ = _attn_case(3, 16, 8, 2, 128, torch.float32, torch.int64, seed=seed)
        for dst, src in zip(gins + ains, new_g + new_a):
            dst.copy_(src)
        torch.cuda.synchronize()
        graph.replay()
        torch.cuda.synchronize()
        _gdn_check(gins, gouts, 128 ** -0.5, torch.float32)
        assert _err(aouts[0], _attn_ref(ains, 0, True, 128 ** -0.5)) <= 2e-3
