"""`dflash-trt build --backend torch`: the step keys a run launches (runtime/prebuild.py) are built before any
request, each through the executor's own entry (compile or load from the step store, capture); off a GPU the
command is one line."""
import types

import pytest

from dflash_trt.abi import PoolSizes
from dflash_trt.runtime.prebuild import prebuild, step_keys


class _Executor:
    def __init__(self):
        self.built = []

    def entry(self, kind, K, B):
        self.built.append((kind, K, B))


def _rt(max_seqs=4, chunk=512, drafter=True, any_width=True):
    rt = types.SimpleNamespace(sizes=PoolSizes(max_seqs=max_seqs, prefill_chunk=chunk),
                               dcfg=object() if drafter else None, executor=_Executor(),
                               backend=types.SimpleNamespace(any_prefill_width=any_width))
    rt.verify_widths = lambda: [1, 2, 3, 4, 8, 16]
    return rt


def test_every_key_a_run_launches():
    keys = step_keys(_rt())
    assert {k for k in keys if k[0] == "prefill"} == {("prefill", w, b) for w in (256, 512) for b in (1, 2, 4)}
    assert {k for k in keys if k[0] == "decode"} == {("decode", 1, b) for b in (1, 2, 4)}
    assert {k for k in keys if k[0] == "spec"} == {("spec", K, b) for K in (2, 3, 4, 8, 16) for b in (1, 2, 4)}
    assert len(keys) == len(set(keys)) == 24


def test_keys_follow_the_options():
    assert {k for k in step_keys(_rt(), gamma=7) if k[0] == "spec"} == {("spec", 8, b) for b in (1, 2, 4)}
    assert not [k for k in step_keys(_rt(drafter=False)) if k[0] == "spec"]
    assert {k[1] for k in step_keys(_rt(any_width=False)) if k[0] == "prefill"} == {512}  # engines: one width
    big = step_keys(_rt(max_seqs=16))
    assert {k[2] for k in big if k[0] == "prefill"} == {1, 2, 4} and {k[2] for k in big if k[0] == "decode"} == {
        1, 2, 4, 8, 16}
    assert step_keys(_rt(max_seqs=16), max_batch=3) == [k for k in big if k[2] <= 4]  # a run of 3 at most


def test_prebuild_builds_each_key_through_the_executor():
    rt, said = _rt(max_seqs=1), []
    keys = prebuild(rt, progress=said.append)
    assert rt.executor.built == keys and len(said) == len(keys) and said[0].startswith(f"[1/{len(keys)}] prefill")


def test_the_command_is_one_line_off_a_gpu(capsys):
    from dflash_trt.cli import main

    assert main(["build", "--backend", "torch", "--model", "models/target", "--device", "cpu"]) == 2
    assert "compiles its steps on a GPU" in capsys.readouterr().err
    assert main(["build", "--backend", "torch", "--model", "no/such/dir"]) == 2
    assert "no/such/dir: not a directory" in capsys.readouterr().err
