"""The written contracts between the runtime, its executors, backends and devices (typing.Protocol, structural).

Every member the runtime (runtime.py), the scheduler (scheduler.py) and the executors read is named here, and every
backend, executor and device class declares every member of its protocol (class attributes carry the defaults), so a
missing one fails tests/test_interfaces.py instead of hiding behind a getattr default.

  Backend     what the runtime and the executors ask of a backend (numpy `run`, fused steps, capability flags)
  StepGraphs  what the fused device step (runtime/backends/torch_fused_step.FusedSteps) calls: one graph on device
              tensors
  Executor    how the runtime and the scheduler issue steps (host: synchronous; graph: steps in flight)
  Device      pools and the commit kernels (every device); StepDevice adds the step IO of the graph executor
numpy-free and torch-free: annotations only.
"""
from __future__ import annotations

from typing import Any, Callable, ContextManager, Optional, Protocol, runtime_checkable


@runtime_checkable
class Backend(Protocol):
    name: str
    """Short name of the backend (messages, snapshots)."""
    kv_dtype: str
    """dtype name of the KV / ctx pools its graphs read and write."""
    want_logits: bool
    """Whether run() returns the graphs' logits too (the host executor sets it while a step samples)."""
    concurrent_prefill: bool
    """Its kernels follow torch's current stream, so prefills may run on a second stream beside the steps."""
    any_prefill_width: bool
    """Its prefill step takes ids of any row width (engines are built for the chunk's only)."""
    fused_steps: Optional[Callable[[Any], Any]]
    """fused_steps(rt) -> the device-side steps (FusedSteps) over this backend, or None where it has none."""

    def run(self, graph: str, inputs: dict) -> dict:
        """Run ABI graph `graph` on `inputs` (ABI name -> array); returns its outputs by ABI name (numpy on the host)."""

    def step_widths(self) -> Optional[tuple]:
        """The verify widths K its graphs run (an export's), or None: any width (the runtime runs its default ones)."""

    def weights_id(self, which: str) -> Optional[str]:
        """The identity of the 'target' / 'drafter' weights in snapshots: 'checkpoint:<hash>', the same on every
        backend for one checkpoint ('params:<hash>' for modules not loaded from one); None where there are none."""


@runtime_checkable
class StepGraphs(Protocol):
    commits_decode_gdn: bool
    """Whether target_k1 takes a `gdn_commit` n [B] input and commits its GDN rows into the pool itself (the torch
    modules: one read and one write of the state a decode step); engines keep the ABI's read-only pools."""

    def run(self, graph: str, inputs: dict, want_logits: bool) -> dict:
        """Run ABI graph `graph` on device tensors `inputs` (ABI name -> tensor); its outputs as device tensors.
        Capturable: no host sync, no data-dependent shapes."""


@runtime_checkable
class Executor(Protocol):
    max_inflight: int
    """Steps left running after launch() returns (0: synchronous)."""
    runs_ahead: bool
    """Steps stay in flight after launch, so the host's view of a sequence lags the device (ctx windows slide
    only between launches)."""

    def launch(self, plan) -> Any:
        """Issue one step (batching.StepPlan, pages reserved); returns a pending handle for collect()."""

    def launch_prefill(self, seqs: list, chunks: list) -> list:
        """One prefill chunk of each sequence as one launch; a pending handle per sequence (collect: first token)."""

    def collect(self, pending) -> Any:
        """The result of a launch (waits for it): batching.StepResult, or a prefill row's first token
        (logprobs.FirstToken: an int with its logprobs, or None)."""

    def landed(self, pending) -> bool:
        """Whether collect(pending) would return without waiting."""

    def settle(self) -> None:
        """The prefill work issued so far has landed (pages of a failed prefill may go back)."""

    def quiesce(self) -> None:
        """After a launch or collect that raised: nothing of it still runs."""

    def zero_slot(self, slot: int) -> None:
        """A fresh sequence's GDN and conv state: zeros, ordered before its prefill."""

    def adopt(self, seq) -> None:
        """A sequence whose state was put into the pools from outside (restore) becomes steppable."""


@runtime_checkable
class Device(Protocol):
    name: str
    """Short name of the device (snapshots, messages)."""
    graph_steps: bool
    """Whether the graph executor captures one CUDA graph per step key on it (False: eager steps or host steps)."""

    def zeros(self, shape, dtype) -> Any:
        """A zeroed pool of `shape` and dtype name `dtype`, in this device's array kind."""

    def pad_rows(self, x, rows: int) -> Any:
        """x [B, T, ...] -> [B, rows, ...] zero-padded."""

    def to_host(self, a) -> Any:
        """A numpy copy of device array `a`."""

    def from_host(self, a) -> Any:
        """numpy `a` as this device's array kind."""

    def gather_rows(self, pool, block_table_row, start, count) -> Any:
        """Logical rows [start, start + count) of one sequence's pages, [L, 2, count, H, hd] (numpy)."""

    def on_stream(self) -> ContextManager:
        """The context in which a step's work is issued (the device's stream; a no-op on the host)."""

    def zero_slot(self, pool, slot: int) -> None:
        """pool[:, slot] = 0, ordered on this device's stream."""

    def kv_write(self, pool, rows, block_table, start, n) -> None:
        """Commit n[b] KV rows per sequence at logical rows start[b].. of its pages (in place)."""

    def gdn_fold(self, pool, slots, k, v, g, beta, n) -> None:
        """Fold n[b] rows of gated delta updates into the GDN state of slot[b] (in place)."""

    def gdn_set(self, pool, slots, state, n) -> None:
        """GDN state of slot[b] <- state[:, b] where n[b] > 0 (prefill)."""

    def conv_roll(self, pool, slots, cols, n) -> None:
        """Roll the conv window of slot[b] by n[b] columns of `cols` (in place)."""


@runtime_checkable
class StepDevice(Device, Protocol):
    device: Any
    """The torch device its tensors live on."""
    stream_handle: int
    """The raw stream its launches go to (TensorRT's enqueue; 0 where there is none)."""

    def device_buffer(self, numel: int) -> Any:
        """A zeroed int64 device buffer of numel elements."""

    def staging(self, numel: int) -> Any:
        """A (pinned) host int64 buffer: the source / target of a step's copies."""

    def h2d(self, dst, src) -> None:
        """Async copy of host `src` into device `dst` on this device's stream."""

    def d2h(self, dst, src) -> None:
        """Async copy of device `src` into host `dst` on this device's stream."""

    def new_event(self, timing: bool = False) -> Any:
        """A new event (with timing: elapsed_ms may read it)."""

    def record(self, event) -> None:
        """Record `event` on this device's stream."""

    def wait(self, event) -> None:
        """The host waits for `event`."""

    def done(self, event) -> bool:
        """Whether the work before `event` has finished (no wait)."""

    def synchronize(self) -> None:
        """The host waits for this device's stream."""

    def sync_all(self) -> None:
        """The host waits for the whole device (work on other streams included)."""

    def side_stream(self) -> "StepDevice":
        """This device on a second stream (the same memory)."""

    def stream_wait(self, event) -> None:
        """Work queued here from now on starts after `event` (of another stream); the host does not wait."""

    def capture(self, fn, hook=None) -> Optional[Callable[[], None]]:
        """A replay callable of fn() captured as a graph, or None (fn then runs eagerly)."""


class BackendDefaults:
    """The Backend members a backend (or a wrapper of one) may leave at their defaults."""
    name = "?"
    want_logits = False
    concurrent_prefill = False
    any_prefill_width = False
    fused_steps = None
    inner = None
    """The backend a wrapper (test drafters, recorders) holds: the weights are its."""

    def weights_id(self, which: str):
        return self.inner.weights_id(which) if self.inner is not None else None

    def step_widths(self):
        return self.inner.step_widths() if self.inner is not None else None
