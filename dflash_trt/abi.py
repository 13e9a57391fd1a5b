"""The graph ABI (DESIGN §4): the one place that knows graph names, their inputs/outputs, and pool shapes.

Every backend (torch, ort, trt), the exporter and the manifest read names and shapes from here.
Shapes use B for the batch of sequences; all other dims are static per graph.

target_k{K} / target_prefill (T = K, or the prefill chunk):
  in : input_ids[B,T] i64, positions[B,T] i64, slot[B] i64, seq_len[B] i64, block_table[B,MB] i64,
       kv_pool, gdn_pool, conv_pool (+ valid_len[B] i64 for prefill)
  out: argmax[B,T] i64, kv_rows[La,2,B,T,Hkv,hd], conv_cols[Lg,B,T,C], ctx_hidden[B,T,n_taps*H],
       gdn_k[Lg,B,T,Hk,dk], gdn_v[Lg,B,T,Hv,dv], gdn_g[Lg,B,T,Hv], gdn_beta[Lg,B,T,Hv]   (verify: fold data)
       gdn_state[Lg,B,Hv,dk,dv]                                          (prefill: final state instead)
       (+ logits[B,T,V] f32 when sampling)
       prefill: argmax[B,1] and logits[B,1,V] of row valid_len-1 only (the next token; the lm_head on one row)
drafter_ctx (R rows):  in: ctx_hidden[B,R,n_taps*H], positions[B,R]  out: dkv_rows[Ld,2,B,R,Hkv_d,hd_d]
drafter_block:         in: block_ids[B,Bs], positions[B,Bs], block_table[B,MBd], kv_start[B], kv_len[B], dkv_pool
                       out: drafts[B,Bs-1] i64 (+ logits[B,Bs,V])          Bs = the drafter's block_size
                       DFlash2 (selector top-k k): + in temperature[B] f32, draft_u[B,Bs-1] f32 (the selector's
                       draws; 0: argmax); with logits + out cand[B,Bs-1,k] i64, cand_q[B,Bs-1,k] f32 (the drafts'
                       distributions over their candidates, one-hot on greedy rows)
drafter_block_b{Bs}:   the same for a shorter block of Bs = γ+1 slots (γ drafts, 2 <= Bs < block_size): the
                       reference runs a block of γ+1 slots for γ drafts, and with a non-causal block those drafts
                       differ from the first γ of a full block. One per verify width K = Bs of the manifest.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass

from dflash_trt.config import ConfigError, DrafterConfig, TargetConfig

PREFILL = "target_prefill"
DRAFTER_CTX = "drafter_ctx"
DRAFTER_BLOCK = "drafter_block"


MAX_K = 16  # verify width limit: one GDN chunk (DESIGN §3, T = K <= 16)
DEFAULT_KS = (1, 2, 3, 4, 8, 16)


def parse_ks(s: str) -> list[int]:
    """'1,16' -> [1, 16] (the --k option of export and build); argparse-friendly errors."""
    import argparse

    try:
        ks = sorted({int(x) for x in s.split(",") if x.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"--k wants comma-separated integers, got '{s}'") from None
    if not ks or ks[0] < 1 or ks[-1] > MAX_K:
        raise argparse.ArgumentTypeError(f"--k values must be in 1..{MAX_K}, got {ks}")
    return ks


def target_graph(k: int) -> str:
    return f"target_k{k}"


def parse_target_graph(name: str) -> int | None:
    """'target_k8' -> 8; any other name -> None."""
    if name.startswith("target_k") and name[8:].isdigit():
        return int(name[8:])
    return None


def drafter_block_graph(bs: int, block_size: int) -> str:
    """The drafter block graph of Bs = bs slots (γ = bs - 1 drafts) for a drafter of block_size."""
    if not 2 <= bs <= block_size:
        raise ValueError(f"drafter block of {bs} slots outside 2..block_size={block_size}")
    return DRAFTER_BLOCK if bs == block_size else f"{DRAFTER_BLOCK}_b{bs}"


def parse_drafter_block(name: str, block_size: int) -> int | None:
    """'drafter_block' -> block_size; 'drafter_block_b4' -> 4; any other name -> None."""
    if name == DRAFTER_BLOCK:
        return block_size
    tail = name[len(DRAFTER_BLOCK) + 2:]
    if name.startswith(DRAFTER_BLOCK + "_b") and tail.isdigit() and 2 <= int(tail) < block_size:
        return int(tail)
    return None


def verify_widths(gamma, block_size: int | None, spec: bool, user_export: bool = False) -> tuple | None:
    """The target graphs a run needs: K=1 (prefill tail / plain decode) and, when speculating, K=γ+1 for a fixed γ,
    or for γ None / "auto" (chosen per step) every default width up to the drafter's block — on a user's export
    (user_export) None instead: auto runs among the widths it holds."""
    if not spec or block_size is None:
        return (1,)
    if gamma is None or gamma == "auto":
        return None if user_export else tuple(sorted({1, block_size} | {k for k in DEFAULT_KS if k <= block_size}))
    return tuple(sorted({1, gamma + 1}))


def drafter_block_lens(ks, block_size: int) -> list[int]:
    """Block lengths exported for verify widths ks: every K = γ+1 in 2..block_size-1, plus the full block."""
    return sorted({int(k) for k in ks if 2 <= int(k) < block_size} | {block_size})


def ctx_block_table_width(window: int, page_size: int, max_append: int, max_seq_len: int | None = None) -> int:
    """Pages a drafter ctx window can hold at once (runtime.ctx.CtxWindow): up to 2*window rows (at least
    window + a page - 1, the in-page offset after a slide) plus one append of max_append rows. A window never
    holds more rows than its sequence has (max_seq_len): a full-context window never slides, so it needs one
    table of max_seq_len rows, not two."""
    held = max(2 * window, window + page_size - 1)
    if max_seq_len is not None:
        held = min(held, max_seq_len)
    return -(-(held + max_append) // page_size)


@dataclass(frozen=True)
class PoolSizes:
    """How big the runtime's pools are; static per engine build."""

    kv_blocks: int = 256  # target KV pages
    page_size: int = 16  # rows per page (target and drafter)
    max_seq_len: int = 2048
    max_seqs: int = 4  # GDN/conv state slots
    dkv_blocks: int = 256  # drafter ctx pages
    # drafter ctx rows kept and attended (DESIGN §2b/§5). 0 (default) = max_seq_len: full retention, so
    # full-attention drafter layers see every committed row and sliding layers their last sliding_window, exactly
    # as the reference for prompts + generations up to max_seq_len. An explicit smaller value is a memory bound:
    # the window slides keeping the newest ctx_window rows, and drafts (never the output tokens) may then differ
    # from the reference once a sequence is longer than it.
    ctx_window: int = 0
    prefill_chunk: int = 64

    def __post_init__(self):
        if self.ctx_window is None or self.ctx_window == 0:  # resolved first, so every reader sees one number
            object.__setattr__(self, "ctx_window", self.max_seq_len)
        # every entry point (export, runtime, cache key, CLI) builds a PoolSizes: refuse 0 / negative / non-integer
        # sizes here, before anything traces or allocates (else they fail deep into an export, or much later)
        for f in self.__dataclass_fields__:
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
                raise ConfigError(f"pool size {f} (--{f.replace('_', '-')}) must be a positive integer, got {v!r}")

    @property
    def max_blocks(self) -> int:
        return -(-self.max_seq_len // self.page_size)

    @property
    def max_ctx_blocks(self) -> int:
        """Width of a drafter block table (the graphs' static dim): a window, one append, and the MAX_K rows
        of one step left in flight (the GPU executors plan step t+1 while step t runs)."""
        return ctx_block_table_width(self.ctx_window, self.page_size, self.max_append + MAX_K, self.max_seq_len)

    @property
    def drafter_slack_blocks(self) -> int:
        """Drafter pages beyond the target's: every slot's ctx table may run past its target table by this much
        (the in-flight step's rows), so the drafter pool holds kv_blocks + this."""
        return self.max_seqs * max(self.max_ctx_blocks - self.max_blocks, 0)

    @property
    def max_append(self) -> int:
        return max(self.prefill_chunk, 16)


WIDE_PREFILL_CHUNK = 512  # prefill rows per launch of a model from WIDE_HIDDEN on
WIDE_HIDDEN = 2048


def default_prefill_chunk(t: TargetConfig) -> int:
    """The prefill chunk of a run given no sizes: WIDE_PREFILL_CHUNK rows from a hidden size of WIDE_HIDDEN on, else
    PoolSizes' 64. Why: each chunk reads every weight once, and below ~300 rows per read (a Hopper GPU's bf16 FLOP
    per byte of memory) a large model's prefill waits on those reads; at 512 the projections run on the tensor cores
    (2.1x the tok/s of 64-row chunks on a 32k prompt at Qwen3.5-27B shapes: docs/PERF.md). Small models are bound by
    launches either way, and 64 keeps their graphs small. A prompt that fits half a chunk runs at half its width
    (runtime/batching.prefill_width), near the weight-read time of a 64-row chunk on a large model."""
    return WIDE_PREFILL_CHUNK if t.hidden_size >= WIDE_HIDDEN else PoolSizes.prefill_chunk


def pool_specs(t: TargetConfig, d: DrafterConfig | None, s: PoolSizes, kv_dtype="float32") -> dict:
    """name -> (shape, dtype) of every pool the graphs read."""
    La, Lg = len(t.attn_layers), len(t.gdn_layers)
    specs = {
        "kv_pool": ((La, 2, s.kv_blocks, s.page_size, t.num_kv_heads, t.head_dim), kv_dtype),
        "gdn_pool": ((Lg, s.max_seqs, t.lin_num_v_heads, t.lin_k_dim, t.lin_v_dim), "float32"),
        "conv_pool": ((Lg, s.max_seqs, t.conv_dim, t.conv_kernel - 1), kv_dtype),
    }
    if d is not None:
        specs["dkv_pool"] = ((d.num_layers, 2, s.dkv_blocks, s.page_size, d.num_kv_heads, d.head_dim), kv_dtype)
    return specs


def graph_io(name: str, t: TargetConfig, d: DrafterConfig | None, s: PoolSizes, B: int = 1,
             want_logits: bool = False, kv_dtype="float32"):
    """(inputs, outputs): lists of (name, shape, dtype) for one graph."""
    pools = pool_specs(t, d, s, kv_dtype)
    La, Lg = len(t.attn_layers), len(t.gdn_layers)
    n_taps = len(d.target_layer_ids) if d is not None else 0
    k = parse_target_graph(name)
    if k is not None or name == PREFILL:
        T = k if k is not None else s.prefill_chunk
        ins = [("input_ids", (B, T), "int64"), ("positions", (B, T), "int64"), ("slot", (B,), "int64"),
               ("seq_len", (B,), "int64"), ("block_table", (B, s.max_blocks), "int64")]
        ins += [(p, *pools[p]) for p in ("kv_pool", "gdn_pool", "conv_pool")]
        rows = 1 if name == PREFILL else T  # a prefill chunk's logits: its last valid row only (the next token)
        outs = [("argmax", (B, rows), "int64"),
                ("kv_rows", (La, 2, B, T, t.num_kv_heads, t.head_dim), kv_dtype),
                ("conv_cols", (Lg, B, T, t.conv_dim), kv_dtype)]
        if n_taps:
            outs.append(("ctx_hidden", (B, T, n_taps * t.hidden_size), kv_dtype))
        if name == PREFILL:
            ins.append(("valid_len", (B,), "int64"))
            outs.append(("gdn_state", (Lg, B, t.lin_num_v_heads, t.lin_k_dim, t.lin_v_dim), "float32"))
        else:
            outs += [("gdn_k", (Lg, B, T, t.lin_num_k_heads, t.lin_k_dim), "float32"),
                     ("gdn_v", (Lg, B, T, t.lin_num_v_heads, t.lin_v_dim), "float32"),
                     ("gdn_g", (Lg, B, T, t.lin_num_v_heads), "float32"),
                     ("gdn_beta", (Lg, B, T, t.lin_num_v_heads), "float32")]
        if want_logits:
            outs.append(("logits", (B, rows, t.vocab_size), "float32"))
        return ins, outs
    if d is None:
        raise ValueError(f"graph '{name}' needs a drafter config")
    if name == DRAFTER_CTX:
        R = s.max_append
        ins = [("ctx_hidden", (B, R, n_taps * t.hidden_size), kv_dtype), ("positions", (B, R), "int64")]
        return ins, [("dkv_rows", (d.num_layers, 2, B, R, d.num_kv_heads, d.head_dim), kv_dtype)]
    Bs = parse_drafter_block(name, d.block_size)
    if Bs is not None:
        ins = [("block_ids", (B, Bs), "int64"), ("positions", (B, Bs), "int64"),
               ("block_table", (B, s.max_ctx_blocks), "int64"), ("kv_start", (B,), "int64"),
               ("kv_len", (B,), "int64"), ("dkv_pool", *pools["dkv_pool"])]
        outs = [("drafts", (B, Bs - 1), "int64")]
        if d.dflash2:
            ins += [("temperature", (B,), "float32"), ("draft_u", (B, Bs - 1), "float32")]
        if want_logits:
            outs.append(("logits", (B, Bs, t.vocab_size), "float32"))
            if d.dflash2:
                k = d.selector_top_k
                outs += [("cand", (B, Bs - 1, k), "int64"), ("cand_q", (B, Bs - 1, k), "float32")]
        return ins, outs
    raise ValueError(f"unknown graph '{name}' (expected target_k<K>, {PREFILL}, {DRAFTER_CTX}, {DRAFTER_BLOCK})")
