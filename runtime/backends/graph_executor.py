"""The GPU step executor: per (step kind, K, batch bucket) static step buffers and ONE CUDA graph.

A step (DESIGN §5): the host fills one pinned staging buffer (rows, pages, ctx window base: int64), issues
one async H2D copy into the step's static input buffer, replays the step's graph (torch_fused_step:
drafter_block -> target verify -> accept on the device -> commit kernels -> drafter ctx rows -> per-slot
state advanced), and one async D2H copy brings back only the tokens and n into pinned memory, followed by
one event. The host does not wait for it: it plans and launches step t+1 first (the device advanced
seq_len / bonus itself), then collects step t.

A step with a sampling sequence runs the key (kind, K, B, "sampled"): the same step with per-row sampling
fields in its input buffer (floats as float64 bits, so one int64 copy still fills it) and the logits path;
greedy steps keep their keys (kind, K, B) and graphs unchanged. A step with a row that asks for logprobs runs the key
(..., "logprobs"): a per-row `logprobs` field, and result rows that carry the tokens' packed logprobs
(runtime/logprobs.py); the read-back grows only for those keys.

Prefills run on a second stream (the device's side_stream, when the backend's kernels follow torch's current stream:
`concurrent_prefill`): a joining request's prefill then runs beside the steps in flight instead of between them
(the tiny trained pair's batch-16 step leaves most SMs idle). What keeps the two streams apart: the prefill's slot
and pages were free, and the scheduler frees a request's only once its launches in flight landed; its slot is
zeroed on the prefill stream (zero_slot); a step with a row whose prefill was not collected yet waits for the
prefill stream on the device (the scheduler lets such a joiner sit out one step while others run, so that wait is
rare); and a prefill that fails part-way settles the prefill stream before its pages go back (settle).

Graphs are captured on first use after one eager warm-up with all-padding inputs (inert: n = 0). A capture
that fails is ended by the device (the brick guard), the stream stays usable, and that key runs its step
eagerly from then on; `eager_keys` lists them. On CPU (TorchCpuDevice) every step runs eagerly.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from dflash_trt.runtime.backends.torch_fused_step import RESULT_EXTRA, SAMPLING_FIELDS
from dflash_trt.runtime.batching import (DECODE, PREFILL_STEP, SPEC, StepPlan, StepResult, pad_rows, prefill_rows,
                                         prefill_width, step_tables)
from dflash_trt.runtime.draft_length import MeasuredCosts
from dflash_trt.runtime.logprobs import LOGPROBS_MAX, first_tokens, logprobs_k, packed_width, unpack
from dflash_trt.runtime.sampling import row_params, samples

STAGING_COPIES = 2  # a step's staging/readback pair is reused only after the step before last has landed
TIMED_RUNS = 3  # runs of a new step key timed for auto draft length (_time_step)


class Pending:
    """A launch not yet collected: its result sits in staging set i of buf until a later launch of the same key
    reuses that set; fill() then keeps a copy here first (several prefills of joining requests may be in flight
    on the prefill key at once)."""
    __slots__ = ("kind", "buf", "i", "ev", "value")

    def __init__(self, kind, buf, i, ev):
        self.kind, self.buf, self.i, self.ev, self.value = kind, buf, i, ev, None


class PrefillRow(NamedTuple):
    """One sequence's share of a batched prefill launch: its row of that launch's result, and its state slot."""
    p: Pending
    row: int
    slot: int


class StepBuffers:
    """One key's static buffers: an int64 device input buffer cut into named views (filled by ONE copy),
    a device result buffer, and STAGING_COPIES pinned (staging, readback, event) sets."""

    def __init__(self, dev, fields: dict, result_shape: tuple):
        self.dev, self.names, self.shapes, offs = dev, list(fields), dict(fields), {}
        self.sizes = {name: int(np.prod(shape)) for name, shape in fields.items()}  # once: fill runs every step
        total = 0
        for name in self.names:
            offs[name] = total
            total += self.sizes[name]
        self.offs, self.numel = offs, total
        self.inp = dev.device_buffer(total)
        self.result = dev.device_buffer(int(np.prod(result_shape))).view(result_shape)
        self.views = {k: self._cut(self.inp, k) for k in self.names}
        self.views["result"] = self.result
        # per set: staging, readback, its event, whether that event was recorded
        self.sets = [[dev.staging(total), dev.staging(int(np.prod(result_shape))), dev.new_event(), False]
                     for _ in range(STAGING_COPIES)]
        self.turn = 0
        self.K, self.lp = None, False  # the key's token columns and whether it reports logprobs (set by entry)
        self.unread = [None] * STAGING_COPIES  # per set: the Pending whose result is only there

    def _cut(self, flat, name):
        o = self.offs[name]
        return flat[o:o + self.sizes[name]].view(self.shapes[name])

    def fill(self, values: dict) -> int:
        """Write `values` into the next staging copy (waiting for its previous step), copy it to the device;
        returns the staging set used."""
        i = self.turn
        self.turn = (i + 1) % STAGING_COPIES
        stage, back, ev, recorded = self.sets[i]
        if recorded:
            self.dev.wait(ev)
            if self.unread[i] is not None:  # not collected yet: its result moves out before this launch lands
                self.unread[i].value = back.reshape(self.result.shape).copy()
                self.unread[i] = None
        for k in self.names:  # the host's per-step cost at batch 16 is this loop's business: no temporaries
            o, v = self.offs[k], values[k]
            stage[o:o + self.sizes[k]] = v.reshape(-1) if isinstance(v, np.ndarray) else v
        self.dev.h2d(self.inp, stage)
        return i

    def read_back(self, i: int):
        """Queue the D2H copy of the result into staging set i and record its event."""
        s = self.sets[i]
        self.dev.d2h(s[1], self.result)
        self.dev.record(s[2])
        s[3] = True
        return s[2]

    def pending(self, kind: str, i: int) -> Pending:
        """read_back(i), as a handle that collect() reads once its event has landed."""
        p = self.unread[i] = Pending(kind, self, i, self.read_back(i))
        return p

    def take(self, p: Pending) -> np.ndarray:
        """The result of launch p (waits for it), kept with p: the rows of a batched prefill are collected one by
        one, and the set is free for reuse afterwards."""
        if p.value is None:
            self.dev.wait(p.ev)
            if self.unread[p.i] is p:
                self.unread[p.i] = None
            p.value = self.sets[p.i][1].reshape(self.result.shape).copy()
        return p.value


class GraphStepExecutor:
    max_inflight = 1  # steps left running while the host plans the next (set per instance: inflight)
    runs_ahead = True  # ctx windows slide only between launches (a step in flight keeps its rows)

    def __init__(self, rt, use_graphs: bool | None = None, inflight: int = 1):
        """inflight: steps left running while the host plans the next (1: overlap; 0: synchronous)."""
        self.rt, self.dev = rt, rt.device
        self.max_inflight = int(inflight)
        self.dev.sync_all()  # weights / tables written on other streams have landed before our stream reads them
        with self.dev.on_stream():
            self.steps = rt.backend.fused_steps(rt)
        self.dev.synchronize()
        # the prefill's stream (the step's own when the backend's launches are bound to it: TensorRT's enqueue)
        self.side = self.dev.side_stream() if rt.backend.concurrent_prefill else self.dev
        self._fence = self.side.new_event()  # recorded on the prefill stream when a step must wait for it
        self._unlanded: set = set()  # slots whose last prefill launch was not collected yet
        self.use_graphs = self.dev.graph_steps if use_graphs is None else use_graphs
        self.buffers: dict = {}  # key (kind, K, B) -> StepBuffers
        self.graphs: dict = {}  # key -> replay callable (captured) or None (eager)
        self.eager_keys: set = set()  # keys whose capture failed: they run eagerly (brick guard)
        self.capture_hook = None  # hook(key) inside every capture (tests force a failure with it)
        self.trace = None  # a list -> (start, end, kind) timing events of every launch are appended (bench)
        self.on_capture = None  # progress callback(key) while graphs are captured
        self._timing = None  # (start, end) events of _time_step

    # ---- buffers and graphs per key ----------------------------------------------------------
    @property
    def top_width(self) -> int:
        """Top alternatives a logprobs key computes per token (the host cuts each row to its own k)."""
        return min(LOGPROBS_MAX, self.rt.tcfg.vocab_size)

    def _fields(self, kind, K, B, sampled=False, lp=False):
        s = self.rt.sizes
        f = {"slot": (B,), "srow": (B,), "block_table": (B, s.max_blocks)}
        if sampled:
            f.update({k: (B,) for k in SAMPLING_FIELDS})
        if lp:
            f["logprobs"] = (B,)
        if self.rt.dcfg is not None:
            f.update(ctx_table=(B, self.rt.ctx_blocks), ctx_base=(B,))
        if kind == PREFILL_STEP:
            f.update(ids=(B, K), start=(B,), valid=(B,))
            return f, (B, 2 + (packed_width(1, self.top_width) if lp else 0))
        f["live"] = (B,)
        return f, (B, K + RESULT_EXTRA + (packed_width(K, self.top_width) if lp else 0))

    def _fn(self, kind, K):
        st = self.steps
        if kind == PREFILL_STEP:
            return st.prefill
        if kind == DECODE:
            return st.decode
        return lambda b: st.spec(b, K - 1)

    def entry(self, kind: str, K: int, B: int, sampled: bool = False, lp: bool = False):
        """(buffers, run) of one key; builds the buffers and captures its graph on first use."""
        key = (kind, K, B) + (("sampled",) if sampled else ()) + (("logprobs",) if lp else ())
        buf = self.buffers.get(key)
        if buf is None:
            fields, rshape = self._fields(kind, K, B, sampled, lp)
            dev = self.side if kind == PREFILL_STEP else self.dev
            buf = self.buffers[key] = StepBuffers(dev, fields, rshape)
            buf.K, buf.lp = K, lp  # what collect reads the result rows by
            self._fill_padding(buf, kind, B, sampled, lp)
            fn = self._fn(kind, K)
            self.graphs[key] = None
            if self.use_graphs:
                if self.on_capture is not None:
                    self.on_capture(key)
                hook = None if self.capture_hook is None else (lambda: self.capture_hook(key))
                self.graphs[key] = dev.capture(lambda: fn(buf.views), hook=hook)
                if self.graphs[key] is None:
                    self.eager_keys.add(key)
            if kind != PREFILL_STEP:
                self._time_step(K, B, dev, self._run_of(key, buf))
        return buf, self._run_of(key, buf)

    def _run_of(self, key, buf):
        """What runs a key's step on its buffers: its graph's replay, or its step eagerly."""
        graph, fn = self.graphs[key], self._fn(key[0], key[1])
        return graph if graph is not None else (lambda: fn(buf.views))

    def _time_step(self, K, B, dev, run) -> None:
        """A new decode / spec key's step time into the runtime's MeasuredCosts (auto draft length weighs widths by
        it), once per (K, bucket): the mean of TIMED_RUNS runs on its padding inputs, which stream every weight as a
        real step does (their rows attend to nothing). Only where steps run on a device with timing events."""
        costs = self.rt.step_costs
        if not (isinstance(costs, MeasuredCosts) and dev.graph_steps) or costs.has(K, B):
            return
        if self._timing is None:
            self._timing = (dev.new_event(timing=True), dev.new_event(timing=True))
        start, end = self._timing
        with dev.on_stream():
            dev.record(start)
            for _ in range(TIMED_RUNS):
                run()
            dev.record(end)
        dev.wait(end)
        costs.add(K, B, dev.elapsed_ms(start, end) / TIMED_RUNS / 1e3)

    def _fill_padding(self, buf, kind, B, sampled=False, lp=False):
        """All-padding inputs (live 0 -> n 0, dummy state row): what warm-up and capture run on."""
        vals = self._tables([None] * B, sampled, lp)
        if kind == PREFILL_STEP:
            vals.update(ids=np.zeros(buf.shapes["ids"]), start=np.zeros(B), valid=np.zeros(B))  # valid 0: n 0
        with buf.dev.on_stream():
            buf.fill(vals)
        buf.dev.synchronize()

    def run_key(self, kind, K, B, values: dict, eager: bool = False, sampled: bool = False,
                lp: bool = False) -> np.ndarray:
        """Run one key on explicit inputs and wait (tests: replay vs eager, bit for bit)."""
        buf, run = self.entry(kind, K, B, sampled, lp)
        with buf.dev.on_stream():
            i = buf.fill(values)
            if eager:
                self._fn(kind, K)(buf.views)
            else:
                run()
            buf.dev.wait(buf.read_back(i))
        return buf.sets[i][1].reshape(buf.result.shape).copy()

    # ---- the executor interface ----------------------------------------------------------------
    def zero_slot(self, slot: int) -> None:
        """A fresh sequence's GDN and conv state: zeros, queued on the prefill stream (its prefill reads them)."""
        for name in ("gdn_pool", "conv_pool"):
            self.side.zero_slot(self.rt.pools[name], slot)

    def settle(self) -> None:
        """The prefill stream drained (the host waits): pages of a prefill that failed part-way may go back."""
        self.side.synchronize()
        self._unlanded.clear()

    def quiesce(self) -> None:
        """After a launch or collect that raised: whatever of it reached the device has run, on both streams, before
        the scheduler gives its rows' pages and slots back. A stream that cannot synchronize has failed its work
        (CUDA errors are sticky), so nothing of it writes them later either."""
        try:
            self.dev.synchronize()
            self.settle()
        except Exception:
            self._unlanded.clear()

    def _after_prefills(self, rows) -> None:
        """A step with a row whose prefill is not collected starts after the prefill stream's work so far (a wait on
        the device: the host goes on)."""
        if self.side is not self.dev and any(s is not None and s.slot in self._unlanded for s in rows):
            self.side.record(self._fence)
            self.dev.stream_wait(self._fence)

    def adopt(self, seq) -> None:
        """A sequence whose state was put into the pools from outside (restore): its device-side seq_len and
        bonus, which steps otherwise advance themselves."""
        st = self.steps.state
        self.dev.sync_all()  # the restore's pool writes (torch's own stream) land before any step reads them
        with self.dev.on_stream():
            st.seq_len[seq.slot] = int(seq.seq_len)
            st.bonus[seq.slot] = int(seq.bonus if seq.bonus is not None else 0)
        self.dev.synchronize()

    def _tables(self, rows, sampled=False, lp=False):
        s = self.rt.sizes
        t = step_tables(rows, s.max_blocks, self.rt.ctx_blocks if self.rt.dcfg is not None else None, s.max_seqs)
        if sampled:  # floats travel as their float64 bits in the int64 buffer (fused step views them back)
            t.update({k: (v.view(np.int64) if v.dtype == np.float64 else v) for k, v in row_params(rows).items()})
        if lp:  # each row's k (-1: none); the device computes top_width for every row, the host cuts
            t["logprobs"] = np.array([-1 if q is None or q.sampling is None or q.sampling.logprobs is None
                                      else q.sampling.logprobs for q in rows], dtype=np.int64)
        return t

    def launch_prefill(self, seqs, chunks: list[list[int]]) -> list:
        """One prefill chunk of each of `seqs` as ONE launch in their bucket, at the narrower of two row widths that
        holds them when the backend takes any (batching.prefill_width); returns a handle per sequence (collect gives
        its first token)."""
        C = self.rt.sizes.prefill_chunk
        if self.rt.backend.any_prefill_width:
            C = prefill_width(max(map(len, chunks)), C)
        rows = pad_rows(seqs)
        sampled, lp = samples(rows), logprobs_k(rows) is not None
        vals = self._tables(rows, sampled, lp)
        vals.update(prefill_rows(seqs, chunks, C))
        buf, run = self.entry(PREFILL_STEP, C, len(rows), sampled, lp)
        with self.side.on_stream():
            t0 = self._mark(self.side)
            i = buf.fill(vals)
            run()
            p = buf.pending(PREFILL_STEP, i)
            if t0 is not None:
                self.trace.append((t0, self._mark(self.side), PREFILL_STEP))
        self._unlanded.update(s.slot for s in seqs)
        return [PrefillRow(p, b, s.slot) for b, s in enumerate(seqs)]

    def launch(self, plan: StepPlan):
        if plan.kind not in (SPEC, DECODE):
            raise ValueError(f"unknown step kind {plan.kind!r}")
        sampled, lp = samples(plan.rows), logprobs_k(plan.rows) is not None
        buf, run = self.entry(plan.kind, plan.K, plan.bucket, sampled, lp)
        tables = self._tables(plan.rows, sampled, lp)
        self._after_prefills(plan.rows)
        with self.dev.on_stream():
            t0 = self._mark(self.dev)
            i = buf.fill(tables)
            run()
            p = buf.pending(plan.kind, i)
            if t0 is not None:
                self.trace.append((t0, self._mark(self.dev), plan.kind))
        return p

    def _mark(self, dev):
        """A timing event recorded on dev's stream now (only while tracing)."""
        if self.trace is None:
            return None
        ev = dev.new_event(timing=True)
        dev.record(ev)
        return ev

    def landed(self, pending) -> bool:
        """Whether collect(pending) would return without waiting."""
        p = pending.p if isinstance(pending, PrefillRow) else pending
        return p.value is not None or p.buf.dev.done(p.ev)

    def collect(self, pending):
        if isinstance(pending, PrefillRow):
            self._unlanded.discard(pending.slot)  # its sequence's last chunk: the earlier ones ran before it
            r = pending.p.buf.take(pending.p)[pending.row:pending.row + 1]
            if not pending.p.buf.lp:
                return first_tokens(r[:, 0])[0]
            lp, ids, tlp = unpack(r[:, 2:], 1, self.top_width)
            return first_tokens(r[:, 0], (lp[:, 0], ids[:, 0], tlp[:, 0]))[0]
        r = pending.buf.take(pending)
        K = pending.buf.K
        lp = unpack(r[:, K + RESULT_EXTRA:], K, self.top_width) if pending.buf.lp else None
        return StepResult(r[:, :K], r[:, K], r[:, K + 2], r[:, K + 3], lp)  # r: this launch's own copy (take)
