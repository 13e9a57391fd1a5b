"""Continuous batching at one verify width K (the shape of nano-vllm's LLMEngine.step, small pieces):

  step():  admit   waiting requests join: their prefills are launched together (chunked, the joiners' chunks
                   sharing launches, on the executor's device) and each first token collected once its prefill has
                   landed (the host never waits for one beside a step), so a join does not drain the steps in
                   flight; a request whose last step is in flight frees its row;
                   with steps in flight, PREFETCH more than the batch holds join to wait for a row, prefilled
                   (into pages no running request may need)
           plan    the running requests that still need tokens (a joiner whose prefill is in flight sits out
                   while others run), in the smallest batch bucket; pages for each one's worst case reserved (a
                   request that cannot get them fails alone and is freed; one that leaves frees its pages once its
                   launches in flight land)
           launch  one step for the whole bucket (executor: host numpy path, or the device's CUDA graphs)
           collect the oldest step in flight once more than the executor keeps running: n and the new
                   tokens per row -> commit.finish (a request that steps again keeps its next step's worst case of
                   pages) -> tokens appended; EOS / max tokens -> the request leaves

Faults: a refusal a request meets in normal serving (PoolExhausted, ValueError: out of pages, a bad sampling row)
fails that request alone and is recorded on it. Any other exception raised by a phase of a step is a fault: the
requests it belongs to fail with it (Scheduler._fault; a launch or a collect belongs to every row of its step: their
device state is unknown, so they fail rather than retry), the step's other work goes on, and step() re-raises the
first fault at its end so the caller sees it; the next step() continues from consistent pools.

With an executor that keeps one step in flight (the GPU), step t+1 is planned and launched while step t
runs: its rows' seq_len, positions and bonus are advanced on the device by step t itself, so the host only
needs what it decides (rows, pages, the ctx window's base). There, with requests running, plan + launch come
before admit (Scheduler.step): a joiner's host work then overlaps two queued steps. Pages are therefore reserved for every step not
yet finished (`Request.ahead` rows), and a request's state on the host lags the device by its steps in flight.
Host bookkeeping only — numpy; no torch here.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from dflash_trt.runtime import commit
from dflash_trt.runtime.batching import BUCKETS, DECODE, PREFILL_BATCH, SPEC, StepPlan, pad_rows
from dflash_trt.runtime.pools import PoolExhausted
from dflash_trt.runtime.sampling import GREEDY, SamplingParams

WAITING, RUNNING, FINISHED, FAILED = "waiting", "running", "finished", "failed"
REFUSALS = (PoolExhausted, ValueError)  # what a request can meet in normal serving: recorded, not raised
PREFETCH = 2  # requests admitted (prefilled) ahead of a free row while steps are in flight (Scheduler._admit)


@dataclass(eq=False)  # identity: a request is one object, compared and hashed as such
class Request:
    req_id: int
    prompt: list[int]
    max_new_tokens: int
    tokens: list[int] = field(default_factory=list)  # generated so far (first one from the prefill)
    seq: object = None  # runtime.sequence.Sequence while admitted
    status: str = WAITING
    finish_reason: str | None = None  # "eos" | "length" | "released" | "error"
    error: Exception | None = None
    ahead: int = 0  # rows reserved for this request's steps still in flight
    inflight: int = 0  # its steps in flight
    steps: int = 0  # target launches after the prefill
    accepted: list = field(default_factory=list)  # accepted drafts per spec step
    rt: object = field(default=None, repr=False)  # the Runtime that queued it (release_request checks it)
    sampling: SamplingParams = GREEDY  # seed resolved when queued (req.sampling.seed reproduces it)

    @property
    def done(self) -> bool:
        return self.status in (FINISHED, FAILED)

    @property
    def wants_step(self) -> bool:
        """Running and not certain to be complete once its steps in flight land (each yields >= 1 token)."""
        return self.status == RUNNING and len(self.tokens) + self.inflight < self.max_new_tokens


@dataclass(frozen=True)
class Join:
    """An admitted request's prefill in flight (its entry in Scheduler.inflight): collecting it emits the first
    token. A device executor's next step may run on the request before then (the device holds that token)."""
    req: Request


class Scheduler:
    def __init__(self, rt, gamma: int, spec: bool, max_batch: int = BUCKETS[-1]):
        if not 1 <= max_batch <= BUCKETS[-1]:
            raise ValueError(f"max_batch {max_batch} outside [1, {BUCKETS[-1]}]")
        self.rt, self.ex = rt, rt.executor
        self.spec = bool(spec and rt.dcfg is not None)
        self.gamma = int(gamma) if self.spec else 0
        self.K = self.gamma + 1
        self.max_batch = max_batch
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.inflight: deque = deque()  # (plan or Join, pending handle), in launch order
        self._next_id = 0
        self._error: Exception | None = None  # the step's first fault, re-raised when it ends (_raise_fault)
        self.on_step = None  # hook(rt, request) after each of its steps is finished (tests, tracing)

    # ---- requests -------------------------------------------------------------------------
    def add(self, prompt, max_new_tokens: int, sampling: SamplingParams | None = None) -> Request:
        """Queue a request; bad input (empty prompt, token ids outside the vocabulary, over capacity) raises.
        sampling: how it picks tokens (None: greedy); greedy and sampling requests share batches."""
        ids = self.rt.check_request(prompt, max_new_tokens, self.K)
        sampling = (sampling or GREEDY).resolved()
        req = Request(self._next_id, ids, int(max_new_tokens), rt=self.rt, sampling=sampling)
        self._next_id += 1
        self.waiting.append(req)
        return req

    def release(self, req: Request, reason: str = "released") -> None:
        """Leave now; the results of its launches still in flight are dropped. Its pages and slot go back once
        no launch in flight can touch them: at once when none is, else when the last one is collected. A device
        executor runs the prefills of joining requests on a second stream, beside the steps in flight
        (graph_executor), so a page freed under a running step could be rewritten by a prefill meanwhile."""
        if req.seq is not None and not (self.ex.ahead and req.inflight):
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
        With requests running the launch comes before the admission: a joiner cannot take this step anyway (its
        prefill is not collected), and its admission's host work (pages, tables, the prefill's launches) then runs
        while two steps are queued on the device rather than between a step's collect and the next launch (bench
        host's serving run, batch 16 DFlash, 2-core EPYC: that window's p90 ~480 -> ~140 us, the longest ~710 -> ~240
        us). With nothing to step yet, the admission comes first and the step runs behind its prefills; so it does on
        a host executor (nothing in flight to overlap: its joiners take the step they were admitted in)."""
        touched: list[Request] = []
        plan = self._launch(self._plan(touched), touched) if self.running and self.ex.ahead else None
        self._admit(touched)
        if plan is None:
            plan = self._launch(self._plan(touched), touched)
        return self._raise_fault(self._collect_due(touched, plan))

    def admit(self) -> list[Request]:
        """Only the admission part of a step (prefill waiting requests); benchmarks time it on its own."""
        touched: list[Request] = []
        self._admit(touched)
        return self._raise_fault(touched)

    def _launch(self, plan: StepPlan | None, touched) -> StepPlan | None:
        """Launch plan; a launch that raises fails every row of it (None: nothing was launched)."""
        if plan is None:
            return None
        try:
            self.inflight.append((plan, self.ex.launch(plan)))
        except Exception as e:
            for req in plan.reqs:  # the launch is not in flight: what _plan counted for it goes
                req.ahead -= plan.K
                req.inflight -= 1
            self.ex.quiesce()  # a part of it that reached the device has run before its rows' pages go back
            self._fault(plan.reqs, e, touched)
            return None
        return plan

    def _collect_due(self, touched, plan: StepPlan | None) -> list[Request]:
        """After launching `plan` (None: nothing to launch): landed prefills, then the oldest steps while more than the
        executor keeps running are in flight (with no launch, everything in flight)."""
        # joiners' first tokens once their prefills have landed; one still running is not waited for (H200, trained
        # pair bf16, batch 16 plain with requests joining a step apart: the host blocked on each prefill that outlasted
        # the step queued behind it, 34 % GPU idle, 34.8k tok/s against 59.1k)
        for entry in [e for e in self.inflight if isinstance(e[0], Join) and self.ex.ahead and self.ex.landed(e[1])]:
            self._collect_entry(entry, touched)
        while self.inflight and (plan is None or sum(not isinstance(e, Join) for e, _ in self.inflight)
                                 > self.ex.max_inflight):
            self._collect_next(touched)
        return list(dict.fromkeys(touched))

    def _collect_next(self, touched) -> None:
        """The oldest step in flight, after the prefills of its own rows' joiners (their first tokens come first);
        with no step in flight, the oldest prefill."""
        i = next((k for k, (e, _) in enumerate(self.inflight) if not isinstance(e, Join)), 0)
        entry = self.inflight[i]
        if not isinstance(entry[0], Join):
            for e in [e for e in list(self.inflight)[:i] if e[0].req in entry[0].reqs]:
                self._collect_entry(e, touched)
        self._collect_entry(entry, touched)

    def _collect_entry(self, entry, touched) -> None:
        self.inflight = deque(e for e in self.inflight if e is not entry)
        self._collect(*entry, touched)

    def drain(self) -> list[Request]:
        """Collect every launch in flight (a caller that stops stepping early: its pages and slots come back)."""
        touched: list[Request] = []
        while self.inflight:
            self._collect(*self.inflight.popleft(), touched)
        return self._raise_fault(list(dict.fromkeys(touched)))

    def _landed(self, req: Request) -> None:
        """One launch of req collected; a request that left gives its pages and slot back with its last one."""
        req.inflight -= 1
        if req.status != RUNNING and req.inflight == 0 and req.seq is not None:
            self.rt._release(req.seq)
            req.seq = None

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

    def _admit(self, touched) -> None:
        rt, joined = self.rt, []
        # A request whose last step is in flight no longer takes a row: a waiting one joins now (when a state slot
        # is free; pools with more slots than max_batch leave room) and its prefill runs beside that step (the GPU
        # executor's second stream; behind it on one stream). While steps are in flight, one scheduler step admits
        # at most PREFILL_BATCH joiners (one shared prefill launch's host work), so a batch whose requests end
        # together refills over a few steps with the GPU kept busy, rather than idling while the host admits all of
        # them (H200, trained pair bf16, batch 16 plain, 64 requests: 3 idle gaps of ~3 ms before the joiners'
        # prefills in a 225 ms run; 1.3-2.5 ms with early joins alone).
        # With steps in flight on a device executor, up to PREFETCH requests more than the batch holds join too: their
        # prefills run beside the steps while they wait for a row, so a row that frees is filled at the next launch
        # rather than after a prefill (the joiner would sit out a step: H200, trained pair bf16, batch 16 DFlash, 64
        # requests, 164 launches; the host path, which never sits one out, runs the same requests in 157 on CPU, fp32).
        stepping = sum(1 for r in self.running if r.wants_step)
        ahead = self.ex.ahead and bool(self.inflight)
        cap, room = (PREFILL_BATCH, self.max_batch + PREFETCH) if ahead else (self.max_batch, self.max_batch)
        free = [rt.kv_alloc.num_free, rt.dkv_alloc.num_free if rt.dcfg is not None else 0]
        owed = self._pages_owed() if ahead and self.waiting else [0, 0]  # per scheduler step: only when someone waits
        while self.waiting and len(joined) < cap and stepping + len(joined) < room and rt.slots.num_free > 0:
            need = self._pages_to_start(self.waiting[0])
            if (self.running or self.inflight) and (need[0] > free[0] or need[1] > free[1]):
                break  # requests running or landing give pages back as they end: wait for them rather than fail
            if ahead:  # a prefetch takes only pages that no request running or joining may still need
                life = self._pages_for_life(self.waiting[0])
                if stepping + len(joined) >= self.max_batch and (life[0] + owed[0] > free[0]
                                                                 or life[1] + owed[1] > free[1]):
                    break
                owed = [owed[0] + life[0] - need[0], owed[1] + life[1] - need[1]]
            free = [free[0] - need[0], free[1] - need[1]]
            req = self.waiting.popleft()
            try:
                req.seq = rt.add_sequence(req.prompt, sampling=req.sampling)
            except Exception as e:  # a request that cannot be admitted fails alone
                self._fault([req], e, touched)
                continue
            req.seq.managed = True  # from now on only this scheduler steps or releases it
            joined.append(req)
        if not joined:
            return
        # the joiners' prefills together: their chunks share launches (Runtime.launch_prefills)
        try:
            results = rt.launch_prefills([r.seq for r in joined], _api="_scheduler")
        except Exception as e:  # not one request's fault (the prefills' host work broke): none keeps its slot
            self._fault(joined, e, touched)
            return
        for req, pending in zip(joined, results):
            if isinstance(pending, Exception):  # its prefill launch failed (Runtime._launch_chunk)
                self._fault([req], pending, touched)
                continue
            req.status = RUNNING
            req.inflight += 1  # the first token: wants_step counts it
            self.running.append(req)
            self.inflight.append((Join(req), pending))
            if not self.ex.ahead:  # a host executor's steps read seq.bonus: collect now (nothing else is in flight)
                self._collect(*self.inflight.pop(), touched)

    def _pages_to_start(self, req: Request) -> tuple[int, int]:
        """(KV pages, drafter ctx pages) that req's prefill and first step reserve."""
        rt, ps = self.rt, self.rt.sizes.page_size
        rows = len(req.prompt) + self.K
        ctx = commit.cdiv(min(rows, rt.sizes.ctx_window), ps) if rt.dcfg is not None else 0
        return commit.cdiv(rows, ps), ctx

    def _pages_for_life(self, req: Request) -> tuple[int, int]:
        """(KV pages, drafter ctx pages) req may hold at most: its prompt, its max new tokens and a step's worst case
        (a ctx window holds at most its block table's width)."""
        rt, ps = self.rt, self.rt.sizes.page_size
        rows = len(req.prompt) + req.max_new_tokens + self.K
        return commit.cdiv(rows, ps), min(commit.cdiv(rows, ps), rt.ctx_blocks) if rt.dcfg is not None else 0

    def _pages_owed(self) -> list[int]:
        """Pages the running requests may still take before they end: their life's worst case less what they hold."""
        owed = [0, 0]
        for req in self.running:
            if req.seq is not None:
                life, ctx = self._pages_for_life(req), req.seq.ctx
                owed[0] += max(0, life[0] - len(req.seq.pages))
                owed[1] += max(0, life[1] - (ctx.num_pages if ctx is not None else 0))
        return owed

    def _plan(self, touched) -> StepPlan | None:
        rt, K = self.rt, self.K
        kind = SPEC if self.spec and rt.gate.spec_on() else DECODE
        K = K if kind == SPEC else 1
        live = []
        want = [r for r in self.running if r.wants_step][: self.max_batch]
        # a joiner whose prefill is still in flight (its first token not collected) sits out this step while others
        # run: the step need not wait for its prefill, which then runs beside two steps rather than one. H200, trained
        # pair bf16, batch 16 DFlash, 64 requests: prefills on the step's stream 80.5-85.1k tok/s; on a second stream
        # beside the step before (which waited for them) 87.3-90.1k, 6.3-8.8 of their 21.5 ms hidden; sitting out, 90.2k
        # (median of 87.2 / 90.2 / 92.2k; two leases)
        ready = [r for r in want if r.seq.bonus is not None]
        for req in ready if ready and self.ex.ahead else want:
            seq = req.seq
            try:
                if self.ex.ahead and seq.ctx is not None:
                    seq.ctx.slide()  # only between launches: no step in flight reads a dropped row
                commit.reserve(seq, K, rt.kv_alloc, rt.sizes.page_size, ahead=req.ahead)
            except Exception as e:  # out of pages (or a fault): this request fails, the others run
                self._fault([req], e, touched)
                continue
            req.ahead += K
            req.inflight += 1
            live.append(req)
        if not live:
            return None
        return StepPlan(kind, K, pad_rows([r.seq for r in live]), reqs=live)

    def _collect(self, plan: StepPlan | Join, pending, touched) -> None:
        rt = self.rt
        reqs = [plan.req] if isinstance(plan, Join) else plan.reqs
        try:
            res = self.ex.collect(pending)
        except Exception as e:  # the launch's result is lost: every row of it fails
            self.ex.quiesce()
            for req in reqs:
                req.ahead -= plan.K if isinstance(plan, StepPlan) else 0
                self._landed(req)
            self._fault(reqs, e, touched)
            return
        if isinstance(plan, Join):
            self._landed(plan.req)
            if plan.req.status == RUNNING:  # else it left while its prefill was in flight
                plan.req.seq.bonus = int(res)
                self._emit(plan.req, [plan.req.seq.bonus], touched)
            return
        accepted = []
        ns, tokens = res.n.tolist(), res.tokens.tolist()  # Python ints at once, not a numpy scalar per token
        for b, req in enumerate(reqs):
            req.ahead -= plan.K
            self._landed(req)
            if req.status != RUNNING:
                continue  # left while this step was in flight: its rows are dropped
            try:
                self._finish_row(req, plan, res, b, ns[b], tokens[b], touched)
            except Exception as e:  # this row's host work (or the on_step hook) failed: it fails alone
                self._fault([req], e, touched)
                continue
            if plan.kind == SPEC:
                accepted.append(ns[b] - 1)
        if plan.kind == SPEC and accepted:
            rt.gate.record(sum(accepted) / len(accepted), plan.gamma)
        elif plan.kind == DECODE:
            rt.gate.tick()

    def _finish_row(self, req: Request, plan: StepPlan, res, b: int, n: int, tokens: list, touched) -> None:
        """Row b of a collected step: commit.finish of its n rows, then its new tokens."""
        # a request that steps again keeps the pages of its next step's worst case (at this width) rather than give
        # them back for the next plan to take straight back: 2 allocs + 1.5 frees per request and step otherwise.
        # `bench host`, batch 16 DFlash, 2-core Xeon, 6 alternating runs: 273-451 us a step (median ~418) -> 225-375
        # (median ~230). The admission sums stay exact: a request's pages owed (_pages_owed) fall as it holds more.
        keep = req.ahead + (plan.K if req.wants_step else 0)
        commit.finish(req.seq, n, self.rt.kv_alloc, self.rt.sizes.page_size, ahead=keep)
        new = tokens[:n]
        req.seq.bonus = new[-1]
        req.steps += 1
        if plan.kind == SPEC:
            req.accepted.append(n - 1)
        if self.on_step is not None:
            self.on_step(self.rt, req, plan, res, b)
        self._emit(req, new, touched)

    def _emit(self, req: Request, new: list[int], touched) -> None:
        """Append tokens, cut at max tokens / the first EOS; a request that is complete leaves."""
        eos = self.rt.eos
        for t in new:
            if len(req.tokens) >= req.max_new_tokens:
                break
            req.tokens.append(t)
            if t in eos:
                req.finish_reason = "eos"
                break
        touched.append(req)
        if req.finish_reason == "eos" or len(req.tokens) >= req.max_new_tokens:
            self.release(req, req.finish_reason or "length")
