"""The device side of one runtime step, in torch, with no host round trip inside (DESIGN §5 "GPU step"):
what a step's CUDA graph captures. Each function reads a step's static input buffer (the host's rows,
pages and ctx window base), runs the graphs through one StepGraphs object (runtime/interfaces.py: the torch
backend's ModuleGraphs over its modules, on CUDA our kernels as custom ops; the TensorRT backend's EngineGraphs),
accepts greedily ON THE DEVICE, commits through the device's commit kernels (runtime/commit.write, n a device
tensor) and advances the per-slot device state (seq_len, bonus) so the next step needs nothing from the host
but its rows. No .item(), no data-dependent shapes, no host syncs: everything is capturable. On CPU the same
code runs eagerly (that is how its logic is tested without a GPU).

A step whose buffers carry sampling fields (SAMPLING_FIELDS: a key with a sampling sequence) asks the graphs for
their logits and picks tokens with runtime/sampling.py (drafts from the drafter's q, speculative rejection
sampling against the target's p, counter-based uniforms: all inside the graph); its temperature-0 rows come out
exactly as greedy. Greedy keys run the argmax path unchanged.

A step whose buffers carry the `logprobs` field (a key with a row that asks for logprobs) asks for the logits too and
appends the emitted tokens' logprobs and top LOGPROBS_MAX (runtime/logprobs.py, packed as int64) to its result rows;
other keys compute none of it.

Result row per sequence (int64): tokens[0:K] (the emitted tokens are its first n; greedy: the target argmax),
n, seq_len before the step, kv_start, kv_len (the drafter window attended)[, logprobs.pack of the K tokens].
Prefill: first token, valid[, logprobs.pack of the first token].
"""
from __future__ import annotations

import torch

from dflash_trt.abi import DRAFTER_CTX, PREFILL, target_graph
from dflash_trt.runtime.backends.opaque_ops import as_int32
from dflash_trt.runtime.commit import WriteTables, write
from dflash_trt.runtime.logprobs import pack, token_logprobs
from dflash_trt.runtime.step_recipe import ctx_window, greedy_accept, positions, propose, target_inputs, verify
from dflash_trt.runtime.sampling import (TOKEN, draft_tokens, row_tensors, sample, selector_draws, selector_q,
                                         speculative_accept, token_probs, uniform)

RESULT_EXTRA = 4  # n, seq_len, kv_start, kv_len after the K token columns
SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p", "seed")  # per row; floats as float64 bits


def _logprobs(b, logits, tokens):
    """The packed logprobs of tokens [B, T] under logits [B, T, V] when the key reports them, else None."""
    return pack(token_logprobs(logits, tokens)) if "logprobs" in b else None


def _sampling(b):
    """The step's per-row sampling parameters as tensors, or None for a greedy key."""
    if "temperature" not in b:
        return None
    return row_tensors({k: b[k] for k in SAMPLING_FIELDS}, b["temperature"].device)


class TorchOps:
    """The array namespace of the step recipe (runtime/step_recipe.py) on the step's device: int64 tensors."""

    @staticmethod
    def full(shape, value, like):
        return torch.full(shape, value, dtype=torch.int64, device=like.device)

    @staticmethod
    def arange(n: int, like):
        return torch.arange(n, device=like.device)

    @staticmethod
    def concat(tensors, axis: int):
        return torch.cat(tensors, axis)

    @staticmethod
    def cumprod_int64(mask, axis: int):
        return torch.cumprod(mask.to(torch.int64), axis)

    @staticmethod
    def clamp_max(x, hi: int):
        return torch.clamp(x, max=hi)

    @staticmethod
    def zeros_f32(shape, like):
        return torch.zeros(shape, dtype=torch.float32, device=like.device)


TORCH = TorchOps()


class SlotState:
    """seq_len and bonus per state slot, on the device; row max_seqs is the dummy row of padding rows."""

    def __init__(self, max_seqs: int, device):
        self.seq_len = torch.zeros(max_seqs + 1, dtype=torch.int64, device=device)
        self.bonus = torch.zeros(max_seqs + 1, dtype=torch.int64, device=device)


class FusedSteps:
    def __init__(self, graphs, rt, graph_int32: bool = True):
        """graphs: a StepGraphs (run(graph, device tensors, want_logits) -> device tensors) on rt.device;
        rt.dcfg: the drafter's config (None: no drafter, no ctx rows). graph_int32: the graphs take their index
        inputs (slot, seq_len, block tables, drafter window) as the step's int32 casts (the torch modules: their
        kernels read int32); False: as the ABI's int64 (TensorRT engines bind the ABI). The commit kernels read the
        int32 casts either way."""
        self.graphs, self.dcfg, self.rt, self.graph_int32 = graphs, rt.dcfg, rt, graph_int32
        self.dev, self.pools = rt.device, rt.pools
        self.window = rt.sizes.ctx_window
        self.state = SlotState(rt.sizes.max_seqs, rt.device.device)

    # ---- pieces ---------------------------------------------------------------------------
    def _index(self, b, seq_len, window=None, live=False) -> tuple[dict, dict]:
        """(ix, gi): the step's index tensors (slot, block and ctx tables, seq_len, the drafter window; with `live`
        the live flags too) as every kernel reads them, int32, cast once a step (opaque_ops.as_int32 says why; the
        step buffers hold the ABI's int64), and the same tensors as the graphs take them: ix, or (graph_int32 False)
        the int64 ones."""
        wide = {k: b[k] for k in ("slot", "block_table", "ctx_table", "live") if k in b and (k != "live" or live)}
        wide["seq_len"] = seq_len
        if window is not None:
            wide["kv_start"], wide["kv_len"] = window
        if "ctx_base" in b:  # the commit's first logical ctx row (commit reads it as ix["ctx_start"])
            wide["ctx_start"] = seq_len - b["ctx_base"]
        # one cast kernel for all of them (and the one kernel that concatenates them): each index tensor is then a
        # view of that buffer, where a cast per tensor was a kernel each (6-8 a step)
        flat = as_int32(torch.cat([t.reshape(-1) for t in wide.values()]))
        ix, o = {}, 0
        for k, t in wide.items():
            ix[k] = flat[o:o + t.numel()].view(t.shape)
            o += t.numel()
        gi = ix if self.graph_int32 else {k: t for k, t in wide.items() if k != "ctx_start"}
        return ix, gi

    def _target(self, graph, ids, pos, gi, valid=None, logits=False, gdn_commit=None):
        x = target_inputs(ids, pos, gi, self.pools, valid)
        if gdn_commit is not None:
            x["gdn_commit"] = gdn_commit
        return self.graphs.run(graph, x, logits)

    def _commit(self, out, n, b, ix, seq_len, pos):
        """The device part of the one commit path, drafter ctx rows at logical rows position - ctx_base.
        n is tied to the step's argmax (its value unchanged: an argmax is >= 0) so that the pool writes follow every
        read of the pools in any order of the compiled graph. Where n does not depend on the step (prefill: the valid
        rows; decode: the live flags), Inductor may place a read after the write that its rows allow (kv_write's rows
        are the K/V projections, conv_roll's the pre-conv columns) and then copy the whole pool in and back out
        around the write (figures: docs/PERF.md)."""
        t = WriteTables(ix["slot"], ix["seq_len"], ix["block_table"])
        n = as_int32(torch.where(out["argmax"][:, 0] >= 0, n, 0))  # once for the four commit kernels
        dkv = None
        if self.dcfg is not None:
            t.ctx_table, t.ctx_start = ix["ctx_table"], ix["ctx_start"]
            dkv = self.graphs.run(DRAFTER_CTX, {"ctx_hidden": out["ctx_hidden"], "positions": pos}, False)["dkv_rows"]
        write(self.dev, self.pools, out, n, t, dkv)

    def _window(self, b, seq_len):
        """The drafter ctx rows a sequence attends: the newest min(seq_len, window), ending at its last row."""
        if self.dcfg is None:
            return torch.zeros_like(seq_len), torch.zeros_like(seq_len)
        return ctx_window(TORCH, seq_len, b["ctx_base"], self.window)

    def _advance(self, b, am, n, seq_len, bonus, kv, lp=None):
        """Per-slot state after the step (padding rows: n = 0, so their dummy row keeps its zeros); am: the
        emitted tokens [B, K] (their first n); lp: their packed logprobs, or None."""
        live = b["live"] > 0
        new_bonus = am.gather(1, (n - 1).clamp(min=0)[:, None])[:, 0]
        self.state.seq_len.index_copy_(0, b["srow"], seq_len + n)
        self.state.bonus.index_copy_(0, b["srow"], torch.where(live, new_bonus, bonus))
        r = b["result"]
        K = am.shape[1]
        r[:, :K] = am
        r[:, K] = n
        r[:, K + 1] = seq_len
        r[:, K + 2], r[:, K + 3] = kv
        if lp is not None:
            r[:, K + RESULT_EXTRA:] = lp

    # ---- steps ----------------------------------------------------------------------------------
    def prefill(self, b) -> None:
        """One chunk: ids [1,C] at positions start.., valid rows; result [1, 2] = (first token, valid)."""
        ids, start, valid = b["ids"], b["start"], b["valid"]
        rp = _sampling(b)
        pos = positions(TORCH, start, ids.shape[1])
        ix, gi = self._index(b, start)
        out = self._target(PREFILL, ids, pos, gi, valid, logits=rp is not None or "logprobs" in b)
        self._commit(out, valid, b, ix, start, pos)
        lg = None if "logits" not in out else out["logits"][:, 0]  # the chunk's last valid row
        if rp is None:
            first = out["argmax"][:, 0]
        else:  # the first new token, at position start + valid
            first = sample(token_probs(lg, rp), uniform(rp["seed"], start + valid, TOKEN))
        lp = _logprobs(b, lg, first)
        first = torch.where(valid > 0, first, self.state.bonus[b["srow"]])  # valid 0 (warm-up): inert
        self.state.seq_len.index_copy_(0, b["srow"], start + valid)
        self.state.bonus.index_copy_(0, b["srow"], first)
        b["result"][:, 0] = first
        b["result"][:, 1] = valid
        if lp is not None:
            b["result"][:, 2:] = lp

    def decode(self, b) -> None:
        """Plain K=1 step on the bonus token (also the gated-off path: ctx rows still appended)."""
        seq_len, bonus = self.state.seq_len[b["srow"]], self.state.bonus[b["srow"]]
        pos = seq_len[:, None]
        rp = _sampling(b)
        # graphs that commit a decode row's GDN state themselves read and write it once (no fold data, no fold): n is
        # the live rows, cast with the step's other index tensors
        ix, gi = self._index(b, seq_len, live=self.graphs.commits_decode_gdn)
        n = b["live"].clone()
        gdn_commit = ix.get("live")
        out = self._target(target_graph(1), bonus[:, None], pos, gi, logits=rp is not None or "logprobs" in b,
                           gdn_commit=gdn_commit)
        self._commit(out, n, b, ix, seq_len, pos)
        tok = out["argmax"]
        if rp is not None:
            tok = sample(token_probs(out["logits"][:, 0], rp), uniform(rp["seed"], seq_len + 1, TOKEN))[:, None]
        self._advance(b, tok, n, seq_len, bonus, self._window(b, seq_len), _logprobs(b, out.get("logits"), tok))

    def spec(self, b, gamma: int) -> None:
        """drafter_block -> target_k{γ+1} -> accept on the device (greedy, or rejection sampling) -> commit
        n = accepted + 1."""
        rp = _sampling(b)
        seq_len, bonus = self.state.seq_len[b["srow"]], self.state.bonus[b["srow"]]
        kv_start, kv_len = self._window(b, seq_len)
        ix, gi = self._index(b, seq_len, (kv_start, kv_len))
        run = self.graphs.run
        dflash2 = rp is not None and self.dcfg.dflash2
        dout, bpos = propose(TORCH, run, gi, bonus, seq_len, gamma + 1, self.dcfg, self.pools["dkv_pool"],
                             rp is not None, selector_draws(rp, seq_len, gamma) if dflash2 else None)
        if rp is None:
            drafts = dout["drafts"]
        elif dflash2:  # the selector drew the drafts in the graph; q: its distributions over the candidates
            drafts, q = dout["drafts"], selector_q(dout)
        else:  # slot j of the block predicts the token at position seq_len + j
            q = token_probs(dout["logits"][:, 1:], rp)
            drafts = draft_tokens(q, rp["seed"], bpos[:, 1:])
        pos = bpos
        out = verify(TORCH, run, gi, bonus, drafts, pos, self.pools, rp is not None or "logprobs" in b)
        if rp is None:
            am = out["argmax"]
            n = greedy_accept(TORCH, drafts, am, b["live"])
        else:  # verify row j predicts the token at position seq_len + 1 + j
            am, n = speculative_accept(token_probs(out["logits"], rp), q, drafts, rp["seed"], bpos + 1)
            n = n * b["live"]
        self._commit(out, n, b, ix, seq_len, pos)
        self._advance(b, am, n, seq_len, bonus, (kv_start, kv_len), _logprobs(b, out.get("logits"), am))
