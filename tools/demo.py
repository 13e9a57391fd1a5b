"""`dflash-trt demo`: the embedded default model, on CPU, plain greedy vs DFlash — same tokens, fewer steps.

Model: the trained pair shipped under models/ when present; otherwise a tiny seeded random pair
created once into the cache dir (~/.cache/dflash_trt, or $DFLASH_TRT_CACHE).
"""
from __future__ import annotations

import argparse
import os

from dflash_trt.abi import PoolSizes
from dflash_trt.args import gamma_arg
from dflash_trt.config import cache_root
from dflash_trt.log import progress

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHIPPED = os.path.join(REPO, "models")
DEFAULT_PROMPT = 'def test_trailing_garbage(self):\n    data = tarfile.TarInfo("foo").tobuf()'


def default_pair() -> tuple[str, str, str]:
    """(target dir, drafter dir, description)."""
    t, d = os.path.join(SHIPPED, "target"), os.path.join(SHIPPED, "drafter")
    if os.path.isfile(os.path.join(t, "config.json")) and os.path.isfile(os.path.join(d, "config.json")):
        return t, d, "trained tiny pair shipped in models/"
    from dflash_trt.optional import require_torch
    from dflash_trt.runtime.load import UsageError

    require_torch("creating the demo's tiny random model (no models/ shipped)", UsageError)
    from dflash_trt.tools.tiny import make_tiny_pair

    root = os.path.join(cache_root(), "tiny-random-seed0")
    if not os.path.isfile(os.path.join(root, "drafter", "model.safetensors")):
        make_tiny_pair(root, seed=0)
    return os.path.join(root, "target"), os.path.join(root, "drafter"), f"tiny random pair (seed 0) in {root}"


# --gamma's default, resolved to the drafter's block size - 1: an object no typed --gamma can equal (argparse passes
# a non-string default as is)
TRAINED_BLOCK = object()


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", default=DEFAULT_PROMPT)
    p.add_argument("--max-new-tokens", type=int, default=96)
    # the shipped drafter's trained block (16): the width the demo shows; auto's default cost model is not measured
    # and on ONNX Runtime on the CPU it picks narrow widths (docs/PERF.md)
    p.add_argument("--gamma", type=gamma_arg, default=TRAINED_BLOCK,
                   help="drafts per step (default: the drafter's block size - 1), or auto: chosen per step")
    p.add_argument("--backend", default="ort", choices=["ort", "torch"],
                   help="ort: ONNX graphs on ONNX Runtime (exported once, cached); torch: reference modules")


def run(args) -> int:
    from dflash_trt.config import DrafterConfig, read_json
    from dflash_trt.runtime.load import UsageError, load_runtime
    from dflash_trt.runtime.runtime import check_gamma
    from dflash_trt.abi import verify_widths

    if args.max_new_tokens < 1:  # checked before the (possibly slow) export / weight load
        raise UsageError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    tdir, ddir, what = default_pair()
    block = DrafterConfig.from_dict(read_json(os.path.join(ddir, "config.json"))).block_size
    args.gamma = block - 1 if args.gamma is TRAINED_BLOCK else args.gamma  # None: auto
    if args.gamma is not None:
        check_gamma(args.gamma, block)
    progress(f"model: {what}\nbackend: {args.backend} (CPU)")
    # the default pools, as `generate` and `bench` use them: the three share one cached export
    rt, codec = load_runtime(tdir, ddir, args.backend, PoolSizes(), ks=verify_widths(args.gamma, block, True))
    ids = codec.encode(args.prompt)
    plain, sp = rt.generate(ids, args.max_new_tokens, spec=False)
    spec, ss = rt.generate(ids, args.max_new_tokens, gamma=args.gamma)
    print("----- prompt + generated -----")
    print(args.prompt + codec.decode(spec))
    print("------------------------------")
    print(f"plain : {sp.new_tokens} tokens, {sp.target_steps + 1} target launches, {sp.tokens_per_s:.1f} tok/s")
    print(f"dflash: {ss.new_tokens} tokens, {ss.target_steps + 1} target launches, tau={ss.tau:.2f}, "
          f"{ss.tokens_per_s:.1f} tok/s")
    same = plain == spec
    print(f"identical tokens: {same}")
    return 0 if same else 1
