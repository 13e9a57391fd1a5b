"""The speculative step's recipe, written once for both executors: the host executor (runtime/host_step.py) runs it
on numpy arrays, the fused device step (runtime/backends/torch_fused_step.py) on torch tensors inside the step's
CUDA graph. They differ only in where the arrays live (the array namespace `xp`: NP here, TORCH there) and in how a
graph is launched (`run(graph, inputs, want_logits) -> outputs`: backend.run on the host, a StepGraphs on the
device).

  positions     [B, T] absolute positions start[b] + t of a step's rows
  ctx_window    (kv_start, kv_len): the drafter ctx rows a sequence attends, the newest min(seq_len, window) ending
                at its last row (logical rows: position - ctx_base)
  propose       the draft block (bonus token + mask tokens, γ+1 slots) through drafter_block
  verify        [bonus, drafts] through target_k{γ+1}
  greedy_accept n = accepted drafts + 1: the longest prefix with draft_i == target argmax_i (a running product of
                matches), 0 on padding rows
The step tables every executor starts from are batching.step_tables. numpy at module level; no torch import.
"""
from __future__ import annotations

import numpy as np

from dflash_trt.abi import drafter_block_graph, target_graph


class NumpyOps:
    """The array namespace of the host executor: int64 numpy arrays."""

    @staticmethod
    def full(shape, value, like):
        return np.full(shape, value, dtype=np.int64)

    @staticmethod
    def arange(n: int, like):
        return np.arange(n, dtype=np.int64)

    @staticmethod
    def concat(arrays, axis: int):
        return np.concatenate(arrays, axis=axis)

    @staticmethod
    def cumprod_int64(mask, axis: int):
        return np.cumprod(mask.astype(np.int64), axis=axis)

    @staticmethod
    def clamp_max(x, hi: int):
        return np.minimum(x, hi)

    @staticmethod
    def zeros_f32(shape, like):
        return np.zeros(shape, dtype=np.float32)


NP = NumpyOps()


def positions(xp, start, rows: int):
    """[B, rows] absolute positions: start[b] + t for t < rows."""
    return start[:, None] + xp.arange(rows, start)[None]


def ctx_window(xp, seq_len, ctx_base, window: int):
    """(kv_start, kv_len) [B]: the drafter attends logical ctx rows [kv_start, kv_len), the newest
    min(seq_len, window) rows ending at the sequence's last row (seq_len - ctx_base). Padding rows (0, 0): (0, 0)."""
    kv_len = seq_len - ctx_base
    return kv_len - xp.clamp_max(seq_len, window), kv_len


def target_inputs(ids, pos, index: dict, pools: dict, valid=None) -> dict:
    """The target graph's inputs: ids / pos [B, T], index's slot / seq_len / block_table, the three pools;
    valid [B] (rows of a prefill chunk) only for target_prefill."""
    x = {"input_ids": ids, "positions": pos, "slot": index["slot"], "seq_len": index["seq_len"],
         "block_table": index["block_table"], "kv_pool": pools["kv_pool"], "gdn_pool": pools["gdn_pool"],
         "conv_pool": pools["conv_pool"]}
    if valid is not None:
        x["valid_len"] = valid
    return x


def propose(xp, run, index: dict, bonus, seq_len, K: int, dcfg, dkv_pool, want_logits: bool, draw=None):
    """drafter_block on a block of K = γ+1 slots (the bonus token, then mask tokens) at positions seq_len..;
    returns (its outputs: drafts [B, γ], logits when asked; the block's positions [B, K]). γ drafts come from a
    block of γ+1 slots, as the reference runs them. DFlash2: draw = (temperature [B], u [B, γ]) float32 for the
    selector, which draws the drafts inside the graph (None: argmax on every row)."""
    B = bonus.shape[0]
    block = xp.full((B, K), dcfg.mask_token_id, bonus)
    block[:, 0] = bonus
    bpos = positions(xp, seq_len, K)
    x = {"block_ids": block, "positions": bpos, "block_table": index["ctx_table"], "kv_start": index["kv_start"],
         "kv_len": index["kv_len"], "dkv_pool": dkv_pool}
    if dcfg.dflash2:
        x["temperature"], x["draft_u"] = draw or (xp.zeros_f32((B,), bonus), xp.zeros_f32((B, K - 1), bonus))
    return run(drafter_block_graph(K, dcfg.block_size), x, want_logits), bpos


def verify(xp, run, index: dict, bonus, drafts, pos, pools: dict, want_logits: bool) -> dict:
    """target_k{γ+1} on [bonus, drafts] [B, γ+1] at positions pos."""
    ids = xp.concat([bonus[:, None], drafts], 1)
    return run(target_graph(ids.shape[1]), target_inputs(ids, pos, index, pools), want_logits)


def greedy_accept(xp, drafts, argmax, live):
    """n [B] = accepted + 1 (0 where live is 0): accepted = the longest prefix of drafts [B, γ] equal to the target's
    argmax [B, γ+1] (a running product of matches: γ when all match, the first miss's index otherwise); the bonus
    is the argmax at the first miss, so the emitted tokens are argmax[b, :n[b]]."""
    acc = xp.cumprod_int64(drafts == argmax[:, :drafts.shape[1]], 1).sum(1)
    return (acc + 1) * live
