"""`dflash-trt` command line. Each subcommand lives in its own module; this file only dispatches."""
from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module with add_args(parser) and run(args), help)
COMMANDS = {
    "generate": ("dflash_trt.tools.generate", "generate text with a target (+ DFlash drafter)"),
    "demo": ("dflash_trt.tools.demo", "run the embedded default model on CPU, plain vs DFlash"),
}
# subcommands that parse their own argv: module with main(argv) -> int
PASSTHROUGH = {
    "bench": ("dflash_trt.tools.bench", "benchmarks (kernels, generate, e2e)"),
    "export": ("dflash_trt.export.onnx_export", "export ONNX graphs per K + manifest"),
    "compare": ("dflash_trt.tools.compare", "compare backends (polygraphy, top-k KL)"),
    "build": ("dflash_trt.engines.build", "build TensorRT engines per K"),
}


def _user_errors():
    from dflash_trt.config import ConfigError
    from dflash_trt.export.checkpoint import CheckpointError
    from dflash_trt.runtime.devices.cuda import CudaUnavailable
    from dflash_trt.runtime.load import UsageError
    from dflash_trt.runtime.pools import PoolExhausted
    from dflash_trt.runtime.runtime import CapacityError

    return (ConfigError, CheckpointError, CapacityError, PoolExhausted, NotImplementedError, CudaUnavailable,
            UsageError)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in PASSTHROUGH:
        mod = importlib.import_module(PASSTHROUGH[argv[0]][0])
        return int(mod.main(argv[1:]) or 0)
    p = argparse.ArgumentParser(prog="dflash-trt", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    for name, (mod, help_) in COMMANDS.items():
        sp = sub.add_parser(name, help=help_)
        importlib.import_module(mod).add_args(sp)
    for name, (_, help_) in PASSTHROUGH.items():
        sub.add_parser(name, help=help_ + " (see dflash-trt %s --help)" % name, add_help=False)
    args = p.parse_args(argv)
    try:
        return int(importlib.import_module(COMMANDS[args.cmd][0]).run(args) or 0)
    except Exception as e:
        if not isinstance(e, _user_errors()):
            raise
        print(f"dflash-trt {args.cmd}: error: {e}", file=sys.stderr)  # bad input: one clear line
        return 2


if __name__ == "__main__":
    sys.exit(main())
