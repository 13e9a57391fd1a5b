"""CPU: each plugin's `enqueue` with the CUDA launchers replaced by emulators that read and write host memory
through the same raw pointers — checks the pointer/argument plumbing (input/output order, dims, dtypes,
attributes, int64 index narrowing into the workspace) against the torch references without a GPU.
The real kernels behind the same calls are checked in test_trt_gpu.py (marked gpu)."""
import ctypes

import numpy as np
import pytest
import torch

from dflash_trt.plugins import trt_base
from dflash_trt.plugins import trt_compat as C
from dflash_trt.plugins import trt_plugins as P
from dflash_trt.plugins.conv import reference as conv_ref
from dflash_trt.plugins.conv import trt_plugin as conv_plugin
from dflash_trt.plugins.gdn import reference as gdn_ref
from dflash_trt.plugins.gdn import trt_plugin as gdn_plugin
from dflash_trt.plugins.opspec import KernelError
from dflash_trt.plugins.paged_attention import reference as attention_ref
from dflash_trt.plugins.paged_attention import trt_plugin as attention_plugin
from dflash_trt.plugins.paged_attention.spec import workspace_bound

NP = {"float32": np.float32, "int32": np.int32, "int64": np.int64}


def view(ptr, shape, dt):
    n = int(np.prod(shape)) * np.dtype(NP[dt]).itemsize
    return torch.from_numpy(np.frombuffer((ctypes.c_byte * n).from_address(ptr), dtype=NP[dt]).reshape(shape))


class FakeLaunch:
    """Stand-ins for the ops' launch.py functions the plugins call, same signatures, computing on host memory."""

    def __init__(self):
        self.calls = []

    def gdn_wy16(self, q, k, v, g, beta, state, slot, o, k_hat, v_f, g_f, b_f, state_out, *, B, T, Hk, Hv, dk, dv,
                 in_dtype, gb_dtype, o_dtype, state_dtype, scale, stream):
        self.calls.append(("gdn", stream))
        assert slot == 0
        r = gdn_ref.gdn_chunk_wy16(view(q, (B, T, Hk, dk), in_dtype), view(k, (B, T, Hk, dk), in_dtype),
                                   view(v, (B, T, Hv, dv), in_dtype), view(g, (B, T, Hv), gb_dtype),
                                   view(beta, (B, T, Hv), gb_dtype), view(state, (B, Hv, dk, dv), state_dtype), scale)
        for ptr, val in ((o, r.o), (k_hat, r.k_hat), (v_f, r.v), (g_f, r.g), (b_f, r.beta), (state_out, r.state)):
            view(ptr, tuple(val.shape), "float32").copy_(val)

    def conv_verify(self, x, state, slot, weight, y, *, B, T, C, W, x_dtype, s_dtype, w_dtype, y_dtype, stream):
        self.calls.append(("conv", stream))
        r = conv_ref.conv_verify(view(x, (B, T, C), x_dtype), view(state, (B, C, W - 1), s_dtype),
                                view(weight, (C, W), w_dtype))
        view(y, (B, T, C), y_dtype).copy_(r)

    def paged_attention(self, q, k_new, v_new, pool, block_table, kv_start, kv_len, o, *, B, T, Hq, Hkv, hd, layer,
                        num_blocks, block_size, max_blocks, causal, scale, window, q_dtype, n_dtype, p_dtype, o_dtype,
                        workspace, stream):
        self.calls.append(("attn", stream))
        self.workspace = workspace  # split-KV partials: the tail of TensorRT's workspace
        L = self.L
        r = attention_ref.paged_attention_ref(
            view(q, (B, T, Hq, hd), q_dtype), view(k_new, (B, T, Hkv, hd), n_dtype), view(v_new, (B, T, Hkv, hd), n_dtype),
            view(pool, (L, 2, num_blocks, block_size, Hkv, hd), p_dtype), layer,
            view(block_table, (B, max_blocks), "int32").long(), view(kv_start, (B,), "int32").long(),
            view(kv_len, (B,), "int32").long(), causal, scale, window)
        view(o, (B, T, Hq, hd), o_dtype).copy_(r)


@pytest.fixture
def fake(monkeypatch):
    f = FakeLaunch()
    for mod in (gdn_plugin, conv_plugin, attention_plugin):  # each op's plugin calls its own launcher module
        monkeypatch.setattr(mod, "launch", f)

    def narrow(dst, src, n, stream):
        view(dst, (n,), "int32").copy_(view(src, (n,), "int64").to(torch.int32))

    monkeypatch.setattr(trt_base, "narrow_i64", narrow)
    return f


def _enqueue(plugin, ins, outs):
    dyn = lambda ts: [C.dynamic_desc(tuple(t.shape), str(t.dtype)) for t in ts]
    desc = lambda ts: [C.tensor_desc(tuple(t.shape), str(t.dtype)) for t in ts]
    ws = torch.zeros(max(plugin.get_workspace_size(dyn(ins), dyn(outs)), 1), dtype=torch.uint8)
    plugin.enqueue(desc(ins), desc(outs), [t.data_ptr() for t in ins], [t.data_ptr() for t in outs], ws.data_ptr(), 77)
    return ws


@pytest.mark.parametrize("T", [1, 16, 20])
def test_gdn_enqueue_plumbing(fake, T):
    B, Hk, Hv, dk, dv = 2, 2, 4, 64, 32
    g = torch.Generator().manual_seed(T)
    r = lambda *s: torch.randn(*s, generator=g)
    ins = [r(B, T, Hk, dk), r(B, T, Hk, dk), r(B, T, Hv, dv), -r(B, T, Hv).abs(), r(B, T, Hv).sigmoid(),
           r(B, Hv, dk, dv)]
    outs = [torch.zeros(B, T, Hv, dv), torch.zeros(B, Hv, dk, dv), torch.zeros(B, T, Hk, dk), torch.zeros(B, T, Hv, dv),
            torch.zeros(B, T, Hv), torch.zeros(B, T, Hv)]
    _enqueue(P.creators()["GdnChunkWY16"].create_plugin("g", {"scale": 0.2}, C.TensorRTPhase.RUNTIME), ins, outs)
    ref = gdn_ref.gdn_chunk_wy16(*ins, scale=0.2)
    for got, want in zip(outs, (ref.o, ref.state, ref.k_hat, ref.v, ref.g, ref.beta)):  # plugin output order
        torch.testing.assert_close(got, want)
    assert fake.calls == [("gdn", 77)]


def test_conv_enqueue_plumbing(fake):
    ins = [torch.randn(2, 5, 24), torch.randn(2, 24, 3), torch.randn(24, 4)]
    outs = [torch.zeros(2, 5, 24)]
    _enqueue(P.PLUGINS["CausalConvVerify"](), ins, outs)
    torch.testing.assert_close(outs[0], conv_ref.conv_verify(*ins))


@pytest.mark.parametrize("idx", [torch.int64, torch.int32])
@pytest.mark.parametrize("causal", [0, 1])
def test_attention_enqueue_plumbing(fake, idx, causal):
    B, T, Hq, Hkv, hd, L, NB, BS, MB = 2, 4, 4, 2, 64, 3, 6, 4, 5
    fake.L = L
    bt = torch.tensor([[3, 1, 4, -1, -1], [0, 5, 2, -1, -1]])
    ins = [torch.randn(B, T, Hq, hd), torch.randn(B, T, Hkv, hd), torch.randn(B, T, Hkv, hd),
           torch.randn(L, 2, NB, BS, Hkv, hd), bt.to(idx), torch.tensor([1, 0]).to(idx), torch.tensor([9, 12]).to(idx)]
    outs = [torch.zeros(B, T, Hq, hd)]
    plugin = P.PLUGINS["PagedAttention"]({"layer": 2, "causal": causal, "scale": 0.3})
    ws = _enqueue(plugin, ins, outs)
    want = attention_ref.paged_attention_ref(*ins[:4], 2, bt, ins[5].long(), ins[6].long(), bool(causal), 0.3)
    torch.testing.assert_close(outs[0], want)
    partials = workspace_bound(B, T, Hq, hd)
    assert (ws.numel() > partials) == (idx == torch.int64)
    assert fake.workspace == ws.data_ptr() + ws.numel() - partials


def test_runtime_shape_change_rejects_unsupported_kernel_shapes():
    p = P.PLUGINS["GdnChunkWY16"]({}, C.TensorRTPhase.RUNTIME)
    shapes = [(1, 2, 2, 16), (1, 2, 2, 16), (1, 2, 4, 8), (1, 2, 4), (1, 2, 4), (1, 4, 16, 8)]
    descs = [C.tensor_desc(s, "float32") for s in shapes]
    with pytest.raises(KernelError, match="dk=16"):
        p.on_shape_change(descs, [])
