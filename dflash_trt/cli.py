"""`dflash-trt` command line. Each subcommand lives in its own module; this file only dispatches."""
from __future__ import annotations

import importlib
import sys

from dflash_trt.args import ArgumentParser

# subcommand -> (module with add_args(parser) and run(args), help)
COMMANDS = {
    "generate": ("dflash_trt.tools.generate", "generate text with a target (+ DFlash drafter)"),
    "demo": ("dflash_trt.tools.demo", "run the embedded default model on CPU, plain vs DFlash"),
    "serve": ("dflash_trt.serve.command", "OpenAI-compatible HTTP server (completions, chat, streaming)"),
    "cache": ("dflash_trt.tools.cache", "list or clear the cached exports, engines and compiled kernels"),
}
# subcommands that parse their own argv: module with main(argv) -> int
PASSTHROUGH = {
    "bench": ("dflash_trt.tools.bench", "benchmarks (kernels, generate, e2e, host)"),
    "export": ("dflash_trt.export.onnx_export", "export ONNX graphs per K + manifest"),
    "compare": ("dflash_trt.tools.compare", "compare backends (polygraphy, top-k KL)"),
    "build": ("dflash_trt.engines.build", "build TensorRT engines per K"),
}


# module -> the exception classes in it that mean bad input or an unusable environment, not a bug
USER_ERRORS = {
    "dflash_trt.config": ("ConfigError",),
    "dflash_trt.manifest": ("ManifestError",),
    "dflash_trt.export.checkpoint": ("CheckpointError",),
    "dflash_trt.export.onnx_export": ("ExportError",),
    "dflash_trt.engines.load": ("EngineError",),
    "dflash_trt.engines.network": ("BuildError",),
    "dflash_trt.plugins.opspec": ("KernelError", "ShapeError"),
    "dflash_trt.plugins.nvrtc": ("NvrtcError",),
    "dflash_trt.plugins.trt_compat": ("ParserLibError", "TensorRTMissing"),
    "dflash_trt.runtime.devices.cuda": ("CudaUnavailable",),
    "dflash_trt.runtime.load": ("UsageError",),
    "dflash_trt.runtime.parallel.launch": ("ParallelError",),  # a rank's error, named with its rank
    "dflash_trt.runtime.parallel.shard": ("ShardError",),
    "dflash_trt.runtime.pools": ("PoolExhausted",),
    "dflash_trt.runtime.runtime": ("CapacityError", "GammaError"),
    "dflash_trt.runtime.sampling": ("SamplingError",),
    "dflash_trt.runtime.sequence": ("SequenceError", "TokenIdError"),
    "dflash_trt.runtime.snapshot": ("SnapshotError",),
    "dflash_trt.api.chat": ("ChatTemplateError",),
    "dflash_trt.api.params": ("ParamError",),
    # ONNX Runtime's load errors
    "onnxruntime.capi.onnxruntime_pybind11_state": ("Fail", "InvalidArgument", "InvalidGraph", "InvalidProtobuf",
                                                    "NoSuchFile", "NoModel", "NotImplemented"),
}


def _user_errors() -> tuple:
    """Every exception class that means bad input (not a bug): printed as one line, exit 2. Only from modules
    already imported (an error can only come from a module that ran), so an install without torch, TensorRT or
    ORT never imports them here and `dflash-trt --help` stays fast."""
    errs = [NotImplementedError, OSError]
    for mod, names in USER_ERRORS.items():
        m = sys.modules.get(mod)
        errs += [getattr(m, n) for n in names if m is not None and isinstance(getattr(m, n, None), type)]
    return tuple(errs)


def _one_line(e: BaseException) -> str:
    msg = " ".join(str(e).split()) or type(e).__name__  # a multi-line message (ORT, TensorRT) on one line
    if isinstance(e, OSError) and e.filename and str(e.filename) not in msg:
        msg += f": {e.filename}"
    return msg


def _run(cmd: str, fn) -> int:
    """The one place user errors become `dflash-trt <cmd>: error: ...` + exit 2; anything else is a bug."""
    try:
        return int(fn() or 0)
    except Exception as e:
        if not isinstance(e, _user_errors()):
            raise
        print(f"dflash-trt {cmd}: error: {_one_line(e)}", file=sys.stderr)
        return 2


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in PASSTHROUGH:
        mod = importlib.import_module(PASSTHROUGH[argv[0]][0])
        return _run(argv[0], lambda: mod.main(argv[1:]))
    p = ArgumentParser(prog="dflash-trt", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    for name, (mod, help_) in COMMANDS.items():
        sp = sub.add_parser(name, help=help_)
        importlib.import_module(mod).add_args(sp)
    for name, (_, help_) in PASSTHROUGH.items():
        sub.add_parser(name, help=help_ + " (see dflash-trt %s --help)" % name, add_help=False)
    args = p.parse_args(argv)
    return _run(args.cmd, lambda: importlib.import_module(COMMANDS[args.cmd][0]).run(args))


if __name__ == "__main__":
    sys.exit(main())
