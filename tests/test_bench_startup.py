"""`dflash-trt bench startup` on the CPU: two real process starts over the trained pair, each phase timed from the
spawn; the fresh cache it made is removed, a given cache is left as found; bad arguments refused before anything
starts; the start-up targets judged only on their configuration."""
import json
import os

import pytest

from dflash_trt.tools import bench_startup

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET, DRAFTER = os.path.join(ROOT, "models", "target"), os.path.join(ROOT, "models", "drafter")
PAIR = ["--model", TARGET, "--drafter", DRAFTER, "--device", "cpu", "--prompt-tokens", "24", "--new-tokens", "6"]


def test_two_starts_time_every_phase_and_remove_their_fresh_cache(tmp_path, capsys):
    out = tmp_path / "startup.json"
    assert bench_startup.main([*PAIR, "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert len(res["starts"]) == 2
    for t in res["starts"]:
        assert list(t) == list(bench_startup.PHASES)
        seconds = [t[p] for p in bench_startup.PHASES]
        assert 0 < seconds[0] and seconds == sorted(seconds)
    assert not os.path.exists(res["cache"])  # made by the run, removed after
    assert res["targets"] == []  # not the targets' configuration
    text = capsys.readouterr().out
    assert "first decoded" in text and "not judged on this run" in text and "eager steps (the CPU path)" in text


def test_a_given_cache_is_used_and_left_in_place(tmp_path, capsys):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "mine.txt").write_text("user data")
    assert bench_startup.main([*PAIR, "--starts", "1", "--cache", str(cache)]) == 0
    assert (cache / "mine.txt").read_text() == "user data"
    assert f"cache {cache} as found" in capsys.readouterr().out


@pytest.mark.parametrize("extra,words", [
    (["--model", "random-27b", "--device", "cpu"], "built on a GPU"),
    (["--new-tokens", "1"], "--new-tokens must be >= 2"),
    (["--layers", "4"], "--layers builds a preset"),
    (["--compile-regions", "--no-compile"], "exclude each other"),
    (["--fp8"], "--fp8 builds a preset"),
    (["--cache", "/nonexistent/dir"], "not a directory"),
])
def test_bad_arguments_are_refused_in_one_line(extra, words, capsys):
    assert bench_startup.main([*PAIR, *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0]


def test_targets_are_judged_on_the_64_layer_preset_compiled_on_a_gpu():
    res = {"model": "random-27b", "layers": None, "device": "cuda", "compiled": True,
           "starts": [{"first_decoded": 170.0}, {"first_decoded": 31.0}]}
    assert [(n, ok) for n, ok, _ in bench_startup.targets(res)] == [("first start", True), ("later start", False)]
    res["starts"][1]["first_decoded"] = 29.0
    assert all(ok for _, ok, _ in bench_startup.targets(res))
    for other in ({"layers": 16}, {"device": "cpu"}, {"compiled": False}, {"model": "random-moe-35b-a3b"}):
        assert bench_startup.targets({**res, **other}) == []


def test_child_arguments_drop_the_parents_own():
    argv = ["--model", "m", "--json", "x.json", "--starts=3", "--cache", "c", "--new-tokens", "4"]
    assert bench_startup.child_argv(argv) == ["--model", "m", "--new-tokens", "4"]


@pytest.mark.gpu
def test_a_later_gpu_start_loads_what_the_first_one_compiled(tmp_path):
    out = tmp_path / "startup.json"
    assert bench_startup.main(["--model", "random-27b", "--layers", "2", "--prompt-tokens", "64", "--new-tokens", "4",
                               "--json", str(out)]) == 0
    first, later = (t["first_decoded"] - t["runtime"] for t in json.loads(out.read_text())["starts"])
    assert later < first
