"""`load_runtime`: checkpoint directories -> a ready `Runtime` over one backend, plus the text codec.

The one place that wires a target (+ drafter) to a backend; the CLI, demo, bench and tests call it.
"""
from __future__ import annotations

from dflash_trt.abi import DEFAULT_KS, PoolSizes
from dflash_trt.runtime.runtime import Runtime


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


def load_codec(model_dir: str):
    """tokenizer.json of the target when present, else UTF-8 bytes."""
    from dflash_trt.export.checkpoint import load_tokenizer

    tok = load_tokenizer(model_dir)
    return TokenizerCodec(tok) if tok is not None else ByteCodec()


def load_runtime(model_dir: str, drafter_dir: str | None = None, backend: str = "torch",
                 sizes: PoolSizes | None = None, gate=None, ks=DEFAULT_KS) -> tuple[Runtime, object]:
    """Build a Runtime over the chosen backend; returns (runtime, codec).
    torch: the reference modules (fp32, CPU); ort: the ONNX graphs for verify widths `ks`, exported once
    into the cache (keyed by both checkpoint hashes, sizes and exporter version) and reused after."""
    from dflash_trt.runtime.backends import make_backend

    codec = load_codec(model_dir)
    if backend == "ort":
        from dflash_trt.export.onnx_export import ensure_export

        be = make_backend("ort", manifest=ensure_export(model_dir, drafter_dir, ks=ks, sizes=sizes or PoolSizes()))
        return Runtime(be, be.tcfg, be.dcfg, be.sizes, gate=gate), codec
    import torch

    from dflash_trt.export.checkpoint import load_drafter, load_target

    target = load_target(model_dir, torch.float32)
    drafter = load_drafter(drafter_dir, target, torch.float32) if drafter_dir else None
    be = make_backend(backend, target=target, drafter=drafter)
    return Runtime(be, target.cfg, drafter.cfg if drafter else None, sizes or PoolSizes(), gate=gate), codec
