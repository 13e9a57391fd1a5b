"""The speculative-decoding runtime: owns the pools and sequences, runs steps through an executor, and
funnels every state change through the one commit path (runtime/commit.py). numpy + a Device; no torch
or tensorrt here (the GPU executor is imported lazily from runtime/backends/).

Step kinds (all end in a commit of n rows):
  prefill  target_prefill over chunks of the prompt (n = valid rows of the chunk)
  decode   target_k1 on the bonus token (n = 1) — also a step whose chosen width is 1 (runtime.draft_length), ctx
           still appended
  spec     drafter_block -> target_k{γ+1} -> greedy accept (T > 0: rejection sampling) -> n = accepted + 1

Executors (runtime/executors.py picks one): `HostStepExecutor` (graphs through backend.run, accept on the host;
every backend, CPU) and `GraphStepExecutor` (fused steps on a CudaDevice: one CUDA graph per step kind, K and batch
bucket, accept and commit on the device, one step kept in flight). Both are driven by the same scheduler.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from dflash_trt.abi import DEFAULT_KS, MAX_K, PoolSizes, ctx_block_table_width, pool_specs
from dflash_trt.runtime import commit, snapshot
from dflash_trt.runtime.batching import BUCKETS, DECODE, PREFILL_BATCH, SPEC, StepPlan, pad_rows
from dflash_trt.runtime.ctx import CtxWindow
from dflash_trt.runtime.devices.host import HostDevice
from dflash_trt.runtime.draft_length import DraftLength, GammaError, MeasuredCosts, StepCosts, check_gamma  # noqa: F401
from dflash_trt.runtime.executors import choose_executor
from dflash_trt.runtime.pools import BlockAllocator, PoolExhausted, SlotPool
from dflash_trt.runtime.sampling import SamplingParams
from dflash_trt.runtime.scheduler import FAILED, Request, Scheduler
from dflash_trt.runtime.sequence import Sequence, SequenceError, token_ids

LOOKAHEAD_ROWS = MAX_K  # the widest verify step: the extra ctx rows reserved while one step is in flight


class CapacityError(ValueError):
    """A request does not fit the runtime's sizes (prompt + new tokens over max_seq_len, ...)."""


@dataclass
class GenStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    target_steps: int = 0  # target decode/verify launches after prefill
    spec_steps: int = 0
    accepted: list = field(default_factory=list)  # accepted drafts per spec step
    seconds: float = 0.0

    @property
    def tau(self) -> float:
        """Acceptance length: tokens gained per spec (verify) step, accepted drafts + bonus."""
        return (sum(self.accepted) + len(self.accepted)) / max(len(self.accepted), 1)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0


class Runtime:
    def __init__(self, backend, target_cfg, drafter_cfg=None, sizes: PoolSizes = PoolSizes(),
                 device=None, step_costs: StepCosts | None = None, executor=None):
        """executor: a factory taking the runtime (e.g. HostStepExecutor), or None: executors.choose_executor.
        step_costs: the time of a step per (width, batch bucket) that auto draft length weighs (None: MeasuredCosts,
        which the graph executor fills with each step's measured time as it builds it; the default cost model until
        then and on the host path)."""
        self.backend = backend
        self.tcfg, self.dcfg, self.sizes = target_cfg, drafter_cfg, sizes
        self.device = device or HostDevice()
        self.pools = {
            name: self.device.zeros(shape, dtype)
            for name, (shape, dtype) in pool_specs(target_cfg, drafter_cfg, sizes, backend.kv_dtype).items()
        }
        self.kv_alloc = BlockAllocator(sizes.kv_blocks, "target kv pages")
        self.dkv_alloc = BlockAllocator(sizes.dkv_blocks, "drafter ctx pages")
        self.slots = SlotPool(sizes.max_seqs, "sequence state slots")
        self.step_costs = step_costs or MeasuredCosts()
        self._next_id = 0
        self.eos = set(target_cfg.eos_token_ids)
        self.executor = (executor or choose_executor)(self)
        # a ctx window also holds the rows reserved for the steps in flight; room for one is always kept, so
        # every executor with at most one step in flight uses the exported graphs' width (abi.max_ctx_blocks)
        self.ctx_append = sizes.max_append + LOOKAHEAD_ROWS * max(1, self.executor.max_inflight)
        self.ctx_blocks = ctx_block_table_width(sizes.ctx_window, sizes.page_size, self.ctx_append,
                                                sizes.max_seq_len)
        self.scheduler: Scheduler | None = None

    # ---- sequence lifetime ----------------------------------------------------------------
    def check_prompt(self, prompt) -> list[int]:
        """The prompt as Python ints; TokenIdError for a non-integer or out-of-vocabulary id (never truncated)."""
        ids = token_ids(prompt, self.tcfg.vocab_size)
        if len(ids) == 0:
            raise CapacityError("empty prompt: at least one token is needed")
        return ids

    def check_request(self, prompt, max_new_tokens: int, K: int) -> list[int]:
        """Bad input fails here, before any pool is touched; returns the prompt as Python ints."""
        ids = self.check_prompt(prompt)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)):
            raise ValueError(f"max_new_tokens must be an integer, got {max_new_tokens!r}")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        need = len(ids) + max_new_tokens + K * (1 + self.executor.max_inflight)
        if need > self.sizes.max_seq_len:
            raise CapacityError(
                f"prompt of {len(ids)} tokens + {max_new_tokens} new tokens (+ verify width) needs {need} "
                f"positions; this runtime holds max_seq_len={self.sizes.max_seq_len}"
            )
        return ids

    def _check_seq(self, seq, api: str = "step") -> None:
        """A handle this runtime may act on: its own, not released, not driven by the scheduler."""
        if not isinstance(seq, Sequence):
            raise SequenceError(f"{api}: expected a Sequence of this runtime, got {type(seq).__name__}")
        if seq.owner is not self:
            raise SequenceError(f"{api}: sequence {seq.seq_id} belongs to another Runtime (its pools hold its state)")
        if not seq.live:
            raise SequenceError(f"{api}: sequence {seq.seq_id} was released; add a new sequence")
        if seq.managed and api != "_scheduler":
            raise SequenceError(f"{api}: sequence {seq.seq_id} is a scheduler request's; use step()/release_request()")

    def _check_batch(self, seqs, api: str) -> list:
        """Every handle of a step validated before any page is reserved or any row written."""
        seqs = list(seqs)
        if not seqs:
            raise SequenceError(f"{api}: no sequences given")
        if len(seqs) > BUCKETS[-1]:
            raise SequenceError(f"{api}: a step holds at most {BUCKETS[-1]} sequences, got {len(seqs)}")
        seen = set()
        for s in seqs:
            self._check_seq(s, api)
            if id(s) in seen:
                raise SequenceError(f"{api}: sequence {s.seq_id} appears twice in one batch")
            seen.add(id(s))
            if s.bonus is None:
                raise SequenceError(f"{api}: sequence {s.seq_id} has not been prefilled; call prefill() first")
        return seqs

    def add_sequence(self, prompt: list[int], sampling: SamplingParams | None = None) -> Sequence:
        """A new sequence; `sampling` (None: greedy) decides its tokens in every step it takes."""
        if sampling is not None and not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        sampling = sampling.resolved() if sampling is not None else None
        ids = self.check_prompt(prompt)
        if self.sizes.max_seq_len < len(ids) + 1:  # prefill() could never finish: refuse before taking a slot
            raise CapacityError(f"prompt of {len(ids)} tokens does not fit max_seq_len={self.sizes.max_seq_len}")
        slot = self.slots.alloc()
        try:
            self.executor.zero_slot(slot)  # a fresh sequence starts from zero state (on the stream of its prefill)
        except BaseException:
            self.slots.free(slot)
            raise
        seq = Sequence(self._next_id, ids, slot, self.sizes.max_blocks, ctx=self._new_ctx(), owner=self,
                       sampling=sampling)
        self._next_id += 1
        return seq

    def _new_ctx(self):
        if self.dcfg is None:
            return None
        return CtxWindow(self.sizes.ctx_window, self.sizes.page_size, self.dkv_alloc, self.ctx_append,
                         auto_slide=not self.executor.runs_ahead, max_seq_len=self.sizes.max_seq_len)

    def release(self, seq: Sequence) -> None:
        """Give back seq's pages and slot. Releasing a released sequence again is a no-op; a foreign or
        scheduler-owned one is refused (SequenceError) before anything changes."""
        if isinstance(seq, Sequence) and seq.owner is self and not seq.live:
            return
        self._check_seq(seq, "release")
        if seq.bonus is None and seq.seq_len:  # launch_prefills() without its collect: that work lands first
            self.executor.settle()
        self._release(seq)

    def _release(self, seq: Sequence) -> None:
        if seq.slot < 0:
            return
        if seq.pages:
            self.kv_alloc.free(seq.pages)
        seq.pages = []
        if seq.ctx is not None:
            seq.ctx.release()
        self.slots.free(seq.slot)
        seq.slot = -1

    def save_sequence(self, seq: Sequence, path: str, extra: dict | None = None) -> str:
        """Snapshot seq's state (KV rows, GDN/conv slot, ctx rows + positions, tokens, bonus) between steps
        to the directory `path` (safetensors + JSON, written atomically); runtime/snapshot.py has the format."""
        if not (isinstance(seq, Sequence) and not seq.live):  # a released one: snapshot's SnapshotError says so
            self._check_seq(seq, "save_sequence")
        return snapshot.save_sequence(self, seq, path, extra)

    def restore_sequence(self, path: str) -> Sequence:
        """A live sequence in the state saved at `path`, on fresh pages and slot; continues token-identically.
        Refuses a snapshot of another model/config (SnapshotMismatch names the fields)."""
        seq = snapshot.restore_sequence(self, path)
        self.executor.adopt(seq)  # the GPU executor keeps seq_len / bonus on the device too
        return seq

    # ---- steps (each: reserve -> executor -> finish) ---------------------------------------
    def prefill(self, seq: Sequence, _api: str = "prefill") -> int:
        """The prompt through target_prefill chunks; sets and returns seq.bonus, the first new token.
        Once per sequence. A prefill that fails part-way (PoolExhausted) puts the sequence back as
        add_sequence left it (pages and ctx pages given back, state slot zeroed), so a retry is exact."""
        pending = self.launch_prefills([seq], _api)[0]
        if isinstance(pending, Exception):
            raise pending
        try:
            bonus = int(self.executor.collect(pending))
        except BaseException:
            self._rewind(seq)
            raise
        seq.bonus = bonus
        return seq.bonus

    def launch_prefills(self, seqs: list[Sequence], _api: str = "prefill") -> list:
        """prefill() of several sequences without the wait. Chunk i of every prompt that has one goes out in
        launches of up to PREFILL_BATCH rows (requests that join together share them: one launch, not one each);
        each chunk's rows are committed on the host. Returns per sequence the last chunk's pending result
        (executor.collect gives the first token), or the PoolExhausted / ValueError that failed it: that sequence
        alone is put back as add_sequence left it, the others go on. The scheduler collects the results with
        the steps in flight, so requests that join do not drain them; seq.bonus stays None until then (a device
        executor keeps the token itself: the next step may already run on it)."""
        for seq in seqs:
            self._check_seq(seq, _api)
            if seq.bonus is not None or seq.seq_len:
                raise SequenceError(f"prefill: sequence {seq.seq_id} was already prefilled ({seq.seq_len} rows)")
        out: list = [None] * len(seqs)  # per sequence: its last chunk's pending result, or what failed it
        try:
            C = self.sizes.prefill_chunk
            for lo in range(0, max((len(s.tokens) for s in seqs), default=0), C):
                due = [i for i, s in enumerate(seqs) if not isinstance(out[i], Exception) and lo < len(s.tokens)]
                for g in range(0, len(due), PREFILL_BATCH):
                    for i in due[g:g + PREFILL_BATCH]:
                        out[i] = self._reserve_chunk(seqs[i], lo)  # None, or what failed it
                    group = [i for i in due[g:g + PREFILL_BATCH] if out[i] is None]
                    if group:
                        for i, r in zip(group, self._launch_chunk([seqs[i] for i in group], lo)):
                            out[i] = r
        except BaseException:
            for s, r in zip(seqs, out):
                if not isinstance(r, Exception):  # a failed one was put back already
                    self._rewind(s)
            raise
        return out

    def _reserve_chunk(self, seq: Sequence, lo: int) -> Exception | None:
        """Pages for rows [lo, lo + chunk) of seq's prompt; a sequence that cannot get them is put back as
        add_sequence left it and its error returned (it fails alone)."""
        try:
            if self.executor.runs_ahead and seq.ctx is not None:
                seq.ctx.slide()
            commit.reserve(seq, len(seq.tokens[lo:lo + self.sizes.prefill_chunk]), self.kv_alloc, self.sizes.page_size)
        except (PoolExhausted, ValueError) as e:
            self._rewind(seq)
            return e
        return None

    def _launch_chunk(self, seqs: list[Sequence], lo: int) -> list:
        """Rows [lo, lo + chunk) of each of seqs (pages reserved) as one launch, then committed on the host;
        per sequence its pending result or the error that failed it. A launch the executor refuses (PoolExhausted
        / ValueError, e.g. a sampling row on graphs without logits) wrote nothing: with several rows, each is
        retried alone, so only the sequences that cause it fail (each put back as add_sequence left it). Any other
        exception may have left part of the launch's work behind: every sequence of the launch fails with it."""
        C, ps = self.sizes.prefill_chunk, self.sizes.page_size
        chunks = [s.tokens[lo:lo + C] for s in seqs]
        try:
            pending = self.executor.launch_prefill(seqs, chunks)
        except Exception as e:
            if isinstance(e, (PoolExhausted, ValueError)) and len(seqs) > 1:
                return [self._launch_chunk([s], lo)[0] for s in seqs]
            for s in seqs:
                self._rewind(s)
            return [e] * len(seqs)
        for s, chunk in zip(seqs, chunks):
            commit.finish(s, len(chunk), self.kv_alloc, ps)  # n = the chunk's length
        return list(pending)

    def _rewind(self, seq: Sequence) -> None:
        """Back to the fresh state of add_sequence (same slot): the rows a failed prefill committed are dropped."""
        self.executor.settle()  # its earlier chunks may still run beside the steps: they land before the pages go back
        if seq.pages:
            self.kv_alloc.free(seq.pages)
        seq.pages = []
        if seq.ctx is not None:
            seq.ctx.release()
        seq.ctx = self._new_ctx()
        seq.seq_len, seq.bonus = 0, None
        self.executor.zero_slot(seq.slot)

    def _run_step(self, kind: str, seqs, K: int):
        ps = self.sizes.page_size
        commit.reserve_batch(seqs, [K] * len(seqs), self.kv_alloc, ps)
        res = self.executor.collect(self.executor.launch(StepPlan(kind, K, pad_rows(seqs))))
        new = []
        for b, s in enumerate(seqs):
            n = int(res.n[b])
            commit.finish(s, n, self.kv_alloc, ps)
            new.append([int(t) for t in res.tokens[b, :n]])
            s.bonus = new[-1][-1]
        return new, res

    def decode_step(self, seqs) -> list[list[int]]:
        """Plain K=1 step on each sequence's bonus token; returns the new token per sequence."""
        return self._run_step(DECODE, self._check_batch(seqs, "decode_step"), 1)[0]

    def spec_step(self, seqs, gamma: int) -> tuple[list[list[int]], list[int]]:
        """propose -> verify K=γ+1 -> accept (greedy, or rejection sampling) -> commit. Returns (new tokens, accepted counts)."""
        if self.dcfg is None:
            raise SequenceError("spec_step: this runtime has no drafter; use decode_step")
        seqs = self._check_batch(seqs, "spec_step")
        if self._check_gamma(gamma) is None:
            raise GammaError("spec_step runs one width: gamma must be an integer, not auto")
        new, res = self._run_step(SPEC, seqs, gamma + 1)
        return new, [int(n) - 1 for n in res.n[: len(seqs)]]

    def _check_gamma(self, gamma) -> int | None:
        return check_gamma(gamma, self.dcfg.block_size)

    def verify_widths(self) -> list[int]:
        """The step widths K this runtime can run: the exported ones for a backend of an export, else the default
        widths (each a compiled / captured graph per batch bucket on a device); at most the drafter's block."""
        ks = self.backend.step_widths() or DEFAULT_KS
        top = self.dcfg.block_size if self.dcfg is not None else 1
        return sorted({1} | {int(k) for k in ks if int(k) <= top})

    def draft_length(self, gamma: int | None) -> DraftLength:
        """A batch's step width policy: gamma fixed (K = gamma + 1), or None: auto over verify_widths()."""
        return DraftLength(self.verify_widths(), self.step_costs, fixed=None if gamma is None else gamma + 1)

    # ---- continuous batching (one K per batch) -----------------------------------------------
    def add_request(self, prompt, max_new_tokens: int, gamma: int | str | None = None, spec: bool = True, *,
                    temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
                    seed: int | None = None, ignore_eos: bool = False, logprobs: int | None = None):
        """Queue a request for batched decoding; step() advances every running request by one step.
        temperature > 0 samples (top_k / top_p / min_p filter, seed reproduces; runtime/sampling.py); greedy and
        sampling requests share batches. Bad sampling parameters raise SamplingError before anything is queued.
        ignore_eos: the request runs to max_new_tokens through EOS tokens. logprobs k: req.logprobs gets each
        token's logprob and top k under the target's raw distribution (runtime/logprobs.py)."""
        sp = SamplingParams(temperature, top_k, top_p, min_p, seed, logprobs)
        use_spec = spec and self.dcfg is not None
        gamma = self._check_gamma(gamma) if use_spec else 0
        sch = self.scheduler
        if sch is None or not sch.has_work:
            sch = self.scheduler = Scheduler(self, gamma, use_spec)
        elif (sch.spec, sch.gamma) != (use_spec, gamma if use_spec else 0):
            raise ValueError(f"this batch decodes with spec={sch.spec} gamma={sch.gamma}; a request with "
                             f"spec={use_spec} gamma={gamma} must wait until it drains")
        return sch.add(prompt, max_new_tokens, sp, ignore_eos=ignore_eos)

    def step(self):
        """One scheduler step; returns the requests that got tokens, finished or failed. An exception inside it (a
        fault, not a request's refusal) fails the requests it belongs to (state "failed", .error set, slot and pages
        freed) and is re-raised once the step's other requests have moved on; the next step() continues."""
        return self.scheduler.step() if self.scheduler is not None else []

    @property
    def has_work(self) -> bool:
        """Requests waiting, running or with a step in flight."""
        return self.scheduler is not None and self.scheduler.has_work

    def release_request(self, req) -> None:
        """Let a request leave now. A request of another runtime is refused (SequenceError); one of this
        runtime that already left is a no-op."""
        if not isinstance(req, Request) or req.rt is not self:
            raise SequenceError(f"release_request: not a request of this runtime ({type(req).__name__})")
        if self.scheduler is not None:
            self.scheduler.release(req)

    # ---- one request ------------------------------------------------------------------------
    def generate(self, prompt: list[int], max_new_tokens: int, gamma: int | str | None = None,
                 spec: bool = True, on_step=None, *, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 min_p: float = 0.0, seed: int | None = None) -> tuple[list[int], GenStats]:
        """Generation of one sequence; spec decoding when a drafter is present and spec=True. temperature 0:
        greedy; > 0: sampling (top_k / top_p / min_p, seed: same seed -> same tokens) with speculative rejection
        sampling, so DFlash keeps the target's distribution exactly. The sequence's pages and slot are always
        given back, also when a step raises. on_step(rt, seq) runs after each finished step."""
        sp = SamplingParams(temperature, top_k, top_p, min_p, seed)
        use_spec = spec and self.dcfg is not None
        gamma = self._check_gamma(gamma) if use_spec else 0
        sch = Scheduler(self, gamma, use_spec, max_batch=1)
        if on_step is not None:
            sch.on_step = lambda rt, req, plan, res, b: on_step(rt, req.seq)
        req = sch.add(prompt, max_new_tokens, sp)
        t0 = time.perf_counter()
        try:
            while sch.has_work:
                sch.step()
        finally:
            for r in list(sch.running) + list(sch.waiting):
                sch.release(r)
            sch.drain()  # a raising step may leave one in flight: let it land
        seconds = time.perf_counter() - t0
        if req.status == FAILED:
            raise req.error
        stats = GenStats(prompt_tokens=len(prompt), new_tokens=len(req.tokens), target_steps=req.steps,
                         spec_steps=len(req.accepted), accepted=list(req.accepted), seconds=seconds)
        return req.tokens, stats
