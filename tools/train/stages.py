"""Stage `train`: the target, then the DFlash drafter on the frozen target's greedy continuations."""
from __future__ import annotations

import copy
import json
import math
import os
import time

import numpy as np
import torch

from dflash_trt.config import DrafterConfig, TargetConfig
from dflash_trt.modeling.drafter import Drafter
from dflash_trt.modeling.target import TargetModel
from dflash_trt.tools.train.common import Log, pick_device, round_bf16_
from dflash_trt.tools.train.configs import BLOCK, drafter_config, init_weights, target_config
from dflash_trt.tools.train.data import load_work
from dflash_trt.tools.train.drafter import (blocks, eval_drafter, make_drafter_data, reference_block_logits,
                                            block_logits, train_drafter)
from dflash_trt.tools.train.save import save_dir
from dflash_trt.tools.train.target import check_fast_vs_reference, eval_target, train_target


def train(work: str, out: str, target_seconds=190.0, drafter_seconds=120.0, target_steps=None, drafter_steps=None,
          seed=0, device=None, n_gen=None, gen_prompt_lens=(8, 32, 64, 128), gen_len=None, small=False,
          max_shard_mb=15, smoke=False, init_target=None, held_prompt_lens=None, drafter_gen_batch=4096,
          n_held=None):
    """Train target, then drafter; write out/target, out/drafter, out/train_log.json.
    small: tiny shapes; smoke: real shapes, tiny batches and data (both for CPU runs of the code path).
    init_target: a target checkpoint dir from an earlier run: skip target training, train the drafter only.
    gen_len / n_gen / n_held: continuation length and counts (default 320 / 16384 / 512; small or smoke:
    96 / 64 / 16)."""
    dev = pick_device(device)
    log, meta, train_tok, held_tok = _start(work, out, seed, dev)
    gen = torch.Generator().manual_seed(seed)  # weight init and the drafter data's prompts, in this order
    target, tcfg_d, dcfg_d = _make_target(meta, small, init_target, gen, dev, log)
    lite = small or smoke
    _target_stage(target, tcfg_d, train_tok, held_tok, dev, log, lite, out, init_target, target_seconds,
                  target_steps, seed, max_shard_mb)

    # ---- drafter data: the target's greedy continuations ----
    target.tap_ids = list(dcfg_d["dflash_config"]["target_layer_ids"])
    gen_len_ = gen_len or (96 if lite else 320)
    plens = tuple(p for p in gen_prompt_lens if p + 2 * BLOCK <= gen_len_)
    hplens = tuple(p for p in (held_prompt_lens or plens) if p + 2 * BLOCK <= gen_len_)
    gbatch = drafter_gen_batch if dev.type == "cuda" else 16
    t_gen = time.time()
    train_data = make_drafter_data(target, train_tok, dev, gen, n_gen or (64 if lite else 16384), plens,
                                   gen_len_, gbatch, log, "train")
    held_data = make_drafter_data(target, held_tok, dev, gen, n_held or (16 if lite else 512), hplens, gen_len_,
                                  gbatch, log, "held-out")
    gen_s = time.time() - t_gen

    drafter = _drafter_stage(target, dcfg_d, train_data, held_data, gen_s, meta["mask_id"], gen, dev, log, lite,
                             out, drafter_seconds, drafter_steps, seed)
    _check_drafter(drafter, target, held_data, meta["mask_id"], dev, log)
    log.put("wall_seconds", round(time.time() - log.t0, 1))
    log(f"total wall {time.time() - log.t0:.0f} s")
    return log.data


def _start(work: str, out: str, seed: int, dev):
    """Seeds, TF32 on CUDA, the log under out/; (log, meta, train tokens, held-out tokens) of the work dir."""
    torch.manual_seed(seed)
    np.random.seed(seed)
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    os.makedirs(out, exist_ok=True)
    log = Log(os.path.join(out, "train_log.json"))
    meta, train_tok, held_tok = load_work(work)
    log.put("meta", {k: v for k, v in meta.items() if k != "heldout_file_names"})
    log.put("device", torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu")
    log.put("torch", torch.__version__)
    return log, meta, train_tok, held_tok


def _make_target(meta, small: bool, init_target, gen, dev, log):
    """(target on dev, its config dict, the drafter's config dict): initialised from gen, or loaded from
    init_target."""
    tcfg_d = target_config(meta["vocab"], meta["eos_id"], **(dict(hidden=64, layers=4, inter=128) if small else {}))
    if init_target:
        from dflash_trt.export.checkpoint import load_target

        with open(os.path.join(init_target, "config.json")) as f:
            tcfg_d = json.load(f)
        target = load_target(init_target, torch.float32)
    else:
        target = TargetModel(TargetConfig.from_dict(tcfg_d))
        init_weights(target, target.cfg.num_layers, gen)
    tcfg = target.cfg
    dcfg_d = drafter_config(tcfg_d, meta["mask_id"], inter=128 if small else 1024)
    taps = dcfg_d["dflash_config"]["target_layer_ids"]
    target.to(dev)
    n_t = sum(p.numel() for p in target.parameters())
    log(f"target: {n_t / 1e6:.2f}M params, layers {tcfg.layer_types}, taps {taps}", target_params=n_t)
    log.put("target_config", tcfg_d)
    return target, tcfg_d, dcfg_d


def _target_stage(target, tcfg_d, train_tok, held_tok, dev, log, lite: bool, out: str, init_target,
                  target_seconds, target_steps, seed, max_shard_mb) -> None:
    """Train (unless loaded), round to bf16, evaluate, freeze, save out/target (unless loaded), check the fast
    path against the reference."""
    L = 64 if lite else 512
    if init_target:
        tr = dict(loaded_from=init_target)
        log(f"target: loaded from {init_target} (not trained in this run)")
    else:
        tr = train_target(target, train_tok, held_tok, dev, log, target_seconds, target_steps,
                          batch=8 if lite else 128, L=L, seed=seed, eval_every=50 if lite else 300)
    round_bf16_(target)  # the saved (bf16) model is the one that generates the drafter's data
    n_eval = 64 if lite else 256
    hl = eval_target(target, held_tok, dev, L, n_eval)
    tr.update(heldout_loss=hl, heldout_ppl=math.exp(hl),
              heldout_tokens_evaluated=min(n_eval, (held_tok.numel() - 1) // L) * L)
    log(f"target done: {tr.get('steps', 0)} steps in {tr.get('seconds', 0):.0f} s, held-out loss {hl:.3f} "
        f"(ppl {math.exp(hl):.2f})")
    log.put("target", tr)
    for p in target.parameters():
        p.requires_grad_(False)
    target.eval()
    if not init_target:
        save_dir(target, tcfg_d, os.path.join(out, "target"), prefix="model.",
                 max_shard_bytes=max_shard_mb * 2**20 if max_shard_mb else None)
    diff, agree = check_fast_vs_reference(target, held_tok)
    log(f"check: fast vs reference target logits max|diff| {diff:.2e}, argmax agreement {agree:.4f}")
    log.put("check_target_fast_vs_reference", dict(max_abs_diff=diff, argmax_agree=agree))


def _drafter_stage(target, dcfg_d, train_data, held_data, gen_s, mask_id, gen, dev, log, lite: bool, out: str,
                   drafter_seconds, drafter_steps, seed):
    """The drafter initialised from gen, trained, rounded to bf16, evaluated and saved to out/drafter."""
    dcfg = DrafterConfig.from_dict(dcfg_d)
    drafter = Drafter(dcfg, target.cfg.hidden_size)
    init_weights(drafter, dcfg.num_layers, gen)
    drafter.to(dev).bind_target(target)
    n_d = sum(p.numel() for p in drafter.parameters())
    taps = dcfg_d["dflash_config"]["target_layer_ids"]
    log(f"drafter: {n_d / 1e6:.2f}M params, {dcfg.num_layers} layers, block {BLOCK}, taps {taps}", drafter_params=n_d)
    log.put("drafter_config", dcfg_d)
    dr = train_drafter(drafter, train_data, dev, log, drafter_seconds, mask_id, drafter_steps,
                       batch=8 if lite else 64, anchors=8 if lite else 32, seed=seed)
    round_bf16_(drafter)
    acc, tau, nblk = eval_drafter(drafter, held_data, mask_id, dev)
    acc_tr, tau_tr, _ = eval_drafter(drafter, tuple(t[:512] for t in train_data), mask_id, dev)
    dr.update(generation_seconds=gen_s, heldout_position_accuracy=acc, heldout_offline_tau=tau,
              heldout_blocks=nblk, train_position_accuracy=acc_tr, train_offline_tau=tau_tr)
    log("drafter per-position accuracy (held-out, slot 1..15): " + " ".join(f"{a:.2f}" for a in acc))
    log(f"drafter offline tau (gamma=15): held-out {tau:.2f}, train {tau_tr:.2f}")
    log.put("drafter", dr)
    save_dir(drafter, dcfg_d, os.path.join(out, "drafter"))
    return drafter


def _check_drafter(drafter, target, held_data, mask_id, dev, log) -> None:
    """The training path (train_forward, on dev) vs the graph path (ctx() + block(), fp32 CPU): one sequence,
    4 blocks."""
    s, p, c = (t[:1] for t in held_data)
    T_ = s.shape[1]
    anc = torch.tensor([[int(p[0]), int(p[0]) + 5, (int(p[0]) + T_ - BLOCK) // 2, T_ - BLOCK]], device=dev)
    block, _ = blocks(s, anc, mask_id)
    with torch.no_grad():
        fast = block_logits(drafter, c.float(), anc, block)[0].cpu()
        dc = copy.deepcopy(drafter).cpu().bind_target(copy.deepcopy(target).cpu())
        ref = reference_block_logits(dc, c.float().cpu(), anc[0].cpu(), block[0].cpu())
    ddiff = (fast - ref).abs().max().item()
    log(f"check: fast vs Drafter.ctx+block logits max|diff| {ddiff:.2e}")
    log.put("check_drafter_fast_vs_reference", dict(max_abs_diff=ddiff))
