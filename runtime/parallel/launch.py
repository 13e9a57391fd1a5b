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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, backend: str, timeout_s: float, fn, args, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if backend == "nccl":
        torch.cuda.set_device(rank)
    else:  # the CPU cores shared out, not every rank on all of them
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
    try:
        result = fn(*args)
        if rank == 0:
            with open(out, "wb") as f:
                pickle.dump(result, f)
    finally:
        dist.destroy_process_group()


def run_parallel(fn, world: int, args: tuple = (), backend: str | None = None, timeout_s: float = TIMEOUT_S):
    """fn(*args) on `world` spawned ranks of one process group (fn and args picklable: a module-level function);
    returns rank 0's result. backend: 'gloo' | 'nccl' (default: nccl where CUDA is, else gloo). timeout_s bounds
    every collective."""
    if world < 1:
        raise ValueError(f"world size {world}: at least 1 process")
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl" and torch.cuda.device_count() < world:
        raise ParallelError(f"{world} ranks on NCCL need {world} GPUs; {torch.cuda.device_count()} visible")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank0.pkl")
        try:
            mp.spawn(_worker, args=(world, _free_port(), backend, timeout_s, fn, args, out), nprocs=world, join=True)
        except mp.ProcessRaisedException as e:
            last = str(e).strip().splitlines()[-1]
            raise ParallelError(f"rank {e.error_index} of {world} failed: {last}") from None
        except mp.ProcessExitedException as e:
            raise ParallelError(f"rank {e.error_index} of {world} exited with code {e.exit_code}") from None
        with open(out, "rb") as f:
            return pickle.load(f)
