"""Continuous batching, one verify width K per step for the whole batch (the shape of nano-vllm's LLMEngine.step,
small pieces):

  step():  admit   waiting requests join: their prefills are launched together (chunked, the joiners' chunks
                   sharing launches, on the executor's device) and each first token collected once its prefill has
                   landed (the host never waits for one beside a step), so a join does not drain the steps in
                   flight; a request whose last step is in flight frees its row;
                   with steps in flight, PREFETCH more than the batch holds join to wait for a row, prefilled
                   (into pages no running request may need)
           plan    the running requests that still need tokens (a joiner whose prefill is in flight sits out
                   while others run), in the smallest batch bucket, and the step's width K (runtime.draft_length:
                   fixed, or the one of most committed tokens per second); pages for each one's worst case reserved (a
                   request that cannot get them fails alone and is freed; one that leaves frees its pages once its
                   launches in flight land)
           launch  one step for the whole bucket (executor: host numpy path, or the device's CUDA graphs)
           collect the oldest step in flight once more than the executor keeps running: n and the new
                   tokens per row -> commit.finish (a request that steps again keeps its next step's worst case of
                   pages) -> tokens appended; EOS / max tokens -> the request leaves

Its parts: who joins (runtime.admission), the step's width (runtime.draft_length), the worst-case page sums
(runtime.page_budget), the launches in flight and which is due (runtime.inflight); this module holds the requests,
the phases' order and the faults.

Faults: a refusal a request meets in normal serving (PoolExhausted, ValueError: out of pages, a bad sampling row)
fails that request alone and is recorded on it. Any other exception raised by a phase of a step is a fault: the
requests it belongs to fail with it (Scheduler._fault; a launch or a collect belongs to every row of its step: their
device state is unknown, so they fail rather than retry), the step's other work goes on, and step() re-raises the
first fault at its end so the caller sees it; the next step() continues from consistent pools.

With an executor that runs ahead (keeps one step in flight: the GPU), step t+1 is planned and launched while step t
runs: its rows' seq_len, positions and bonus are advanced on the device by step t itself, so the host only
needs what it decides (rows, pages, the ctx window's base). There, with requests running, plan + launch come
before admit (Scheduler.step): a joiner's host work then overlaps two queued steps. Pages are therefore reserved for
every step not yet finished (`Request.rows_in_flight`), and a request's state on the host lags the device by its
steps in flight. Host bookkeeping only — numpy; no torch here.
"""
from __future__ import annotations

from collections import deque

from dflash_trt.runtime import commit
from dflash_trt.runtime.admission import PREFETCH, Admission
from dflash_trt.runtime.batching import BUCKETS, DECODE, SPEC, StepPlan, bucket_for, pad_rows
from dflash_trt.runtime.inflight import InFlightQueue, Join
from dflash_trt.runtime.logprobs import row_entries
from dflash_trt.runtime.page_budget import PageBudget
from dflash_trt.runtime.pools import PoolExhausted
from dflash_trt.runtime.request import FAILED, FINISHED, RUNNING, WAITING, Request
from dflash_trt.runtime.sampling import GREEDY, SamplingParams, samples

__all__ = ["WAITING", "RUNNING", "FINISHED", "FAILED", "REFUSALS", "PREFETCH", "Request", "Join", "Scheduler"]

REFUSALS = (PoolExhausted, ValueError)  # what a request can meet in normal serving: recorded, not raised


class Scheduler:
    """Continuous batching of one runtime's requests (see the module docstring for a step). gamma: drafts per step,
    or None: chosen per step; spec False (or no drafter): plain decoding."""

    def __init__(self, rt, gamma: int | None, spec: bool, max_batch: int = BUCKETS[-1]):
        if not 1 <= max_batch <= BUCKETS[-1]:
            raise ValueError(f"max_batch {max_batch} outside [1, {BUCKETS[-1]}]")
        self.rt, self.ex = rt, rt.executor
        self.spec = bool(spec and rt.dcfg is not None)
        self.gamma = (None if gamma is None else int(gamma)) if self.spec else 0
        self.draft_length = rt.draft_length(self.gamma) if self.spec else None
        self.K = self.draft_length.widest if self.spec else 1  # the widest step: what a request reserves for
        self.max_batch = max_batch
        self.budget = PageBudget(rt.sizes.page_size, self.K, rt.sizes.ctx_window if rt.dcfg is not None else None,
                                 rt.ctx_blocks)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.inflight = InFlightQueue()
        self._next_id = 0
        self._error: Exception | None = None  # the step's first fault, re-raised when it ends (_raise_fault)
        self.on_step = None  # hook(rt, request, plan, result, row) after each of its steps is finished (tests, tracing)

    # ---- requests -------------------------------------------------------------------------
    def add(self, prompt, max_new_tokens: int, sampling: SamplingParams | None = None,
            ignore_eos: bool = False) -> Request:
        """Queue a request; bad input (empty prompt, token ids outside the vocabulary, over capacity) raises.
        sampling: how it picks tokens (None: greedy); greedy and sampling requests share batches.
        ignore_eos: EOS does not end it (benchmarks, fixed-length outputs)."""
        ids = self.rt.check_request(prompt, max_new_tokens, self.K)
        sampling = (sampling or GREEDY).resolved()
        req = Request(self._next_id, ids, int(max_new_tokens), rt=self.rt, sampling=sampling,
                      ignore_eos=bool(ignore_eos))
        self._next_id += 1
        self.waiting.append(req)
        return req

    def release(self, req: Request, reason: str = "released") -> None:
        """Leave now; the results of its launches still in flight are dropped. Its pages and slot go back once
        no launch in flight can touch them: at once when none is, else when the last one is collected. A device
        executor runs the prefills of joining requests on a second stream, beside the steps in flight
        (graph_executor), so a page freed under a running step could be rewritten by a prefill meanwhile."""
        if req.seq is not None and not (self.ex.runs_ahead and req.launches_in_flight):
            self.rt._release(req.seq)  # the scheduler's own handle (direct release() refuses managed ones)
            req.seq = None
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        if not req.done:
            req.status, req.finish_reason = FINISHED, reason

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.inflight)

    # ---- one scheduler step -----------------------------------------------------------------
    def step(self) -> list[Request]:
        """Plan + launch one batch step, admit, collect what is due; returns the requests that changed.
        With requests running on an executor that runs ahead, the launch comes before the admission: a joiner
        cannot take this step anyway, and its admission's host work then overlaps two queued steps. Otherwise the
        admission comes first (nothing to overlap: the joiners take the step they were admitted in)."""
        touched: list[Request] = []
        plan = self._launch(self._plan(touched), touched) if self.running and self.ex.runs_ahead else None
        self._admit(touched)
        if plan is None:
            plan = self._launch(self._plan(touched), touched)
        return self._raise_fault(self._collect_due(touched, plan))

    def admit(self) -> list[Request]:
        """Only the admission part of a step (prefill waiting requests); benchmarks time it on its own."""
        touched: list[Request] = []
        self._admit(touched)
        return self._raise_fault(touched)

    def drain(self) -> list[Request]:
        """Collect every launch in flight (a caller that stops stepping early: its pages and slots come back)."""
        touched: list[Request] = []
        while self.inflight:
            self._collect(*self.inflight.pop_oldest(), touched)
        return self._raise_fault(list(dict.fromkeys(touched)))

    def _launch(self, plan: StepPlan | None, touched) -> StepPlan | None:
        """Launch plan; a launch that raises fails every row of it (None: nothing was launched)."""
        if plan is None:
            return None
        try:
            self.inflight.push(plan, self.ex.launch(plan))
        except Exception as err:
            for req in plan.reqs:  # the launch is not in flight: what _plan counted for it goes
                req.rows_in_flight -= plan.K
                req.launches_in_flight -= 1
            self.ex.quiesce()  # a part of it that reached the device has run before its rows' pages go back
            self._fault(plan.reqs, err, touched)
            return None
        return plan

    def _collect_due(self, touched, plan: StepPlan | None) -> list[Request]:
        """After launching `plan` (None: nothing to launch): landed prefills, then the oldest steps while more than the
        executor keeps running are in flight (with no launch, everything in flight)."""
        if self.ex.runs_ahead:  # a prefill still running is not waited for: the host would block beside a step
            for entry in self.inflight.landed_joins(self.ex.landed):
                self._collect_entry(entry, touched)
        while self.inflight.due(plan is not None, self.ex.max_inflight):
            for entry in self.inflight.next_due():
                self._collect_entry(entry, touched)
        return list(dict.fromkeys(touched))

    def _collect_entry(self, entry, touched) -> None:
        self.inflight.take(entry)
        self._collect(*entry, touched)

    # ---- faults -------------------------------------------------------------------------------
    def _fail(self, req: Request, err: Exception, touched) -> None:
        """The one place a request fails: it leaves with finish_reason "error" and err recorded; its slot and pages
        go back now, or as its last launch in flight lands (release). One that already left stays as it left."""
        if req.done:
            return
        self.release(req, "error")
        req.status, req.error = FAILED, err
        touched.append(req)

    def _fault(self, reqs, err: Exception, touched) -> None:
        """reqs fail with err; unless it is a refusal (only recorded on them), the step re-raises it once its work is
        done (the first one, with several)."""
        for req in reqs:
            self._fail(req, err, touched)
        if self._error is None and not isinstance(err, REFUSALS):
            self._error = err

    def _raise_fault(self, touched: list) -> list:
        err, self._error = self._error, None
        if err is not None:
            raise err
        return touched

    # ---- admit --------------------------------------------------------------------------------
    def _admit(self, touched) -> None:
        """Waiting requests join (runtime.admission decides who) and their prefills are launched together."""
        joined = self._join_waiting(touched)
        if joined:
            self._launch_prefills(joined, touched)

    def _admission(self) -> Admission:
        """The admission decision for this step, from what the scheduler and the pools hold now."""
        rt, overlapping = self.rt, self.ex.runs_ahead and bool(self.inflight)
        free = (rt.kv_alloc.num_free, rt.dkv_alloc.num_free if rt.dcfg is not None else 0)
        owed = self.budget.owed(self.running) if overlapping and self.waiting else (0, 0)  # only when someone waits
        return Admission(self.budget, max_batch=self.max_batch, stepping=sum(1 for r in self.running if r.wants_step),
                         overlapping=overlapping, busy=bool(self.running or self.inflight), free=free, owed=owed)

    def _join_waiting(self, touched) -> list[Request]:
        """The waiting requests admitted this step, in queue order, each with its sequence made (one that cannot be
        made fails alone)."""
        admission, joined = self._admission(), []
        while (self.waiting and admission.has_room(len(joined), self.rt.slots.num_free)
               and admission.admits(len(self.waiting[0].prompt), self.waiting[0].max_new_tokens, len(joined))):
            req = self.waiting.popleft()
            try:
                req.seq = self.rt.add_sequence(req.prompt, sampling=req.sampling)
            except Exception as err:
                self._fault([req], err, touched)
                continue
            req.seq.managed = True  # from now on only this scheduler steps or releases it
            joined.append(req)
        return joined

    def _launch_prefills(self, joined: list[Request], touched) -> None:
        """The joiners' prefills together (their chunks share launches: Runtime.launch_prefills); each becomes a Join
        in flight, collected at once on a host executor (its steps read seq.bonus; nothing else is in flight)."""
        try:
            results = self.rt.launch_prefills([r.seq for r in joined], _api="_scheduler")
        except Exception as err:  # not one request's fault (the prefills' host work broke): none keeps its slot
            self._fault(joined, err, touched)
            return
        for req, pending in zip(joined, results):
            if isinstance(pending, Exception):  # its prefill launch failed (Runtime._launch_chunk)
                self._fault([req], pending, touched)
                continue
            req.status = RUNNING
            req.launches_in_flight += 1  # the first token: wants_step counts it
            self.running.append(req)
            self.inflight.push(Join(req), pending)
            if not self.ex.runs_ahead:
                self._collect(*self.inflight.pop_newest(), touched)

    # ---- plan ---------------------------------------------------------------------------------
    def _plan(self, touched) -> StepPlan | None:
        """The running requests that want a step (at most max_batch), each with its step's worst case reserved; one
        that cannot get its pages fails alone. None: no row to launch."""
        wanting = [r for r in self.running if r.wants_step][: self.max_batch]
        # a joiner whose first token is not collected sits out while others run: its prefill then overlaps two steps
        ready = [r for r in wanting if r.seq.bonus is not None]
        rows = ready if ready and self.ex.runs_ahead else wanting
        if not rows:
            return None
        K = self.draft_length.choose(bucket_for(len(rows)), samples([r.seq for r in rows])) if self.spec else 1
        live = [req for req in rows if self._reserve(req, K, touched)]
        index = self.draft_length.chosen - 1 if self.spec else None
        return StepPlan(SPEC if K > 1 else DECODE, K, pad_rows([r.seq for r in live]), live, index) if live else None

    def _reserve(self, req: Request, K: int, touched) -> bool:
        """Pages for one more step of K rows of req, past its rows in flight; False: it failed instead."""
        try:
            if self.ex.runs_ahead and req.seq.ctx is not None:
                req.seq.ctx.slide()  # only between launches: no step in flight reads a dropped row
            commit.reserve(req.seq, K, self.rt.kv_alloc, self.rt.sizes.page_size, ahead=req.rows_in_flight)
        except Exception as err:  # out of pages (or a fault): this request fails, the others run
            self._fault([req], err, touched)
            return False
        req.rows_in_flight += K
        req.launches_in_flight += 1
        return True

    # ---- collect ------------------------------------------------------------------------------
    def _launch_collected(self, req: Request) -> None:
        """One launch of req collected; a request that left gives its pages and slot back with its last one."""
        req.launches_in_flight -= 1
        if req.status != RUNNING and req.launches_in_flight == 0 and req.seq is not None:
            self.rt._release(req.seq)
            req.seq = None

    def _collect(self, launch: StepPlan | Join, pending, touched) -> None:
        """Collect one launch in flight: a prefill's first token, or a step's rows; a lost result fails its rows."""
        reqs = [launch.req] if isinstance(launch, Join) else launch.reqs
        try:
            result = self.ex.collect(pending)
        except Exception as err:  # the launch's result is lost: every row of it fails
            self.ex.quiesce()
            for req in reqs:
                req.rows_in_flight -= launch.K if isinstance(launch, StepPlan) else 0
                self._launch_collected(req)
            self._fault(reqs, err, touched)
            return
        if isinstance(launch, Join):
            self._launch_collected(launch.req)
            if launch.req.status == RUNNING:  # else it left while its prefill was in flight
                launch.req.seq.bonus = int(result)
                self._emit(launch.req, [launch.req.seq.bonus], touched, result.logprobs, 0)
            return
        self._collect_step(launch, result, touched)

    def _collect_step(self, plan: StepPlan, result, touched) -> None:
        """Each row of a collected step finished (a row that fails fails alone), then the draft length told."""
        accepted = []
        committed, tokens = result.n.tolist(), result.tokens.tolist()  # Python ints at once, not numpy scalars
        for row, req in enumerate(plan.reqs):
            req.rows_in_flight -= plan.K
            self._launch_collected(req)
            if req.status != RUNNING:
                continue  # left while this step was in flight: its rows are dropped
            try:
                self._finish_row(req, plan, result, row, committed[row], tokens[row], touched)
            except Exception as err:  # this row's host work (or the on_step hook) failed: it fails alone
                self._fault([req], err, touched)
                continue
            if plan.kind == SPEC:
                accepted.append(committed[row] - 1)
        if plan.kind == SPEC:
            self.draft_length.record(plan.K, accepted, plan.index)

    def _finish_row(self, req: Request, plan: StepPlan, result, row: int, n: int, tokens: list, touched) -> None:
        """Row `row` of a collected step: commit.finish of its n rows, then its new tokens."""
        # one that steps again keeps its next step's worst case rather than free pages the next plan takes straight
        # back; the admission's sums stay exact (a request's pages owed fall as it holds more)
        keep = req.rows_in_flight + (plan.K if req.wants_step else 0)
        commit.finish(req.seq, n, self.rt.kv_alloc, self.rt.sizes.page_size, ahead=keep)
        new = tokens[:n]
        req.seq.bonus = new[-1]
        req.steps += 1
        if plan.kind == SPEC:
            req.accepted.append(n - 1)
        if self.on_step is not None:
            self.on_step(self.rt, req, plan, result, row)
        self._emit(req, new, touched, result.logprobs, row)

    def _emit(self, req: Request, new: list[int], touched, logprobs=None, row: int = 0) -> None:
        """Append tokens (and, when req asks, their logprobs: row `row` of the launch's numpy triple), cut at max
        tokens / the first EOS; a request that is complete leaves."""
        k = req.sampling.logprobs
        entries = row_entries(logprobs, row, new, k) if k is not None and logprobs is not None else None
        for j, token in enumerate(new):
            if len(req.tokens) >= req.max_new_tokens:
                break
            req.tokens.append(token)
            if entries is not None:
                req.logprobs.append(entries[j])
            if token in self.rt.eos and not req.ignore_eos:
                req.finish_reason = "eos"
                break
        touched.append(req)
        if req.finish_reason == "eos" or len(req.tokens) >= req.max_new_tokens:
            self.release(req, req.finish_reason or "length")
