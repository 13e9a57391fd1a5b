"""An install without PyTorch (`pip install -e ".[onnx]"`): the ORT backend generates from an existing export, and
whatever does need torch (an export, the torch backend, sampling) is refused in one line, exit 2, no traceback.
The no-torch process blocks `import torch` with a meta-path finder and runs the CLI entry point in-process."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

from dflash_trt import cli
from dflash_trt.tools.tiny import make_tiny_pair

pytest.importorskip("onnxscript")  # the export made with torch needs it

NO_TORCH = textwrap.dedent("""
    import contextlib, io, json, sys, traceback

    class NoTorch:
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)

    sys.meta_path.insert(0, NoTorch())
    from dflash_trt.cli import main

    runs = []
    for argv in json.loads(sys.argv[1]):
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = main(argv)
            except SystemExit as e:
                rc = e.code
            except BaseException:
                traceback.print_exc()
                rc = "raised"
        runs.append({"rc": rc, "out": out.getvalue(), "err": err.getvalue()})
    print(json.dumps({"runs": runs, "torch": sorted(m for m in sys.modules if m.split(".")[0] == "torch")}))
""")
PROMPT = "def add(a, b):\n    return"


def _no_torch(argvs, env):
    p = subprocess.run([sys.executable, "-c", NO_TORCH, json.dumps(argvs)], capture_output=True, text=True,
                       env=env, timeout=300)
    assert p.returncode == 0, p.stderr
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert res["torch"] == []
    return res["runs"]


def _refused(run, sub, match):
    lines = run["err"].strip().splitlines()
    assert run["rc"] == 2 and "Traceback" not in run["err"], run
    assert len(lines) == 1 and lines[0].startswith(f"dflash-trt {sub}: error: ") and match in lines[0], run


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    import torch

    torch.set_num_threads(1)  # tiny matmuls on a shared box
    # one GDN and one attention layer: both kinds of graph body, half the tiny pair's export time
    over = dict(layers=2, layer_types=["linear_attention", "full_attention"])
    return make_tiny_pair(str(tmp_path_factory.mktemp("pair")), seed=3, target_over=over)[0]


def test_ort_without_torch_generates_from_an_existing_export(target, tmp_path, monkeypatch, capsys):
    cache = str(tmp_path / "cache")
    monkeypatch.setenv("DFLASH_TRT_CACHE", cache)
    gen = ["generate", "--model", target, "--backend", "ort", "--prompt", PROMPT, "--max-new-tokens", "6",
           "--max-seq-len", "64"]
    assert cli.main(gen) == 0  # with torch: exports into the private cache
    with_torch = capsys.readouterr()
    assert "[1/2] target_k1" in with_torch.err and "[plain] backend=ort" in with_torch.err
    assert "[1/" not in with_torch.out and "backend=" not in with_torch.out  # stdout: the text alone
    out_dir = tmp_path / "export-out"
    runs = _no_torch([gen,
                      gen + ["--temperature", "0.8"],
                      gen[:4] + ["torch"] + gen[5:],
                      gen[:-1] + ["80"],  # other pool sizes: a cache miss, so an export is needed
                      ["export", "--model", target, "--k", "1", "--out", str(out_dir)]],
                     dict(os.environ, DFLASH_TRT_CACHE=cache))
    assert runs[0]["rc"] == 0, runs[0]
    assert runs[0]["out"] == with_torch.out  # the same tokens as the run with torch
    _refused(runs[1], "generate", "sampling (temperature > 0) needs PyTorch, which is not installed: pip install torch")
    _refused(runs[2], "generate", "--backend torch needs PyTorch")
    _refused(runs[3], "generate", "exporting the checkpoint to ONNX needs PyTorch, which is not installed: "
                                  "pip install torch")
    _refused(runs[4], "export", "exporting the checkpoint to ONNX needs PyTorch")
    assert not out_dir.exists()
    entries = [f for f in os.listdir(cache) if f.startswith("onnx-") and not f.endswith(".lock")]
    assert len(entries) == 1  # the refused export left no entry (complete or partial) beside the first
