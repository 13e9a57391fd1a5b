"""`serve --tensor-parallel N`: the server runs on rank 0, the other ranks follow its engine.

The serving process is rank 0 of the group: it loads its shard, runs the HTTP server and the engine loop as on one
process. It starts N-1 follower processes that each load their shard and an Engine of their own. Every Engine call
the loop makes on rank 0 (add, abort, step) is first sent to the followers through a pipe, in order, and they make
the same call on their Engine. The Engines are deterministic in their inputs (the lm_head gathers the full logits on
every rank, unseeded sampling is seeded once on rank 0 before it is sent), so every rank adds, steps, ends and
releases the same tracks and their collectives line up; the pipe carries no deadline, so an idle server waits for
requests without any collective timing out. Exact by construction: rank 0's tokens are those of one process with
the same sharded model (and so of one unsharded process, as LLM(tensor_parallel_size=N) is)."""
from __future__ import annotations

import torch.multiprocessing as mp

from dflash_trt.api.llm import seeded
from dflash_trt.runtime.parallel.launch import backend_for, free_port, join_group


class FollowedEngine:
    """Rank 0's Engine, its add / abort / step calls replayed on the followers first (tracks named by add order)."""

    def __init__(self, engine, conns: list, procs: list):
        self.engine, self.conns, self.procs, self.added = engine, conns, procs, 0

    def __getattr__(self, name):  # has_work, rt, room...: rank 0's
        return getattr(self.engine, name)

    def _send(self, *msg) -> None:
        for c in self.conns:
            c.send(msg)

    def add(self, prompt_ids, params, index: int = 0):
        params = seeded(params)
        self._send("add", prompt_ids, params, index)
        track = self.engine.add(prompt_ids, params, index)  # refused alike on every rank: none keeps a track
        track.number, self.added = self.added, self.added + 1
        return track

    def abort(self, track, reason: str = "abort") -> None:
        self._send("abort", track.number, reason)
        self.engine.abort(track, reason)

    def step(self):
        self._send("step")
        return self.engine.step()

    def close(self) -> None:
        """The followers stop (killed when they do not within 10 s)."""
        for c in self.conns:
            try:
                c.send(("stop",))
            except OSError:
                pass
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()


def _follow(rank: int, world: int, port: int, backend: str, make, args, conn) -> None:
    """A follower: its Engine (make(args)), then the calls rank 0 sends until 'stop' or the pipe closes."""
    join_group(rank, world, port, backend)
    engine, tracks, added = make(args), {}, 0  # live tracks by add order
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg[0] == "stop":
            return
        if msg[0] == "add":
            try:
                tracks[added] = engine.add(*msg[1:])
                added += 1
            except Exception:  # noqa: BLE001  (rank 0 refused it alike and answers the client)
                pass
        elif msg[0] == "abort":
            if msg[1] in tracks:
                engine.abort(tracks.pop(msg[1]), msg[2])
        else:
            engine.step()
            tracks = {k: t for k, t in tracks.items() if not t.finished}


def start_followers(world: int, device: str, make, args) -> tuple[list, list]:
    """(pipes, processes): ranks 1..world-1 following; this process then joins the group as rank 0."""
    ctx, port, backend = mp.get_context("spawn"), free_port(), backend_for(device)
    conns, procs = [], []
    for rank in range(1, world):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_follow, args=(rank, world, port, backend, make, args, child), daemon=True)
        p.start()
        child.close()
        conns.append(parent)
        procs.append(p)
    join_group(0, world, port, backend)
    return conns, procs
