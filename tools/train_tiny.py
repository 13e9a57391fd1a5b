"""Train the small hybrid target + DFlash drafter pair shipped under models/ (the embedded default).

Everything here is seeded and reads only what every machine has: the Python standard library's own
`.py` sources are the corpus. Stages (each a subcommand of `main(argv)`):

  prepare   corpus -> byte-level BPE tokenizer (`tokenizers`, vocab 4096, `<|endoftext|>` eos,
            `<|mask|>` for the drafter) -> uint16 token streams (train / held-out, split by a hash of
            each file's path) + held-out prompts (first lines of functions of held-out files).
            Runs on CPU; its output dir is what the GPU stage reads, so the GPU machine needs neither
            the same Python stdlib nor the `tokenizers` package.
  train     target: Qwen3.5 text layout (qwen3_5_text, 3 GDN : 1 attention), next-token loss, bf16
            autocast, AdamW, cosine LR, step count fitted to a wall-clock budget (logged, so a rerun can
            pin it with --target-steps). Then the weights are rounded to bf16 (what is saved is what
            generates the drafter's data), the target greedily continues prompts cut from training
            files, and a DFlash drafter (block 16, z-lab tap rule) is trained on the frozen target's
            hidden states with the block-wise loss of the DFlash paper (arXiv 2602.06036): random
            anchors, block = [anchor token, MASK x15] at positions anchor..anchor+15, the context is
            the target's tap rows at positions < anchor, slot j >= 1 predicts the token at anchor+j,
            cross-entropy weighted w_j = exp(-(j-1)/gamma). Labels are the target's own greedy
            continuation, so "slot j correct and all before it" is exactly "draft j accepted".
            Writes HF-format dirs (config.json + safetensors, bf16) and train_log.json.
  finalize  merge shards (the GPU machine returns files of <= 16 MB), add tokenizer.json and
            generation_config.json -> models/target, models/drafter.
  tune      fine-tune the drafter on the target's greedy continuations of *function starts* of training
            files (the `def` line + first body line, like the held-out prompts): the regime generate,
            demo and the tests run in (short context, first ~64 tokens). The GPU stage's generic data
            (random windows, 320-token continuations that end up in repetitive loops) gives a high
            offline tau (~9.5) there but only ~2.4 at the start of a function. CPU-friendly (~0.5 s a
            step on 2 cores); reports the exact offline replay of greedy speculative decoding.
  selfcheck CPU: the fast training math here == the project's reference modules (see below).
  all       prepare + train + finalize + the SHIPPED_TUNES in one go (one machine).

How models/ was made (models/train_log.json holds every figure):
  prepare (CPU, Python 3.11.7 stdlib)
  train on one H200: target 1456 steps (190 s budget; the held-out-best snapshot of step 900 kept);
      that run's drafter stage hit an anchor rounding bug (fixed), so the drafter was trained in a
      second run `train --init-target <run 1>/target --drafter-seconds 90 --held-prompt-lens 8,32`
      (4535 steps); finalize --src <run 2> --target-src <run 1>
  tune x len(SHIPPED_TUNES) on CPU, in place (--models models), with the arguments listed there.

Speed: training does not go through TargetModel.step (paged attention, fold data, per-sequence
loops); `target_forward` below is the same math, dense: causal SDPA for attention, and the GDN in
chunked WY form with all chunks' intra-chunk work batched (chunk 64, triangular solve) and only the
state hand-off looped. `selfcheck` and the end of `train` check it against TargetModel.step /
Drafter.train_forward (the reference path our loaders and runtime use).

Usage (repo root on PYTHONPATH):
  python -m dflash_trt.tools.train_tiny prepare --work .train_data --prompts-out tests/prompts_heldout.txt
  python -m dflash_trt.tools.train_tiny train --work .train_data --out OUT   (GPU: ~6 min on one H200)
  python -m dflash_trt.tools.train_tiny finalize --src OUT --work .train_data --models models
"""
from __future__ import annotations

import argparse
import ast
import copy
import hashlib
import json
import math
import os
import shutil
import sys
import textwrap
import time

import numpy as np
import torch
import torch.nn.functional as F

from dflash_trt.config import DrafterConfig, TargetConfig
from dflash_trt.export.drafter import Drafter
from dflash_trt.export.gdn_ref import gdn_gates, gdn_recurrent, l2norm
from dflash_trt.export.target import TargetModel, apply_rope, rope_cos_sin

EOS, MASK = "<|endoftext|>", "<|mask|>"
BLOCK = 16
# the drafter fine-tunes applied to models/ after the GPU stage, in order (tune's keyword arguments)
SHIPPED_TUNES = [
    dict(n_train=6144, n_lengths=8, steps=1800, lr=1e-3, decay_gamma=7.0, seed=0),
    dict(n_train=12288, n_lengths=24, steps=2400, lr=7e-4, decay_gamma=5.0, seed=1),
]

# ----------------------------------------------------------------------------------------------
# model configs (HF config.json dicts)
# ----------------------------------------------------------------------------------------------


def target_config(vocab: int, eos_id: int, hidden=256, layers=8, inter=768, max_pos=2048) -> dict:
    """Qwen3.5 text decoder: layer i is full attention iff (i+1) % 4 == 0, else Gated DeltaNet."""
    types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]
    return dict(
        architectures=["Qwen3_5ForCausalLM"], model_type="qwen3_5_text", vocab_size=vocab,
        hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers, layer_types=types,
        full_attention_interval=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
        linear_conv_kernel_dim=4, hidden_act="silu", rms_norm_eps=1e-6, attention_bias=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                         "mrope_section": [8, 4, 4]},
        max_position_embeddings=max_pos, tie_word_embeddings=True, eos_token_id=eos_id,
        bos_token_id=None, pad_token_id=None, torch_dtype="bfloat16", dtype="bfloat16",
    )


def zlab_taps(n_target: int, n_draft: int) -> list[int]:
    """z-lab dflash `build_target_layer_ids`: one tap per drafter layer, spread over [1, n-3]."""
    if n_draft == 1:
        return [n_target // 2]
    start, end = 1, n_target - 3
    return [int(round(start + i * (end - start) / (n_draft - 1))) for i in range(n_draft)]


def drafter_config(tcfg: dict, mask_id: int, layers=2, inter=1024) -> dict:
    taps = zlab_taps(tcfg["num_hidden_layers"], layers)
    return dict(
        architectures=["DFlashDraftModel"], model_type="qwen3", hidden_size=tcfg["hidden_size"],
        intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        head_dim=64, hidden_act="silu", rms_norm_eps=1e-6, rope_theta=10000.0, attention_bias=False,
        max_position_embeddings=tcfg["max_position_embeddings"], vocab_size=tcfg["vocab_size"],
        tie_word_embeddings=False, block_size=BLOCK, num_target_layers=tcfg["num_hidden_layers"],
        dflash_config={"target_layer_ids": taps, "mask_token_id": mask_id}, torch_dtype="bfloat16",
    )


# ----------------------------------------------------------------------------------------------
# stage 1: corpus, tokenizer, prompts
# ----------------------------------------------------------------------------------------------


def is_heldout(relpath: str, every: int = 32) -> bool:
    """Deterministic held-out split: ~1/every of the files, by a hash of the path (not of the order)."""
    return int(hashlib.sha1(relpath.encode()).hexdigest(), 16) % every == 0


def stdlib_sources(root: str | None = None, max_bytes: int = 400_000) -> list[tuple[str, str]]:
    """(relative path, text) of the stdlib's .py files, sorted; skips site-/dist-packages, undecodable
    files and a few huge generated tables (> max_bytes)."""
    import sysconfig

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


def function_prompts(files, tok, n: int, seed: int, max_tokens: int = 96) -> list[str]:
    """Held-out prompts: function_snippets of held-out files, picked with a seeded shuffle, at most 2 per file."""
    cands = function_snippets(files, tok, max_tokens)
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(cands))
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


def write_prompts(path: str, prompts: list[str]) -> None:
    with open(path, "w") as f:
        f.write("# Held-out prompts (first lines of functions of held-out stdlib files; tools/train_tiny.py).\n")
        f.write("# One JSON string per line; lines starting with '#' are comments.\n")
        for p in prompts:
            f.write(json.dumps(p) + "\n")


def read_prompts(path: str) -> list[str]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip() and not line.startswith("#")]


def prepare(work: str, vocab: int = 4096, seed: int = 0, n_prompts: int = 24, prompts_out: str | None = None,
            stdlib: str | None = None) -> dict:
    t0 = time.time()
    os.makedirs(work, exist_ok=True)
    files = stdlib_sources(stdlib)
    train_f = [(r, t) for r, t in files if not is_heldout(r)]
    held_f = [(r, t) for r, t in files if is_heldout(r)]
    tok = train_tokenizer((t for _, t in train_f), vocab)
    tok.save(os.path.join(work, "tokenizer.json"))
    eos_id, mask_id = tok.token_to_id(EOS), tok.token_to_id(MASK)

    def stream(fs):
        enc = tok.encode_batch([t for _, t in fs])
        parts = []
        for e in enc:
            parts += [np.asarray(e.ids, dtype=np.uint16), np.asarray([eos_id], dtype=np.uint16)]
        return np.concatenate(parts)

    tr, he = stream(train_f), stream(held_f)
    tr.tofile(os.path.join(work, "train.u16"))
    he.tofile(os.path.join(work, "heldout.u16"))
    prompts = function_prompts(held_f, tok, n_prompts, seed)
    write_prompts(os.path.join(work, "prompts_heldout.txt"), prompts)
    if prompts_out:
        write_prompts(prompts_out, prompts)
    import sysconfig

    meta = dict(
        python=sys.version.split()[0], stdlib=stdlib or sysconfig.get_paths()["stdlib"],
        files=len(files), train_files=len(train_f), heldout_files=len(held_f),
        heldout_file_names=[r for r, _ in held_f], train_tokens=int(tr.size), heldout_tokens=int(he.size),
        train_bytes=sum(len(t.encode()) for _, t in train_f), vocab=tok.get_vocab_size(), eos_id=eos_id,
        mask_id=mask_id, prompts=len(prompts), seconds=round(time.time() - t0, 1),
    )
    with open(os.path.join(work, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
    print(f"prepare: {meta['files']} files ({meta['heldout_files']} held out), {meta['train_tokens']:,} train / "
          f"{meta['heldout_tokens']:,} held-out tokens, vocab {meta['vocab']}, {len(prompts)} prompts, "
          f"{meta['seconds']} s")
    return meta


# ----------------------------------------------------------------------------------------------
# fast, differentiable math (== export/target.py + export/gdn_ref.py, checked by selfcheck)
# ----------------------------------------------------------------------------------------------


def gdn_chunk_fast(q, k, v, g, beta, state=None, chunk: int = 64):
    """See _gdn_chunk_fast; runs with autocast off, so the state math stays fp32 in bf16 training."""
    with torch.autocast(q.device.type, enabled=False):
        return _gdn_chunk_fast(q, k, v, g, beta, state, chunk)


def _gdn_chunk_fast(q, k, v, g, beta, state=None, chunk: int = 64):
    """Gated delta rule, chunked WY form (DESIGN §2 step 4-5) with all chunks' intra-chunk work batched.
    q,k [B,T,Hk,dk]; v [B,T,Hv,dv]; g, beta [B,T,Hv]; state [B,Hv,dk,dv] or None (zeros). fp32 inside.
    Returns (o [B,T,Hv,dv] fp32, final state). Padding rows have beta=0, g=0: they change nothing."""
    B, T, Hk, dk = q.shape
    Hv, dv = v.shape[2], v.shape[3]
    f32 = torch.float32
    qh, kh = l2norm(q.to(f32)) * dk**-0.5, l2norm(k.to(f32))
    if Hv != Hk:
        qh, kh = qh.repeat_interleave(Hv // Hk, 2), kh.repeat_interleave(Hv // Hk, 2)
    v, g, beta = v.to(f32), g.to(f32), beta.to(f32)
    C = min(chunk, T)
    pad = (-T) % C
    if pad:
        qh, kh, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (qh, kh, v))
        g, beta = (F.pad(x, (0, 0, 0, pad)) for x in (g, beta))
    N = (T + pad) // C

    def heads(x):  # [B,Tp,Hv,(d)] -> [B,Hv,N,C,(d)]
        x = x.transpose(1, 2)
        return x.reshape(B, Hv, N, C, *x.shape[3:])

    Q, K, V, G, Bt = heads(qh), heads(kh), heads(v), heads(g), heads(beta)
    gam = G.cumsum(-1)
    lower = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    decay = torch.exp((gam[..., :, None] - gam[..., None, :]).masked_fill(~lower, float("-inf")))
    A = Bt[..., :, None] * (K @ K.transpose(-1, -2)) * decay.tril(-1)
    eye = torch.eye(C, dtype=f32, device=q.device)
    Tinv = torch.linalg.solve_triangular(eye + A, eye.expand_as(A), upper=False, unitriangular=True)
    eg = torch.exp(gam)
    W = Tinv @ ((Bt * eg)[..., None] * K)
    U = Tinv @ (Bt[..., None] * V)
    QK = (Q @ K.transpose(-1, -2)) * decay
    gC = gam[..., -1]
    tail = torch.exp(gC[..., None] - gam)[..., None]
    S = torch.zeros(B, Hv, dk, dv, dtype=f32, device=q.device) if state is None else state.to(f32)
    outs = []
    for n in range(N):
        Vn = U[:, :, n] - W[:, :, n] @ S
        outs.append(eg[:, :, n, :, None] * (Q[:, :, n] @ S) + QK[:, :, n] @ Vn)
        S = torch.exp(gC[:, :, n])[..., None, None] * S + K[:, :, n].transpose(-1, -2) @ (tail[:, :, n] * Vn)
    o = torch.stack(outs, 2).reshape(B, Hv, N * C, dv)[:, :, :T].transpose(1, 2)
    return o, S


def _gdn_layer(mod, x, conv_state=None, state=None, recurrent=False):
    """GatedDeltaNet.forward, dense. Returns (y, pre-conv cols, final GDN state)."""
    c = mod.cfg
    Hk, Hv, dk, dv = c.lin_num_k_heads, c.lin_num_v_heads, c.lin_k_dim, c.lin_v_dim
    B, T, _ = x.shape
    cols, z, b, a = mod.project(x)
    W = c.conv_kernel
    w = mod.conv1d.weight
    xt = cols.transpose(1, 2)
    full = F.pad(xt, (W - 1, 0)) if conv_state is None else torch.cat([conv_state.to(xt.dtype), xt], -1)
    mixed = F.silu(F.conv1d(full, w.to(xt.dtype), groups=w.shape[0])).transpose(1, 2)
    q, k, v = torch.split(mixed, [Hk * dk, Hk * dk, Hv * dv], dim=-1)
    g, beta = gdn_gates(a, b, mod.A_log, mod.dt_bias)
    q, k, v = q.reshape(B, T, Hk, dk), k.reshape(B, T, Hk, dk), v.reshape(B, T, Hv, dv)
    if recurrent:
        zero = torch.zeros(B, Hv, dk, dv, device=x.device) if state is None else state
        o, S = gdn_recurrent(q.float(), k.float(), v.float(), g.float(), beta.float(), zero.float())
    else:
        o, S = gdn_chunk_fast(q, k, v, g, beta, state)
    y = mod.out_proj(mod.norm(o.to(x.dtype), z).reshape(B, T, Hv * dv))
    return y, cols, S


def _sdpa(q, k, v, causal, scale, mask=None):
    """[B,T,H,d] layout in and out; GQA by repeating kv heads (portable across torch versions)."""
    r = q.shape[2] // k.shape[2]
    if r > 1:
        k, v = k.repeat_interleave(r, 2), v.repeat_interleave(r, 2)
    dt = q.dtype if q.dtype == k.dtype == v.dtype else torch.promote_types(q.dtype, k.dtype)
    o = F.scaled_dot_product_attention(q.transpose(1, 2).to(dt), k.transpose(1, 2).to(dt), v.transpose(1, 2).to(dt),
                                       attn_mask=mask, is_causal=causal, scale=scale)
    return o.transpose(1, 2)


def target_forward(model: TargetModel, ids, taps=(), with_logits=True):
    """Dense forward from zero state over ids [B,T] (positions 0..T-1), same math as TargetModel.step.
    Returns (logits fp32 or None, tap rows [B,T,len(taps)*H] or None)."""
    cfg = model.cfg
    B, T = ids.shape
    h = model.embed_tokens(ids)
    pos = torch.arange(T, device=ids.device)[None].expand(B, T)
    cos, sin = rope_cos_sin(pos, cfg.rotary_dim, cfg.rope_theta, h.dtype)
    tap_rows = {}
    for i, layer in enumerate(model.layers):
        x = layer.input_layernorm(h)
        if layer.is_attention:
            att = layer.self_attn
            q, gate, k, v = att.qkv(x, cos, sin)
            o = _sdpa(q, k, v, True, cfg.head_dim**-0.5)
            y = att.o_proj((o * torch.sigmoid(gate)).reshape(B, T, cfg.num_heads * cfg.head_dim))
        else:
            y, _, _ = _gdn_layer(layer.linear_attn, x)
        h = h + y
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        if i in taps:
            tap_rows[i] = h
    logits = model.logits(h) if with_logits else None
    return logits, (torch.cat([tap_rows[t] for t in taps], -1) if taps else None)


@torch.no_grad()
def greedy_generate(model: TargetModel, prompt, n_new: int):
    """Batched greedy continuation with incremental state (conv window, GDN state, KV cache).
    prompt [B,P] (P >= conv_kernel-1). Returns [B,P+n_new]. fp32 state, same math as the runtime."""
    cfg = model.cfg
    B, P = prompt.shape
    dev = prompt.device
    Tmax = P + n_new
    W = cfg.conv_kernel
    seq = torch.empty(B, Tmax, dtype=torch.long, device=dev)
    seq[:, :P] = prompt
    kcache = [torch.zeros(B, Tmax, cfg.num_kv_heads, cfg.head_dim, device=dev) for _ in cfg.attn_layers]
    vcache = [torch.zeros_like(kc) for kc in kcache]
    conv, gstate = {}, {}

    def run(ids, t0):
        T = ids.shape[1]
        h = model.embed_tokens(ids)
        pos = torch.arange(t0, t0 + T, device=dev)[None].expand(B, T)
        cos, sin = rope_cos_sin(pos, cfg.rotary_dim, cfg.rope_theta, h.dtype)
        ia = 0
        for i, layer in enumerate(model.layers):
            x = layer.input_layernorm(h)
            if layer.is_attention:
                att = layer.self_attn
                q, gate, k, v = att.qkv(x, cos, sin)
                kcache[ia][:, t0:t0 + T], vcache[ia][:, t0:t0 + T] = k, v
                o = _sdpa(q, kcache[ia][:, :t0 + T], vcache[ia][:, :t0 + T], T > 1, cfg.head_dim**-0.5)
                y = att.o_proj((o * torch.sigmoid(gate)).reshape(B, T, -1))
                ia += 1
            else:
                y, cols, S = _gdn_layer(layer.linear_attn, x, conv.get(i), gstate.get(i), recurrent=T == 1)
                prev = conv.get(i)
                allc = cols.transpose(1, 2) if prev is None else torch.cat([prev, cols.transpose(1, 2)], -1)
                conv[i], gstate[i] = allc[..., -(W - 1):], S
            h = h + y
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return model.logits(h[:, -1]).argmax(-1)

    nxt = run(prompt, 0)
    for t in range(P, Tmax):
        seq[:, t] = nxt
        if t + 1 < Tmax:
            nxt = run(seq[:, t:t + 1], t)
    return seq


def drafter_blocks(drafter: Drafter, ctx_hidden, anchors, block_ids):
    """DFlash training forward for many blocks per sequence at once (same math as Drafter.train_forward).
    ctx_hidden [B,T,F] (target taps at positions 0..T-1); anchors [B,A] (block a starts at position
    anchors[b,a] and sees ctx rows < anchors[b,a]); block_ids [B,A,Bs]. Returns logits [B,A,Bs,V]."""
    embed, lm_head = drafter._target
    cfg = drafter.cfg
    B, T, _ = ctx_hidden.shape
    A, Bs = block_ids.shape[1], block_ids.shape[2]
    dev = ctx_hidden.device
    c = drafter.hidden_norm(drafter.fc(ctx_hidden.to(drafter.fc.weight.dtype)))
    cpos = torch.arange(T, device=dev)[None].expand(B, T)
    ccos, csin = rope_cos_sin(cpos, cfg.head_dim, cfg.rope_theta, c.dtype)
    bpos = (anchors[:, :, None] + torch.arange(Bs, device=dev)).reshape(B, A * Bs)
    h = embed(block_ids.reshape(B, A * Bs)).to(c.dtype)
    cos, sin = rope_cos_sin(bpos, cfg.head_dim, cfg.rope_theta, h.dtype)
    ctx_ok = torch.arange(T, device=dev)[None, None, :] < anchors.repeat_interleave(Bs, 1)[:, :, None]
    blk = torch.arange(A, device=dev).repeat_interleave(Bs)
    own = (blk[:, None] == blk[None, :])[None].expand(B, -1, -1)
    mask = torch.cat([ctx_ok, own], -1)[:, None]  # [B,1,A*Bs,T+A*Bs]
    for layer in drafter.layers:
        att = layer.self_attn
        x = layer.input_layernorm(h)
        q = apply_rope(att.q_norm(att.q_proj(x).view(B, A * Bs, cfg.num_heads, cfg.head_dim)), cos, sin)
        kc, vc = att.kv(c, ccos, csin)
        kb, vb = att.kv(x, cos, sin)
        o = _sdpa(q, torch.cat([kc, kb], 1), torch.cat([vc, vb], 1), False, cfg.head_dim**-0.5, mask)
        h = h + att.o_proj(o.reshape(B, A * Bs, -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return lm_head(drafter.norm(h)).float().view(B, A, Bs, -1)


def reference_logits(model: TargetModel, ids):
    """TargetModel.step from zero pools (the reference path the runtime uses), fp32 logits [B,T,V]."""
    cfg = model.cfg
    B, T = ids.shape
    dev = ids.device
    dt = next(model.parameters()).dtype
    ps = 16
    nb = -(-T // ps) + 1
    kv = torch.zeros(len(cfg.attn_layers), 2, nb * B, ps, cfg.num_kv_heads, cfg.head_dim, device=dev, dtype=dt)
    gdn = torch.zeros(len(cfg.gdn_layers), B, cfg.lin_num_v_heads, cfg.lin_k_dim, cfg.lin_v_dim, device=dev)
    conv = torch.zeros(len(cfg.gdn_layers), B, cfg.conv_dim, cfg.conv_kernel - 1, device=dev, dtype=dt)
    pos = torch.arange(T, device=dev)[None].expand(B, T)
    bt = torch.arange(nb * B, device=dev).view(B, nb)
    zero = torch.zeros(B, dtype=torch.long, device=dev)
    out = model.step(ids, pos, torch.arange(B, device=dev), zero, bt, kv, gdn, conv, want_logits=True)
    return out["logits"]


# ----------------------------------------------------------------------------------------------
# init, save
# ----------------------------------------------------------------------------------------------


def init_weights(module, n_layers: int, gen: torch.Generator, std: float = 0.02):
    """GPT-style init: N(0, 0.02), residual-out projections scaled by 1/sqrt(2L); norms as the modules
    create them (zero-centred target norms 0, plain norms 1); GDN gates Mamba-style: A in [1,16],
    dt in [1e-3, 1e-1] (log-uniform) through dt_bias = softplus^-1(dt); conv like nn.Conv1d."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(1, 16, generator=gen).log())
            elif name.endswith("dt_bias"):
                dt = torch.exp(torch.empty(p.shape).uniform_(math.log(1e-3), math.log(1e-1), generator=gen))
                p.copy_(dt + torch.log(-torch.expm1(-dt)))
            elif "conv1d" in name:
                bound = 1 / math.sqrt(p.shape[-1])
                p.copy_(torch.empty(p.shape).uniform_(-bound, bound, generator=gen))
            elif "norm" in name:
                continue
            else:
                s = std / math.sqrt(2 * n_layers) if name.endswith(("o_proj.weight", "out_proj.weight",
                                                                    "down_proj.weight")) else std
                p.copy_(torch.randn(p.shape, generator=gen) * s)


def save_dir(module, config: dict, d: str, prefix: str = "", max_shard_bytes: int | None = None) -> list[str]:
    """config.json + bf16 safetensors; sharded HF-style (model-0000i-of-0000n + index) when the weights
    exceed max_shard_bytes (the GPU machine returns files of <= 16 MB)."""
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


# ----------------------------------------------------------------------------------------------
# stage 2: training
# ----------------------------------------------------------------------------------------------


class Log:
    def __init__(self, path: str | None):
        self.path, self.data, self.t0 = path, {"events": []}, time.time()

    def __call__(self, msg: str, **kv):
        t = round(time.time() - self.t0, 1)
        print(f"[{t:7.1f}s] {msg}", flush=True)
        if kv:
            self.data["events"].append(dict(t=t, **kv))

    def put(self, key, value):
        self.data[key] = value
        self.flush()

    def flush(self):
        if self.path:
            with open(self.path, "w") as f:
                json.dump(self.data, f, indent=1)


def cosine_lr(step, total, peak, warmup, floor=0.1):
    if step < warmup:
        return peak * (step + 1) / warmup
    p = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * p)))


def _param_groups(module, wd):
    decay = [p for n, p in module.named_parameters() if p.requires_grad and p.dim() == 2]
    rest = [p for n, p in module.named_parameters() if p.requires_grad and p.dim() != 2]
    return [{"params": decay, "weight_decay": wd}, {"params": rest, "weight_decay": 0.0}]


def _windows(data: torch.Tensor, n: int, L: int, gen: torch.Generator):
    starts = torch.randint(0, data.numel() - L, (n,), generator=gen)
    return torch.stack([data[s:s + L] for s in starts.tolist()])


def _autocast(dev):
    return torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda")


@torch.no_grad()
def eval_target(model, data, dev, L, n_windows, batch=16):
    """Mean next-token loss over n_windows consecutive (non-overlapping) windows of the held-out stream."""
    model.eval()
    n = min(n_windows, (data.numel() - 1) // L)
    tot, cnt = 0.0, 0
    for i in range(0, n, batch):
        x = torch.stack([data[j * L:j * L + L + 1] for j in range(i, min(n, i + batch))]).to(dev).long()
        with _autocast(dev):
            logits, _ = target_forward(model, x[:, :-1])
        tot += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum").item()
        cnt += x[:, 1:].numel()
    model.train()
    return tot / max(cnt, 1)


def train_target(model, train, held, dev, log, seconds, steps=None, batch=128, L=512, lr=2e-3, seed=0,
                 eval_every=200):
    gen = torch.Generator().manual_seed(seed + 1)
    opt = torch.optim.AdamW(_param_groups(model, 0.1), lr=lr, betas=(0.9, 0.95), eps=1e-8,
                            fused=dev.type == "cuda")
    model.train()
    warmup, total = 100, steps or 10**9
    t0 = time.time()
    hist = []
    step = 0
    best = (float("inf"), 0, None)
    while step < total:
        x = _windows(train, batch, L + 1, gen).to(dev, non_blocking=True).long()
        for gp in opt.param_groups:
            gp["lr"] = cosine_lr(step, total if total < 10**9 else 10**6, lr, warmup)
        with _autocast(dev):
            logits, _ = target_forward(model, x[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step == 10:
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t10 = time.time()
        if steps is None and step == 40:  # fit the schedule to the wall-clock budget
            if dev.type == "cuda":
                torch.cuda.synchronize()
            dt = (time.time() - t10) / 30
            total = max(50, int((seconds - (time.time() - t0)) / dt) + step)
            log(f"target: {dt * 1000:.1f} ms/step, {batch * L / dt / 1e3:.0f}k tok/s -> {total} steps",
                ms_per_step=dt * 1000, total_steps=total)
        if step % 50 == 0 or step == total:
            lv = loss.item()
            hist.append((step, lv))
            msg = f"target step {step}/{total} loss {lv:.3f} gnorm {gn.item():.2f} lr {opt.param_groups[0]['lr']:.2e}"
            kv = dict(stage="target", step=step, loss=lv)
            if step % eval_every == 0 or step == total:
                hl = eval_target(model, held, dev, L, 32)
                msg += f" | held-out {hl:.3f}"
                kv["heldout_loss"] = hl
                if hl < best[0]:  # keep the best snapshot (guards against overfitting the small corpus)
                    best = (hl, step, {k: v.detach().clone() for k, v in model.state_dict().items()})
            log(msg, **kv)
    if best[2] is not None and best[1] != step:
        model.load_state_dict(best[2])
        log(f"target: kept the snapshot of step {best[1]} (held-out {best[0]:.3f})")
    return dict(steps=step, seconds=time.time() - t0, tokens=step * batch * L, batch=batch, seq_len=L, peak_lr=lr,
                final_train_loss=hist[-1][1] if hist else None, kept_step=best[1] if best[2] is not None else step)


@torch.no_grad()
def make_drafter_data(model, data, dev, taps, gen, n_seqs, prompt_lens, total_len, batch, log, tag):
    """Greedy continuations of prompts cut from `data`, with the target's tap rows (fp32 math, bf16 store).
    Returns seqs [N,T] long, prompt length per seq [N], ctx [N,T,F] bf16 (on dev)."""
    model.eval()
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # labels = fp32 greedy, as the CPU runtime computes it
    seqs, plens, ctxs = [], [], []
    per = max(1, n_seqs // len(prompt_lens))
    t0 = time.time()
    for P in prompt_lens:
        for i in range(0, per, batch):
            nb = min(batch, per - i)
            prompt = _windows(data, nb, P, gen).to(dev).long()
            s = greedy_generate(model, prompt, total_len - P)
            _, c = target_forward(model, s, taps, with_logits=False)
            seqs.append(s)
            ctxs.append(c.to(torch.bfloat16))
            plens.append(torch.full((nb,), P, device=dev))
    if dev.type == "cuda":
        torch.cuda.synchronize()
    torch.backends.cuda.matmul.allow_tf32 = tf32
    seqs, plens, ctxs = torch.cat(seqs), torch.cat(plens), torch.cat(ctxs)
    log(f"drafter data ({tag}): {seqs.shape[0]} greedy continuations x {total_len} tokens, prompts {prompt_lens}, "
        f"{time.time() - t0:.1f} s")
    return seqs, plens, ctxs


def _sample_anchors(plens, T, A, gen_dev):
    """A anchors per sequence, uniform in [P, T-Bs] (the block's labels are all generated tokens)."""
    lo = plens.float()[:, None]
    r = torch.rand(plens.shape[0], A, device=plens.device, generator=gen_dev)
    return (lo + r * (T - BLOCK + 1 - lo)).long().clamp_(max=T - BLOCK)  # fp32 rounding can hit the bound


def _blocks(seqs, anchors, mask_id):
    idx = anchors[:, :, None] + torch.arange(BLOCK, device=seqs.device)
    labels = torch.gather(seqs, 1, idx.reshape(seqs.shape[0], -1)).view_as(idx)
    block = torch.full_like(labels, mask_id)
    block[:, :, 0] = labels[:, :, 0]
    return block, labels


def drafter_loss(drafter, ctx, seqs, anchors, mask_id, weights):
    block, labels = _blocks(seqs, anchors, mask_id)
    logits = drafter_blocks(drafter, ctx, anchors, block)[:, :, 1:]
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, :, 1:].reshape(-1), reduction="none")
    ce = ce.view(labels.shape[0], labels.shape[1], BLOCK - 1)
    return (ce * weights).sum(-1).mean() / weights.sum(), logits, labels


def train_drafter(drafter, data, dev, log, seconds, mask_id, steps=None, batch=64, anchors=32, lr=1.5e-3, seed=0,
                  decay_gamma=7.0):
    seqs, plens, ctx = data
    N, T = seqs.shape
    w = torch.exp(-torch.arange(BLOCK - 1, device=dev, dtype=torch.float32) / decay_gamma)  # w_j, j = 1..15
    gdev = torch.Generator(device=dev).manual_seed(seed + 2)
    opt = torch.optim.AdamW(_param_groups(drafter, 0.01), lr=lr, betas=(0.9, 0.95), fused=dev.type == "cuda")
    drafter.train()
    warmup, total, step = 50, steps or 10**9, 0
    t0 = time.time()
    perm, pi = torch.randperm(N, device=dev, generator=gdev), 0
    while step < total:
        if pi + batch > N:
            perm, pi = torch.randperm(N, device=dev, generator=gdev), 0
        idx = perm[pi:pi + batch]
        pi += batch
        anc = _sample_anchors(plens[idx], T, anchors, gdev)
        for gp in opt.param_groups:
            gp["lr"] = cosine_lr(step, total if total < 10**9 else 10**6, lr, warmup)
        with _autocast(dev):
            loss, _, _ = drafter_loss(drafter, ctx[idx], seqs[idx], anc, mask_id, w)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        step += 1
        if step == 10:
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t10 = time.time()
        if steps is None and step == 40:
            if dev.type == "cuda":
                torch.cuda.synchronize()
            dt = (time.time() - t10) / 30
            total = max(50, int((seconds - (time.time() - t0)) / dt) + step)
            log(f"drafter: {dt * 1000:.1f} ms/step -> {total} steps", ms_per_step=dt * 1000, total_steps=total)
        if step % 100 == 0 or step == total:
            log(f"drafter step {step}/{total} loss {loss.item():.3f}", stage="drafter", step=step, loss=loss.item())
    return dict(steps=step, seconds=time.time() - t0, batch_seqs=batch, anchors_per_seq=anchors, peak_lr=lr,
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
        P = int(p.min())
        anc = torch.arange(P, T - BLOCK + 1, stride, device=dev)[None].expand(s.shape[0], -1).contiguous()
        anc = torch.maximum(anc, p[:, None])
        block, labels = _blocks(s, anc, mask_id)
        with _autocast(dev):
            logits = drafter_blocks(drafter, c, anc, block)[:, :, 1:]
        ok = logits.argmax(-1) == labels[:, :, 1:]
        correct += ok.float().sum((0, 1))
        acc_len += ok.long().cumprod(-1).sum().item()
        nblk += ok.shape[0] * ok.shape[1]
    drafter.train()
    return (correct / nblk).tolist(), 1 + acc_len / nblk, nblk


def _round_bf16_(module):
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(p.to(torch.bfloat16).float())


def train(work: str, out: str, target_seconds=190.0, drafter_seconds=120.0, target_steps=None, drafter_steps=None,
          seed=0, device=None, n_gen=16384, gen_prompt_lens=(8, 32, 64, 128), gen_len=320, small=False,
          max_shard_mb=15, smoke=False, init_target=None, held_prompt_lens=None, drafter_gen_batch=4096):
    """Train target, then drafter; write out/target, out/drafter, out/train_log.json.
    small: tiny shapes; smoke: real shapes, tiny batches and data (both for CPU runs of the code path).
    init_target: a target checkpoint dir from an earlier run: skip target training, train the drafter only."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(seed)
    np.random.seed(seed)
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    os.makedirs(out, exist_ok=True)
    log = Log(os.path.join(out, "train_log.json"))
    with open(os.path.join(work, "meta.json")) as f:
        meta = json.load(f)
    train_tok = torch.from_numpy(np.fromfile(os.path.join(work, "train.u16"), dtype=np.uint16).astype(np.int32))
    held_tok = torch.from_numpy(np.fromfile(os.path.join(work, "heldout.u16"), dtype=np.uint16).astype(np.int32))
    log.put("meta", {k: v for k, v in meta.items() if k != "heldout_file_names"})
    log.put("device", torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu")
    log.put("torch", torch.__version__)

    tkw = dict(hidden=64, layers=4, inter=128) if small else {}
    tcfg_d = target_config(meta["vocab"], meta["eos_id"], **tkw)
    dcfg_d = drafter_config(tcfg_d, meta["mask_id"], inter=128 if small else 1024)
    taps = dcfg_d["dflash_config"]["target_layer_ids"]
    gen = torch.Generator().manual_seed(seed)
    if init_target:
        from dflash_trt.export.checkpoint import load_target

        with open(os.path.join(init_target, "config.json")) as f:
            tcfg_d = json.load(f)
        dcfg_d = drafter_config(tcfg_d, meta["mask_id"], inter=128 if small else 1024)
        taps = dcfg_d["dflash_config"]["target_layer_ids"]
        target = load_target(init_target, torch.float32, tap_ids=taps)
        tcfg = target.cfg
    else:
        tcfg = TargetConfig.from_dict(tcfg_d)
        target = TargetModel(tcfg, taps)
        init_weights(target, tcfg.num_layers, gen)
    target.to(dev)
    n_t = sum(p.numel() for p in target.parameters())
    log(f"target: {n_t / 1e6:.2f}M params, layers {tcfg.layer_types}, taps {taps}", target_params=n_t)
    log.put("target_config", tcfg_d)

    # ---- target ----
    lite = small or smoke
    L = 64 if lite else 512
    if init_target:
        tr = dict(loaded_from=init_target)
        log(f"target: loaded from {init_target} (not trained in this run)")
    else:
        tr = train_target(target, train_tok, held_tok, dev, log, target_seconds, target_steps,
                          batch=8 if lite else 128, L=L, seed=seed, eval_every=50 if lite else 300)
    _round_bf16_(target)  # the saved (bf16) model is the one that generates the drafter's data
    hl = eval_target(target, held_tok, dev, L, 64 if lite else 256)
    tr.update(heldout_loss=hl, heldout_ppl=math.exp(hl), heldout_tokens_evaluated=min(
        (64 if lite else 256), (held_tok.numel() - 1) // L) * L)
    log(f"target done: {tr.get('steps', 0)} steps in {tr.get('seconds', 0):.0f} s, held-out loss {hl:.3f} "
        f"(ppl {math.exp(hl):.2f})")
    log.put("target", tr)
    for p in target.parameters():
        p.requires_grad_(False)
    target.eval()
    if not init_target:
        save_dir(target, tcfg_d, os.path.join(out, "target"), prefix="model.",
                 max_shard_bytes=max_shard_mb * 2**20 if max_shard_mb else None)

    # the fast training math vs the reference path (TargetModel.step) on held-out text, fp32
    x = torch.stack([held_tok[i * 200:i * 200 + 128] for i in range(2)]).long()
    with torch.no_grad():
        ref = reference_logits(copy.deepcopy(target).cpu(), x)
        fast, _ = target_forward(target, x.to(dev))
        fast = fast.cpu()
    diff = (ref - fast).abs().max().item()
    agree = (ref.argmax(-1) == fast.argmax(-1)).float().mean().item()
    log(f"check: fast vs reference target logits max|diff| {diff:.2e}, argmax agreement {agree:.4f}")
    log.put("check_target_fast_vs_reference", dict(max_abs_diff=diff, argmax_agree=agree))

    # ---- drafter data: the target's greedy continuations ----
    gen_len_ = 96 if lite else gen_len
    plens = tuple(p for p in gen_prompt_lens if p + 2 * BLOCK <= gen_len_)
    t_gen = time.time()
    gbatch = drafter_gen_batch if dev.type == "cuda" else 16
    hplens = tuple(p for p in (held_prompt_lens or plens) if p + 2 * BLOCK <= gen_len_)
    train_data = make_drafter_data(target, train_tok, dev, taps, gen, 64 if lite else n_gen, plens, gen_len_,
                                   gbatch, log, "train")
    held_data = make_drafter_data(target, held_tok, dev, taps, gen, 16 if lite else 512, hplens, gen_len_,
                                  gbatch, log, "held-out")
    gen_s = time.time() - t_gen

    # ---- drafter ----
    dcfg = DrafterConfig.from_dict(dcfg_d)
    drafter = Drafter(dcfg, tcfg.hidden_size)
    init_weights(drafter, dcfg.num_layers, gen)
    drafter.to(dev).bind_target(target)
    n_d = sum(p.numel() for p in drafter.parameters())
    log(f"drafter: {n_d / 1e6:.2f}M params, {dcfg.num_layers} layers, block {BLOCK}, taps {taps}", drafter_params=n_d)
    log.put("drafter_config", dcfg_d)
    dr = train_drafter(drafter, train_data, dev, log, drafter_seconds, meta["mask_id"], drafter_steps,
                       batch=8 if lite else 64, anchors=8 if lite else 32, seed=seed)
    _round_bf16_(drafter)
    acc, tau, nblk = eval_drafter(drafter, held_data, meta["mask_id"], dev)
    acc_tr, tau_tr, _ = eval_drafter(drafter, tuple(t[:512] for t in train_data), meta["mask_id"], dev)
    dr.update(generation_seconds=gen_s, heldout_position_accuracy=acc, heldout_offline_tau=tau,
              heldout_blocks=nblk, train_position_accuracy=acc_tr, train_offline_tau=tau_tr)
    log("drafter per-position accuracy (held-out, slot 1..15): " + " ".join(f"{a:.2f}" for a in acc))
    log(f"drafter offline tau (gamma=15): held-out {tau:.2f}, train {tau_tr:.2f}")
    log.put("drafter", dr)
    save_dir(drafter, dcfg_d, os.path.join(out, "drafter"))

    # the fast drafter math vs Drafter.train_forward (reference), one sequence, 4 blocks
    s, p, c = (t[:1] for t in held_data)
    T_ = s.shape[1]
    anc = torch.tensor([[int(p[0]), int(p[0]) + 5, (int(p[0]) + T_ - BLOCK) // 2, T_ - BLOCK]], device=dev)
    block, _ = _blocks(s, anc, meta["mask_id"])
    with torch.no_grad():
        fast = drafter_blocks(drafter, c.float(), anc, block)[0].cpu()
        dc = copy.deepcopy(drafter).cpu().bind_target(copy.deepcopy(target).cpu())
        c, anc, block = c.float().cpu(), anc.cpu(), block.cpu()
        ctx_mask = torch.arange(s.shape[1])[None, None, :] < anc[0][:, None, None].expand(4, BLOCK, 1)
        ref = dc.train_forward(c.expand(4, -1, -1), torch.arange(s.shape[1])[None].expand(4, -1),
                               block[0], anc[0][:, None] + torch.arange(BLOCK), ctx_mask).float()
    ddiff = (fast - ref).abs().max().item()
    log(f"check: fast vs Drafter.train_forward logits max|diff| {ddiff:.2e}")
    log.put("check_drafter_fast_vs_reference", dict(max_abs_diff=ddiff))
    log.put("wall_seconds", round(time.time() - log.t0, 1))
    log(f"total wall {time.time() - log.t0:.0f} s")
    return log.data


# ----------------------------------------------------------------------------------------------
# stage 2b: drafter fine-tune on function-start continuations (the regime generate/demo/tests run in)
# ----------------------------------------------------------------------------------------------


@torch.no_grad()
def snippet_data(target, tok, snippets, n_new: int, dev, log, tag, batch: int = 256):
    """Greedy continuations (n_new tokens) of function-start snippets, grouped by prompt length.
    Returns seqs [N,Tmax] (right-padded with 0), prompt lengths [N], ctx [N,Tmax,F] bf16 (pad rows 0:
    a block at anchor a only sees ctx rows < a, and a + BLOCK - 1 < P + n_new, so pads are never read)."""
    t0 = time.time()
    enc = [tok.encode(s).ids for s in snippets]
    groups = {}
    for ids in enc:
        groups.setdefault(len(ids), []).append(ids)
    Tmax = max(groups) + n_new
    taps = target.tap_ids
    seqs, plens, ctxs = [], [], []
    for P in sorted(groups):
        g = groups[P]
        for i in range(0, len(g), batch):
            prompt = torch.tensor(g[i:i + batch], device=dev)
            sq = greedy_generate(target, prompt, n_new)
            _, c = target_forward(target, sq, taps, with_logits=False)
            seqs.append(F.pad(sq, (0, Tmax - sq.shape[1])))
            ctxs.append(F.pad(c, (0, 0, 0, Tmax - sq.shape[1])).to(torch.bfloat16))
            plens.append(torch.full((sq.shape[0],), P, device=dev))
    seqs, plens, ctxs = torch.cat(seqs), torch.cat(plens), torch.cat(ctxs)
    log(f"snippet data ({tag}): {seqs.shape[0]} function starts + {n_new} greedy tokens, "
        f"{len(groups)} prompt lengths, {time.time() - t0:.0f} s")
    return seqs, plens, ctxs


@torch.no_grad()
def simulate_tau(drafter, data, mask_id, n_new: int, data_new: int, gamma: int = BLOCK - 1, batch: int = 128):
    """Exact offline replay of greedy speculative decoding over the target's own continuations: block at
    anchor a (the bonus token's position), accept the all-correct prefix of the gamma drafts, next anchor
    a + accepted + 1, until n_new tokens (the first comes from prefill, as in Runtime.generate).
    data_new: how many greedy tokens each sequence holds after its prompt (>= n_new + BLOCK - 2 is exact)
    Returns (mean tau per sequence, pooled tau)."""
    seqs, plens, ctx = data
    drafter.eval()
    taus, tot_tok, tot_steps = [], 0, 0
    for i in range(0, seqs.shape[0], batch):
        s, p, c = seqs[i:i + batch], plens[i:i + batch], ctx[i:i + batch].float()
        B = s.shape[0]
        anc = p.clone()
        end = p + n_new  # sequence positions P .. P+n_new-1 are the new tokens
        acc_sum = torch.zeros(B, dtype=torch.long, device=s.device)
        steps = torch.zeros(B, dtype=torch.long, device=s.device)
        while True:
            live = anc + 1 < end  # Runtime.generate: loop while fewer than n_new tokens
            if not live.any():
                break
            a = torch.minimum(anc, p + data_new - BLOCK)[:, None]  # labels must exist (clamp only if data is short)
            block, labels = _blocks(s, a, mask_id)
            d = drafter_blocks(drafter, c, a, block)[:, 0, 1:gamma + 1].argmax(-1)
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


def tune(models: str, work: str, out: str | None = None, n_train: int = 6144, n_held: int = 256, n_new: int = 80,
         steps: int = 1800, batch: int = 32, anchors: int = 8, lr: float = 1e-3, seed: int = 0, device=None,
         decay_gamma: float = 7.0, n_lengths: int = 8) -> dict:
    """Fine-tune models/drafter on the target's continuations of function starts of training files
    (prompts like tests/prompts_heldout.txt, anchors in the first n_new-16 generated positions: the regime
    of generate/demo). Cheap enough for a CPU (a few minutes of generation, ~1 s a step)."""
    from dflash_trt.export.checkpoint import load_drafter, load_target, load_tokenizer

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(seed)
    out = out or models
    log = Log(None)
    tdir, ddir = os.path.join(models, "target"), os.path.join(models, "drafter")
    with open(os.path.join(ddir, "config.json")) as f:
        dcfg_d = json.load(f)
    taps = dcfg_d["dflash_config"]["target_layer_ids"]
    mask_id = dcfg_d["dflash_config"]["mask_token_id"]
    target = load_target(tdir, torch.float32, tap_ids=taps).to(dev)
    for p in target.parameters():
        p.requires_grad_(False)
    drafter = load_drafter(ddir, target, torch.float32).to(dev)
    drafter.bind_target(target)
    tok = load_tokenizer(tdir)
    with open(os.path.join(work, "meta.json")) as f:
        meta = json.load(f)
    files = stdlib_sources(meta.get("stdlib"))
    def pick(files_, n, n_lengths, rng):
        """n snippets whose token lengths are among the n_lengths most common ones (few length groups
        keep the batched greedy generation cheap on a CPU)."""
        sn = [x[1] for x in function_snippets(files_, tok)]
        lens = [len(tok.encode(x).ids) for x in sn]
        common = sorted(set(lens), key=lambda L: (-lens.count(L), L))[:n_lengths]
        sn = [x for x, L in zip(sn, lens) if L in common]
        return [sn[i] for i in rng.permutation(len(sn))[:n]]

    tr_sn = pick([f for f in files if not is_heldout(f[0])], n_train, n_lengths, np.random.default_rng(seed + 3))
    he_sn = pick([f for f in files if is_heldout(f[0])], n_held, 4, np.random.default_rng(3))  # fixed eval set
    key = hashlib.sha1(json.dumps([tr_sn, he_sn, n_new]).encode() + open(os.path.join(tdir, "model.safetensors"),
                                                                          "rb").read()).hexdigest()[:12]
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
    w = torch.exp(-torch.arange(BLOCK - 1, device=dev, dtype=torch.float32) / decay_gamma)
    gdev = torch.Generator(device=dev).manual_seed(seed + 4)
    opt = torch.optim.AdamW(_param_groups(drafter, 0.01), lr=lr, betas=(0.9, 0.95))
    drafter.train()
    t0 = time.time()
    perm, pi = torch.randperm(N, device=dev, generator=gdev), 0
    for step in range(steps):
        if pi + batch > N:
            perm, pi = torch.randperm(N, device=dev, generator=gdev), 0
        idx = perm[pi:pi + batch]
        pi += batch
        p = plens[idx]
        r = torch.rand(batch, anchors, device=dev, generator=gdev)
        span = n_new - BLOCK + 1
        anc = (p[:, None].float() + r * span).long().clamp_(max=p[:, None] + span - 1)
        for gp in opt.param_groups:
            gp["lr"] = cosine_lr(step, steps, lr, 30)
        with _autocast(dev):
            loss, _, _ = drafter_loss(drafter, ctx[idx].float(), seqs[idx], anc, mask_id, w)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        if (step + 1) % 50 == 0 or step + 1 == steps:
            log(f"tune step {step + 1}/{steps} loss {loss.item():.3f}", stage="tune", step=step + 1, loss=loss.item())
    tune_s = time.time() - t0
    _round_bf16_(drafter)
    after = simulate_tau(drafter, held_data, mask_id, 64, n_new)
    acc, otau, _ = eval_drafter(drafter, held_data, mask_id, dev)
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


# ----------------------------------------------------------------------------------------------
# stage 3: finalize
# ----------------------------------------------------------------------------------------------


def finalize(src: str, work: str, models: str, target_src: str | None = None) -> None:
    """src (train's out dir) -> models/target, models/drafter (single bf16 safetensors each) + tokenizer,
    generation config, the training log."""
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
    print(f"finalize: {models}/target {sizes['target'] / 1e6:.1f} MB, {models}/drafter {sizes['drafter'] / 1e6:.1f} MB")


# ----------------------------------------------------------------------------------------------
# selfcheck (CPU)
# ----------------------------------------------------------------------------------------------


def selfcheck(seed: int = 0) -> None:
    """The fast math here against the project's reference modules, fp32/fp64 on CPU."""
    from dflash_trt.export.gdn_ref import gdn_chunk_wy16

    g = torch.Generator().manual_seed(seed)
    B, T, Hk, Hv, dk, dv = 2, 77, 2, 4, 8, 6
    q, k = torch.randn(B, T, Hk, dk, generator=g, dtype=torch.float64), torch.randn(B, T, Hk, dk, generator=g,
                                                                                    dtype=torch.float64)
    v = torch.randn(B, T, Hv, dv, generator=g, dtype=torch.float64)
    gg = -torch.rand(B, T, Hv, generator=g, dtype=torch.float64) * 2
    beta = torch.rand(B, T, Hv, generator=g, dtype=torch.float64)
    S0 = torch.randn(B, Hv, dk, dv, generator=g, dtype=torch.float64)
    ref = gdn_chunk_wy16(q, k, v, gg, beta, S0)
    for C in (16, 32, 64):
        o, S = gdn_chunk_fast(q, k, v, gg, beta, S0.float(), chunk=C)
        e = max((o - ref.o).abs().max().item(), (S - ref.state).abs().max().item())
        print(f"selfcheck gdn_chunk_fast (chunk {C}) vs gdn_chunk_wy16: max|diff| {e:.1e}")
        assert e < 1e-3, e

    tcfg_d = target_config(300, 0, hidden=64, layers=4, inter=96)
    tcfg = TargetConfig.from_dict(tcfg_d)
    taps = zlab_taps(4, 2)
    model = TargetModel(tcfg, taps)
    init_weights(model, 4, g, std=0.1)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(0.1 * torch.randn(p.shape, generator=g))
    ids = torch.randint(0, 300, (2, 40), generator=g)
    with torch.no_grad():
        ref = reference_logits(model, ids)
        fast, _ = target_forward(model, ids)
        e = (ref - fast).abs().max().item()
    print(f"selfcheck target_forward vs TargetModel.step: max|diff| {e:.1e}")
    assert e < 1e-4, e
    with torch.no_grad():
        seq = greedy_generate(model, ids[:, :10], 20)
        s2 = ids[:, :10]
        for _ in range(20):  # greedy by full recompute
            lg, _ = target_forward(model, s2)
            s2 = torch.cat([s2, lg[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(seq, s2), (seq, s2)
    print("selfcheck greedy_generate (incremental) == greedy by full recompute")

    dcfg_d = drafter_config(tcfg_d, 1, layers=2, inter=96)
    dcfg_d.update(head_dim=16)
    drafter = Drafter(DrafterConfig.from_dict(dcfg_d), 64).bind_target(model)
    init_weights(drafter, 2, g, std=0.1)
    with torch.no_grad():
        _, ctx = target_forward(model, ids, taps, with_logits=False)
        anc = torch.tensor([[3, 10, 24], [1, 17, 24]])
        block, _ = _blocks(ids, anc, 1)
        fast = drafter_blocks(drafter, ctx, anc, block)
        e = 0.0
        for b in range(2):
            cm = torch.arange(40)[None, None, :] < anc[b][:, None, None].expand(3, BLOCK, 1)
            ref = drafter.train_forward(ctx[b:b + 1].expand(3, -1, -1), torch.arange(40)[None].expand(3, -1),
                                        block[b], anc[b][:, None] + torch.arange(BLOCK), cm)
            e = max(e, (ref - fast[b]).abs().max().item())
    print(f"selfcheck drafter_blocks vs Drafter.train_forward: max|diff| {e:.1e}")
    assert e < 1e-4, e


# ----------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="train_tiny", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sp = sub.add_parser("prepare")
    sp.add_argument("--work", default=".train_data")
    sp.add_argument("--vocab", type=int, default=4096)
    sp.add_argument("--prompts", type=int, default=24)
    sp.add_argument("--prompts-out", default=None)
    sp.add_argument("--stdlib", default=None, help="stdlib dir (default: sysconfig's)")
    sp.add_argument("--seed", type=int, default=0)
    for name in ("train", "all"):
        tp = sub.add_parser(name)
        tp.add_argument("--work", default=".train_data")
        tp.add_argument("--out", required=True)
        tp.add_argument("--target-seconds", type=float, default=190)
        tp.add_argument("--drafter-seconds", type=float, default=120)
        tp.add_argument("--target-steps", type=int, default=None, help="pin the step count (else fit to seconds)")
        tp.add_argument("--drafter-steps", type=int, default=None)
        tp.add_argument("--n-gen", type=int, default=16384, help="greedy continuations for the drafter")
        tp.add_argument("--device", default=None)
        tp.add_argument("--small", action="store_true", help="tiny shapes, for a CPU smoke run")
        tp.add_argument("--smoke", action="store_true", help="real shapes, tiny batches/data (CPU smoke run)")
        tp.add_argument("--max-shard-mb", type=int, default=15)
        tp.add_argument("--init-target", default=None, help="target dir of an earlier run: train the drafter only")
        tp.add_argument("--held-prompt-lens", default=None, help="comma list, prompt lengths of held-out continuations")
        tp.add_argument("--seed", type=int, default=0)
        if name == "all":
            tp.add_argument("--models", default="models")
            tp.add_argument("--prompts-out", default=None)
    fp = sub.add_parser("finalize")
    fp.add_argument("--src", required=True)
    fp.add_argument("--work", default=".train_data")
    fp.add_argument("--models", default="models")
    fp.add_argument("--target-src", default=None, help="take target/ (and its log) from this run's dir instead")
    up = sub.add_parser("tune")
    up.add_argument("--models", default="models")
    up.add_argument("--work", default=".train_data")
    up.add_argument("--out", default=None, help="where drafter/ goes (default: --models, in place)")
    up.add_argument("--n-train", type=int, default=6144)
    up.add_argument("--steps", type=int, default=1800)
    up.add_argument("--device", default=None)
    up.add_argument("--lr", type=float, default=1e-3)
    up.add_argument("--anchors", type=int, default=8)
    up.add_argument("--seed", type=int, default=0)
    up.add_argument("--lengths", type=int, default=8, help="use snippets of the N most common token lengths")
    up.add_argument("--decay-gamma", type=float, default=7.0, help="loss weight exp(-(j-1)/gamma) of slot j")
    sub.add_parser("selfcheck")
    a = p.parse_args(argv)
    if a.cmd == "prepare":
        prepare(a.work, a.vocab, a.seed, a.prompts, a.prompts_out, a.stdlib)
    elif a.cmd in ("train", "all"):
        if a.cmd == "all":
            prepare(a.work, seed=a.seed, prompts_out=a.prompts_out)
        train(a.work, a.out, a.target_seconds, a.drafter_seconds, a.target_steps, a.drafter_steps, a.seed,
              a.device, n_gen=a.n_gen, small=a.small, max_shard_mb=a.max_shard_mb,
              smoke=a.smoke, init_target=a.init_target,
              held_prompt_lens=[int(x) for x in a.held_prompt_lens.split(",")] if a.held_prompt_lens else None)
        if a.cmd == "all":
            finalize(a.out, a.work, a.models)
            for kw in SHIPPED_TUNES:
                tune(a.models, a.work, a.models, device=a.device, **kw)
    elif a.cmd == "tune":
        tune(a.models, a.work, a.out, n_train=a.n_train, steps=a.steps, device=a.device, lr=a.lr, anchors=a.anchors,
             seed=a.seed, n_lengths=a.lengths, decay_gamma=a.decay_gamma)
    elif a.cmd == "finalize":
        finalize(a.src, a.work, a.models, a.target_src)
    else:
        selfcheck()
    return 0


if __name__ == "__main__":
    sys.exit(main())
