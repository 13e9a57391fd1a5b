"""Stage `tune`: fine-tune the drafter on the target's greedy continuations of *function starts* of
training files (the `def` line + first body line, like the held-out prompts): the regime generate,
demo and the tests run in (short context, the first ~64 tokens). Reports the exact offline replay of
greedy speculative decoding (drafter.simulate_tau) before and after."""
from __future__ import annotations

import hashlib
import json
import os
import time

import numpy as np
import torch
import torch.nn.functional as F

from dflash_trt.tools.train.common import Log, autocast, cosine_lr, param_groups, pick_device, round_bf16_
from dflash_trt.tools.train.configs import BLOCK
from dflash_trt.tools.train.data import corpus_files, function_snippets, is_heldout
from dflash_trt.tools.train.drafter import drafter_loss, eval_drafter, loss_weights, simulate_tau
from dflash_trt.tools.train.generate import continuations
from dflash_trt.tools.train.save import save_dir

# the drafter fine-tunes applied to models/ after the GPU stage, in order (tune's keyword arguments)
SHIPPED_TUNES = [
    dict(n_train=6144, n_lengths=8, steps=1800, lr=1e-3, decay_gamma=7.0, seed=0),
    dict(n_train=12288, n_lengths=24, steps=2400, lr=7e-4, decay_gamma=5.0, seed=1),
]


@torch.no_grad()
def snippet_data(target, tok, snippets, n_new: int, dev, log, tag, batch: int = 256):
    """Greedy continuations (n_new tokens) of function-start snippets, grouped by prompt length.
    Returns seqs [N,Tmax] (right-padded with 0), prompt lengths [N], ctx [N,Tmax,F] bf16 (pad rows 0:
    a block at anchor a only sees ctx rows < a, and a + BLOCK - 1 < P + n_new, so pads are never read)."""
    t0 = time.time()
    groups = {}
    for ids in (tok.encode(s).ids for s in snippets):
        groups.setdefault(len(ids), []).append(ids)
    Tmax = max(groups) + n_new
    seqs, plens, ctxs = [], [], []
    for P in sorted(groups):
        g = groups[P]
        for i in range(0, len(g), batch):
            sq, c = continuations(target, torch.tensor(g[i:i + batch], device=dev), n_new, batch)
            seqs.append(F.pad(sq, (0, Tmax - sq.shape[1])))
            ctxs.append(F.pad(c, (0, 0, 0, Tmax - sq.shape[1])))
            plens.append(torch.full((sq.shape[0],), P, device=dev))
    seqs, plens, ctxs = torch.cat(seqs), torch.cat(plens), torch.cat(ctxs)
    log(f"snippet data ({tag}): {seqs.shape[0]} function starts + {n_new} greedy tokens, "
        f"{len(groups)} prompt lengths, {time.time() - t0:.0f} s")
    return seqs, plens, ctxs


def pick_snippets(files, tok, n, n_lengths, rng):
    """n snippets whose token lengths are among the n_lengths most common ones (few length groups keep
    the batched greedy generation cheap on a CPU)."""
    sn = [x[1] for x in function_snippets(files, tok)]
    lens = [len(tok.encode(x).ids) for x in sn]
    common = sorted(set(lens), key=lambda L: (-lens.count(L), L))[:n_lengths]
    sn = [x for x, L in zip(sn, lens) if L in common]
    return [sn[i] for i in rng.permutation(len(sn))[:n]]


def tune(models: str, work: str, out: str | None = None, n_train: int = 6144, n_held: int = 256, n_new: int = 80,
         steps: int = 1800, batch: int = 32, anchors: int = 8, lr: float = 1e-3, seed: int = 0, device=None,
         decay_gamma: float = 7.0, n_lengths: int = 8) -> dict:
    """Fine-tune models/drafter on the target's continuations of function starts of training files
    (anchors in the first n_new-16 generated positions: the regime of generate/demo); writes out/drafter
    and appends a report to out/train_log.json's 'drafter_tunes'. Cheap enough for a CPU."""
    from dflash_trt.export.checkpoint import load_drafter, load_target, load_tokenizer

    dev = pick_device(device)
    torch.manual_seed(seed)
    out = out or models
    log = Log(None)
    tdir, ddir = os.path.join(models, "target"), os.path.join(models, "drafter")
    with open(os.path.join(ddir, "config.json")) as f:
        dcfg_d = json.load(f)
    mask_id = dcfg_d["dflash_config"]["mask_token_id"]
    target = load_target(tdir, torch.float32).to(dev)
    for p in target.parameters():
        p.requires_grad_(False)
    drafter = load_drafter(ddir, target, torch.float32).to(dev)  # also sets the target's taps
    tok = load_tokenizer(tdir)
    with open(os.path.join(work, "meta.json")) as f:
        files = corpus_files(json.load(f))
    tr_sn = pick_snippets([f for f in files if not is_heldout(f[0])], tok, n_train, n_lengths,
                          np.random.default_rng(seed + 3))
    he_sn = pick_snippets([f for f in files if is_heldout(f[0])], tok, n_held, 4, np.random.default_rng(3))  # fixed
    with open(os.path.join(tdir, "model.safetensors"), "rb") as f:
        key = hashlib.sha1(json.dumps([tr_sn, he_sn, n_new]).encode() + f.read()).hexdigest()[:12]
    cache = os.path.join(work, f"tune_data_{key}.pt")  # the continuations depend only on target + snippets
    if os.path.isfile(cache):
        train_data, held_data = (tuple(t.to(dev) for t in d) for d in torch.load(cache))
        log(f"snippet data: cached {cache}")
    else:
        train_data = snippet_data(target, tok, tr_sn, n_new, dev, log, "train")
        held_data = snippet_data(target, tok, he_sn, n_new, dev, log, "held-out")
        torch.save([tuple(t.cpu() for t in train_data), tuple(t.cpu() for t in held_data)], cache)
    before = simulate_tau(drafter, held_data, mask_id, 64, n_new)
    log(f"drafter before tune: held-out function starts, replayed tau (64 new) mean {before[0]:.2f} pooled {before[1]:.2f}")

    seqs, plens, ctx = train_data
    N = seqs.shape[0]
    w = loss_weights(decay_gamma, dev)
    gdev = torch.Generator(device=dev).manual_seed(seed + 4)
    opt = torch.optim.AdamW(param_groups(drafter, 0.01), lr=lr, betas=(0.9, 0.95))
    drafter.train()
    t0 = time.time()
    perm, pi = torch.randperm(N, device=dev, generator=gdev), 0
    span = n_new - BLOCK + 1  # anchors in [P, P + span): every label is a generated token
    for step in range(steps):
        if pi + batch > N:
            perm, pi = torch.randperm(N, device=dev, generator=gdev), 0
        idx = perm[pi:pi + batch]
        pi += batch
        p = plens[idx]
        r = torch.rand(batch, anchors, device=dev, generator=gdev)
        anc = (p[:, None].float() + r * span).long().clamp_(max=p[:, None] + span - 1)
        for gp in opt.param_groups:
            gp["lr"] = cosine_lr(step, steps, lr, 30)
        with autocast(dev):
            loss, _, _ = drafter_loss(drafter, ctx[idx].float(), seqs[idx], anc, mask_id, w)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        if (step + 1) % 50 == 0 or step + 1 == steps:
            log(f"tune step {step + 1}/{steps} loss {loss.item():.3f}", stage="tune", step=step + 1, loss=loss.item())
    tune_s = time.time() - t0
    round_bf16_(drafter)
    after = simulate_tau(drafter, held_data, mask_id, 64, n_new)
    acc, _, _ = eval_drafter(drafter, held_data, mask_id, dev)
    log(f"drafter after tune: replayed tau (64 new) mean {after[0]:.2f} pooled {after[1]:.2f}; "
        "per-position accuracy " + " ".join(f"{a:.2f}" for a in acc))
    save_dir(drafter, dcfg_d, os.path.join(out, "drafter"))
    rep = dict(device=str(dev), init_drafter=ddir, n_train=N, prompt_lengths=n_lengths, seed=seed,
               loss_decay_gamma=decay_gamma, n_held=int(held_data[0].shape[0]), new_tokens=n_new, steps=steps,
               batch_seqs=batch, anchors_per_seq=anchors, peak_lr=lr, seconds=round(tune_s, 1),
               heldout_replayed_tau_before=before, heldout_replayed_tau_after=after,
               heldout_position_accuracy=acc, events=log.data["events"])
    lp, lg = os.path.join(out, "train_log.json"), {}
    if os.path.isfile(lp):
        with open(lp) as f:
            lg = json.load(f)
    lg["drafter_tunes"] = lg.get("drafter_tunes", []) + [rep]  # one entry per tune run, in order
    with open(lp, "w") as f:
        json.dump(lg, f, indent=1)
    return rep
