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
from safetensors.torch import load_file, save

from dflash_trt.files import write_bytes
from dflash_trt.log import progress
from dflash_trt.tools.train.common import (Log, StepClock, autocast, cosine_lr, log_step, optimizer_step, param_groups,
                                           pick_device, round_bf16_)
from dflash_trt.tools.train.configs import BLOCK
from dflash_trt.tools.train.data import corpus_files, function_snippets, is_heldout
from dflash_trt.tools.train.drafter import drafter_loss, eval_drafter, loss_weights, simulate_tau
from dflash_trt.tools.train.generate import fp32_math, greedy_continue_ragged, tap_rows
from dflash_trt.tools.train.save import save_dir

# the drafter fine-tunes applied to models/ after the GPU stage, in order (tune's keyword arguments)
SHIPPED_TUNES = [
    dict(n_train=6144, n_lengths=8, steps=1800, lr=1e-3, decay_gamma=7.0, seed=0),
    dict(n_train=12288, n_lengths=24, steps=2400, lr=7e-4, decay_gamma=5.0, seed=1),
    # on a GPU: every length, 144 labels (the bench's 128 new tokens), data from the fp32 and the bf16 target
    dict(n_train=28000, n_lengths=0, n_new=144, replay=128, dtypes=("float32", "bfloat16"), seconds=180, batch=64,
         anchors=16, lr=8e-4, decay_gamma=7.0, seed=2),
]


@torch.no_grad()
def snippet_data(target, tok, snippets, n_new: int, dev, log, tag):
    """Greedy continuations (n_new tokens) of function-start snippets of any token lengths, through one
    Runtime (generate.greedy_continue_ragged). Returns seqs [N,Tmax] (right-padded with 0), prompt lengths
    [N], ctx [N,Tmax,F] bf16 (pad rows follow the sequence, so the causal taps before them are exact; a
    block at anchor a only sees ctx rows < a, and a + BLOCK - 1 < P + n_new, so pads are never read)."""
    t0 = time.time()
    prompts = [tok.encode(s).ids for s in snippets]
    with fp32_math():
        seqs = greedy_continue_ragged(target, prompts, n_new)
        T = max(len(x) for x in seqs)
        seqs = torch.tensor([x + [0] * (T - len(x)) for x in seqs], dtype=torch.long, device=dev)
        ctx = tap_rows(target, seqs)
    plens = torch.tensor([len(x) for x in prompts], device=dev)
    log(f"snippet data ({tag}): {seqs.shape[0]} function starts + {n_new} greedy tokens, "
        f"target {next(target.parameters()).dtype}, {time.time() - t0:.0f} s")
    return seqs, plens, ctx


def pick_snippets(files, tok, n, n_lengths, rng):
    """n snippets whose token lengths are among the n_lengths most common ones (few length groups keep
    the batched greedy generation cheap on a CPU; 0: every length)."""
    sn = [x[1] for x in function_snippets(files, tok)]
    lens = [len(tok.encode(x).ids) for x in sn]
    if n_lengths:
        common = sorted(set(lens), key=lambda L: (-lens.count(L), L))[:n_lengths]
        sn = [x for x, L in zip(sn, lens) if L in common]
    return [sn[i] for i in rng.permutation(len(sn))[:n]]


def choose_snippets(work: str, tok, n_train: int, n_held: int, n_lengths: int, seed: int):
    """(training snippets, held-out snippets) from the corpus prepare used (work/meta.json). The held-out
    choice is fixed (seed 3, the 4 most common lengths), so every tune reports on the same prompts."""
    with open(os.path.join(work, "meta.json")) as f:
        files = corpus_files(json.load(f))
    tr = pick_snippets([f for f in files if not is_heldout(f[0])], tok, n_train, n_lengths,
                       np.random.default_rng(seed + 3))
    he = pick_snippets([f for f in files if is_heldout(f[0])], tok, n_held, 4, np.random.default_rng(3))
    return tr, he


def write_snippets(path: str, work: str, models: str, n_train: int, n_held: int, n_lengths: int, seed: int):
    """choose_snippets -> path (JSON {"train": [...], "heldout": [...]}, written atomically): what `tune
    --snippets` reads on a machine whose Python stdlib is not the corpus prepare read."""
    from dflash_trt.export.checkpoint import load_tokenizer

    tr, he = choose_snippets(work, load_tokenizer(os.path.join(models, "target")), n_train, n_held, n_lengths, seed)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"train": tr, "heldout": he}, f)
    os.replace(tmp, path)
    progress(f"{path}: {len(tr)} training and {len(he)} held-out function starts")


def _data(models, target, tok, tr_sn, he_sn, n_new, dtypes, dev, log):
    """Training data over every dtype in dtypes (the training snippets split between them, so the drafter
    learns each one's hidden states and greedy path; the bf16 target is what the GPU runs) and held-out
    data per dtype (all held-out snippets each). target: the fp32 one tune already loaded (with its taps)."""
    from dflash_trt.export.checkpoint import load_target

    train, held = [], {}
    for k, name in enumerate(dtypes):
        t = target
        if name != "float32":
            t = load_target(os.path.join(models, "target"), getattr(torch, name)).to(dev)
            t.tap_ids = list(target.tap_ids)
        mine = tr_sn[k::len(dtypes)]
        s, p, c = snippet_data(t, tok, he_sn + mine, n_new, dev, log, f"held-out + train, {name}")  # one Runtime
        n = len(he_sn)
        held[name] = (s[:n], p[:n], c[:n])
        train.append((s[n:], p[n:], c[n:]))
    T = max(d[0].shape[1] for d in train)
    pad = [(F.pad(s, (0, T - s.shape[1])), p, F.pad(c, (0, 0, 0, T - c.shape[1]))) for s, p, c in train]
    return tuple(torch.cat(x) for x in zip(*pad)), held


def _save_data(path: str, train_data, held) -> None:
    """The tune data (train (seqs, prompt lengths, ctx rows); held-out per dtype) as one safetensors file, atomically:
    no pickle (torch.save) for data a later run reads back."""
    flat = {f"train.{i}": t for i, t in enumerate(train_data)}
    flat.update({f"held.{k}.{i}": t for k, v in held.items() for i, t in enumerate(v)})
    # copies: slices of one tensor share storage, which safetensors refuses
    write_bytes(path, save({k: t.detach().to("cpu", copy=True).contiguous() for k, t in flat.items()}))


def _load_data(path: str, dtypes, dev):
    """_save_data's (train_data, held) on `dev`, held in `dtypes` order (the cache key has them)."""
    flat = load_file(path, device=str(dev))
    n = lambda pre: sum(k.startswith(pre) for k in flat)  # noqa: E731
    train = tuple(flat[f"train.{i}"] for i in range(n("train.")))
    return train, {k: tuple(flat[f"held.{k}.{i}"] for i in range(n(f"held.{k}."))) for k in dtypes}


def tune(models: str, work: str, out: str | None = None, n_train: int = 6144, n_held: int = 256, n_new: int = 80,
         steps: int = 1800, batch: int = 32, anchors: int = 8, lr: float = 1e-3, seed: int = 0, device=None,
         decay_gamma: float = 7.0, n_lengths: int = 8, snippets: str | None = None,
         dtypes: tuple[str, ...] = ("float32",), replay: int = 64, seconds: float | None = None) -> dict:
    """Fine-tune models/drafter on the target's continuations of function starts of training files
    (anchors in the first n_new-16 generated positions: the regime of generate/demo); writes out/drafter
    and appends a report to out/train_log.json's 'drafter_tunes'. snippets: a write_snippets file instead
    of the corpus; dtypes: the target dtypes the data is generated in; replay: new tokens of the replayed
    held-out tau (exact when replay <= n_new - BLOCK + 2); seconds: fit the step count to this training
    budget instead of `steps` (common.StepClock). Cheap enough for a CPU at the defaults."""
    from dflash_trt.export.checkpoint import load_drafter, load_target, load_tokenizer

    dev = pick_device(device)
    if dev.type == "cpu" and set(dtypes) != {"float32"}:  # before minutes of work, not after
        raise ValueError(f"tune: data dtypes {','.join(dtypes)} need a GPU (the CPU runtime runs fp32 targets only)")
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
    if snippets:
        with open(snippets) as f:
            sn = json.load(f)
        tr_sn, he_sn = sn["train"][:n_train], sn["heldout"][:n_held]
    else:
        tr_sn, he_sn = choose_snippets(work, tok, n_train, n_held, n_lengths, seed)
    train_data, held = _cached_data(models, work, target, tok, tr_sn, he_sn, n_new, dtypes, dev, log)

    before = _report(drafter, held, mask_id, replay, n_new, log, "before")
    step, tune_s = _fit(drafter, train_data, mask_id, n_new, steps, batch, anchors, lr, seed, decay_gamma, seconds,
                        dev, log)
    round_bf16_(drafter)
    after = _report(drafter, held, mask_id, replay, n_new, log, "after")
    acc, _, _ = eval_drafter(drafter, held[dtypes[0]], mask_id, dev)
    log(f"per-position accuracy ({dtypes[0]} held-out) " + " ".join(f"{a:.2f}" for a in acc))
    save_dir(drafter, dcfg_d, os.path.join(out, "drafter"))
    rep = dict(device=str(dev), init_drafter=ddir, n_train=train_data[0].shape[0],
               prompt_lengths=None if snippets else n_lengths, seed=seed, loss_decay_gamma=decay_gamma,
               n_held=len(he_sn), new_tokens=n_new, data_dtypes=list(dtypes),
               replay_new_tokens=replay, snippets_file=snippets, steps=step,
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


def _cached_data(models, work, target, tok, tr_sn, he_sn, n_new, dtypes, dev, log):
    """_data's (train_data, held), from work/tune_data_<key>.safetensors when an earlier run left it there."""
    with open(os.path.join(models, "target", "model.safetensors"), "rb") as f:
        key = hashlib.sha1(json.dumps([tr_sn, he_sn, n_new, list(dtypes)]).encode() + f.read()).hexdigest()[:12]
    cache = os.path.join(work, f"tune_data_{key}.safetensors")  # keyed by target + snippets
    if os.path.isfile(cache):
        train_data, held = _load_data(cache, dtypes, dev)
        log(f"snippet data: cached {cache}")
    else:
        train_data, held = _data(models, target, tok, tr_sn, he_sn, n_new, dtypes, dev, log)
        if train_data[2].numel() * 2 < 2**32 and os.path.isdir(work):  # a GPU-sized set is cheaper to remake
            _save_data(cache, train_data, held)
    return train_data, held


def _report(drafter, held, mask_id, replay, n_new, log, when):
    """The replayed held-out tau per data dtype, logged; one dtype: its [mean, pooled] alone."""
    taus = {k: simulate_tau(drafter, d, mask_id, replay, n_new) for k, d in held.items()}
    log(f"drafter {when} tune: held-out function starts, replayed tau ({replay} new) " +
        ", ".join(f"{k} mean {t[0]:.2f} pooled {t[1]:.2f}" for k, t in taus.items()))
    return taus if len(taus) > 1 else next(iter(taus.values()))


def _fit(drafter, train_data, mask_id, n_new, steps, batch, anchors, lr, seed, decay_gamma, seconds, dev, log):
    """The fine-tune's training loop (AdamW, cosine LR; `seconds` fits the step count): (steps run, seconds)."""
    seqs, plens, ctx = train_data
    N = seqs.shape[0]
    w = loss_weights(decay_gamma, dev)
    gdev = torch.Generator(device=dev).manual_seed(seed + 4)
    opt = torch.optim.AdamW(param_groups(drafter, 0.01), lr=lr, betas=(0.9, 0.95))
    drafter.train()
    t0 = time.time()
    perm, pi = torch.randperm(N, device=dev, generator=gdev), 0
    span = n_new - BLOCK + 1  # anchors in [P, P + span): every label is a generated token
    clock, step = StepClock(dev, seconds, None if seconds else steps), 0
    while step < clock.total:
        if pi + batch > N:
            perm, pi = torch.randperm(N, device=dev, generator=gdev), 0
        idx = perm[pi:pi + batch]
        pi += batch
        p = plens[idx]
        r = torch.rand(batch, anchors, device=dev, generator=gdev)
        anc = (p[:, None].float() + r * span).long().clamp_(max=p[:, None] + span - 1)
        for gp in opt.param_groups:
            gp["lr"] = cosine_lr(step, clock.schedule_total(), lr, 30)
        with autocast(dev):
            loss, _, _ = drafter_loss(drafter, ctx[idx].float(), seqs[idx], anc, mask_id, w)
        optimizer_step(opt, drafter, loss)
        step += 1
        log_step(log, clock, "tune", step, loss, 50)
    return step, time.time() - t0
