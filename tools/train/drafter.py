"""The DFlash drafter's data, block-wise loss (arXiv 2602.06036) and training loop, on Drafter.train_forward.

A block at anchor a: [token at a, MASK x15] at positions a..a+15; it sees the target's tap rows at
positions < a; slot j >= 1 predicts the token at a+j; cross-entropy weighted w_j = exp(-(j-1)/gamma).
Labels are the target's own greedy continuation, so "slot j correct and all before it" is exactly
"draft j accepted" by greedy verification.
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from dflash_trt.tools.train.common import (StepClock, autocast, cosine_lr, log_step, optimizer_step, param_groups,
                                           windows)
from dflash_trt.tools.train.configs import BLOCK
from dflash_trt.tools.train.generate import continuations


@torch.no_grad()
def make_drafter_data(model, data, dev, gen, n_seqs, prompt_lens, total_len, batch, log, tag):
    """Greedy continuations of prompts cut from the stream `data` (n_seqs spread over prompt_lens), with
    the target's tap rows. Returns seqs [N,T] long, prompt length per seq [N], ctx [N,T,F] bf16 (on dev)."""
    model.eval()
    seqs, plens, ctxs = [], [], []
    per = max(1, n_seqs // len(prompt_lens))
    t0 = time.time()
    for P in prompt_lens:
        for i in range(0, per, batch):
            nb = min(batch, per - i)
            s, c = continuations(model, windows(data, nb, P, gen).to(dev).long(), total_len - P, batch)
            seqs.append(s)
            ctxs.append(c)
            plens.append(torch.full((nb,), P, device=dev))
    seqs, plens, ctxs = torch.cat(seqs), torch.cat(plens), torch.cat(ctxs)
    log(f"drafter data ({tag}): {seqs.shape[0]} greedy continuations x {total_len} tokens, prompts {prompt_lens}, "
        f"{time.time() - t0:.1f} s")
    return seqs, plens, ctxs


def sample_anchors(plens, T, A, gen_dev):
    """A anchors per sequence, uniform in [P, T-Bs] (the block's labels are all generated tokens)."""
    lo = plens.float()[:, None]
    r = torch.rand(plens.shape[0], A, device=plens.device, generator=gen_dev)
    return (lo + r * (T - BLOCK + 1 - lo)).long().clamp_(max=T - BLOCK)  # fp32 rounding can hit the bound


def blocks(seqs, anchors, mask_id):
    """seqs [B,T], anchors [B,A] -> (block ids [B,A,Bs] = [token at a, MASK...], labels [B,A,Bs])."""
    idx = anchors[:, :, None] + torch.arange(BLOCK, device=seqs.device)
    labels = torch.gather(seqs, 1, idx.reshape(seqs.shape[0], -1)).view_as(idx)
    block = torch.full_like(labels, mask_id)
    block[:, :, 0] = labels[:, :, 0]
    return block, labels


def block_logits(drafter, ctx, anchors, block):
    """All A blocks of each sequence in one Drafter.train_forward row: ctx [B,T,F] (taps at positions
    0..T-1), anchors [B,A], block [B,A,Bs]; block a sees ctx rows < anchors[b,a]. Returns [B,A,Bs,V]."""
    B, T, _ = ctx.shape
    A, Bs = block.shape[1], block.shape[2]
    pos = torch.arange(T, device=ctx.device)[None].expand(B, T)
    bpos = (anchors[:, :, None] + torch.arange(Bs, device=ctx.device)).reshape(B, A * Bs)
    ctx_mask = torch.arange(T, device=ctx.device)[None, None, :] < anchors.repeat_interleave(Bs, 1)[:, :, None]
    out = drafter.train_forward(ctx, pos, block.reshape(B, A * Bs), bpos, ctx_mask, n_blocks=A)
    return out.view(B, A, Bs, -1)


def drafter_loss(drafter, ctx, seqs, anchors, mask_id, weights):
    """The block-wise DFlash loss: sum_j w_j CE(slot j) / sum_j w_j, mean over blocks."""
    block, labels = blocks(seqs, anchors, mask_id)
    logits = block_logits(drafter, ctx, anchors, block)[:, :, 1:]
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, :, 1:].reshape(-1), reduction="none")
    ce = ce.view(labels.shape[0], labels.shape[1], BLOCK - 1)
    return (ce * weights).sum(-1).mean() / weights.sum(), logits, labels


def loss_weights(decay_gamma, dev):
    return torch.exp(-torch.arange(BLOCK - 1, device=dev, dtype=torch.float32) / decay_gamma)  # w_j, j = 1..15


def train_drafter(drafter, data, dev, log, seconds, mask_id, steps=None, batch=64, anchors=32, lr=1.5e-3, seed=0,
                  decay_gamma=7.0):
    seqs, plens, ctx = data
    N, T = seqs.shape
    w = loss_weights(decay_gamma, dev)
    gdev = torch.Generator(device=dev).manual_seed(seed + 2)
    opt = torch.optim.AdamW(param_groups(drafter, 0.01), lr=lr, betas=(0.9, 0.95), fused=dev.type == "cuda")
    drafter.train()
    warmup, clock, step = 50, StepClock(dev, seconds, steps), 0
    perm, pi = torch.randperm(N, device=dev, generator=gdev), 0
    while step < clock.total:
        if pi + batch > N:
            perm, pi = torch.randperm(N, device=dev, generator=gdev), 0
        idx = perm[pi:pi + batch]
        pi += batch
        anc = sample_anchors(plens[idx], T, anchors, gdev)
        for gp in opt.param_groups:
            gp["lr"] = cosine_lr(step, clock.schedule_total(), lr, warmup)
        with autocast(dev):
            loss, _, _ = drafter_loss(drafter, ctx[idx], seqs[idx], anc, mask_id, w)
        optimizer_step(opt, drafter, loss)
        step += 1
        log_step(log, clock, "drafter", step, loss, 100)
    return dict(steps=step, seconds=time.time() - clock.t0, batch_seqs=batch, anchors_per_seq=anchors, peak_lr=lr,
                loss_decay_gamma=decay_gamma, train_seqs=N, seq_len=T)


@torch.no_grad()
def eval_drafter(drafter, data, mask_id, dev, stride=3, batch=32):
    """Per-position top-1 accuracy (slot j vs the target's greedy token at anchor+j) and the offline
    acceptance length tau = 1 + mean length of the all-correct prefix of each block (greedy verify of
    15 drafts accepts exactly that prefix, since labels are the target's own greedy continuation)."""
    seqs, plens, ctx = data
    drafter.eval()
    N, T = seqs.shape
    correct = torch.zeros(BLOCK - 1, device=dev)
    acc_len, nblk = 0.0, 0
    for i in range(0, N, batch):
        s, p, c = seqs[i:i + batch], plens[i:i + batch], ctx[i:i + batch]
        anc = torch.arange(int(p.min()), T - BLOCK + 1, stride, device=dev)[None].expand(s.shape[0], -1).contiguous()
        anc = torch.maximum(anc, p[:, None])
        block, labels = blocks(s, anc, mask_id)
        with autocast(dev):
            logits = block_logits(drafter, c, anc, block)[:, :, 1:]
        ok = logits.argmax(-1) == labels[:, :, 1:]
        correct += ok.float().sum((0, 1))
        acc_len += ok.long().cumprod(-1).sum().item()
        nblk += ok.shape[0] * ok.shape[1]
    drafter.train()
    return (correct / nblk).tolist(), 1 + acc_len / nblk, nblk


@torch.no_grad()
def simulate_tau(drafter, data, mask_id, n_new: int, data_new: int, gamma: int = BLOCK - 1, batch: int = 128):
    """Exact offline replay of greedy speculative decoding over the target's own continuations: block at
    anchor a (the bonus token's position), accept the all-correct prefix of the gamma drafts, next anchor
    a + accepted + 1, until n_new tokens (the first comes from prefill, as in Runtime.generate).
    data_new: how many greedy tokens each sequence holds after its prompt (>= n_new + BLOCK - 2 is exact).
    Returns (mean tau per sequence, pooled tau)."""
    seqs, plens, ctx = data
    drafter.eval()
    taus, tot_tok, tot_steps = [], 0, 0
    for i in range(0, seqs.shape[0], batch):
        s, p, c = seqs[i:i + batch], plens[i:i + batch], ctx[i:i + batch].float()
        anc = p.clone()
        end = p + n_new  # sequence positions P .. P+n_new-1 are the new tokens
        acc_sum = torch.zeros(s.shape[0], dtype=torch.long, device=s.device)
        steps = torch.zeros_like(acc_sum)
        while True:
            live = anc + 1 < end  # Runtime.generate: loop while fewer than n_new tokens
            if not live.any():
                break
            a = torch.minimum(anc, p + data_new - BLOCK)[:, None]  # labels must exist
            block, labels = blocks(s, a, mask_id)
            d = block_logits(drafter, c, a, block)[:, 0, 1:gamma + 1].argmax(-1)
            ok = (d == labels[:, 0, 1:gamma + 1]).long().cumprod(-1).sum(-1)
            ok = torch.where(a[:, 0] == anc, ok, torch.zeros_like(ok))
            acc_sum += torch.where(live, ok, 0)
            steps += live.long()
            anc = torch.where(live, anc + ok + 1, anc)
        taus += ((acc_sum + steps).float() / steps.clamp(min=1)).tolist()
        tot_tok += int((acc_sum + steps).sum())
        tot_steps += int(steps.sum())
    drafter.train()
    return sum(taus) / len(taus), tot_tok / max(tot_steps, 1)


@torch.no_grad()
def reference_block_logits(drafter, ctx, anchors, block, page: int = 16):
    """The graph path for the same blocks: Drafter.ctx() rows written into drafter pages, then one
    Drafter.block() per anchor over ctx rows [0, anchor). ctx [1,T,F]; anchors [A]; block [A,Bs] -> [A,Bs,V]."""
    T, A, Bs = ctx.shape[1], anchors.shape[0], block.shape[1]
    rows = drafter.ctx(ctx, torch.arange(T, device=ctx.device)[None])["dkv_rows"]  # [Ld,2,1,T,Hkv,hd]
    nb = -(-T // page)
    pool = rows.new_zeros(rows.shape[0], 2, nb, page, *rows.shape[4:])
    r = torch.arange(T, device=ctx.device)
    pool[:, :, r // page, r % page] = rows[:, :, 0]
    table = torch.arange(nb, device=ctx.device)[None].expand(A, nb)
    pos = anchors[:, None] + torch.arange(Bs, device=ctx.device)
    return drafter.block(block, pos, table, torch.zeros_like(anchors), anchors, pool, want_logits=True)["logits"]
