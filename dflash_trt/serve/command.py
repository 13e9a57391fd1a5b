"""`dflash-trt serve`: load a target (+ drafter), start the engine loop and an OpenAI-compatible server."""
from __future__ import annotations

import argparse
import os

from dflash_trt.args import GAMMA_HELP, gamma_arg
from dflash_trt.log import progress
from dflash_trt.tools.generate import (add_compile_arg, add_ctx_window_arg, add_drafter_fp8_arg, add_engines_arg,
                                       add_memory_arg, add_tensor_parallel_arg)
from dflash_trt.runtime.load import UsageError


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="target checkpoint dir (HF format)")
    p.add_argument("--drafter", help="DFlash drafter checkpoint dir")
    p.add_argument("--backend", default="torch", choices=["torch", "ort", "trt"])
    p.add_argument("--device", default="cpu", help="cpu, or cuda[:N]")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    add_engines_arg(p)
    add_tensor_parallel_arg(p)
    p.add_argument("--gamma", type=gamma_arg, default="auto", help=GAMMA_HELP)
    p.add_argument("--no-spec", action="store_true", help="plain decoding (no drafter steps)")
    p.add_argument("--max-seq-len", type=int, default=None, help="positions per sequence (prompt + new + verify)")
    p.add_argument("--max-seqs", type=int, default=None, help="sequences decoded together (state slots; default 4)")
    add_memory_arg(p)
    add_ctx_window_arg(p)
    add_compile_arg(p)
    add_drafter_fp8_arg(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-queue", type=int, default=64,
                   help="completions pending (waiting + running) before new requests get 503")
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: --model's folder name)")
    p.add_argument("--chat-template", default=None, help="a Jinja chat template file (default: the checkpoint's)")


def build_state(args):
    """Everything but the HTTP server: the runtime, its engine loop (started) and the chat template."""
    from dflash_trt.api.chat import ChatTemplate, find_template, special_tokens
    from dflash_trt.serve.app import ServerState
    from dflash_trt.serve.loop import EngineLoop
    from dflash_trt.serve.metrics import Metrics
    from dflash_trt.serve.protocol import generation_defaults

    if args.max_queue < 1:
        raise UsageError(f"--max-queue must be >= 1, got {args.max_queue}")
    source = None
    if args.chat_template is not None:
        with open(args.chat_template, encoding="utf-8") as f:  # OSError: one line from the CLI
            source = f.read()
    engine = _engine(args) if args.tensor_parallel == 1 else _rank0_engine(args)
    source = source if source is not None else find_template(args.model)
    template = ChatTemplate(source, special_tokens(args.model)) if source is not None else None
    loop = EngineLoop(engine, Metrics(), args.max_queue).start()
    name = args.served_model_name or os.path.basename(os.path.normpath(args.model))
    return ServerState(loop, engine.codec, name, generation_defaults(args.model), template)


def _engine(args):
    """This process's Engine over its runtime (under --tensor-parallel: its rank's shard)."""
    from dflash_trt.api.engine import Engine
    from dflash_trt.tools.generate import runtime_of

    rt, codec = runtime_of(args, max_seqs=args.max_seqs, tensor_parallel_size=args.tensor_parallel)
    return Engine(rt, codec, gamma=args.gamma, spec=not args.no_spec)


def _rank0_engine(args):
    """--tensor-parallel N: the followers started (serve/ranks.py), this process rank 0, its Engine followed.
    What every rank would refuse is refused here first, before any process starts."""
    from dflash_trt.runtime.load import check_checkpoint_dir, check_tensor_parallel
    from dflash_trt.runtime.parallel.shard import check_checkpoint_shardable
    from dflash_trt.serve.ranks import FollowedEngine, start_followers

    check_tensor_parallel(args.tensor_parallel, args.backend)
    check_checkpoint_dir(args.model, "target checkpoint")
    check_checkpoint_shardable(args.model, args.tensor_parallel)
    conns, procs = start_followers(args.tensor_parallel, args.device, _engine, args)
    return FollowedEngine(_engine(args), conns, procs)


def run(args) -> int:
    from dflash_trt.optional import require

    require("fastapi", "dflash-trt serve", UsageError)
    require("uvicorn", "dflash-trt serve", UsageError)
    import uvicorn

    from dflash_trt.serve.app import build_app

    state = build_state(args)
    progress(f"serve: {state.model_name} ({args.backend}, {args.device}) on http://{args.host}:{args.port}")
    try:
        uvicorn.run(build_app(state), host=args.host, port=args.port, log_level="warning")
    finally:
        state.loop.close()
        if args.tensor_parallel != 1:
            state.loop.engine.close()
    return 0
