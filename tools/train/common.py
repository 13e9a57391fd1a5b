"""Small pieces every training loop shares: the log, the LR schedule, AdamW groups, batches, precision."""
from __future__ import annotations

import json
import math
import time

import torch

from dflash_trt.log import progress


class Log:
    """Prints timestamped lines; keyword figures go to data['events'], put() to data[key] (and the file)."""

    def __init__(self, path: str | None):
        self.path, self.data, self.t0 = path, {"events": []}, time.time()

    def __call__(self, msg: str, **kv):
        t = round(time.time() - self.t0, 1)
        progress(f"[{t:7.1f}s] {msg}")
        if kv:
            self.data["events"].append(dict(t=t, **kv))

    def put(self, key, value):
        self.data[key] = value
        self.flush()

    def flush(self):
        if self.path:
            with open(self.path, "w") as f:
                json.dump(self.data, f, indent=1)


def pick_device(device: str | None) -> torch.device:
    return torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def cosine_lr(step, total, peak, warmup, floor=0.1):
    if step < warmup:
        return peak * (step + 1) / warmup
    p = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * p)))


def param_groups(module, wd):
    """Weight decay on matrices only (not on norms, gates, conv kernels)."""
    decay = [p for n, p in module.named_parameters() if p.requires_grad and p.dim() == 2]
    rest = [p for n, p in module.named_parameters() if p.requires_grad and p.dim() != 2]
    return [{"params": decay, "weight_decay": wd}, {"params": rest, "weight_decay": 0.0}]


def windows(data: torch.Tensor, n: int, L: int, gen: torch.Generator):
    """n random windows of L tokens of a token stream (CPU generator: same draws on every device)."""
    starts = torch.randint(0, data.numel() - L, (n,), generator=gen)
    return torch.stack([data[s:s + L] for s in starts.tolist()])


def autocast(dev):
    """bf16 autocast on a GPU; CPU runs (smoke tests, tune) stay fp32."""
    return torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda")


def round_bf16_(module):
    """Round the weights to bf16 in place: what is saved (bf16) is then exactly what later stages use."""
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(p.to(torch.bfloat16).float())


class StepClock:
    """Fits a step count to a wall-clock budget: times steps 10..40, then total = what fits in `seconds`."""

    def __init__(self, dev, seconds, steps):
        self.dev, self.seconds, self.total, self.fit = dev, seconds, steps or 10**9, steps is None
        self.t0 = time.time()

    def schedule_total(self):
        """The total the LR schedule uses before the fit (a long run's shape)."""
        return self.total if self.total < 10**9 else 10**6

    def tick(self, step):
        """Call after each step; returns ms per step when the fit happened at this step, else None."""
        if step == 10:
            sync(self.dev)
            self.t10 = time.time()
        if self.fit and step == 40:
            sync(self.dev)
            dt = (time.time() - self.t10) / 30
            self.total = max(50, int((self.seconds - (time.time() - self.t0)) / dt) + step)
            return dt * 1000
        return None


def optimizer_step(opt, module, loss):
    """One update of every stage: gradients of `loss`, their norm clipped to 1 over module's parameters, opt's step.
    Returns the norm before clipping."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    gn = torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
    opt.step()
    return gn


def log_step(log, clock: StepClock, stage: str, step: int, loss, every: int) -> None:
    """After step `step` (1-based): the step-count fit when it happens, and the loss every `every` steps."""
    ms = clock.tick(step)
    if ms is not None:
        log(f"{stage}: {ms:.1f} ms/step -> {clock.total} steps", ms_per_step=ms, total_steps=clock.total)
    if step % every == 0 or step == clock.total:
        log(f"{stage} step {step}/{clock.total} loss {loss.item():.3f}", stage=stage, step=step, loss=loss.item())
