"""`dflash-trt serve` refuses bad arguments in one line (exit 2) before any weights load or port is bound."""
import os

import pytest

from dflash_trt.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET, DRAFTER = os.path.join(ROOT, "models", "target"), os.path.join(ROOT, "models", "drafter")


@pytest.mark.parametrize("argv, msg", [
    (["--model", "/nonexistent-dir"], "not a directory"),
    (["--model", TARGET, "--drafter", ROOT], "no config.json"),
    (["--model", TARGET, "--drafter", DRAFTER, "--gamma", "99"], "gamma 99 outside"),
    (["--model", TARGET, "--max-queue", "0"], "--max-queue must be >= 1"),
    (["--model", TARGET, "--chat-template", "/nonexistent.jinja"], "nonexistent.jinja"),
])
def test_serve_refusals(argv, msg, capsys):
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dflash-trt serve: error: ") and msg in err and err.count("\n") == 1
