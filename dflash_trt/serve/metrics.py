"""The server's counters and gauges, rendered as Prometheus text (/metrics) and as /health's JSON.

Only the engine thread writes the runtime gauges (it alone may read the Runtime); HTTP handlers read a snapshot.
One lock guards every field, so a scrape never sees half an update."""
from __future__ import annotations

import threading

PREFIX = "dflash_trt_"
OUTCOMES = ("stop", "length", "abort", "error", "rejected")


class Metrics:
    def __init__(self):
        self.lock = threading.Lock()
        self.requests = dict.fromkeys(OUTCOMES, 0)  # completions by how they ended (rejected: never queued)
        self.prompt_tokens = self.generation_tokens = 0
        self.spec_steps = self.accepted_drafts = 0
        self.steps = 0
        self.step_seconds = 0.0
        self.gauges = {"pending": 0, "waiting": 0, "running": 0}
        self.pools = {}  # name -> (free, total)

    def finished(self, track) -> None:
        acc = track.req.accepted
        with self.lock:
            self.requests[track.finish_reason if track.finish_reason in OUTCOMES else "error"] += 1
            self.prompt_tokens += len(track.req.prompt)
            self.generation_tokens += len(track.token_ids)
            self.spec_steps += len(acc)
            self.accepted_drafts += sum(acc)

    def rejected(self, n: int) -> None:
        with self.lock:
            self.requests["rejected"] += n

    def step(self, seconds: float) -> None:
        with self.lock:
            self.steps += 1
            self.step_seconds += seconds

    def snapshot(self, rt, pending: int) -> None:
        """Engine thread: queue depth and pool use as the Runtime holds them now."""
        sch = rt.scheduler
        pools = {"kv_pages": (rt.kv_alloc.num_free, rt.sizes.kv_blocks),
                 "state_slots": (rt.slots.num_free, rt.sizes.max_seqs)}
        if rt.dcfg is not None:
            pools["ctx_pages"] = (rt.dkv_alloc.num_free, rt.sizes.dkv_blocks)
        with self.lock:
            self.gauges = {"pending": pending, "waiting": len(sch.waiting) if sch else 0,
                           "running": len(sch.running) if sch else 0}
            self.pools = pools

    @property
    def tau(self) -> float:
        return (self.accepted_drafts + self.spec_steps) / self.spec_steps if self.spec_steps else 0.0

    def health(self) -> dict:
        with self.lock:
            return {"status": "ok", **self.gauges,
                    "pools": {k: {"free": f, "total": t} for k, (f, t) in self.pools.items()}}

    def render(self) -> str:
        with self.lock:
            lines = [f"# TYPE {PREFIX}requests_total counter"]
            lines += [f'{PREFIX}requests_total{{outcome="{k}"}} {v}' for k, v in self.requests.items()]
            for name, v, kind in (("prompt_tokens_total", self.prompt_tokens, "counter"),
                                  ("generation_tokens_total", self.generation_tokens, "counter"),
                                  ("spec_steps_total", self.spec_steps, "counter"),
                                  ("accepted_drafts_total", self.accepted_drafts, "counter"),
                                  ("tau", self.tau, "gauge"),
                                  ("step_seconds_sum", self.step_seconds, "counter"),
                                  ("step_seconds_count", self.steps, "counter"),
                                  ("queue_pending", self.gauges["pending"], "gauge"),
                                  ("queue_waiting", self.gauges["waiting"], "gauge"),
                                  ("queue_running", self.gauges["running"], "gauge")):
                lines += [f"# TYPE {PREFIX}{name} {kind}", f"{PREFIX}{name} {v:g}" if isinstance(v, float)
                          else f"{PREFIX}{name} {v}"]
            lines.append(f"# TYPE {PREFIX}pool_free gauge")
            lines += [f'{PREFIX}pool_free{{pool="{k}"}} {f}' for k, (f, _) in self.pools.items()]
            lines.append(f"# TYPE {PREFIX}pool_total gauge")
            lines += [f'{PREFIX}pool_total{{pool="{k}"}} {t}' for k, (_, t) in self.pools.items()]
        return "\n".join(lines) + "\n"
