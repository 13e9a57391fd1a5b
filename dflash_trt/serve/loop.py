"""`EngineLoop`: the one thread that owns the Runtime (it is not thread-safe) and drives its continuous batching.

HTTP handlers never touch the Runtime: they `submit()` a request's prompts (the loop queues them between two steps
and answers through a Future: the tracks, or the runtime's own refusal) and `abort()` tracks whose client left (the
loop releases them between steps: slot and pages back). After every step the loop hands each changed track's new
text to its sink (a callback the handler gave; called on this thread). A fault inside a step fails only the
requests it belongs to (the Engine reports it); any other exception in an iteration is logged and the loop goes on,
so no request can stop the server."""
from __future__ import annotations

import queue
import threading
import time
import traceback
from concurrent.futures import Future

from dflash_trt.api.engine import Engine
from dflash_trt.api.params import SamplingParams
from dflash_trt.log import progress


class QueueFull(RuntimeError):
    """More completions pending than --max-queue allows (the server answers 503)."""


class EngineLoop:
    def __init__(self, engine: Engine, metrics, max_queue: int = 64):
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        self.engine, self.metrics, self.max_queue = engine, metrics, max_queue
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._pending = 0  # completions submitted and not yet ended (the queue depth --max-queue bounds)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dflash-trt-engine", daemon=True)

    def start(self) -> "EngineLoop":
        self.metrics.snapshot(self.engine.rt, 0)
        self._thread.start()
        return self

    def close(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._cmds.put(("wake", None))
        self._thread.join(timeout)

    # ---- any thread ---------------------------------------------------------------------------
    def submit(self, prompts: list, params: SamplingParams, sink) -> Future:
        """Queue len(prompts) x params.n completions (all or none); the Future gives their tracks (prompt-major)
        or the error that refused them. QueueFull at once when they would pass max_queue."""
        k = len(prompts) * params.n
        with self._lock:
            if self._pending + k > self.max_queue:
                self.metrics.rejected(k)
                raise QueueFull(f"server busy: {self._pending} completions pending, this request adds {k} "
                                f"(max_queue={self.max_queue}); retry later")
            self._pending += k
        fut: Future = Future()
        self._cmds.put(("add", (prompts, params, sink, fut)))
        return fut

    def abort(self, tracks) -> None:
        """The client left: end these tracks between two steps (no-op for those that already ended)."""
        self._cmds.put(("abort", list(tracks)))

    # ---- the engine thread --------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._commands(block=not self.engine.has_work)
                if self.engine.has_work:
                    t0 = time.perf_counter()
                    changed, fault = self.engine.step()
                    self.metrics.step(time.perf_counter() - t0)
                    if fault is not None:
                        progress(f"serve: a step fault failed its requests: {type(fault).__name__}: {fault}")
                    for t in changed:
                        self._deliver(t)
                self.metrics.snapshot(self.engine.rt, self._pending)
            except Exception:  # a bug, not a request's refusal: log it, keep serving
                progress("serve: engine loop error (continuing):\n" + traceback.format_exc())

    def _commands(self, block: bool) -> None:
        try:
            cmd = self._cmds.get(timeout=0.5) if block else self._cmds.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, arg = cmd
            if kind == "add":
                self._add(*arg)
            elif kind == "abort":
                self._abort(arg)
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return

    def _add(self, prompts, params, sink, fut: Future) -> None:
        tracks = []
        try:
            for ids in prompts:
                for j in range(params.n):
                    t = self.engine.add(ids, params, j)
                    t.sink = sink
                    tracks.append(t)
        except Exception as err:  # refused before its steps: none of its completions stays queued
            for t in tracks:
                self.engine.abort(t)
            self._ended(len(prompts) * params.n)
            fut.set_exception(err)
            return
        fut.set_result(tracks)

    def _abort(self, tracks) -> None:
        for t in tracks:
            if not t.finished:
                self.engine.abort(t)
                self.metrics.finished(t)
                self._ended(1)

    def _deliver(self, t) -> None:
        delta, tokens = t.take_delta()
        if t.finished:
            self.metrics.finished(t)
            self._ended(1)
        if (delta or tokens or t.finished) and t.sink is not None:
            try:
                t.sink(t, delta, tokens)
            except Exception:  # the handler's event loop is gone (shutdown): nothing to tell
                pass

    def _ended(self, k: int) -> None:
        with self._lock:
            self._pending -= k
