"""The speculative-decoding runtime: owns the pools and sequences, runs steps through an executor, and
funnels every state change through the one commit path (runtime/commit.py). numpy + a Device; no torch
or tensorrt here (the GPU executor is imported lazily from runtime/backends/).

Step kinds (all end in a commit of n rows):
  prefill  target_prefill over chunks of the prompt (n = valid rows of the chunk)
  decode   target_k1 on the bonus token (n = 1) — also the gated-off path, ctx still appended
  spec     drafter_block -> target_k{γ+1} -> greedy accept -> n = accepted + 1

Executors: `HostStepExecutor` (graphs through backend.run, accept on the host; every backend, CPU) and
`GraphStepExecutor` (torch backend on a CudaDevice: one CUDA graph per step kind, K and batch bucket,
accept and commit on the device, one step kept in flight). Both are driven by the same scheduler.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from dflash_trt.abi import PoolSizes, ctx_block_table_width, pool_specs
from dflash_trt.runtime import commit, snapshot
from dflash_trt.runtime.batching import DECODE, SPEC, StepPlan, pad_rows
from dflash_trt.runtime.ctx import CtxWindow
from dflash_trt.runtime.devices.host import HostDevice
from dflash_trt.runtime.gating import Gate
from dflash_trt.runtime.host_step import HostStepExecutor
from dflash_trt.runtime.pools import BlockAllocator, SlotPool
from dflash_trt.runtime.scheduler import FAILED, Scheduler
from dflash_trt.runtime.sequence import Sequence

LOOKAHEAD_ROWS = 16  # the widest verify step: the extra ctx rows reserved while one step is in flight


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


def _default_executor(rt, backend, device):
    """The device's CUDA-graph executor when the device offers graphs and the backend has fused steps."""
    if getattr(device, "graph_steps", False) and getattr(backend, "fused_steps", None) is not None:
        from dflash_trt.runtime.backends.graph_executor import GraphStepExecutor

        return GraphStepExecutor(rt)
    return HostStepExecutor(rt)


class Runtime:
    def __init__(self, backend, target_cfg, drafter_cfg=None, sizes: PoolSizes = PoolSizes(),
                 device=None, gate: Gate | None = None, executor=None):
        """executor: None (the device's default), "host", "graph", or a factory taking the runtime."""
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
        self.gate = gate or Gate()
        self._next_id = 0
        self.eos = set(target_cfg.eos_token_ids)
        if executor == "host":
            self.executor = HostStepExecutor(self)
        elif executor == "graph":
            from dflash_trt.runtime.backends.graph_executor import GraphStepExecutor

            self.executor = GraphStepExecutor(self)
        elif callable(executor):
            self.executor = executor(self)
        else:
            self.executor = _default_executor(self, backend, self.device)
        # a ctx window also holds the rows reserved for the steps in flight (ONNX graphs: the ABI width)
        self.ctx_append = sizes.max_append + LOOKAHEAD_ROWS * self.executor.max_inflight
        self.ctx_blocks = ctx_block_table_width(sizes.ctx_window, sizes.page_size, self.ctx_append)
        self.scheduler: Scheduler | None = None

    # ---- sequence lifetime ----------------------------------------------------------------
    def check_prompt(self, prompt) -> None:
        if len(prompt) == 0:
            raise CapacityError("empty prompt: at least one token is needed")
        bad = [t for t in prompt if not 0 <= int(t) < self.tcfg.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} outside the vocabulary [0, {self.tcfg.vocab_size})")

    def check_request(self, prompt, max_new_tokens: int, K: int) -> None:
        """Bad input fails here, before any pool is touched."""
        self.check_prompt(prompt)
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        need = len(prompt) + max_new_tokens + K * (1 + self.executor.max_inflight)
        if need > self.sizes.max_seq_len:
            raise CapacityError(
                f"prompt of {len(prompt)} tokens + {max_new_tokens} new tokens (+ verify width) needs {need} "
                f"positions; this runtime holds max_seq_len={self.sizes.max_seq_len}"
            )

    def add_sequence(self, prompt: list[int]) -> Sequence:
        self.check_prompt(prompt)
        slot = self.slots.alloc()
        for name in ("gdn_pool", "conv_pool"):  # a fresh sequence starts from zero state
            zero = getattr(self.device, "zero_slot", None)
            if zero is not None:
                zero(self.pools[name], slot)
            else:
                self.pools[name][:, slot] = 0
        ctx = None
        if self.dcfg is not None:
            ctx = CtxWindow(self.sizes.ctx_window, self.sizes.page_size, self.dkv_alloc, self.ctx_append,
                            auto_slide=not self.executor.ahead)
        seq = Sequence(self._next_id, [int(t) for t in prompt], slot, self.sizes.max_blocks, ctx=ctx)
        self._next_id += 1
        return seq

    def release(self, seq: Sequence) -> None:
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
        return snapshot.save_sequence(self, seq, path, extra)

    def restore_sequence(self, path: str) -> Sequence:
        """A live sequence in the state saved at `path`, on fresh pages and slot; continues token-identically.
        Refuses a snapshot of another model/config (SnapshotMismatch names the fields)."""
        seq = snapshot.restore_sequence(self, path)
        self.executor.adopt(seq)  # the GPU executor keeps seq_len / bonus on the device too
        return seq

    # ---- steps (each: reserve -> executor -> finish) ---------------------------------------
    def prefill(self, seq: Sequence) -> int:
        """The prompt through target_prefill chunks; sets and returns seq.bonus, the first new token."""
        C, ps = self.sizes.prefill_chunk, self.sizes.page_size
        toks = seq.tokens
        pending = None
        for lo in range(0, len(toks), C):
            chunk = toks[lo:lo + C]
            if self.executor.ahead and seq.ctx is not None:
                seq.ctx.slide()
            commit.reserve(seq, len(chunk), self.kv_alloc, ps)
            pending = self.executor.launch_prefill(seq, chunk)
            commit.finish(seq, len(chunk), self.kv_alloc, ps)  # n is the chunk's length: known on the host
        seq.bonus = int(self.executor.collect(pending))
        return seq.bonus

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
        return self._run_step(DECODE, seqs, 1)[0]

    def spec_step(self, seqs, gamma: int) -> tuple[list[list[int]], list[int]]:
        """propose -> verify K=γ+1 -> greedy accept -> commit. Returns (new tokens, accepted counts)."""
        self._check_gamma(gamma)
        new, res = self._run_step(SPEC, seqs, gamma + 1)
        return new, [int(n) - 1 for n in res.n[: len(seqs)]]

    def _check_gamma(self, gamma: int) -> None:
        Bs = self.dcfg.block_size
        if not 1 <= gamma <= Bs - 1:
            raise ValueError(f"gamma {gamma} outside [1, block_size-1={Bs - 1}]")

    # ---- continuous batching (one K per batch) -----------------------------------------------
    def add_request(self, prompt, max_new_tokens: int, gamma: int | None = None, spec: bool = True):
        """Queue a request for batched decoding; step() advances every running request by one step."""
        use_spec = spec and self.dcfg is not None
        gamma = gamma if gamma is not None else (self.dcfg.block_size - 1 if use_spec else 0)
        if use_spec:
            self._check_gamma(gamma)
        sch = self.scheduler
        if sch is None or not sch.has_work:
            sch = self.scheduler = Scheduler(self, gamma, use_spec)
        elif (sch.spec, sch.gamma) != (use_spec, gamma if use_spec else 0):
            raise ValueError(f"this batch decodes with spec={sch.spec} gamma={sch.gamma}; a request with "
                             f"spec={use_spec} gamma={gamma} must wait until it drains")
        return sch.add(prompt, max_new_tokens)

    def step(self):
        """One scheduler step; returns the requests that got tokens, finished or failed."""
        return self.scheduler.step() if self.scheduler is not None else []

    @property
    def has_work(self) -> bool:
        """Requests waiting, running or with a step in flight."""
        return self.scheduler is not None and self.scheduler.has_work

    def release_request(self, req) -> None:
        if self.scheduler is not None:
            self.scheduler.release(req)

    # ---- one request ------------------------------------------------------------------------
    def generate(self, prompt: list[int], max_new_tokens: int, gamma: int | None = None,
                 spec: bool = True, on_step=None) -> tuple[list[int], GenStats]:
        """Greedy generation of one sequence; spec decoding when a drafter is present and spec=True.
        The sequence's pages and slot are always given back, also when a step raises.
        on_step(rt, seq) runs after each finished step."""
        use_spec = spec and self.dcfg is not None
        gamma = gamma if gamma is not None else (self.dcfg.block_size - 1 if use_spec else 0)
        if use_spec:
            self._check_gamma(gamma)
        sch = Scheduler(self, gamma, use_spec, max_batch=1)
        if on_step is not None:
            sch.on_step = lambda rt, req, plan, res, b: on_step(rt, req.seq)
        req = sch.add(prompt, max_new_tokens)
        self.gate.reset()
        t0 = time.perf_counter()
        try:
            while sch.has_work:
                sch.step()
        finally:
            for r in list(sch.running) + list(sch.waiting):
                sch.release(r)
            while sch.inflight:  # a raising step may leave one in flight: let it land
                self.executor.collect(sch.inflight.popleft()[1])
        seconds = time.perf_counter() - t0
        if req.status == FAILED:
            raise req.error
        stats = GenStats(prompt_tokens=len(prompt), new_tokens=len(req.tokens), target_steps=req.steps,
                         spec_steps=len(req.accepted), accepted=list(req.accepted), seconds=seconds)
        return req.tokens, stats
