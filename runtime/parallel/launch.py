"""One process per rank: `run_parallel(fn, world, args)` spawns `world` processes (torch.multiprocessing, spawn start
method), joins them into one process group (gloo on CPU; NCCL on CUDA, one GPU per rank, not yet run on a multi-GPU
machine) and runs fn(*args) on every rank; rank 0's return value comes back.

Scheduling across ranks: every rank runs the same deterministic scheduler on the same inputs (the same prompts,
sampling parameters and seeds). The sharded lm_head all-gathers the full logits, so every rank picks the same
tokens, accepts the same drafts and plans the same next step: the step sequences, and with them the collectives,
line up without a rank-0 broadcast of each plan (one fewer collective per step, nothing to serialise). That holds
for schedulers whose decisions depend only on their inputs and the tokens; a wall-clock-driven decision (a deadline,
a timing-based gate) would have to be broadcast from rank 0 instead.

Failure: every collective carries the group's timeout, so a rank waiting on a peer that hangs raises instead of
waiting forever; a rank that raises ends the run on every rank (spawn terminates the others) and run_parallel raises
ParallelError naming the rank and its error.
"""
from __future__ import annotations

import datetime
import os
import pickle
import socket
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT_S = 300.0


class ParallelError(RuntimeError):
    """A rank of a parallel run failed; the message names the rank and its error."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join_group(rank: int, world: int, port: int, backend: str, timeout_s: float = TIMEOUT_S) -> None:
    """This process joins the group as `rank` (its CUDA device or its share of the CPU cores set first)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if backend == "nccl":
        torch.cuda.set_device(rank)
    else:  # the CPU cores shared out, not every rank on all of them
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s))


def abort_group_on_error(backend) -> None:
    """A graph that raises on this rank leaves the process group before the error reaches the scheduler: the peers'
    pending and later collectives then fail at once (instead of after the timeout, or against the collectives of
    this rank's next step), so the step's requests fail on every rank and no rank computes on mismatched data."""
    run = backend.run

    def guarded(graph, inputs):
        try:
            return run(graph, inputs)
        except BaseException:
            if dist.is_initialized():
                dist.destroy_process_group()
            raise

    backend.run = guarded


def _worker(rank: int, world: int, port: int, backend: str, timeout_s: float, fn, args, out: str) -> None:
    join_group(rank, world, port, backend, timeout_s)
    try:
        result = fn(*args)
        if rank == 0:
            with open(out, "wb") as f:
                pickle.dump(result, f)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def backend_for(device: str) -> str:
    """The collective backend of ranks computing on `device`: gloo for the CPU, NCCL for CUDA."""
    return "gloo" if device == "cpu" else "nccl"


def _backend(world: int, backend: str | None) -> str:
    if not isinstance(world, int) or world < 1:
        raise ValueError(f"world size {world!r}: at least 1 process")
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl" and torch.cuda.device_count() < world:
        raise ParallelError(f"{world} ranks on NCCL need {world} GPUs; {torch.cuda.device_count()} visible")
    return backend


def run_parallel(fn, world: int, args: tuple = (), backend: str | None = None, timeout_s: float = TIMEOUT_S):
    """fn(*args) on `world` spawned ranks of one process group (fn and args picklable: a module-level function);
    returns rank 0's result. backend: 'gloo' | 'nccl' (default: nccl where CUDA is, else gloo). timeout_s bounds
    every collective."""
    backend = _backend(world, backend)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank0.pkl")
        try:
            mp.spawn(_worker, args=(world, free_port(), backend, timeout_s, fn, args, out), nprocs=world, join=True)
        except mp.ProcessRaisedException as e:
            kind, _, msg = str(e).strip().splitlines()[-1].partition(": ")  # "pkg.mod.Type: message"
            last = f"{kind.rpartition('.')[2]}: {msg}"
            raise ParallelError(f"rank {e.error_index} of {world} failed: {last}") from None
        except mp.ProcessExitedException as e:
            raise ParallelError(f"rank {e.error_index} of {world} exited with code {e.exit_code}") from None
        with open(out, "rb") as f:
            return pickle.load(f)


def _failure(e: BaseException) -> tuple:
    """('err', the exception where it pickles (else None), 'Type: message')."""
    try:
        obj = pickle.loads(pickle.dumps(e))
    except Exception:  # noqa: BLE001  (an exception type that does not round-trip: its line still does)
        obj = None
    return "err", obj, f"{type(e).__name__}: {e}"


def _serve(rank: int, world: int, port: int, backend: str, timeout_s: float, make, args, conn) -> None:
    """A RankPool rank: build obj = make(*args), then answer (method, args, kwargs) messages until None or the pipe
    closes. Every rank answers ('ok', result (rank 0) or None, '') or _failure(its exception)."""
    try:
        join_group(rank, world, port, backend, timeout_s)
        obj = make(*args)
        conn.send(("ok", None, ""))
    except BaseException as e:  # noqa: BLE001  (reported to the parent, which ends every rank)
        conn.send(_failure(e))
        return
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            break
        if msg is None:
            break
        try:
            result = getattr(obj, msg[0])(*msg[1], **msg[2])
            conn.send(("ok", result if rank == 0 else None, ""))
        except BaseException as e:  # noqa: BLE001
            conn.send(_failure(e))
    if dist.is_initialized():
        dist.destroy_process_group()


class RankPool:
    """`world` long-lived spawned ranks of one process group, each holding make(*args); call(method, *args) runs
    obj.method(*args, **kwargs) on every rank with the same arguments (the same deterministic work, see the module doc) and
    returns rank 0's result. When every rank raised the same error (bad input every rank refuses alike, a request
    failed on all of them), that error is raised here and the ranks stay up; any other failure (some ranks only, a
    rank that exits) ends the pool: every rank is stopped and ParallelError names the failed ranks and their errors."""

    def __init__(self, world: int, make, args: tuple = (), backend: str | None = None, timeout_s: float = TIMEOUT_S):
        backend = _backend(world, backend)
        ctx = mp.get_context("spawn")
        port = free_port()
        self.world, self.conns, self.procs = world, [], []
        for rank in range(world):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_serve, args=(rank, world, port, backend, timeout_s, make, args, child),
                            daemon=True)
            p.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(p)
        self._collect()

    def call(self, method: str, *args, **kwargs):
        if not self.conns:
            raise ParallelError("the ranks were stopped (an earlier failure, or close())")
        for c in self.conns:
            try:
                c.send((method, args, kwargs))
            except OSError:  # a rank that exited: _collect names it
                pass
        return self._collect()

    def _collect(self):
        replies = []
        for rank, (c, p) in enumerate(zip(self.conns, self.procs)):
            while not c.poll(0.5) and p.is_alive():
                pass
            try:
                replies.append(c.recv())
            except (EOFError, OSError):
                replies.append(("err", None, f"exited with code {p.exitcode}"))
        failed = [(rank, r) for rank, r in enumerate(replies) if r[0] != "ok"]
        if not failed:
            return replies[0][1]
        same = len(failed) == self.world and len({r[2] for _, r in failed}) == 1
        if same and isinstance(failed[0][1][1], BaseException):
            raise failed[0][1][1]
        self.close()
        raise ParallelError("; ".join(f"rank {rank} of {self.world} failed: {r[2]}" for rank, r in failed))

    def close(self) -> None:
        for c in self.conns:
            try:
                c.send(None)
            except (OSError, ValueError):
                pass
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
                p.join()
        self.conns, self.procs = [], []
