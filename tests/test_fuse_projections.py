"""modeling/fuse.py: projections sharing an input as one GEMM. Fused and unfused modules give the same logits,
ctx taps and drafts (fp64: the same dot products), the fused weights are views of one buffer (no copy), and the
checkpoint's parameter names and values are untouched."""
import pytest
import torch

from dflash_trt.config import DrafterConfig, TargetConfig
from dflash_trt.modeling.drafter import Drafter
from dflash_trt.modeling.target import TargetModel
from dflash_trt.modeling.mlp import SparseMoE
from dflash_trt.tools.tiny import TINY_MOE, _randomize, tiny_drafter_config, tiny_target_config


def _pair(model_type, **over):
    gen = torch.Generator().manual_seed(3)
    tc = tiny_target_config(layers=4, model_type=model_type, **over)
    t = TargetModel(TargetConfig.from_dict(tc))
    _randomize(t, gen)
    d = Drafter(DrafterConfig.from_dict(tiny_drafter_config(tc)), tc["hidden_size"])
    _randomize(d, gen)
    d.bind_target(t)
    return t.double().eval(), d.double().eval()


def _run(t, d, ids):
    out = t.forward_full(ids)
    B, T = ids.shape
    ctx = d.ctx(out["ctx_hidden"], torch.arange(T).expand(B, T))["dkv_rows"]
    return out["logits"], out["ctx_hidden"], ctx


@pytest.mark.parametrize("model_type,moe", [("qwen3_5_text", False), ("qwen3_next", False), ("qwen3_next", True)])
def test_fused_projections_same_outputs_and_no_copy(model_type, moe):
    """Dense MLPs and, in sparse-MoE layers, the shared expert's gate/up and the router + shared-expert gate are
    fused the same way."""
    t, d = _pair(model_type, **(TINY_MOE if moe else {}))
    assert any(isinstance(layer.mlp, SparseMoE) for layer in t.layers) == moe
    assert t.cfg.gdn_layout == ("split" if model_type == "qwen3_5_text" else "qkvz")
    ids = torch.randint(0, t.cfg.vocab_size, (2, 11), generator=torch.Generator().manual_seed(0))
    before_sd = {k: v.clone() for k, v in {**t.state_dict(), **{"d." + k: v for k, v in d.state_dict().items()}}.items()}
    n_params = (len(list(t.parameters())), len(list(d.parameters())))
    with torch.no_grad():
        want = _run(t, d, ids)
        t.fuse_projections(), d.fuse_projections()
        t.fuse_projections()  # idempotent
        got = _run(t, d, ids)
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
    after_sd = {**t.state_dict(), **{"d." + k: v for k, v in d.state_dict().items()}}
    assert after_sd.keys() == before_sd.keys() and all(torch.equal(after_sd[k], before_sd[k]) for k in before_sd)
    assert (len(list(t.parameters())), len(list(d.parameters()))) == n_params
    fused = [(m, n, b) for m in list(t.modules()) + list(d.modules()) for n, b in m.named_buffers(recurse=False)
             if n.startswith("_fused_")]
    layers, sparse = len(t.layers), sum(isinstance(layer.mlp, SparseMoE) for layer in t.layers)
    # mixer + MLP per target layer (+ router/shared gate per sparse layer); k/v + MLP per drafter layer
    assert len(fused) == 2 * layers + sparse + 2 * len(d.layers)
    for m, n, buf in fused:  # every fused layer's weight is rows of the buffer, not a copy
        first = n[len("_fused_"):]
        w = getattr(m, first).weight
        assert w.data_ptr() == buf.data_ptr() and w.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()


def test_fused_gradients_reach_the_buffer():
    """A drafter trained after fusing: an in-place optimizer step on a layer's weight is seen by the fused GEMM."""
    _, d = _pair("qwen3_5_text")
    d.fuse_projections()
    mlp = d.layers[0].mlp
    x = torch.randn(3, mlp.gate_proj.in_features, dtype=torch.float64)
    y0 = mlp(x)
    with torch.no_grad():
        mlp.up_proj.weight.mul_(2.0)
    torch.testing.assert_close(mlp(x), mlp.down_proj(torch.nn.functional.silu(mlp.gate_proj(x)) * mlp.up_proj(x)))
    assert not torch.allclose(mlp(x), y0)
