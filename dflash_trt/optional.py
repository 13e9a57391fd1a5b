"""Optional dependencies (the pyproject extras): a missing one is refused in one line that says what needs it and
how to install it, as an error of the caller's kind, instead of a ModuleNotFoundError traceback."""
from __future__ import annotations


def require_torch(why: str, error: type[Exception]):
    """The torch module, or `error` saying that `why` needs PyTorch. Only torch itself being absent is
    refused: a missing module inside an installed torch is a broken install and keeps its traceback."""
    try:
        import torch
    except ModuleNotFoundError as e:
        if e.name != "torch":
            raise
        raise error(f"{why} needs PyTorch, which is not installed: pip install torch") from None
    return torch


def require(module: str, why: str, error: type[Exception], extra: str = "serve"):
    """The module, or `error` saying that `why` needs it (pip install "dflash-trt[extra]")."""
    import importlib

    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module:
            raise
        raise error(f"{why} needs {module}, which is not installed: pip install \"dflash-trt[{extra}]\"") from None
