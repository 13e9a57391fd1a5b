"""Stage `prepare`: the corpus (the Python standard library's own .py files), the byte-level BPE tokenizer,
uint16 token streams (train / held-out, split by a hash of each file's path) and the held-out prompts.
Also the function-start snippets the held-out prompts and the `tune` stage are cut from."""
from __future__ import annotations

import ast
import hashlib
import json
import os
import sys
import sysconfig
import textwrap
import time

import numpy as np
import torch

from dflash_trt.log import progress
from dflash_trt.tools.train.configs import EOS, MASK

PROMPTS_HEADER = ("# Held-out prompts (first lines of functions of held-out stdlib files; "
                  "python -m dflash_trt.tools.train prepare).\n")


def is_heldout(relpath: str, every: int = 32) -> bool:
    """Deterministic held-out split: ~1/every of the files, by a hash of the path (not of the order)."""
    return int(hashlib.sha1(relpath.encode()).hexdigest(), 16) % every == 0


def stdlib_sources(root: str | None = None, max_bytes: int = 400_000, max_files: int | None = None):
    """(relative path, text) of the stdlib's .py files, sorted; skips site-/dist-packages, undecodable
    files and a few huge generated tables (> max_bytes). max_files (smoke runs): the first max_files
    training files and the first max(1, max_files // 8) held-out ones, so both splits are non-empty."""
    root = root or sysconfig.get_paths()["stdlib"]
    out = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in ("site-packages", "dist-packages", "__pycache__"))
        for f in sorted(files):
            if not f.endswith(".py"):
                continue
            p = os.path.join(d, f)
            if os.path.getsize(p) > max_bytes:
                continue
            try:
                with open(p, encoding="utf-8") as fh:
                    text = fh.read()
            except (UnicodeDecodeError, OSError):
                continue
            out.append((os.path.relpath(p, root).replace(os.sep, "/"), text))
    out.sort()
    if max_files:
        tr, he = [x for x in out if not is_heldout(x[0])], [x for x in out if is_heldout(x[0])]
        out = sorted(tr[:max_files] + he[:max(1, max_files // 8)])
    return out


def train_tokenizer(texts, vocab: int = 4096):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, min_frequency=2, special_tokens=[EOS, MASK],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return tok


def function_snippets(files, tok, max_tokens: int = 96) -> list[tuple[str, str]]:
    """(file, snippet): first lines of every function: the `def` line(s) and the first body line,
    dedented, ending at the end of that line's text (a natural token boundary: the next token starts
    with a newline). Sorted by file, then line."""
    cands = []
    for rel, text in files:
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        lines = text.splitlines()
        per_file = []
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or not node.body:
                continue
            start = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
            first = node.body[0]
            if first.lineno == node.lineno:  # one-line def
                continue
            end = first.lineno  # include the first body line (1-based lineno == exclusive 0-based end)
            snippet = textwrap.dedent("\n".join(lines[start:end])).rstrip()
            if not snippet.startswith(("def ", "async def ")) or len(snippet) < 24:
                continue
            if len(tok.encode(snippet).ids) > max_tokens:
                continue
            per_file.append((node.lineno, snippet))
        per_file.sort()
        cands += [(rel, s) for _, s in per_file]
    return cands


def function_prompts(files, tok, n: int, seed: int, max_tokens: int = 96) -> list[str]:
    """Held-out prompts: function_snippets of held-out files, picked with a seeded shuffle, at most 2 per file."""
    cands = function_snippets(files, tok, max_tokens)
    order = np.random.default_rng(seed).permutation(len(cands))
    chosen, used = [], {}
    for i in order:
        rel, s = cands[i]
        if used.get(rel, 0) >= 2 or s in chosen:
            continue
        used[rel] = used.get(rel, 0) + 1
        chosen.append(s)
        if len(chosen) == n:
            break
    return chosen


def write_prompts(path: str, prompts: list[str]) -> None:
    with open(path, "w") as f:
        f.write(PROMPTS_HEADER)
        f.write("# One JSON string per line; lines starting with '#' are comments.\n")
        for p in prompts:
            f.write(json.dumps(p) + "\n")


def read_prompts(path: str) -> list[str]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip() and not line.startswith("#")]


def prepare(work: str, vocab: int = 4096, seed: int = 0, n_prompts: int = 24, prompts_out: str | None = None,
            stdlib: str | None = None, max_files: int | None = None) -> dict:
    """corpus -> work/{tokenizer.json, train.u16, heldout.u16, prompts_heldout.txt, meta.json}."""
    t0 = time.time()
    os.makedirs(work, exist_ok=True)
    files = stdlib_sources(stdlib, max_files=max_files)
    train_f = [(r, t) for r, t in files if not is_heldout(r)]
    held_f = [(r, t) for r, t in files if is_heldout(r)]
    tok = train_tokenizer((t for _, t in train_f), vocab)
    tok.save(os.path.join(work, "tokenizer.json"))
    eos_id, mask_id = tok.token_to_id(EOS), tok.token_to_id(MASK)

    def stream(fs):  # every file's tokens, then EOS
        parts = []
        for e in tok.encode_batch([t for _, t in fs]):
            parts += [np.asarray(e.ids, dtype=np.uint16), np.asarray([eos_id], dtype=np.uint16)]
        return np.concatenate(parts)

    tr, he = stream(train_f), stream(held_f)
    tr.tofile(os.path.join(work, "train.u16"))
    he.tofile(os.path.join(work, "heldout.u16"))
    prompts = function_prompts(held_f, tok, n_prompts, seed)
    write_prompts(os.path.join(work, "prompts_heldout.txt"), prompts)
    if prompts_out:
        write_prompts(prompts_out, prompts)
    meta = dict(
        python=sys.version.split()[0], stdlib=stdlib or sysconfig.get_paths()["stdlib"],
        files=len(files), train_files=len(train_f), heldout_files=len(held_f),
        heldout_file_names=[r for r, _ in held_f], train_tokens=int(tr.size), heldout_tokens=int(he.size),
        train_bytes=sum(len(t.encode()) for _, t in train_f), vocab=tok.get_vocab_size(), eos_id=eos_id,
        mask_id=mask_id, prompts=len(prompts), seconds=round(time.time() - t0, 1),
    )
    if max_files:  # later stages (tune) re-read the corpus: they must see the same subset
        meta["max_files"] = max_files
    with open(os.path.join(work, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
    progress(f"prepare: {meta['files']} files ({meta['heldout_files']} held out), {meta['train_tokens']:,} train / "
          f"{meta['heldout_tokens']:,} held-out tokens, vocab {meta['vocab']}, {len(prompts)} prompts, "
          f"{meta['seconds']} s")
    return meta


def load_work(work: str):
    """prepare's output: (meta, train tokens, held-out tokens) as int32 tensors."""
    with open(os.path.join(work, "meta.json")) as f:
        meta = json.load(f)
    toks = [torch.from_numpy(np.fromfile(os.path.join(work, n), dtype=np.uint16).astype(np.int32))
            for n in ("train.u16", "heldout.u16")]
    return meta, toks[0], toks[1]


def corpus_files(meta: dict):
    """The corpus files prepare used (same stdlib dir and subset), for stages that re-read the sources."""
    return stdlib_sources(meta.get("stdlib"), max_files=meta.get("max_files"))
