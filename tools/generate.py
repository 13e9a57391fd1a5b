"""`dflash-trt generate`: load a target (+ drafter) checkpoint dir, run greedy / DFlash generation, print stats."""
from __future__ import annotations

import argparse
import os

from ..abi import PoolSizes
from ..config import DrafterConfig, read_json


class ByteCodec:
    """Fallback text codec for checkpoints without tokenizer.json: UTF-8 bytes are token ids 0..255."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class TokenizerCodec:
    def __init__(self, tok):
        self.tok = tok

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text).ids

    def decode(self, ids) -> str:
        return self.tok.decode(list(ids))


def load_runtime(model_dir: str, drafter_dir: str | None, backend: str = "torch", sizes: PoolSizes | None = None,
                 gate=None, ks=(1, 2, 3, 4, 8, 16)):
    """Build a Runtime over the chosen backend; returns (runtime, codec).
    torch: the reference modules; ort: the ONNX graphs for verify widths `ks`, exported once into the
    cache (keyed by both checkpoint hashes, sizes and exporter version) and reused after."""
    from ..export.checkpoint import load_tokenizer
    from ..runtime.backends import make_backend
    from ..runtime.runtime import Runtime

    tok = load_tokenizer(model_dir)
    codec = TokenizerCodec(tok) if tok is not None else ByteCodec()
    if backend == "ort":
        from ..export.onnx_export import ensure_export

        be = make_backend("ort", manifest=ensure_export(model_dir, drafter_dir, ks=ks, sizes=sizes or PoolSizes()))
        return Runtime(be, be.tcfg, be.dcfg, be.sizes, gate=gate), codec

    import torch

    from ..export.checkpoint import load_drafter, load_target

    taps = None
    if drafter_dir:
        p = os.path.join(drafter_dir, "config.json")
        taps = DrafterConfig.from_dict(read_json(p), p).target_layer_ids
    target = load_target(model_dir, torch.float32, tap_ids=taps)
    drafter = load_drafter(drafter_dir, target, torch.float32) if drafter_dir else None
    be = make_backend(backend, target=target, drafter=drafter)
    return Runtime(be, target.cfg, drafter.cfg if drafter else None, sizes or PoolSizes(), gate=gate), codec


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="target checkpoint dir (HF format)")
    p.add_argument("--drafter", help="DFlash drafter checkpoint dir")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--gamma", type=int, default=None, help="drafts per step (default block_size-1)")
    p.add_argument("--no-spec", action="store_true", help="plain greedy decoding")
    p.add_argument("--backend", default="torch", choices=["torch", "ort"])


def verify_widths(gamma: int | None, block_size: int | None, spec: bool) -> tuple:
    """The target graphs a run needs: K=1 (prefill tail / plain decode) and K=γ+1 when speculating."""
    if not spec or block_size is None:
        return (1,)
    return tuple(sorted({1, (gamma if gamma is not None else block_size - 1) + 1}))


def run(args) -> int:
    block = None
    if args.drafter:
        p = os.path.join(args.drafter, "config.json")
        block = DrafterConfig.from_dict(read_json(p), p).block_size
    ks = verify_widths(args.gamma, block, not args.no_spec)
    rt, codec = load_runtime(args.model, args.drafter, args.backend, ks=ks)
    ids = codec.encode(args.prompt)
    out, st = rt.generate(ids, args.max_new_tokens, gamma=args.gamma, spec=not args.no_spec)
    print(codec.decode(out))
    mode = "plain" if (args.no_spec or rt.dcfg is None) else "dflash"
    print(f"[{mode}] backend={args.backend} prompt={st.prompt_tokens} new={st.new_tokens} "
          f"target_steps={st.target_steps} tau={st.tau:.2f} tok/s={st.tokens_per_s:.1f}")
    return 0
