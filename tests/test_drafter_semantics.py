"""The drafter block against an implementation no one here wrote: speculators' DFlash decoder layers
(speculators.models.dflash.model_definitions: Qwen3DFlashAttention puts the ctx features into K/V, k_norm on both,
RoPE at [ctx | block] positions) with transformers' Qwen3 RMSNorm / rotary embedding as the glue that speculators'
DFlashDraftModel._backbone_forward uses, eager attention, fp32, on our weights and context.

What speculators honours and where it differs from DESIGN §2b (checked below, not assumed):
- full_attention layers: its own mask (create_anchor_block_mask_mod, sliding_window=None) — every ctx row before the
  anchor + the whole block, bidirectional — is ours exactly: compared end to end with its mask.
- sliding_attention layers: it is causal within the block unless sliding_window_non_causal (ours: causal unless
  is_causal says otherwise — the same flag), but its window is per BLOCK, not per query: every slot sees ctx
  positions >= anchor - sliding_window (W ctx rows + itself for slot 0). DESIGN (the z-lab reference, vLLM, SGLang):
  a query at p sees keys with p - key < W. Its slot-0 row equals ours with W+1; later slots differ; and it never
  windows inside the block (ours does, for blocks longer than the window) (test_speculators_sliding_window_is_per_block). So sliding layers are compared with speculators' layers under
  the DESIGN mask written here from positions.
- input_embedding_scale, output_multiplier, final_logit_softcapping: not in speculators' DFlash; applied around its
  layers by their definitions (DESIGN §2b).

speculators' package __init__ imports its training stack (datasets, openai, ...; with deps it pulls a CUDA torch),
so the two torch-only modules used here are loaded from the installed distribution's files.
"""
import importlib.metadata
import importlib.util

import pytest
import torch

from dflash_trt.config import DrafterConfig, TargetConfig
from dflash_trt.modeling.drafter import Drafter
from dflash_trt.modeling.target import TargetModel
from dflash_trt.plugins.paged_attention.reference import kv_write
from dflash_trt.tools.tiny import _randomize, tiny_drafter_config, tiny_target_config

W, BS, R = 5, 8, 23  # window, block size, ctx rows (> window, so windows bite)


def _speculators_module(rel: str):
    try:
        dist = importlib.metadata.distribution("speculators")
    except importlib.metadata.PackageNotFoundError:
        pytest.fail("speculators is not installed: pip install --no-deps speculators (the external DFlash oracle)")
    (f,) = [f for f in dist.files if str(f) == f"speculators/models/dflash/{rel}"]
    spec = importlib.util.spec_from_file_location(f"speculators_dflash_{rel[:-3]}", f.locate())
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


CONFIGS = {
    "all_full": dict(layer_types=["full_attention"] * 3),
    "mixed": dict(layer_types=["sliding_attention", "full_attention", "sliding_attention"], sliding_window=W),
    "all_sliding": dict(layer_types=["sliding_attention"] * 3, sliding_window=W),
    "all_sliding_noncausal_scaled": dict(layer_types=["sliding_attention"] * 3, sliding_window=W, is_causal=False,
                                         input_embedding_scale=1.7, output_multiplier=0.6,
                                         final_logit_softcapping=2.0),
}


def _pair(name, seed=0):
    tc = tiny_target_config()
    dc = tiny_drafter_config(tc, layers=3, block_size=None)
    del dc["block_size"]
    dc["dflash_config"]["block_size"] = BS  # nested, as the DFlash2-era checkpoints
    dc.update(CONFIGS[name])
    gen = torch.Generator().manual_seed(seed)
    target = TargetModel(TargetConfig.from_dict(tc))
    _randomize(target, gen)
    d = Drafter(DrafterConfig.from_dict(dc), tc["hidden_size"])
    _randomize(d, gen)
    return target, d.bind_target(target), dc


def _ours(d, ctx_hidden, block_ids):
    """The graph path: ctx rows -> drafter pages (kv_write) -> block over pages."""
    cfg = d.cfg
    Bs = block_ids.shape[1]
    ps, nb = 4, 16
    pool = torch.zeros(cfg.num_layers, 2, nb, ps, cfg.num_kv_heads, cfg.head_dim)
    bt = torch.randperm(nb, generator=torch.Generator().manual_seed(3))[None]  # scattered pages
    rows = d.ctx(ctx_hidden, torch.arange(R)[None])["dkv_rows"]
    kv_write(pool, rows, bt, torch.tensor([0]), torch.tensor([R]))
    return d.block(block_ids, R + torch.arange(Bs)[None], bt, torch.tensor([0]), torch.tensor([R]), pool,
                   want_logits=True)["logits"]


def _design_mask(cfg, i, Bs):
    """[Bs, R+Bs] bool from positions: ctx at 0..R-1, block at R..R+Bs-1 (DESIGN §2b)."""
    q = R + torch.arange(Bs)[:, None]
    k = torch.cat([torch.arange(R), R + torch.arange(Bs)])[None]
    m = torch.ones(Bs, R + Bs, dtype=torch.bool)
    if cfg.layer_causal(i):
        m &= k <= q
    if cfg.layer_window(i):
        m &= q - k < cfg.layer_window(i)
    return m


def _speculators_mask(Bs, window, non_causal):
    attn = _speculators_module("attention.py")
    from torch.nn.attention.flex_attention import create_mask

    # its anchor is a base token (the bonus): a sequence of R+1 with the anchor at R; base row R itself is masked
    # (kv < anchor) and dropped, leaving [R ctx | Bs block] columns as ours
    mod, ql, kvl = attn.create_anchor_block_mask_mod(torch.zeros(R + 1, dtype=torch.long), R + 1, torch.tensor([R]),
                                                     Bs, sliding_window=window, sliding_window_non_causal=non_causal)
    m = create_mask(mod, None, None, ql, kvl, device="cpu")[0, 0]
    assert not m[:, R].any()
    return torch.cat([m[:, :R], m[:, R + 1:]], 1)


def _speculators(d, dc, ctx_hidden, block_ids, masks):
    """speculators' decoder layers on our weights; masks: one bool [Bs, R+Bs] per layer."""
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, Qwen3RotaryEmbedding

    md = _speculators_module("model_definitions.py")
    cfg = d.cfg
    qc = Qwen3Config(vocab_size=259, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                     num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                     num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps,
                     rope_theta=cfg.rope_theta, attention_bias=False, layer_types=cfg.layer_types,
                     sliding_window=cfg.sliding_window or None, max_window_layers=0)
    qc._attn_implementation = "eager"
    layers = torch.nn.ModuleList(md.Qwen3DFlashDecoderLayer(qc, i) for i in range(cfg.num_layers))
    layers.load_state_dict({k[len("layers."):]: v for k, v in d.state_dict().items() if k.startswith("layers.")})
    fc = torch.nn.Linear(d.fc.in_features, cfg.hidden_size, bias=False)
    fc.weight.data.copy_(d.fc.weight)
    hidden_norm, norm = Qwen3RMSNorm(cfg.hidden_size, cfg.rms_norm_eps), Qwen3RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
    hidden_norm.weight.data.copy_(d.hidden_norm.weight)
    norm.weight.data.copy_(d.norm.weight)
    embed, lm_head = d._target
    Bs = block_ids.shape[1]
    pos = torch.arange(R + Bs)[None]
    fc_out = hidden_norm(fc(ctx_hidden))
    pe = Qwen3RotaryEmbedding(qc)(fc_out, pos)
    h = embed(block_ids) * cfg.input_embedding_scale
    for layer, m in zip(layers, masks):
        fm = torch.zeros(m.shape).masked_fill(~m, float("-inf"))[None, None]
        h = layer(hidden_states=h, target_hidden=fc_out, attention_mask=fm, position_ids=pos, position_embeddings=pe)
    logits = lm_head(norm(h)) * cfg.output_multiplier
    c = cfg.final_logit_softcapping
    return c * torch.tanh(logits / c) if c > 0 else logits


@pytest.mark.parametrize("Bs", [BS, 4, 2])  # full block and the gamma+1-slot blocks of fewer drafts
@pytest.mark.parametrize("name", list(CONFIGS))
def test_block_logits_equal_speculators(name, Bs):
    _, d, dc = _pair(name)
    gen = torch.Generator().manual_seed(11)
    ctx_hidden = torch.randn(1, R, d.fc.in_features, generator=gen)
    block = torch.full((1, Bs), d.cfg.mask_token_id)
    block[0, 0] = 17
    with torch.no_grad():
        ours = _ours(d, ctx_hidden, block)
        masks = [_design_mask(d.cfg, i, Bs) for i in range(d.cfg.num_layers)]
        ref = _speculators(d, dc, ctx_hidden, block, masks)
        dense = d.train_forward(ctx_hidden, torch.arange(R)[None], block, R + torch.arange(Bs)[None])
    assert (ours - ref).abs().max().item() <= 1e-4
    assert (dense - ref).abs().max().item() <= 1e-4  # the training forward has the same masks
    if name == "all_full":  # end to end with speculators' own mask, too
        own = [_speculators_mask(Bs, None, False)] * d.cfg.num_layers
        assert all(torch.equal(a, b) for a, b in zip(own, masks))
        with torch.no_grad():
            assert (ours - _speculators(d, dc, ctx_hidden, block, own)).abs().max().item() <= 1e-4


def test_windows_and_causality_change_the_drafts():
    """The configs above are not equivalent: the window and the causal block both move the logits."""
    outs = {}
    for name in ("all_full", "all_sliding"):
        _, d, _ = _pair(name)
        ctx_hidden = torch.randn(1, R, d.fc.in_features, generator=torch.Generator().manual_seed(11))
        block = torch.full((1, BS), d.cfg.mask_token_id)
        with torch.no_grad():
            outs[name] = _ours(d, ctx_hidden, block)
    assert (outs["all_full"] - outs["all_sliding"]).abs().max() > 1e-2


@pytest.mark.parametrize("non_causal", [False, True])
def test_speculators_sliding_window_is_per_block(non_causal):
    """Where speculators differs: its sliding mask on the ctx is the DESIGN mask with W+1 for slot 0 only."""
    spec = _speculators_mask(BS, W, non_causal)
    cfg = DrafterConfig.from_dict(dict(tiny_drafter_config(tiny_target_config(), layers=1, block_size=BS),
                                       layer_types=["sliding_attention"], sliding_window=W + 1,
                                       is_causal=not non_causal))
    ours = _design_mask(cfg, 0, BS)
    assert torch.equal(spec[0], ours[0])  # slot 0: W ctx rows + itself
    # the block part: causal unless sliding_window_non_causal, as ours, but never windowed (ours is: p - key < W
    # also inside the block, which bites only for blocks longer than the window)
    block = torch.ones(BS, BS, dtype=torch.bool)
    assert torch.equal(spec[:, R:], block if non_causal else block.tril())
    assert not torch.equal(spec[1:, :R], ours[1:, :R])  # later slots: per-block window vs per-query window


def test_tap_ids_are_hf_hidden_states(tmp_path):
    """Tap id L = HF hidden_states[L+1]; for the last layer that is HF's value after the final norm (the
    reference's), in step (forward_full) and in the training forward alike; unsorted tap ids keep their order."""
    from hf_tiny import make_hf_model

    from dflash_trt.export.checkpoint import load_target

    hf = make_hf_model("qwen3_5", 2, str(tmp_path))
    t = load_target(str(tmp_path))
    n, H = t.cfg.num_layers, t.cfg.hidden_size
    t.tap_ids = [n - 1, 1, n - 2]
    ids = torch.randint(0, 200, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hs = hf(ids, output_hidden_states=True).hidden_states
        for ctx in (t.forward_full(ids, want_logits=False)["ctx_hidden"],
                    t.forward_train(ids, want_logits=False)["ctx_hidden"]):
            for i, layer in enumerate(t.tap_ids):
                assert (ctx[..., i * H:(i + 1) * H] - hs[layer + 1]).abs().max().item() <= 1e-5
