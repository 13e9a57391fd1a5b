"""`dflash-trt generate`: load a target (+ drafter) checkpoint dir, run greedy / sampled, plain / DFlash generation,
print stats."""
from __future__ import annotations

import argparse

from dflash_trt.abi import PoolSizes, verify_widths
from dflash_trt.config import ConfigError
from dflash_trt.args import GAMMA_HELP, gamma_arg
from dflash_trt.log import progress
from dflash_trt.runtime.load import (UsageError, check_checkpoint_dir, check_tensor_parallel, default_sizes,
                                     drafter_block_size, load_runtime)
from dflash_trt.runtime.runtime import check_gamma
from dflash_trt.runtime.sampling import SamplingParams
from dflash_trt.runtime.sequence import TokenIdError


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="target checkpoint dir (HF format)")
    p.add_argument("--drafter", help="DFlash drafter checkpoint dir")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt")
    src.add_argument("--prompt-file", help="read the prompt from this file (UTF-8)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--max-seq-len", type=int, default=None,
                   help=f"positions per sequence: prompt + new tokens + verify width (default {PoolSizes().max_seq_len})")
    p.add_argument("--gamma", type=gamma_arg, default="auto", help=GAMMA_HELP)
    p.add_argument("--no-spec", action="store_true", help="plain decoding (no drafter steps)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy; > 0: sample")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus: the smallest set of mass >= p (1: off)")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p x the top token's (0: off)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed: the same seed gives the same tokens")
    p.add_argument("--backend", default="torch", choices=["torch", "ort", "trt"],
                   help="trt: TensorRT engines on the GPU (TensorRT-RTX: CC 8.0/8.6/8.9/12.x; full TensorRT: Hopper)")
    p.add_argument("--device", default="cpu", help="cpu, or cuda[:N] (pools on the GPU, one CUDA graph per step)")
    add_engines_arg(p)
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="model / KV dtype on cuda (default: the checkpoint's 16-bit dtype for the torch backend, else float32; "
                        "CPU runs float32)")
    add_memory_arg(p)
    add_ctx_window_arg(p)
    add_compile_arg(p)
    add_drafter_fp8_arg(p)
    add_tensor_parallel_arg(p)


def add_drafter_fp8_arg(p) -> None:
    """--drafter-fp8 / --no-drafter-fp8, as generate and serve take it."""
    p.add_argument("--drafter-fp8", action=argparse.BooleanOptionalAction, default=None,
                   help="cuda + torch: the drafter's projections in FP8 blocks (half its bytes; drafts may differ, the "
                        "tokens never do); default: on when the target is an FP8 checkpoint")


def add_compile_arg(p) -> None:
    """--compile / --no-compile, as generate and serve take it."""
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="cuda + torch: prefill/decode/spec steps through Inductor, the default there (a compile per "
                        "step shape on first use, stored in the cache: later processes load it); --no-compile: eager steps")


def compile_choice(args) -> bool:
    """Whether the run compiles its steps: --compile / --no-compile as given, else wherever it applies (the torch
    backend on a GPU). An explicit --compile where it cannot apply is one UsageError line."""
    applies = args.device != "cpu" and args.backend == "torch"
    if args.compile and not applies:
        raise UsageError("--compile compiles the torch backend's GPU steps: it needs --device cuda --backend torch")
    return applies if args.compile is None else bool(args.compile)


def add_tensor_parallel_arg(p) -> None:
    """--tensor-parallel N, as generate and serve take it."""
    p.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                   help="torch: split the target over N processes (gloo on cpu; nccl on cuda, one GPU each)")


def add_memory_arg(p) -> None:
    """--gpu-memory-utilization F, as generate and serve take it."""
    p.add_argument("--gpu-memory-utilization", type=float, default=None, metavar="F",
                   help="cuda + torch: KV pools take what this fraction of the GPU's memory leaves after the weights "
                        "(default: fixed pools)")


def add_engines_arg(p) -> None:
    """--engines DIR, as generate and serve take it."""
    p.add_argument("--engines", default=None, metavar="DIR",
                   help="ort / trt: run this `dflash-trt export --out` directory instead of the cached export")


def runtime_of(args, max_seqs: int | None = None, tensor_parallel_size: int = 1):
    """(runtime, codec) of a command's --model / --drafter / --gamma / --no-spec / --backend / --device / --dtype /
    --max-seq-len / --ctx-window / --engines / --gpu-memory-utilization / --compile, the arguments checked before any
    weight loads. With --engines and no --max-seq-len or --ctx-window, the export's own sizes."""
    check_checkpoint_dir(args.model, "--model")
    chunk = default_sizes(args.model).prefill_chunk if args.engines is None else None  # else the export's default
    ctx = getattr(args, "ctx_window", None)
    sizes = (run_sizes(args.max_seq_len, max_seqs, chunk, ctx)
             if args.engines is None or (args.max_seq_len, max_seqs, ctx) != (None, None, None) else None)
    ks = checked_widths(args, user_export=args.engines is not None)
    return load_runtime(args.model, args.drafter, args.backend, sizes=sizes, ks=ks, device=args.device,
                        dtype=args.dtype, compile_steps=compile_choice(args), export_dir=args.engines,
                        gpu_memory_utilization=args.gpu_memory_utilization, tensor_parallel_size=tensor_parallel_size,
                        drafter_fp8=args.drafter_fp8)


def checked_widths(args, user_export: bool = False) -> tuple | None:
    """--model / --drafter / --gamma checked before any weight loads (a bad one costs nothing); the verify widths
    the run needs."""
    check_checkpoint_dir(args.model, "--model")
    block = drafter_block_size(args.drafter)
    if block is not None and args.gamma is not None and not args.no_spec:
        check_gamma(args.gamma, block)
    return verify_widths(args.gamma, block, not args.no_spec, user_export=user_export)


def run_sizes(max_seq_len: int | None, max_seqs: int | None = None, prefill_chunk: int | None = None,
              ctx_window: int | None = None) -> PoolSizes:
    """Default pools, with max_seq_len / max_seqs raised (target and drafter KV pages to match) when asked and the
    model's prefill chunk (abi.default_prefill_chunk; None: PoolSizes' default); PoolSizes validates the values.
    ctx_window: the drafter's context rows (None: full retention, the default)."""
    if ctx_window is not None and ctx_window < 1:  # PoolSizes reads 0 as "full retention"
        raise ConfigError(f"pool size ctx_window (--ctx-window) must be a positive integer, got {ctx_window!r}")
    d = PoolSizes() if prefill_chunk is None else PoolSizes(prefill_chunk=prefill_chunk)
    shape = PoolSizes(max_seq_len=d.max_seq_len if max_seq_len is None else max_seq_len,
                      max_seqs=d.max_seqs if max_seqs is None else max_seqs,
                      prefill_chunk=d.prefill_chunk, ctx_window=ctx_window or 0)  # checks them
    if (max_seq_len, max_seqs, ctx_window) == (None, None, None):
        return d
    pages = max(d.kv_blocks, shape.max_blocks * shape.max_seqs)
    ctx_pages = max(d.dkv_blocks, shape.max_ctx_blocks * shape.max_seqs)
    return PoolSizes(max_seq_len=shape.max_seq_len, max_seqs=shape.max_seqs, kv_blocks=pages, dkv_blocks=ctx_pages,
                     prefill_chunk=d.prefill_chunk, ctx_window=shape.ctx_window)


def add_ctx_window_arg(p) -> None:
    """--ctx-window N, as generate, serve and build --backend torch take it."""
    p.add_argument("--ctx-window", type=int, default=None, metavar="N",
                   help="the drafter attends only the last N rows of a sequence (default: all of them, as it was "
                        "trained); bounds its per-step cost on long contexts, drafts may get worse, tokens never change")


def read_prompt(args) -> str:
    if args.prompt_file is None:
        return args.prompt
    with open(args.prompt_file, encoding="utf-8") as f:  # OSError / UnicodeError: one line from the CLI
        return f.read()


def run(args) -> int:
    # everything a user can get wrong is checked before weights load, the prompt prefills or graphs export
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    compile_choice(args)
    sp = SamplingParams(args.temperature, args.top_k, args.top_p, args.min_p, args.seed).resolved()
    try:
        text = read_prompt(args)
    except UnicodeDecodeError as e:
        raise UsageError(f"--prompt-file {args.prompt_file}: not UTF-8 text ({e.reason})") from None
    check_tensor_parallel(args.tensor_parallel, args.backend)
    if args.tensor_parallel == 1:
        out, st, mode = _generate(args, text, sp)
    else:
        from dflash_trt.runtime.parallel.launch import backend_for, run_parallel
        from dflash_trt.runtime.parallel.shard import check_checkpoint_shardable

        check_checkpoint_dir(args.model, "--model")
        check_checkpoint_shardable(args.model, args.tensor_parallel)
        out, st, mode = run_parallel(_generate, args.tensor_parallel, (args, text, sp),
                                     backend=backend_for(args.device))
    print(out)  # stdout: the text alone; the stats are a status line
    progress(f"[{mode}] backend={args.backend} device={args.device} prompt={st.prompt_tokens} new={st.new_tokens} "
          f"target_steps={st.target_steps} tau={st.tau:.2f} tok/s={st.tokens_per_s:.1f}"
          + ("" if sp.greedy else f" temperature={sp.temperature:g} seed={sp.seed}")
          + (f" tensor_parallel={args.tensor_parallel}" if args.tensor_parallel > 1 else "")
          + (" (includes capturing the CUDA graphs: see `dflash-trt bench e2e` for speed)" if args.device != "cpu" else ""))
    return 0


def _generate(args, text: str, sp) -> tuple:
    """Load and generate (on every rank alike under --tensor-parallel): (text, stats, 'plain' | 'dflash')."""
    rt, codec = runtime_of(args, tensor_parallel_size=args.tensor_parallel)
    ids = codec.encode(text)
    try:
        rt.check_prompt(ids)
    except TokenIdError as e:
        if getattr(codec, "tok", None) is None:  # ByteCodec: the prompt's bytes are the ids
            raise UsageError(f"{e}: {args.model} has no tokenizer.json, so the prompt's UTF-8 bytes are its token "
                             f"ids; use ASCII text or add a tokenizer") from None
        raise
    out, st = rt.generate(ids, args.max_new_tokens, gamma=args.gamma, spec=not args.no_spec,
                          temperature=sp.temperature, top_k=sp.top_k, top_p=sp.top_p, min_p=sp.min_p, seed=sp.seed)
    return codec.decode(out), st, "plain" if (args.no_spec or rt.dcfg is None) else "dflash"
