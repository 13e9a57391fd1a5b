"""`dflash-trt generate`: load a target (+ drafter) checkpoint dir, run greedy / DFlash generation, print stats."""
from __future__ import annotations

import argparse
import os

from dflash_trt.config import DrafterConfig, read_json
from dflash_trt.runtime.load import load_runtime


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="target checkpoint dir (HF format)")
    p.add_argument("--drafter", help="DFlash drafter checkpoint dir")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--gamma", type=int, default=None, help="drafts per step (default block_size-1)")
    p.add_argument("--no-spec", action="store_true", help="plain greedy decoding")
    p.add_argument("--backend", default="torch", choices=["torch", "ort"])
    p.add_argument("--device", default="cpu", help="cpu, or cuda[:N] (pools on the GPU, one CUDA graph per step)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="model / KV dtype on cuda (default float32; CPU runs float32)")


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
    rt, codec = load_runtime(args.model, args.drafter, args.backend, ks=ks, device=args.device, dtype=args.dtype)
    ids = codec.encode(args.prompt)
    out, st = rt.generate(ids, args.max_new_tokens, gamma=args.gamma, spec=not args.no_spec)
    print(codec.decode(out))
    mode = "plain" if (args.no_spec or rt.dcfg is None) else "dflash"
    print(f"[{mode}] backend={args.backend} device={args.device} prompt={st.prompt_tokens} new={st.new_tokens} "
          f"target_steps={st.target_steps} tau={st.tau:.2f} tok/s={st.tokens_per_s:.1f}"
          + (" (includes capturing the CUDA graphs: see `dflash-trt bench e2e` for speed)" if args.device != "cpu" else ""))
    return 0
