"""The host step executor: the step recipe (runtime/step_recipe.py, on numpy: NP) with each graph through
`backend.run` (numpy in and out), greedy accept on the host, then the device part of the commit (commit.write) with n
as a host array. The CPU path for every backend
(ONNX Runtime, the torch reference on CPU, scripted drafters in tests). Synchronous: nothing stays in
flight, so host state is always current and the scheduler reserves exactly one step ahead.
numpy + a Device; a step with a sampling sequence imports the torch sampling math (runtime/sampling.py), and
asks the graphs for their logits; the greedy path stays numpy.
"""
from __future__ import annotations

import numpy as np

from dflash_trt.abi import DRAFTER_CTX, PREFILL, target_graph
from dflash_trt.runtime.batching import DECODE, SPEC, StepPlan, StepResult, pad_rows, prefill_rows, step_tables
from dflash_trt.runtime.commit import WriteTables, write
from dflash_trt.runtime.logprobs import first_tokens, logprobs_k, to_numpy, token_logprobs
from dflash_trt.runtime.sampling import SamplingError, row_params, samples
from dflash_trt.runtime.step_recipe import NP, ctx_window, greedy_accept, positions, propose, target_inputs, verify


class HostStepExecutor:
    max_inflight = 0  # steps left running after launch() returns
    runs_ahead = False  # ctx windows slide themselves on finish (no step in flight to protect)

    def __init__(self, rt):
        self.rt = rt
        # a device with its own stream (CudaDevice) gets every launch and commit on it
        self._stream = rt.device.on_stream

    # ---- inputs of one batch (padding rows: empty sequence at slot 0) ------------------------
    def _rows(self, rows):
        """The step's index arrays: batching.step_tables, seq_len, and (with a drafter) its ctx window."""
        rt, s = self.rt, self.rt.sizes
        x = step_tables(rows, s.max_blocks, rt.ctx_blocks if rt.dcfg is not None else None, s.max_seqs)
        x["seq_len"] = np.array([q.seq_len if q else 0 for q in rows], dtype=np.int64)
        if rt.dcfg is not None:
            x["kv_start"], x["kv_len"] = ctx_window(NP, x["seq_len"], x["ctx_base"], s.ctx_window)
        return x

    def _run(self, graph, inputs, logits: bool):
        """backend.run, with the graph's logits when the step samples or reports logprobs (the torch backend emits
        them while its want_logits is set; exported graphs carry them unless exported with --no-logits)."""
        be = self.rt.backend
        if not logits:
            return be.run(graph, inputs)
        prev = be.want_logits
        be.want_logits = True
        try:
            out = be.run(graph, inputs)
        finally:
            be.want_logits = prev
        if "logits" not in out:
            raise SamplingError(f"graph {graph} of the {be.name} backend emits no logits, so it cannot sample "
                                f"or report logprobs; re-export without --no-logits, or use temperature 0 "
                                f"without logprobs")
        return out

    def _target(self, graph, x, ids, valid=None, logits=False):
        """A target graph on ids [B, T] at positions seq_len.. (valid: a prefill chunk's rows)."""
        pos = positions(NP, x["seq_len"], ids.shape[1])
        return self._run(graph, target_inputs(ids, pos, x, self.rt.pools, valid), logits)

    def _ctx_rows(self, x, out):
        """drafter_ctx on the target step's ctx_hidden rows (padded to the graph's static R)."""
        rt = self.rt
        if rt.dcfg is None:
            return None
        R = rt.sizes.max_append
        ctx_in = rt.device.pad_rows(out["ctx_hidden"], R)
        pos = positions(NP, x["seq_len"], R)
        return rt.backend.run(DRAFTER_CTX, {"ctx_hidden": ctx_in, "positions": pos})["dkv_rows"]

    def _commit(self, x, out, n):
        rt = self.rt
        t = WriteTables(x["slot"], x["seq_len"], x["block_table"])
        if rt.dcfg is not None:
            t.ctx_table = x["ctx_table"]
            t.ctx_start = x["kv_len"]  # the window's end row: the next row appended
        write(rt.device, rt.pools, out, n, t, self._ctx_rows(x, out))

    # ---- the executor interface ----------------------------------------------------------
    def launch_prefill(self, seqs, chunks: list[list[int]]) -> list:
        """One prefill chunk of each of `seqs` (pages reserved by the caller), batched in their bucket; returns the
        first token of each (the one a sequence keeps is its last chunk's)."""
        with self._stream():
            return self._prefill(seqs, chunks)

    def _prefill(self, seqs, chunks):
        rows = pad_rows(seqs)
        x = self._rows(rows)
        pr = prefill_rows(seqs, chunks, self.rt.sizes.prefill_chunk)
        valid = pr["valid"]
        sampled, lp = samples(rows), logprobs_k(rows) is not None
        out = self._target(PREFILL, x, pr["ids"], valid, logits=sampled or lp)
        self._commit(x, out, valid)
        last = out["logits"][:, 0] if sampled or lp else None  # the chunk's last valid row
        if sampled:  # the first new token, at position seq_len + len(chunk)
            first = self._sampler(rows).first(last, x["seq_len"] + valid)
        else:
            first = out["argmax"][:, 0]
        return first_tokens(first[: len(seqs)], _logprobs(last, first) if lp else None)

    def _sampler(self, rows):
        from dflash_trt.runtime.sampling import HostSampler

        return HostSampler(row_params(rows))

    def launch(self, plan: StepPlan) -> StepResult:
        with self._stream():
            return self._step(plan)

    def _step(self, plan: StepPlan) -> StepResult:
        rt = self.rt
        x = self._rows(plan.rows)
        live = plan.live
        bonus = np.array([s.bonus if s else 0 for s in plan.rows], dtype=np.int64)
        smp = self._sampler(plan.rows) if samples(plan.rows) else None  # None: greedy, numpy only
        lp = logprobs_k(plan.rows) is not None
        logits = smp is not None or lp
        if plan.kind == DECODE:
            out = self._target(target_graph(1), x, bonus[:, None], logits=logits)
            n = live.copy()
            tokens = out["argmax"] if smp is None else smp.first(out["logits"][:, 0], x["seq_len"] + 1)[:, None]
        elif plan.kind == SPEC:
            g = plan.gamma
            dflash2 = smp is not None and rt.dcfg.dflash2
            dout, pos = propose(NP, self._run, x, bonus, x["seq_len"], plan.K, rt.dcfg, rt.pools["dkv_pool"],
                                smp is not None, smp.draws(x["seq_len"], g) if dflash2 else None)
            if smp is None:
                drafts = dout["drafts"][:, :g]
            elif dflash2:  # the selector drew the drafts in the graph, from q over its candidates
                drafts = smp.selected(dout)
            else:  # drafts drawn from the drafter's per-slot q (slot j predicts position seq_len + j)
                drafts = smp.drafts(dout["logits"][:, 1:plan.K], x["seq_len"])
            out = verify(NP, self._run, x, bonus, drafts, pos, rt.pools, logits)
            if smp is None:
                n = greedy_accept(NP, drafts, out["argmax"], live)
                tokens = out["argmax"]
            else:
                tokens, n = smp.accept(out["logits"], drafts, x["seq_len"])
                n = n * live
        else:
            raise ValueError(f"unknown step kind {plan.kind!r}")
        self._commit(x, out, n)
        tokens = np.asarray(tokens, dtype=np.int64)
        return StepResult(tokens, n, x.get("kv_start"), x.get("kv_len"),
                          _logprobs(out["logits"], tokens) if lp else None)

    def collect(self, pending):
        return pending  # already done: launches are synchronous

    def landed(self, pending) -> bool:
        """Always: every launch is synchronous."""
        return True

    def settle(self) -> None:
        """Nothing runs beside anything here (every launch is synchronous)."""

    def quiesce(self) -> None:
        """After a launch or collect that raised: nothing of it still runs (every launch is synchronous)."""

    def zero_slot(self, slot: int) -> None:
        """A fresh sequence's GDN and conv state: zeros (before its prefill)."""
        for name in ("gdn_pool", "conv_pool"):
            self.rt.device.zero_slot(self.rt.pools[name], slot)

    def adopt(self, seq) -> None:
        """A sequence whose state was put into the pools from outside (restore): nothing to do here."""


def _logprobs(logits, tokens) -> tuple:
    """token_logprobs on graph outputs (numpy or torch) -> the numpy triple."""
    import torch

    lg = logits if isinstance(logits, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(logits))
    return to_numpy(token_logprobs(lg, torch.as_tensor(np.asarray(tokens, dtype=np.int64), device=lg.device)))
