"""The README is a user guide that works: its quick-start commands are what CI runs, its CLI reference lists exactly
the options of each command's parser, its links resolve inside the repo, and its Python API and serve snippets run
as written (the serve snippet against `dflash-trt serve` started with the README's own command, on the shipped
pair, CPU)."""
import contextlib
import io
import os
import re
import shlex
import subprocess
import sys

import pytest

from dflash_trt.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
SNIPPET_TIMEOUT_S = 180


def section(title: str, level: int = 2) -> str:
    """The README's text under the heading `title` (up to the next heading of the same or a higher level)."""
    m = re.search(rf"^{'#' * level} {re.escape(title)}\n(.*?)(?=^#{{1,{level}}} |\Z)", README, re.M | re.S)
    assert m, f"README has no section {title!r}"
    return m.group(1)


def blocks(text: str, lang: str) -> list:
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


def test_quick_start_is_what_ci_runs():
    demo, tests, cpu = [b.strip() for b in blocks(section("Quick start"), "bash")]
    ci = [ln.strip().replace(" -q ", " ", 1) if ln.strip().startswith("python -m pip") else ln.strip()
          for ln in open(os.path.join(ROOT, ".ci", "run")) if ln.strip().startswith("python -m")]
    assert tests.split(" && ") == ci
    assert demo.split(" && ") == [ci[0], 'python -m pip install -e ".[onnx]"', "dflash-trt demo"]
    assert cpu == ci[0] + " --index-url https://download.pytorch.org/whl/cpu"


def test_links_stay_in_the_repo():
    links = [t for t in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README) if "://" not in t]
    assert links and "docs/DESIGN.md" in links
    assert all(not t.startswith("..") and os.path.exists(os.path.join(ROOT, t)) for t in links), links


OPTION = r"(?<![\w-])--[a-z][a-z0-9-]*"


def reference(cmd: str, tables: bool = True) -> set:
    """The options the README's CLI reference names under `dflash-trt CMD ...`: in its tables' first column (tables),
    or anywhere in the text."""
    head = next(h for h in re.findall(r"^### (`dflash-trt [^`]*`.*)$", README, re.M) if h.split()[1].strip("`") == cmd)
    text = section(head, 3)
    if tables:
        text = "\n".join(ln.split("|")[1] for ln in text.splitlines() if ln.startswith("| "))
    return set(re.findall(OPTION, text)) - {"--help"}


def _options(argv: list) -> set:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        main([*argv, "--help"])
    lines = [ln.strip() for ln in out.getvalue().splitlines() if ln.startswith("  -")]  # the option lines
    return {m for ln in lines for m in re.findall(OPTION, ln.split("  ")[0])} - {"--help"}


@pytest.mark.parametrize("cmd", ["demo", "generate", "serve", "export", "build", "compare", "cache"])
def test_cli_reference_lists_every_option(cmd):
    assert reference(cmd) == _options([cmd])


def test_bench_reference_names_real_options():
    real = set().union(*(_options(["bench", s]) for s in ("kernels", "generate", "e2e", "host", "serve", "startup")))
    documented = reference("bench", tables=False)
    assert documented and documented <= real, documented - real


def _run_snippet(code: str) -> str:
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=SNIPPET_TIMEOUT_S, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def test_python_api_snippet_runs():
    pytest.importorskip("torch")
    out = _run_snippet(blocks(section("Python API"), "python")[0])
    assert out.strip() and "(" in out  # the logprobs line prints a token's top alternatives


def test_serve_command_and_client_snippet_run():
    pytest.importorskip("torch")
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    pytest.importorskip("openai")
    from test_serve import served

    from dflash_trt.tools.bench_serve import free_port

    text = section("Serve")
    argv = shlex.split(blocks(text, "bash")[0].strip())
    assert argv[:2] == ["dflash-trt", "serve"] and argv[-2:] == ["--port", "8000"]
    snippet = blocks(text, "python")[0]
    assert "127.0.0.1:8000" in snippet
    port = free_port()
    with served(argv[2:-2], port):
        out = _run_snippet(snippet.replace("127.0.0.1:8000", f"127.0.0.1:{port}"))
    assert out.strip() and "[" in out  # the last line prints the token logprobs
