"""Checkpoints in the HF layout our loaders read (dflash_trt.export.checkpoint.load_target / load_drafter):
config.json + bf16 safetensors under the modules' own parameter names; and stage `finalize`."""
from __future__ import annotations

import json
import os
import shutil

import torch

from dflash_trt.log import progress
from dflash_trt.tools.train.configs import CHAT_TEMPLATE, EOS, MASK


def save_dir(module, config: dict, d: str, prefix: str = "", max_shard_bytes: int | None = None) -> list[str]:
    """config.json + bf16 safetensors; sharded HF-style (model-0000i-of-0000n + index) when the weights
    exceed max_shard_bytes (the GPU machine returns files of <= 16 MB). prefix: 'model.' for the target
    (the loader drops it); a tied lm_head is saved once, as the embedding."""
    from safetensors.torch import save_file

    os.makedirs(d, exist_ok=True)
    tensors = {}
    for n, p in module.named_parameters(remove_duplicate=True):
        key = n if n == "lm_head.weight" else prefix + n
        tensors[key] = p.detach().to(torch.bfloat16).contiguous().cpu().clone()
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    if not max_shard_bytes or total <= max_shard_bytes:
        save_file(tensors, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
        return ["model.safetensors"]
    shards, cur, size = [], {}, 0
    for k in sorted(tensors):
        nbytes = tensors[k].numel() * tensors[k].element_size()
        if cur and size + nbytes > max_shard_bytes:
            shards.append(cur)
            cur, size = {}, 0
        cur[k], size = tensors[k], size + nbytes
    shards.append(cur)
    names, wmap = [], {}
    for i, sh in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(sh, os.path.join(d, name), metadata={"format": "pt"})
        names.append(name)
        wmap.update({k: name for k in sh})
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": wmap}, f, indent=1)
    return names + ["model.safetensors.index.json"]


def merge_shards(src: str, dst: str) -> None:
    """Copy a checkpoint dir, merging shards (if any) into one model.safetensors."""
    from safetensors.torch import load_file, save_file

    os.makedirs(dst, exist_ok=True)
    shutil.copy(os.path.join(src, "config.json"), os.path.join(dst, "config.json"))
    index = os.path.join(src, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        tensors = {}
        for fn in files:
            tensors.update(load_file(os.path.join(src, fn)))
        save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    else:
        shutil.copy(os.path.join(src, "model.safetensors"), os.path.join(dst, "model.safetensors"))


def finalize(src: str, work: str, models: str, target_src: str | None = None) -> None:
    """src (train's out dir) -> models/target, models/drafter (single bf16 safetensors each) + tokenizer,
    generation config, the training log. target_src: take target/ (and its log) from that run instead."""
    with open(os.path.join(work, "meta.json")) as f:
        meta = json.load(f)
    for name in ("target", "drafter"):
        d = os.path.join(models, name)
        if os.path.isdir(d):
            shutil.rmtree(d)
        merge_shards(os.path.join(target_src if name == "target" and target_src else src, name), d)
    t = os.path.join(models, "target")
    shutil.copy(os.path.join(work, "tokenizer.json"), os.path.join(t, "tokenizer.json"))
    with open(os.path.join(t, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": meta["eos_id"], "do_sample": False, "max_new_tokens": 128}, f, indent=2)
    with open(os.path.join(t, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "mask_token": MASK,
                   "model_max_length": 2048}, f, indent=2)
    with open(os.path.join(t, "chat_template.jinja"), "w", encoding="utf-8") as f:
        f.write(CHAT_TEMPLATE)
    if os.path.isfile(os.path.join(src, "train_log.json")):
        with open(os.path.join(src, "train_log.json")) as f:
            lg = json.load(f)
        tl = os.path.join(target_src or "", "train_log.json")
        if target_src and os.path.isfile(tl):  # the target came from an earlier run: keep its log too
            with open(tl) as f:
                lg["target_run"] = json.load(f)
        with open(os.path.join(models, "train_log.json"), "w") as f:
            json.dump(lg, f, indent=1)
    for r, _, fs in os.walk(models):  # copies of the device's read-only files: make them plain 0644
        for fn in fs:
            os.chmod(os.path.join(r, fn), 0o644)
    sizes = {n: sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(os.path.join(models, n)) for f in fs)
             for n in ("target", "drafter")}
    progress(f"finalize: {models}/target {sizes['target'] / 1e6:.1f} MB, {models}/drafter {sizes['drafter'] / 1e6:.1f} MB")
