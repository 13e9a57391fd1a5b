"""The DFlash block-diffusion drafter (z-lab checkpoint format, arXiv 2602.06036) in torch.

Two graphs (DESIGN §4):
  ctx(ctx_hidden, positions)  -> per-layer K/V rows of the target context features
      c = hidden_norm(fc(concat(taps))); K = RoPE(k_norm(k_proj c)) at the rows' absolute positions;
      V = v_proj c. c never goes through the drafter MLPs.
  block(block_ids, positions, ctx pages) -> drafts
      block = [bonus, MASK×γ] (Bs = γ+1 slots; a graph per block length) embedded with the target's embedding
      × input_embedding_scale; queries only from the block; per layer (cfg.layer_causal / layer_window):
      full_attention bidirectional over the visible ctx K/V and the block, sliding_attention causal within the
      block and a window (p - key < sliding_window); output slot j predicts the token at slot j;
      logits = target_lm_head(norm(h)) × output_multiplier, then c·tanh(·/c) softcapping;
      drafts = argmax(logits)[1:]. One forward, no denoising.
DFlash2 (cfg.dflash2; modeling/dflash2.py): a grouped dynamic causal conv around each layer's attention and MLP,
and the drafts picked by the candidate selector from the top-k of logits[1:], starting at the bonus token.
RMSNorms here are plain Qwen3 (x̂·w), not zero-centred.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dflash_trt.config import DrafterConfig
from dflash_trt.modeling.dflash2 import CandidateSelector, GroupedConv
from dflash_trt.modeling.fuse import Linear, fuse_linears, linears
from dflash_trt.plugins import ops
from dflash_trt.modeling.target import MLP, RMSNorm, apply_rope, argmax_last, rope_cos_sin


def final_logits(cfg: DrafterConfig, logits):
    """× output_multiplier, then c·tanh(logits/c) when final_logit_softcapping = c > 0 (fp32)."""
    if cfg.output_multiplier != 1.0:
        logits = logits * cfg.output_multiplier
    c = cfg.final_logit_softcapping
    return c * torch.tanh(logits / c) if c > 0 else logits


def embed_block(cfg: DrafterConfig, embed, ids, dtype):
    h = embed(ids).to(dtype)
    return h * cfg.input_embedding_scale if cfg.input_embedding_scale != 1.0 else h


class DrafterAttention(nn.Module):
    KV = ("k_proj", "v_proj")  # one GEMM once fused (modeling/fuse.py)

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        H, nh, nkv, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.cfg = cfg
        self.q_proj = Linear(H, nh * hd, bias=False)
        self.k_proj = Linear(H, nkv * hd, bias=False)
        self.v_proj = Linear(H, nkv * hd, bias=False)
        self.o_proj = Linear(nh * hd, H, bias=False)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, zero_centred=False)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, zero_centred=False)

    def kv(self, x, cos, sin):
        """x [B,R,H] -> K (normed, RoPE'd), V [B,R,Hkv,hd] — used for ctx rows and for block rows alike."""
        B, R, _ = x.shape
        c = self.cfg
        k, v = linears(self, self.KV, x)
        k = apply_rope(self.k_norm(k.view(B, R, c.num_kv_heads, c.head_dim)), cos, sin)
        return k, v.view(B, R, c.num_kv_heads, c.head_dim)


class DrafterLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, zero_centred=False)
        self.self_attn = DrafterAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, zero_centred=False)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        if cfg.dflash2:
            self.attention_conv = GroupedConv(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)
            self.mlp_conv = GroupedConv(cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)

    def attn_in(self, h, n_blocks: int = 1):
        """The attention input of h [B,N,H] (N = n_blocks blocks side by side), and the taps attn_out needs."""
        x = self.input_layernorm(h)
        return _conv_prepare(getattr(self, "attention_conv", None), x, n_blocks)

    def attn_out(self, h, a, taps, n_blocks: int = 1):
        """h + the attention output a (through the DFlash2 conv)."""
        return h + _conv_finish(getattr(self, "attention_conv", None), a, taps, n_blocks)

    def mlp_residual(self, h, n_blocks: int = 1):
        conv = getattr(self, "mlp_conv", None)
        x, taps = _conv_prepare(conv, self.post_attention_layernorm(h), n_blocks)
        return h + _conv_finish(conv, self.mlp(x), taps, n_blocks)


def _blocks(x, n_blocks: int):
    """[B,N,H] -> [B,n_blocks,N/n_blocks,H]: the convs run per block (causal from each block's first slot)."""
    return x.view(x.shape[0], n_blocks, x.shape[1] // n_blocks, x.shape[2])


def _conv_prepare(conv, x, n_blocks):
    if conv is None:
        return x, None
    y, taps = conv.prepare(_blocks(x, n_blocks))
    return y.reshape(x.shape), taps


def _conv_finish(conv, y, taps, n_blocks):
    return y if conv is None else conv.finish(_blocks(y, n_blocks), taps).reshape(y.shape)


class Drafter(nn.Module):
    """Parameter names match the z-lab checkpoint exactly (fc, hidden_norm, norm, layers.N.*)."""

    def __init__(self, cfg: DrafterConfig, target_hidden: int, vocab: int | None = None):
        super().__init__()
        self.cfg = cfg
        n_taps = len(cfg.target_layer_ids)
        self.fc = Linear(n_taps * target_hidden, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, zero_centred=False)
        self.layers = nn.ModuleList(DrafterLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, zero_centred=False)
        if cfg.dflash2:  # the codebooks are [vocab, rank]: the target's vocabulary (check_against)
            if not (vocab or cfg.draft_vocab_size):
                raise ValueError("a DFlash2 drafter needs the vocabulary size: Drafter(cfg, target_hidden, vocab)")
            self.candidate_selector = CandidateSelector(cfg, vocab or cfg.draft_vocab_size)
        self._target = ()  # the target's embed_tokens, lm_head: a tuple keeps them out of state_dict

    @property
    def dtype(self):
        """The dtype the drafter computes in: its norms' (never quantized; an FP8 projection keeps fp8 weights)."""
        return self.hidden_norm.weight.dtype

    def bind_target(self, target) -> "Drafter":
        """Borrow the target's embedding and lm_head, and make the target emit this drafter's taps."""
        self._target = (target.embed_tokens, target.lm_head)
        target.tap_ids = list(self.cfg.target_layer_ids)
        return self

    def fuse_projections(self) -> "Drafter":
        """k/v and gate/up as one GEMM each (modeling/fuse.py); the GPU torch backend calls it."""
        for layer in self.layers:
            fuse_linears(layer.self_attn, DrafterAttention.KV)
            fuse_linears(layer.mlp, MLP.PROJECTIONS)
        return self

    def _rope(self, positions, dtype):
        return rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta, dtype)

    def ctx(self, ctx_hidden, positions):
        """ctx_hidden [B,R,n_taps*H_target], positions [B,R] -> {'dkv_rows': [Ld,2,B,R,Hkv,hd]}."""
        c = self.hidden_norm(self.fc(ctx_hidden.to(self.dtype)))
        cos, sin = self._rope(positions, c.dtype)
        rows = [torch.stack(layer.self_attn.kv(c, cos, sin)) for layer in self.layers]
        return {"dkv_rows": torch.stack(rows)}

    def block(self, block_ids, positions, block_table, kv_start, kv_len, dkv_pool, want_logits=False,
              temperature=None, draft_u=None):
        """block_ids/positions [B,Bs] (Bs = γ+1 <= block_size); the ctx rows [kv_start, kv_len) of each
        sequence's drafter pages, at the contiguous positions just before the block (the sliding windows count
        keys by that). Returns {'drafts': [B,Bs-1] int64} (+ 'logits' [B,Bs,V]). DFlash2: with want_logits,
        temperature [B] and draft_u [B,Bs-1] draw the selector's drafts (T > 0), + 'cand' / 'cand_q' [B,Bs-1,k]
        (the candidates and the draft distributions over them)."""
        if not self._target:
            raise RuntimeError("Drafter.block needs the target's embedding and lm_head: call bind_target(target)")
        embed, lm_head = self._target
        cfg = self.cfg
        B, Bs = block_ids.shape
        h = embed_block(cfg, embed, block_ids, self.dtype)
        cos, sin = self._rope(positions, h.dtype)
        for i, layer in enumerate(self.layers):
            att = layer.self_attn
            x, taps = layer.attn_in(h)
            q = apply_rope(att.q_norm(att.q_proj(x).view(B, Bs, cfg.num_heads, cfg.head_dim)), cos, sin)
            k, v = att.kv(x, cos, sin)
            o = ops.paged_attention(q, k, v, dkv_pool, i, block_table, kv_start, kv_len, cfg.layer_causal(i),
                                    cfg.head_dim**-0.5, cfg.layer_window(i))
            h = layer.attn_out(h, att.o_proj(o.reshape(B, Bs, cfg.num_heads * cfg.head_dim)), taps)
            h = layer.mlp_residual(h)
        hn = self.norm(h)
        logits = final_logits(cfg, lm_head.fp32(hn.to(lm_head.weight.dtype)))
        if not cfg.dflash2:
            out = {"drafts": argmax_last(logits[:, 1:])}
        else:  # the selector picks the drafts (temperature / draft_u: the per-row draw inputs of the ABI)
            drafts, cand, q = self.candidate_selector(hn[:, 1:], logits[:, 1:], block_ids[:, 0], temperature,
                                                      draft_u if want_logits else None)
            out = {"drafts": drafts}
            if want_logits:
                out["cand"], out["cand_q"] = cand, q
        if want_logits:
            out["logits"] = logits
        return out

    def train_forward(self, ctx_hidden, ctx_positions, block_ids, block_positions, ctx_mask=None, n_blocks=1):
        """Dense (page-free) forward for training, differentiable; same math as ctx() + block()
        (tests/test_train.py checks it against them). ctx_hidden [B,R,n_taps*H_target] at ctx_positions
        [B,R]; block_ids / block_positions [B, n_blocks*Bs]: n_blocks blocks side by side per row of the
        batch (training puts many anchors of one sequence in one row, so the ctx projections run once),
        each attending to its own block only (causal and windowed per layer as block()); ctx_mask
        [B, n_blocks*Bs, R] bool (True = may attend) says which ctx rows each block row sees (None: all);
        sliding layers further keep only keys with block_position - key_position < sliding_window.
        Returns logits [B, n_blocks*Bs, V] fp32."""
        embed, lm_head = self._target
        cfg = self.cfg
        B, N = block_ids.shape
        c = self.hidden_norm(self.fc(ctx_hidden.to(self.dtype)))
        ccos, csin = self._rope(ctx_positions, c.dtype)
        h = embed_block(cfg, embed, block_ids, c.dtype)
        cos, sin = self._rope(block_positions, h.dtype)
        idx = torch.arange(N, device=h.device)
        blk = idx // (N // n_blocks)
        own = (blk[:, None] == blk[None, :]).expand(B, N, N)
        cm = ctx_mask if ctx_mask is not None else own.new_ones(B, N, c.shape[1])
        qpos = block_positions[:, :, None]
        dist = torch.cat([qpos - ctx_positions[:, None, :], qpos - block_positions[:, None, :]], -1)  # [B,N,R+N]

        def layer_mask(i):  # [B,1,N,R+N]; None when every key is visible (plain SDPA)
            if ctx_mask is None and n_blocks == 1 and not cfg.layer_causal(i) and not cfg.layer_window(i):
                return None
            m = torch.cat([cm, own & (idx[None, :] <= idx[:, None]) if cfg.layer_causal(i) else own], -1)
            if cfg.layer_window(i):
                m = m & (dist < cfg.layer_window(i))
            return m[:, None]

        for i, layer in enumerate(self.layers):
            mask = layer_mask(i)
            att = layer.self_attn
            x, taps = layer.attn_in(h, n_blocks)
            q = apply_rope(att.q_norm(att.q_proj(x).view(B, N, cfg.num_heads, cfg.head_dim)), cos, sin)
            kc, vc = att.kv(c, ccos, csin)
            kb, vb = att.kv(x, cos, sin)
            k = torch.cat([kc, kb], 1).transpose(1, 2)
            v = torch.cat([vc, vb], 1).transpose(1, 2)
            o = F.scaled_dot_product_attention(
                q.transpose(1, 2), k, v, attn_mask=mask, enable_gqa=cfg.num_heads != cfg.num_kv_heads
            )
            h = layer.attn_out(h, att.o_proj(o.transpose(1, 2).reshape(B, N, -1)), taps, n_blocks)
            h = layer.mlp_residual(h, n_blocks)
        return final_logits(cfg, lm_head.fp32(self.norm(h)))
