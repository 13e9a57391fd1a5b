"""`shard_target`: a loaded TargetModel split in place across the ranks of a torch.distributed group.

Per rank: attention query/gate heads and KV heads (GQA groups stay whole: query head h reads KV head h // r on
both sides of the split), GDN key heads with their value heads (value head j reads key head j // (Hv/Hk)), the
causal-conv channels of those heads, the MLP intermediate, the shared expert's intermediate, and the routed experts
(expert parallel: whole experts per rank; or tensor parallel: every expert's intermediate). The modules of
modeling/ run unchanged on their local widths, with the model's config replaced by the local one (so the runtime's
pools are sized by the local heads: each rank's KV pages and GDN/conv slots hold its heads only). Every output
projection then holds a partial sum of the hidden state: one all-reduce after o_proj, GDN out_proj, the dense
down_proj and each sparse MoE block (routed + shared partials summed once). The router, norms and residual stream
are replicated, so every rank routes every token alike.

Vocabulary: each rank holds a contiguous slice of embed_tokens / lm_head rows. The embedding looks its ids up where
it owns them (zeros elsewhere) and all-reduces: the exact row, since one rank adds it to zeros. The lm_head
all-gathers each rank's logit columns into the full fp32 logits: argmax, the verify step and sampling then run as
on one process on the same logits (first exact step; vocab-local argmax / softmax statistics would move fewer
bytes per row, a later optimisation). Rounding: the all-reduced projections sum their partials in another order
than one GEMM, so logits agree with the single-process run to fp tolerance, not bit for bit.
"""
from __future__ import annotations

import dataclasses
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dflash_trt.modeling.fuse import BUFFER, FP8, linear
from dflash_trt.modeling.mlp import MLP, SparseMoE
from dflash_trt.plugins import ops

EXPERT_MODES = ("ep", "tp")


class ShardError(ValueError):
    """A model the ranks cannot split (a size that does not divide, an FP8 or fused model), refused by name."""


@dataclasses.dataclass(frozen=True)
class Shard:
    rank: int
    world: int
    group: object = None

    def span(self, n: int, what: str) -> tuple[int, int]:
        """This rank's (first, count) of n equal parts."""
        if n % self.world:
            raise ShardError(f"{what} = {n} does not divide over {self.world} ranks")
        return self.rank * (n // self.world), n // self.world

    def all_reduce(self, t):
        dist.all_reduce(t, group=self.group)
        return t

    def reduce_output(self, module: nn.Module) -> None:
        """module's output becomes the sum over the ranks of every rank's output (in place, inference only)."""
        module.register_forward_hook(self._reduce_hook)

    def _reduce_hook(self, _module, _args, y):
        return self.all_reduce(y)


def _narrow(w, dim: int, groups: int, start: int, count: int):
    """w with dim viewed as `groups` equal blocks; blocks [start, start+count) kept, as a contiguous copy."""
    v = w.detach().unflatten(dim, (groups, w.shape[dim] // groups)).narrow(dim, start, count)
    return v.flatten(dim, dim + 1).contiguous()


def _param(w) -> nn.Parameter:
    return nn.Parameter(w, requires_grad=False)


def _rows(lin, groups: int, start: int, count: int) -> None:
    lin.weight = _param(_narrow(lin.weight, 0, groups, start, count))
    lin.out_features = lin.weight.shape[0]


def _cols(lin, groups: int, start: int, count: int) -> None:
    lin.weight = _param(_narrow(lin.weight, 1, groups, start, count))
    lin.in_features = lin.weight.shape[1]


def _attention(att, cfg, sh: Shard) -> dict:
    h0, nh = sh.span(cfg.num_heads, "num_attention_heads")
    k0, nk = sh.span(cfg.num_kv_heads, "num_key_value_heads")
    _rows(att.q_proj, cfg.num_heads, h0, nh)  # [query | gate] rows per head
    _rows(att.k_proj, cfg.num_kv_heads, k0, nk)
    _rows(att.v_proj, cfg.num_kv_heads, k0, nk)
    _cols(att.o_proj, cfg.num_heads, h0, nh)
    sh.reduce_output(att.o_proj)
    return {"num_heads": nh, "num_kv_heads": nk}


def _gdn(gdn, cfg, sh: Shard) -> dict:
    Hk, Hv, dk, dv = cfg.lin_num_k_heads, cfg.lin_num_v_heads, cfg.lin_k_dim, cfg.lin_v_dim
    k0, nk = sh.span(Hk, "linear_num_key_heads")
    r = Hv // Hk
    v0, nv = k0 * r, nk * r

    def qkv_rows(w):  # the conv channels [q | k | v] of every head -> those of this rank's heads
        q, k, v = torch.split(w, [Hk * dk, Hk * dk, Hv * dv])
        return torch.cat([_narrow(q, 0, Hk, k0, nk), _narrow(k, 0, Hk, k0, nk), _narrow(v, 0, Hv, v0, nv)])

    if cfg.gdn_layout == "qkvz":  # rows interleaved per key head: [q | k | v×r | z×r] and [b×r | a×r]
        _rows(gdn.in_proj_qkvz, Hk, k0, nk)
        _rows(gdn.in_proj_ba, Hk, k0, nk)
    else:
        gdn.in_proj_qkv.weight = _param(qkv_rows(gdn.in_proj_qkv.weight.detach()))
        gdn.in_proj_qkv.out_features = gdn.in_proj_qkv.weight.shape[0]
        for lin in (gdn.in_proj_z, gdn.in_proj_b, gdn.in_proj_a):
            _rows(lin, Hv, v0, nv)
    gdn.conv1d.weight = _param(qkv_rows(gdn.conv1d.weight.detach()))
    gdn.dt_bias = _param(gdn.dt_bias.detach()[v0:v0 + nv].clone())
    gdn.A_log = _param(gdn.A_log.detach()[v0:v0 + nv].clone())
    _cols(gdn.out_proj, Hv, v0, nv)
    sh.reduce_output(gdn.out_proj)
    return {"lin_num_k_heads": nk, "lin_num_v_heads": nv}


def _mlp(mlp: MLP, sh: Shard, what: str) -> int:
    """Split the intermediate; returns the local width. The caller all-reduces (down_proj or the MoE block)."""
    inter = mlp.down_proj.in_features
    i0, ni = sh.span(inter, what)
    _rows(mlp.gate_proj, inter, i0, ni)
    _rows(mlp.up_proj, inter, i0, ni)
    _cols(mlp.down_proj, inter, i0, ni)
    return ni


class LocalExperts(nn.Module):
    """This rank's routed experts [first, first+count) of the global ids the replicated router picks, plus one
    all-zero expert at the end: a token's picks held by other ranks go there with weight 0 (the combine scatters
    by expert id, so they may not alias a real expert) and add nothing. The block's all-reduce sums the ranks."""

    def __init__(self, experts, sh: Shard):
        super().__init__()
        n = experts.gate_up_proj.shape[0]
        self.first, count = sh.span(n, "num_experts")
        gu, down = (p.detach()[self.first:self.first + count] for p in (experts.gate_up_proj, experts.down_proj))
        self.gate_up_proj = _param(torch.cat([gu, torch.zeros_like(gu[:1])]))
        self.down_proj = _param(torch.cat([down, torch.zeros_like(down[:1])]))

    def forward(self, x, topk_idx, topk_w):
        null = self.gate_up_proj.shape[0] - 1
        mine = (topk_idx >= self.first) & (topk_idx < self.first + null)
        idx = torch.where(mine, topk_idx - self.first, null)
        w = torch.where(mine, topk_w, torch.zeros_like(topk_w))
        return ops.moe_experts(x, idx, w, self.gate_up_proj, self.down_proj)


def _moe(moe: SparseMoE, sh: Shard, experts: str) -> dict:
    local = {"shared_expert_intermediate_size": _mlp(moe.shared_expert, sh, "shared_expert_intermediate_size")}
    if experts == "ep":
        moe.experts = LocalExperts(moe.experts, sh)
    else:  # every expert's intermediate split: gate_up [E, (gate|up)·I, H], down [E, H, I]
        e = moe.experts
        inter = e.down_proj.shape[-1]
        i0, ni = sh.span(inter, "moe_intermediate_size")
        e.gate_up_proj = _param(_narrow(e.gate_up_proj.unflatten(1, (2, inter)), 2, inter, i0, ni).flatten(1, 2))
        e.down_proj = _param(_narrow(e.down_proj, 2, inter, i0, ni))
        local["moe_intermediate_size"] = ni
    sh.reduce_output(moe)  # routed + shared partials: one all-reduce per block
    return local


class VocabParallelEmbedding(nn.Module):
    """Rows [first, first + n) of the embedding; forward(ids) -> the full embedding, all-reduced."""

    def __init__(self, weight, first: int, sh: Shard):
        super().__init__()
        self.weight, self.first, self.shard = weight, first, sh

    def forward(self, ids):
        mine = (ids >= self.first) & (ids < self.first + self.weight.shape[0])
        h = F.embedding(torch.where(mine, ids - self.first, 0), self.weight)
        return self.shard.all_reduce(h * mine.unsqueeze(-1).to(h.dtype))


class VocabParallelHead(nn.Module):
    """Rows [first, first + n) of the lm_head; fp32(x) -> the full fp32 logits [..., vocab] (all-gathered)."""

    def __init__(self, weight, vocab: int, sh: Shard):
        super().__init__()
        self.weight, self.vocab, self.shard = weight, vocab, sh
        self.per_rank = -(-vocab // sh.world)

    def fp32(self, x):
        y = linear(x, self.weight, fp32_out=True)
        y = F.pad(y, (0, self.per_rank - y.shape[-1]), value=float("-inf")).contiguous()
        parts = [torch.empty_like(y) for _ in range(self.shard.world)]
        dist.all_gather(parts, y, group=self.shard.group)
        return torch.cat(parts, -1)[..., :self.vocab]

    forward = fp32


def _vocab(target, sh: Shard) -> None:
    V = target.cfg.vocab_size
    per = -(-V // sh.world)
    first = min(sh.rank * per, V)
    embed = _param(target.embed_tokens.weight.detach()[first:first + per].clone())
    head = embed if target.cfg.tie_word_embeddings else _param(target.lm_head.weight.detach()[first:first + per].clone())
    target.embed_tokens = VocabParallelEmbedding(embed, first, sh)
    target.lm_head = VocabParallelHead(head, V, sh)


def check_shardable(cfg, world: int, experts: str = "ep") -> None:
    """Every width shard_target splits divides over `world` ranks, else ShardError naming the first that does not
    (checked before any tensor moves, so a refused model stays whole)."""
    if experts not in EXPERT_MODES:
        raise ShardError(f"experts='{experts}': one of {', '.join(EXPERT_MODES)}")
    sizes = {"num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
             "linear_num_key_heads": cfg.lin_num_k_heads}
    if any(not cfg.is_moe_layer(i) for i in range(cfg.num_layers)):
        sizes["intermediate_size"] = cfg.intermediate_size
    if cfg.moe_layers:
        sizes["shared_expert_intermediate_size"] = cfg.shared_expert_intermediate_size
        sizes["num_experts" if experts == "ep" else "moe_intermediate_size"] = (
            cfg.num_experts if experts == "ep" else cfg.moe_intermediate_size)
    for what, n in sizes.items():
        Shard(0, world).span(n, what)
    if (world - 1) * -(-cfg.vocab_size // world) >= cfg.vocab_size:
        raise ShardError(f"vocab_size = {cfg.vocab_size} leaves rank {world - 1} of {world} no vocabulary rows")


def check_checkpoint_shardable(model_dir: str, world: int) -> None:
    """check_shardable on a checkpoint's config.json, before any process starts or weight loads."""
    from dflash_trt.config import TargetConfig, read_json

    path = os.path.join(model_dir, "config.json")
    check_shardable(TargetConfig.from_dict(read_json(path), path), world)


def _refuse(target) -> None:
    if any(p.dtype == FP8 for p in target.parameters()):
        raise ShardError("FP8 checkpoints are not sharded across ranks (their block scales do not split yet); "
                         "load a 16-bit checkpoint")
    if any(name.rpartition(".")[2].startswith(BUFFER) for name, _ in target.named_buffers()):
        raise ShardError("shard_target takes the model as loaded: shard before fuse_projections")


@torch.no_grad()
def shard_target(target, group=None, experts: str = "ep"):
    """Split `target` (a TargetModel as loaded) in place across the ranks of `group` (default: the default process
    group); every rank calls it alike. experts: 'ep' (whole experts per rank) or 'tp' (every expert's intermediate
    split). Shard before a drafter binds the target (bind_target borrows embed_tokens / lm_head); the drafter itself
    stays whole on every rank. Returns target, whose cfg is now this rank's local one."""
    sh = Shard(dist.get_rank(group), dist.get_world_size(group), group)
    check_shardable(target.cfg, sh.world, experts)
    _refuse(target)
    cfg = target.cfg
    local = {}
    for layer in target.layers:
        if layer.is_attention:
            local.update(_attention(layer.self_attn, cfg, sh))
        else:
            local.update(_gdn(layer.linear_attn, cfg, sh))
        if isinstance(layer.mlp, SparseMoE):
            local.update(_moe(layer.mlp, sh, experts))
        else:
            local["intermediate_size"] = _mlp(layer.mlp, sh, "intermediate_size")
            sh.reduce_output(layer.mlp.down_proj)
    _vocab(target, sh)
    target.cfg = dataclasses.replace(cfg, **local)
    for layer in target.layers:
        (layer.self_attn if layer.is_attention else layer.linear_attn).cfg = target.cfg
    return target
