"""The target's training loop: next-token loss on random windows of the train stream, bf16 autocast,
AdamW, cosine LR, step count fitted to a wall-clock budget, the held-out-best snapshot kept.
Every forward is TargetModel.forward_train (the model's dense training path)."""
from __future__ import annotations

import copy
import time

import torch
import torch.nn.functional as F

from dflash_trt.tools.train.common import StepClock, autocast, cosine_lr, optimizer_step, param_groups, windows


def next_token_loss(model, x, reduction="mean"):
    """x [B,L+1] tokens -> cross-entropy of predicting x[:,1:] from x[:,:-1]."""
    logits = model.forward_train(x[:, :-1])["logits"]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction=reduction)


@torch.no_grad()
def eval_target(model, data, dev, L, n_windows, batch=16):
    """Mean next-token loss over n_windows consecutive (non-overlapping) windows of the held-out stream."""
    model.eval()
    n = min(n_windows, (data.numel() - 1) // L)
    tot, cnt = 0.0, 0
    for i in range(0, n, batch):
        x = torch.stack([data[j * L:j * L + L + 1] for j in range(i, min(n, i + batch))]).to(dev).long()
        with autocast(dev):
            tot += next_token_loss(model, x, reduction="sum").item()
        cnt += x[:, 1:].numel()
    model.train()
    return tot / max(cnt, 1)


def train_target(model, train, held, dev, log, seconds, steps=None, batch=128, L=512, lr=2e-3, seed=0,
                 eval_every=200):
    gen = torch.Generator().manual_seed(seed + 1)
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=lr, betas=(0.9, 0.95), eps=1e-8,
                            fused=dev.type == "cuda")
    model.train()
    warmup, clock = 100, StepClock(dev, seconds, steps)
    hist, step = [], 0
    best = (float("inf"), 0, None)
    while step < clock.total:
        x = windows(train, batch, L + 1, gen).to(dev, non_blocking=True).long()
        for gp in opt.param_groups:
            gp["lr"] = cosine_lr(step, clock.schedule_total(), lr, warmup)
        with autocast(dev):
            loss = next_token_loss(model, x)
        gn = optimizer_step(opt, model, loss)
        step += 1
        ms = clock.tick(step)
        if ms is not None:
            log(f"target: {ms:.1f} ms/step, {batch * L / ms:.0f}k tok/s -> {clock.total} steps",
                ms_per_step=ms, total_steps=clock.total)
        if step % 50 == 0 or step == clock.total:
            lv = loss.item()
            hist.append((step, lv))
            msg = f"target step {step}/{clock.total} loss {lv:.3f} gnorm {gn.item():.2f} lr {opt.param_groups[0]['lr']:.2e}"
            kv = dict(stage="target", step=step, loss=lv)
            if step % eval_every == 0 or step == clock.total:
                hl = eval_target(model, held, dev, L, 32)
                msg += f" | held-out {hl:.3f}"
                kv["heldout_loss"] = hl
                if hl < best[0]:  # keep the best snapshot (guards against overfitting the small corpus)
                    best = (hl, step, {k: v.detach().clone() for k, v in model.state_dict().items()})
            log(msg, **kv)
    if best[2] is not None and best[1] != step:
        model.load_state_dict(best[2])
        log(f"target: kept the snapshot of step {best[1]} (held-out {best[0]:.3f})")
    return dict(steps=step, seconds=time.time() - clock.t0, tokens=step * batch * L, batch=batch, seq_len=L,
                peak_lr=lr, final_train_loss=hist[-1][1] if hist else None,
                kept_step=best[1] if best[2] is not None else step)


@torch.no_grad()
def check_fast_vs_reference(target, held, L: int = 128):
    """The training path (forward_train, on the training device) against the graph path (forward_full,
    i.e. TargetModel.step from empty pools, fp32 on CPU) on two held-out windows: (max |diff|, argmax agreement)."""
    gap = min(200, held.numel() // 2)  # windows at 0 and 200 (as logged), short streams: halves
    L = min(L, gap)
    x = torch.stack([held[i * gap:i * gap + L] for i in range(2)]).long()
    ref = copy.deepcopy(target).cpu().float().forward_full(x)["logits"]
    dev = next(target.parameters()).device
    fast = target.forward_train(x.to(dev))["logits"].cpu()
    return (ref - fast).abs().max().item(), (ref.argmax(-1) == fast.argmax(-1)).float().mean().item()
