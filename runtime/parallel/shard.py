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

Every split is a Cut (a parameter's kept ranges along one dim), planned for the whole model before any tensor moves.
The same cuts run on a loaded model (shard_target) and on one built on the meta device before its weights load
(load_target(split=shard_target)): each rank then reads only its slices of the safetensors. FP8 block-wise weights
split with their weight_scale_inv blocks, on whole blocks only (a split inside a block is refused by name).

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

from dflash_trt.modeling.fuse import BUFFER, linear
from dflash_trt.modeling.mlp import MLP, SparseMoE

EXPERT_MODES = ("ep", "tp")


class ShardError(ValueError):
    """A model the ranks cannot split (a size that does not divide, an FP8 split inside a scale block, a fused
    model), refused by name."""


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


@dataclasses.dataclass(frozen=True)
class Split:
    """How a parameter is cut from its whole tensor (shape `full`): the ranges [a, b) of dim kept, in order, then
    `pad` zero slices along dim (the null expert). take(read) assembles it from read(dim, a, b) -> that slice,
    so the same cut runs on a tensor in memory and on a checkpoint's slices (export/checkpoint.py: a parameter
    carrying it as .cut is read that way, each rank reading only its slices)."""
    full: tuple
    dim: int
    ranges: tuple
    pad: int = 0

    @property
    def shape(self) -> tuple:
        n = sum(b - a for a, b in self.ranges) + self.pad
        return self.full[:self.dim] + (n,) + self.full[self.dim + 1:]

    def take(self, read):
        parts = [read(self.dim, a, b) for a, b in self.ranges]
        if self.pad:
            parts.append(torch.zeros_like(parts[0].narrow(self.dim, 0, self.pad)))
        return torch.cat(parts, self.dim).contiguous()


@dataclasses.dataclass(frozen=True)
class Cut:
    owner: nn.Module
    attr: str
    split: Split

    def apply(self) -> None:
        w = getattr(self.owner, self.attr).detach()
        if w.is_meta:  # its shape only (torch's meta kernels of cat & co. import its compiler stack, whose
            # distributed modules would then hold the process group past its destruction)
            p = _param(torch.empty(self.split.shape, dtype=w.dtype, device="meta"))
        else:
            p = _param(self.split.take(lambda d, a, b: w.narrow(d, a, b - a)))
        p.cut = self.split
        setattr(self.owner, self.attr, p)
        if self.attr == "weight" and hasattr(self.owner, "out_features"):  # a projection: its local widths
            self.owner.out_features, self.owner.in_features = p.shape[-2:]


def _param(w) -> nn.Parameter:
    return nn.Parameter(w, requires_grad=False)


def _blocks(n: int, groups: int, start: int, count: int) -> tuple[int, int]:
    """Rows [a, b) of blocks [start, start + count) of n rows viewed as `groups` equal blocks."""
    return start * (n // groups), (start + count) * (n // groups)


def _cut(owner, attr: str, dim: int, ranges, what: str, sh: Shard, pad: int = 0) -> list:
    """The cut of owner.attr, and of its FP8 block scales (owner.attr + '_scale_inv') where it has them: an FP8
    weight splits on whole scale blocks only, else ShardError naming the width that split it."""
    w = getattr(owner, attr)
    cuts = [Cut(owner, attr, Split(tuple(w.shape), dim, tuple(ranges), pad))]
    scales = getattr(owner, attr + "_scale_inv", None)
    if scales is None:
        return cuts
    axis = dim - (w.dim() - 2)  # 0: rows (block[0]), 1: columns (block[1]), < 0: the expert index
    bs = owner.block[axis] if axis >= 0 else 1
    for a, b in ranges:
        edge = next((e for e in (a, b) if e % bs and e != w.shape[dim]), None)
        if edge is not None:
            raise ShardError(f"{what} over {sh.world} ranks splits an FP8 weight at {('row', 'column')[axis]} "
                             f"{edge}, inside a {bs}-{('row', 'column')[axis]} scale block (FP8 targets split on "
                             "whole blocks)")
    sranges = tuple((a // bs, -(-b // bs)) for a, b in ranges)
    return cuts + [Cut(owner, attr + "_scale_inv", Split(tuple(scales.shape), dim, sranges, pad))]


def _rows(lin, groups: int, start: int, count: int, what: str, sh: Shard) -> list:
    return _cut(lin, "weight", 0, [_blocks(lin.weight.shape[0], groups, start, count)], what, sh)


def _cols(lin, groups: int, start: int, count: int, what: str, sh: Shard) -> list:
    return _cut(lin, "weight", 1, [_blocks(lin.weight.shape[1], groups, start, count)], what, sh)


def _attention(att, cfg, sh: Shard, cuts: list) -> dict:
    h0, nh = sh.span(cfg.num_heads, "num_attention_heads")
    k0, nk = sh.span(cfg.num_kv_heads, "num_key_value_heads")
    cuts += _rows(att.q_proj, cfg.num_heads, h0, nh, "num_attention_heads", sh)  # [query | gate] rows per head
    cuts += _rows(att.k_proj, cfg.num_kv_heads, k0, nk, "num_key_value_heads", sh)
    cuts += _rows(att.v_proj, cfg.num_kv_heads, k0, nk, "num_key_value_heads", sh)
    cuts += _cols(att.o_proj, cfg.num_heads, h0, nh, "num_attention_heads", sh)
    return {"num_heads": nh, "num_kv_heads": nk}


def _gdn(gdn, cfg, sh: Shard, cuts: list) -> dict:
    Hk, Hv, dk, dv = cfg.lin_num_k_heads, cfg.lin_num_v_heads, cfg.lin_k_dim, cfg.lin_v_dim
    what = "linear_num_key_heads"
    k0, nk = sh.span(Hk, what)
    r = Hv // Hk
    v0, nv = k0 * r, nk * r
    q, qd = (k0 * dk, (k0 + nk) * dk), Hk * dk  # the conv channels [q | k | v] of this rank's heads
    qkv = [q, (qd + q[0], qd + q[1]), (2 * qd + v0 * dv, 2 * qd + (v0 + nv) * dv)]
    if cfg.gdn_layout == "qkvz":  # rows interleaved per key head: [q | k | v×r | z×r] and [b×r | a×r]
        cuts += _rows(gdn.in_proj_qkvz, Hk, k0, nk, what, sh) + _rows(gdn.in_proj_ba, Hk, k0, nk, what, sh)
    else:
        cuts += _cut(gdn.in_proj_qkv, "weight", 0, qkv, what, sh)
        for lin in (gdn.in_proj_z, gdn.in_proj_b, gdn.in_proj_a):
            cuts += _rows(lin, Hv, v0, nv, what, sh)
    cuts += _cut(gdn.conv1d, "weight", 0, qkv, what, sh)
    cuts += _cut(gdn, "dt_bias", 0, [(v0, v0 + nv)], what, sh) + _cut(gdn, "A_log", 0, [(v0, v0 + nv)], what, sh)
    cuts += _cols(gdn.out_proj, Hv, v0, nv, what, sh)
    return {"lin_num_k_heads": nk, "lin_num_v_heads": nv}


def _mlp(mlp: MLP, sh: Shard, what: str, cuts: list) -> int:
    """Split the intermediate; returns the local width. The caller all-reduces (down_proj or the MoE block)."""
    inter = mlp.down_proj.in_features
    i0, ni = sh.span(inter, what)
    cuts += _rows(mlp.gate_proj, inter, i0, ni, what, sh) + _rows(mlp.up_proj, inter, i0, ni, what, sh)
    cuts += _cols(mlp.down_proj, inter, i0, ni, what, sh)
    return ni


class LocalExperts(nn.Module):
    """This rank's routed experts [first, first+count) of the global ids the replicated router picks, plus one
    all-zero expert at the end: a token's picks held by other ranks go there with weight 0 (the combine scatters
    by expert id, so they may not alias a real expert) and add nothing. The block's all-reduce sums the ranks.
    It holds the cut experts module's parameters under their names (checkpoint names map 1:1) and runs that
    module's forward (16-bit or FP8 experts alike) on the remapped picks."""

    def __init__(self, experts, first: int):
        super().__init__()
        for n, p in experts.named_parameters(recurse=False):
            setattr(self, n, p)
        self.block, self.first, self._forward = getattr(experts, "block", None), first, type(experts).forward

    def forward(self, x, topk_idx, topk_w):
        null = self.gate_up_proj.shape[0] - 1
        mine = (topk_idx >= self.first) & (topk_idx < self.first + null)
        idx = torch.where(mine, topk_idx - self.first, null)
        w = torch.where(mine, topk_w, torch.zeros_like(topk_w))
        return self._forward(self, x, idx, w)


def _moe(moe: SparseMoE, sh: Shard, experts: str, cuts: list) -> dict:
    what = "shared_expert_intermediate_size"
    local = {what: _mlp(moe.shared_expert, sh, what, cuts)}
    e = moe.experts
    if experts == "ep":
        first, count = sh.span(e.gate_up_proj.shape[0], "num_experts")
        for attr in ("gate_up_proj", "down_proj"):
            cuts += _cut(e, attr, 0, [(first, first + count)], "num_experts", sh, pad=1)
    else:  # every expert's intermediate split: gate_up [E, (gate|up)·I, H], down [E, H, I]
        inter = e.down_proj.shape[-1]
        i0, ni = sh.span(inter, "moe_intermediate_size")
        cuts += _cut(e, "gate_up_proj", 1, [(i0, i0 + ni), (inter + i0, inter + i0 + ni)], "moe_intermediate_size", sh)
        cuts += _cut(e, "down_proj", 2, [(i0, i0 + ni)], "moe_intermediate_size", sh)
        local["moe_intermediate_size"] = ni
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


def _vocab(target, sh: Shard, cuts: list) -> int:
    """Cut this rank's vocabulary rows; returns the first."""
    V = target.cfg.vocab_size
    per = -(-V // sh.world)
    first = min(sh.rank * per, V)
    rows = [(first, min(first + per, V))]
    cuts += _cut(target.embed_tokens, "weight", 0, rows, "vocab_size", sh)
    if not target.cfg.tie_word_embeddings:
        cuts += _cut(target.lm_head, "weight", 0, rows, "vocab_size", sh)
    return first


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


def check_checkpoint_shardable(model_dir: str, world: int, experts: str = "ep") -> None:
    """check_shardable on a checkpoint's config.json, then every rank's cuts planned on the target built without
    memory (an FP8 weight split inside a scale block is refused here), before any process starts or weight loads."""
    from dflash_trt.config import TargetConfig, read_json
    from dflash_trt.export.checkpoint import target_skeleton

    path = os.path.join(model_dir, "config.json")
    check_shardable(TargetConfig.from_dict(read_json(path), path), world, experts)
    skeleton = target_skeleton(model_dir)
    for rank in range(world):
        _plan(skeleton, Shard(rank, world), experts)


def _plan(target, sh: Shard, experts: str) -> tuple[list, dict, int]:
    """(every cut, the local config fields, the first vocabulary row): nothing moves yet, so a refused split
    (an FP8 block boundary) leaves the model whole."""
    cfg, cuts, local = target.cfg, [], {}
    for layer in target.layers:
        if layer.is_attention:
            local.update(_attention(layer.self_attn, cfg, sh, cuts))
        else:
            local.update(_gdn(layer.linear_attn, cfg, sh, cuts))
        if isinstance(layer.mlp, SparseMoE):
            local.update(_moe(layer.mlp, sh, experts, cuts))
        else:
            local["intermediate_size"] = _mlp(layer.mlp, sh, "intermediate_size", cuts)
    return cuts, local, _vocab(target, sh, cuts)


def _wire(target, sh: Shard, experts: str, first: int) -> None:
    """The collectives after the output projections, the local experts' id remap and the vocabulary modules."""
    for layer in target.layers:
        sh.reduce_output(layer.self_attn.o_proj if layer.is_attention else layer.linear_attn.out_proj)
        if isinstance(layer.mlp, SparseMoE):
            if experts == "ep":
                layer.mlp.experts = LocalExperts(layer.mlp.experts, sh.span(target.cfg.num_experts, "")[0])
            sh.reduce_output(layer.mlp)  # routed + shared partials: one all-reduce per block
        else:
            sh.reduce_output(layer.mlp.down_proj)
    embed = target.embed_tokens.weight
    head = embed if target.cfg.tie_word_embeddings else target.lm_head.weight
    target.embed_tokens = VocabParallelEmbedding(embed, first, sh)
    target.lm_head = VocabParallelHead(head, target.cfg.vocab_size, sh)


@torch.no_grad()
def shard_target(target, group=None, experts: str = "ep"):
    """Split `target` (a TargetModel as loaded, or as built on the meta device before its weights load: each
    parameter then carries its .cut, which load_target reads slice by slice) in place across the ranks of
    `group` (default: the default process group); every rank calls it alike. experts: 'ep' (whole experts per
    rank) or 'tp' (every expert's intermediate split). FP8 weights split with their block scales, on whole blocks
    only. Shard before a drafter binds the target (bind_target borrows embed_tokens / lm_head); the drafter itself
    stays whole on every rank. Returns target, whose cfg is now this rank's local one."""
    sh = Shard(dist.get_rank(group), dist.get_world_size(group), group)
    check_shardable(target.cfg, sh.world, experts)
    if any(name.rpartition(".")[2].startswith(BUFFER) for name, _ in target.named_buffers()):
        raise ShardError("shard_target takes the model as loaded: shard before fuse_projections")
    cuts, local, first = _plan(target, sh, experts)
    for c in cuts:
        c.apply()
    _wire(target, sh, experts, first)
    target.cfg = dataclasses.replace(target.cfg, **local)
    for layer in target.layers:
        (layer.self_attn if layer.is_attention else layer.linear_attn).cfg = target.cfg
    return target
