"""The hybrid target (Qwen3-Next / Qwen3.5 text decoder) as one readable torch file.

One forward, `step`, serves every target graph of the ABI (target_k{K}, target_prefill): T new
tokens per sequence on top of the state held in the pools (paged KV, GDN state slots, conv slots).
Pools are read-only here; the graph returns what the runtime's commit path writes back:
new K/V rows, GDN fold data (or the final state for prefill), pre-conv columns and ctx_hidden.
`step` runs its pieces (embed_rope, gdn_layer / attention_layer per layer, head) through its `regions` argument
(modeling/regions.py): called as they are, or each compiled once for every layer of its kind.

Shapes: B sequences, T new tokens, H hidden, La/Lg attention/GDN layer counts,
Hk/Hv GDN key/value heads with dims dk/dv, C = conv_dim, W = conv kernel.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dflash_trt.config import TargetConfig
from dflash_trt.modeling.fuse import Linear, fuse_linears, linears
from dflash_trt.modeling.gdn_dense import gdn_chunk_dense
from dflash_trt.modeling.mlp import MLP, SparseMoE
from dflash_trt.modeling.regions import EAGER
from dflash_trt.plugins import ops
from dflash_trt.plugins.gdn.reference import gdn_gates


class RMSNorm(nn.Module):
    """RMSNorm in fp32. zero_centred (Qwen3-Next/3.5 decoder norms): x̂·(1+w), multiplied before the cast
    as HF does. Plain (Qwen3 / the DFlash drafter, the GDN output norm): w·x̂ after the cast to x's dtype."""

    def __init__(self, dim: int, eps: float, zero_centred: bool = True):
        super().__init__()
        self.eps, self.zero_centred = eps, zero_centred
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centred else torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.zero_centred:
            return (xf * (1.0 + self.weight.float())).type_as(x)
        return self.weight * xf.to(x.dtype)


class GatedRMSNorm(RMSNorm):
    """GDN output norm: w ⊙ o/rms(o) ⊙ silu(z) per value head (plain weight, not zero-centred)."""

    def __init__(self, dim: int, eps: float):
        super().__init__(dim, eps, zero_centred=False)

    def forward(self, o, z):
        return (super().forward(o) * F.silu(z.float())).to(o.dtype)


def rope_cos_sin(positions, rotary_dim: int, theta: float, dtype):
    """positions [B,T] -> cos, sin [B,T,rotary_dim] (NeoX layout: frequencies repeated twice)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=positions.device) / rotary_dim))
    freqs = positions.to(torch.float32)[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x, cos, sin):
    """x [B,T,heads,hd]; rotates the first cos.shape[-1] dims (partial RoPE), NeoX rotate_half."""
    rd = cos.shape[-1]
    xr, xp = x[..., :rd], x[..., rd:]
    half = rd // 2
    rot = torch.cat([-xr[..., half:], xr[..., :half]], dim=-1)
    xr = xr * cos[:, :, None] + rot * sin[:, :, None]
    return torch.cat([xr, xp], dim=-1)


ARGMAX_SPLIT = 4096  # a CUDA argmax over more columns than this runs in two stages


def last_rows(h, valid_len):
    """h [B, T, H] -> [B, 1, H]: row valid_len - 1 of each sequence (row 0 where valid_len is 0), the one row of a
    prefill chunk whose logits are read (the next token); the lm_head then runs on B rows, not B x chunk."""
    idx = (valid_len - 1).clamp(min=0).view(-1, 1, 1).expand(-1, 1, h.shape[-1])
    return h.gather(1, idx)


def argmax_last(logits):
    """logits.argmax(-1), the first index among equal maxima. On CUDA, a large vocabulary is reduced in two stages
    (per 4096-column chunk, then over chunks): Inductor gives a one-row argmax one thread block (figures:
    docs/PERF.md). Same index either way: the first chunk holding the max, its first index."""
    if not logits.is_cuda or logits.shape[-1] <= 2 * ARGMAX_SPLIT:
        return logits.argmax(-1)
    return argmax_chunked(logits)


def argmax_chunked(logits):
    V = logits.shape[-1]
    n = -(-V // ARGMAX_SPLIT)
    x = F.pad(logits, (0, n * ARGMAX_SPLIT - V), value=float("-inf")).unflatten(-1, (n, ARGMAX_SPLIT))
    best, idx = x.max(-1)
    chunk = best.argmax(-1, keepdim=True)
    return (chunk * ARGMAX_SPLIT + idx.gather(-1, chunk)).squeeze(-1)


class GatedDeltaNet(nn.Module):
    PROJECTIONS = {"split": ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"), "qkvz": ("in_proj_qkvz", "in_proj_ba")}

    def __init__(self, cfg: TargetConfig):
        super().__init__()
        self.cfg = cfg
        Hk, Hv, dk, dv = cfg.lin_num_k_heads, cfg.lin_num_v_heads, cfg.lin_k_dim, cfg.lin_v_dim
        H, C = cfg.hidden_size, cfg.conv_dim
        if cfg.gdn_layout == "qkvz":
            self.in_proj_qkvz = Linear(H, 2 * Hk * dk + 2 * Hv * dv, bias=False)
            self.in_proj_ba = Linear(H, 2 * Hv, bias=False)
        else:
            self.in_proj_qkv = Linear(H, C, bias=False)
            self.in_proj_z = Linear(H, Hv * dv, bias=False)
            self.in_proj_b = Linear(H, Hv, bias=False)
            self.in_proj_a = Linear(H, Hv, bias=False)
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.zeros(C, 1, cfg.conv_kernel))  # HF Conv1d layout
        self.dt_bias = nn.Parameter(torch.ones(Hv))
        self.A_log = nn.Parameter(torch.zeros(Hv))
        self.norm = GatedRMSNorm(dv, cfg.rms_norm_eps)
        self.out_proj = Linear(Hv * dv, H, bias=False)

    def project(self, x):
        """x [B,T,H] -> pre-conv columns [B,T,C] ([q|k|v], all heads), z [B,T,Hv,dv], b, a [B,T,Hv]."""
        c = self.cfg
        Hk, Hv, dk, dv = c.lin_num_k_heads, c.lin_num_v_heads, c.lin_k_dim, c.lin_v_dim
        B, T, _ = x.shape
        if c.gdn_layout == "split":
            qkv, z, b, a = linears(self, self.PROJECTIONS["split"], x)
            return qkv, z.view(B, T, Hv, dv), b, a
        # Qwen3-Next interleaves per key head: [q | k | v×r | z×r] and [b×r | a×r], r = Hv/Hk
        r = Hv // Hk
        qkvz, ba = linears(self, self.PROJECTIONS["qkvz"], x)
        qkvz = qkvz.view(B, T, Hk, 2 * dk + 2 * r * dv)
        q, k, v, z = torch.split(qkvz, [dk, dk, r * dv, r * dv], dim=-1)
        ba = ba.view(B, T, Hk, 2 * r)
        b, a = torch.split(ba, [r, r], dim=-1)
        cols = torch.cat([q.reshape(B, T, -1), k.reshape(B, T, -1), v.reshape(B, T, -1)], dim=-1)
        return cols, z.reshape(B, T, Hv, dv), b.reshape(B, T, Hv), a.reshape(B, T, Hv)

    def forward(self, x, conv_state, state, slot=None, valid_len=None, commit=None):
        """x [B,T,H]; conv_state [B,C,W-1]; state [B,Hv,dk,dv] fp32 (both read-only); with slot [B], conv_state and
        state are the layer's pools and rows slot[b] the sequences' states. valid_len [B] (prefill): rows past it
        are padding and GdnOut.state is the state after the valid rows. Returns (y [B,T,H], pre-conv cols [B,T,C],
        GdnOut). commit = (pool [Lg,slots,Hv,dk,dv], layer, n [B]) (a plain decode step, T = 1): the row is committed
        into the pool's layer where n > 0 (ops.gdn_decode_commit) and GdnOut is None."""
        c = self.cfg
        Hk, Hv, dk, dv = c.lin_num_k_heads, c.lin_num_v_heads, c.lin_k_dim, c.lin_v_dim
        B, T, _ = x.shape
        cols, z, b, a = self.project(x)
        mixed = ops.conv_verify(cols, conv_state, self.conv1d.weight[:, 0, :], slot)
        q, k, v = torch.split(mixed, [Hk * dk, Hk * dk, Hv * dv], dim=-1)
        q, k, v = q.reshape(B, T, Hk, dk), k.reshape(B, T, Hk, dk), v.reshape(B, T, Hv, dv)
        if commit is not None:
            pool, layer, n = commit
            o, out = ops.gdn_decode_commit(q, k, v, a, b, self.A_log, self.dt_bias, pool, layer, slot, n), None
        else:
            out = ops.gdn_chunk(q, k, v, a, b, self.A_log, self.dt_bias, state, slot=slot, valid_len=valid_len)
            o = out.o
        o = self.norm(o.to(x.dtype), z)
        return self.out_proj(o.reshape(B, T, Hv * dv)), cols, out

    def forward_dense(self, x):
        """Training path: whole sequences x [B,T,H] from zero conv and GDN state -> y [B,T,H].
        Same math as forward(x, zeros, zeros)[0], batched and differentiable everywhere (F.conv1d for the
        causal conv, gdn_chunk_dense for the recurrence); the custom ops have no backward on CUDA."""
        c = self.cfg
        Hk, Hv, dk, dv = c.lin_num_k_heads, c.lin_num_v_heads, c.lin_k_dim, c.lin_v_dim
        B, T, _ = x.shape
        cols, z, b, a = self.project(x)
        w = self.conv1d.weight
        xt = F.pad(cols.transpose(1, 2), (c.conv_kernel - 1, 0))  # zero conv state: W-1 zero columns
        mixed = F.silu(F.conv1d(xt, w.to(xt.dtype), groups=w.shape[0])).transpose(1, 2)
        q, k, v = torch.split(mixed, [Hk * dk, Hk * dk, Hv * dv], dim=-1)
        g, beta = gdn_gates(a, b, self.A_log, self.dt_bias)
        o, _ = gdn_chunk_dense(q.reshape(B, T, Hk, dk), k.reshape(B, T, Hk, dk), v.reshape(B, T, Hv, dv), g, beta)
        o = self.norm(o.to(x.dtype), z)
        return self.out_proj(o.reshape(B, T, Hv * dv))


class Attention(nn.Module):
    def __init__(self, cfg: TargetConfig):
        super().__init__()
        self.cfg = cfg
        H, nh, nkv, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = Linear(H, nh * hd * 2, bias=False)  # [query | gate] per head
        self.k_proj = Linear(H, nkv * hd, bias=False)
        self.v_proj = Linear(H, nkv * hd, bias=False)
        self.o_proj = Linear(nh * hd, H, bias=False)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)

    def qkv(self, x, cos, sin):
        """x [B,T,H] -> q, gate [B,T,Hq,hd] and k, v [B,T,Hkv,hd]; q/k normed and RoPE'd (k as cached)."""
        c = self.cfg
        B, T, _ = x.shape
        qg, k, v = linears(self, ("q_proj", "k_proj", "v_proj"), x)
        qg = qg.view(B, T, c.num_heads, 2 * c.head_dim)
        q, gate = qg[..., : c.head_dim], qg[..., c.head_dim :]
        q = apply_rope(self.q_norm(q), cos, sin)
        k = apply_rope(self.k_norm(k.view(B, T, c.num_kv_heads, c.head_dim)), cos, sin)
        return q, gate, k, v.view(B, T, c.num_kv_heads, c.head_dim)

    def forward(self, x, cos, sin, kv_pool, pool_layer, block_table, seq_len):
        """Returns (y [B,T,H], k_rows, v_rows [B,T,Hkv,hd]) — rows post-norm, post-RoPE, as cached."""
        c = self.cfg
        B, T, _ = x.shape
        q, gate, k, v = self.qkv(x, cos, sin)
        zero = torch.zeros_like(seq_len)
        o = ops.paged_attention(
            q, k, v, kv_pool, pool_layer, block_table, zero, seq_len, True, c.head_dim**-0.5
        )
        y = self.o_proj((o * torch.sigmoid(gate)).reshape(B, T, c.num_heads * c.head_dim))
        return y, k, v

    def forward_dense(self, x, cos, sin):
        """Training path: causal attention over whole sequences x [B,T,H] (no cache) -> y [B,T,H].
        Same math as forward() with an empty cache, through SDPA (batched, differentiable)."""
        c = self.cfg
        B, T, _ = x.shape
        q, gate, k, v = self.qkv(x, cos, sin)
        r = c.num_heads // c.num_kv_heads
        k, v = k.repeat_interleave(r, 2), v.repeat_interleave(r, 2)  # GQA: q-head h reads kv-head h // r
        # under autocast q/k come out of RoPE in fp32 and v in bf16: one dtype for SDPA
        dt = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
        o = F.scaled_dot_product_attention(q.transpose(1, 2).to(dt), k.transpose(1, 2).to(dt),
                                           v.transpose(1, 2).to(dt), is_causal=True, scale=c.head_dim**-0.5)
        return self.o_proj((o.transpose(1, 2) * torch.sigmoid(gate)).reshape(B, T, c.num_heads * c.head_dim))


def embed_rope(embed, input_ids, positions, rotary_dim: int, theta: float):
    """The step's first piece: token embeddings [B,T,H] and the RoPE tables of the positions."""
    h = embed(input_ids)
    return (h, *rope_cos_sin(positions, rotary_dim, theta, h.dtype))


def attention_layer(layer, h, cos, sin, kv_pool, pool_layer: int, block_table, seq_len):
    """One attention decoder layer of the step: (h after the layer, its K/V rows [2,B,T,Hkv,hd] as cached)."""
    y, k, v = layer.self_attn(layer.input_layernorm(h), cos, sin, kv_pool, pool_layer, block_table, seq_len)
    h = h + y
    return h + layer.mlp(layer.post_attention_layernorm(h)), torch.stack([k, v])


def gdn_layer(layer, h, conv_state, state, slot, valid_len, commit):
    """One GDN decoder layer of the step: (h after the layer, pre-conv columns, GdnOut or None when committed)."""
    y, cols, out = layer.linear_attn(layer.input_layernorm(h), conv_state, state, slot, valid_len, commit)
    h = h + y
    return h + layer.mlp(layer.post_attention_layernorm(h)), cols, out


def head(norm, lm_head, h, valid_len):
    """The step's last piece: fp32 logits of every row, or (prefill, valid_len given) of each sequence's last row,
    and their argmax."""
    logits = lm_head.fp32(norm(h if valid_len is None else last_rows(h, valid_len)))
    return logits, argmax_last(logits)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TargetConfig, layer_type: str, index: int):
        super().__init__()
        self.is_attention = layer_type == "full_attention"
        if self.is_attention:
            self.self_attn = Attention(cfg)
        else:
            self.linear_attn = GatedDeltaNet(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # one module per layer for step() and forward_train() alike, so both paths run the same MLP
        self.mlp = SparseMoE(cfg) if cfg.is_moe_layer(index) else MLP(cfg.hidden_size, cfg.intermediate_size)


class TargetModel(nn.Module):
    """Parameter names match the HF checkpoint with the `model.` prefix dropped (see checkpoint.py). empty: the
    embedding left uninitialised, for a loader that fills every weight (on the meta device its random init would
    import torch's compiler stack, whose distributed modules then hold the process group past its destruction)."""

    def __init__(self, cfg: TargetConfig, tap_ids: list[int] | None = None, empty: bool = False):
        super().__init__()
        self.cfg = cfg
        self.tap_ids = list(tap_ids or [])
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size) if empty else None)
        self.layers = nn.ModuleList(DecoderLayer(cfg, t, i) for i, t in enumerate(cfg.layer_types))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def fuse_projections(self) -> "TargetModel":
        """Projections sharing an input become one GEMM each (modeling/fuse.py); call once the model is on its
        device. The GPU torch backend does; export and the CPU reference keep the separate layers."""
        for layer in self.layers:
            if layer.is_attention:
                fuse_linears(layer.self_attn, ("q_proj", "k_proj", "v_proj"))
            else:
                fuse_linears(layer.linear_attn, GatedDeltaNet.PROJECTIONS[self.cfg.gdn_layout])
            mlp = layer.mlp
            if isinstance(mlp, SparseMoE):
                fuse_linears(mlp, SparseMoE.GATES)
                mlp = mlp.shared_expert
            fuse_linears(mlp, MLP.PROJECTIONS)
        return self

    def _tap(self, i: int, h):
        """Tap id i = the residual stream after layer i, as HF's hidden_states[i+1]: for the last layer that is
        the value after the final norm (what the DFlash reference trains and runs on, DESIGN §2b)."""
        return self.norm(h) if i == len(self.layers) - 1 else h

    def logits(self, h):
        return self.lm_head.fp32(self.norm(h))

    def forward_full(self, input_ids, want_logits=True):
        """Whole sequences [B,T] from empty state, no cache: the dense oracle path (tests, training)."""
        c, (B, T) = self.cfg, input_ids.shape
        dev, dt = input_ids.device, self.embed_tokens.weight.dtype
        zeros = lambda *shape, dtype=dt: torch.zeros(shape, dtype=dtype, device=dev)
        return self.step(
            input_ids, torch.arange(T, device=dev).expand(B, T), torch.arange(B, device=dev),
            zeros(B, dtype=torch.long), zeros(B, 1, dtype=torch.long),
            zeros(len(c.attn_layers), 2, 1, 1, c.num_kv_heads, c.head_dim),
            zeros(len(c.gdn_layers), B, c.lin_num_v_heads, c.lin_k_dim, c.lin_v_dim, dtype=torch.float32),
            zeros(len(c.gdn_layers), B, c.conv_dim, c.conv_kernel - 1), want_logits=want_logits,
        )

    def forward_train(self, input_ids, want_logits=True):
        """Training path: whole sequences [B,T] (positions 0..T-1) from empty state, dense and differentiable:
        causal SDPA for attention, gdn_chunk_dense for the GDN layers. Same math as forward_full / step
        (tests/test_train.py checks logits, ctx_hidden and gradients against forward_full), without the
        pools, paged attention and per-sequence loops of the graph path.
        Returns {'logits': [B,T,V] fp32 or None, 'ctx_hidden': [B,T,n_taps*H] (taps in tap_ids order) or None}."""
        cfg = self.cfg
        B, T = input_ids.shape
        h = self.embed_tokens(input_ids)
        pos = torch.arange(T, device=input_ids.device).expand(B, T)
        cos, sin = rope_cos_sin(pos, cfg.rotary_dim, cfg.rope_theta, h.dtype)
        taps = {}
        for i, layer in enumerate(self.layers):
            x = layer.input_layernorm(h)
            h = h + (layer.self_attn.forward_dense(x, cos, sin) if layer.is_attention
                     else layer.linear_attn.forward_dense(x))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
            if i in self.tap_ids:
                taps[i] = self._tap(i, h)
        return {"logits": self.logits(h) if want_logits else None,
                "ctx_hidden": torch.cat([taps[t] for t in self.tap_ids], -1) if self.tap_ids else None}

    def step(self, input_ids, positions, slot, seq_len, block_table, kv_pool, gdn_pool, conv_pool,
             valid_len=None, want_logits=False, gdn_commit=None, regions=EAGER):
        """One target graph. input_ids/positions [B,T] int64; slot, seq_len [B]; block_table [B,max_blocks];
        kv_pool [La,2,blocks,bs,Hkv,hd]; gdn_pool [Lg,slots,Hv,dk,dv] fp32; conv_pool [Lg,slots,C,W-1].
        valid_len [B] (prefill only): rows >= valid_len are padding; the GDN state is then returned as the
        final state after valid_len rows ('gdn_state') instead of fold data, and argmax / logits are row
        valid_len - 1's alone ([B, 1]: the next token).
        gdn_commit n [B] (a plain decode step, T = 1, on the torch backend): every GDN layer commits its row into
        gdn_pool where n > 0 as it runs (GatedDeltaNet commit) and the outputs carry no fold data; the commit then
        rolls conv and writes KV rows as for any step."""
        if gdn_commit is not None and (valid_len is not None or input_ids.shape[1] != 1):
            raise ValueError(f"gdn_commit is for one-row decode steps, got input_ids {tuple(input_ids.shape)}"
                             f"{' with valid_len' if valid_len is not None else ''}")
        run = regions
        h, cos, sin = run(embed_rope, self.embed_tokens, input_ids, positions, self.cfg.rotary_dim, self.cfg.rope_theta)
        kv_rows, fold, states, cols_all, taps = [], [], [], [], {}
        ia = ig = 0
        for i, layer in enumerate(self.layers):
            if layer.is_attention:
                h, kv = run(attention_layer, layer, h, cos, sin, *run.layer_of(kv_pool, ia), block_table, seq_len)
                kv_rows.append(kv)
                ia += 1
            else:
                commit = None if gdn_commit is None else (*run.layer_of(gdn_pool, ig), gdn_commit)
                h, cols, out = run(gdn_layer, layer, h, conv_pool[ig], gdn_pool[ig], slot, valid_len, commit)
                cols_all.append(cols)
                if out is not None and valid_len is None:  # out None: committed in place
                    fold.append((out.k_hat, out.v, out.g, out.beta))
                elif out is not None:
                    states.append(out.state)
                ig += 1
            if i in self.tap_ids:
                taps[i] = self._tap(i, h)
        logits, argmax = run(head, self.norm, self.lm_head, h, valid_len)
        out = {
            "argmax": argmax,
            "kv_rows": torch.stack(kv_rows) if kv_rows else None,
            "conv_cols": torch.stack(cols_all) if cols_all else None,
            "ctx_hidden": torch.cat([taps[t] for t in self.tap_ids], dim=-1) if self.tap_ids else None,
        }
        if valid_len is None:  # (no fold data when gdn_commit committed the rows)
            out.update({name: torch.stack(x) for name, x in zip(("gdn_k", "gdn_v", "gdn_g", "gdn_beta"), zip(*fold))})
        else:
            out["gdn_state"] = torch.stack(states)
        if want_logits:
            out["logits"] = logits
        return out
