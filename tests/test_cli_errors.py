"""One-line errors everywhere and no silent nonsense: every user error of every subcommand (argparse's usage errors
included) is `dflash-trt <sub>: error: ...` on stderr and exit 2, checked before weights load, graphs trace or
TensorRT starts; a real bug still raises. In-process through dflash_trt.cli.main."""
import json
import os
import shutil

import pytest
import torch
from test_onnx_common import exported, tiny_pair  # noqa: F401

from dflash_trt import cli
from dflash_trt.tools.tiny import make_tiny_pair


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    torch.set_num_threads(1)  # tiny matmuls: threads only contend on a shared 2-core box
    return make_tiny_pair(str(tmp_path_factory.mktemp("pair")), seed=2)


@pytest.fixture(scope="module")
def broken_weights(pair, tmp_path_factory):
    """The target with its weights truncated: an error about anything else proves it came before loading."""
    d = str(tmp_path_factory.mktemp("broken") / "target")
    shutil.copytree(pair[0], d)
    with open(os.path.join(d, "model.safetensors"), "r+b") as f:
        f.truncate(100)
    return d


def one_line(capsys, sub, argv, match):
    try:
        rc = cli.main(argv)
    except SystemExit as e:  # argparse's usage errors exit from the parser
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"dflash-trt {sub}: error: "), err
    assert match in lines[0], lines[0]
    return lines[0]


# ---- generate / demo ----------------------------------------------------------------------------
@pytest.mark.parametrize("gamma", ["0", "16", "-3"])
def test_generate_bad_gamma_before_loading_weights(capsys, pair, broken_weights, gamma):
    one_line(capsys, "generate", ["generate", "--model", broken_weights, "--drafter", pair[1], "--prompt", "hi",
                                  "--gamma", gamma], f"gamma {gamma} outside [1, block_size-1=15]")


def test_generate_gamma_16_ort_names_gamma_not_a_k_list(capsys, pair, tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_TRT_CACHE", str(tmp_path / "cache"))
    line = one_line(capsys, "generate", ["generate", "--model", pair[0], "--drafter", pair[1], "--prompt", "hi",
                                         "--gamma", "16", "--backend", "ort"], "gamma 16 outside")
    assert "--k" not in line and "K list" not in line
    assert not os.path.exists(tmp_path / "cache")  # refused before any export


@pytest.mark.parametrize("n", ["0", "-5"])
def test_generate_max_new_tokens_below_1(capsys, pair, broken_weights, n):
    one_line(capsys, "generate", ["generate", "--model", broken_weights, "--prompt", "hi", "--max-new-tokens", n],
             "--max-new-tokens must be >= 1")


def test_generate_max_seq_len_0(capsys, broken_weights):
    one_line(capsys, "generate", ["generate", "--model", broken_weights, "--prompt", "hi", "--max-seq-len", "0"],
             "pool size max_seq_len (--max-seq-len) must be a positive integer, got 0")


def test_generate_max_seq_len_and_prompt_file(capsys, pair, tmp_path):
    f = tmp_path / "prompt.txt"
    f.write_text("x" * 3000)  # over the default max_seq_len 2048: needs --max-seq-len
    base = ["generate", "--model", pair[0], "--drafter", pair[1], "--prompt-file", str(f), "--max-new-tokens", "3"]
    one_line(capsys, "generate", base, "needs 3019 positions; this runtime holds max_seq_len=2048")
    assert cli.main(base + ["--max-seq-len", "3100"]) == 0
    cap = capsys.readouterr()
    assert "prompt=3000 new=3" in cap.err  # the stats are a status line: stdout carries the text alone
    assert cap.out.count("\n") == 1 and "prompt=" not in cap.out


@pytest.fixture(scope="module")
def bad_dirs(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad")
    (d / "a_file").write_text("not a checkpoint")
    (d / "no_config").mkdir()
    (d / "bad_json").mkdir()
    (d / "bad_json" / "config.json").write_text("{not json")
    return d


@pytest.mark.parametrize("flag", ["--model", "--drafter"])
@pytest.mark.parametrize("backend", ["torch", "ort"])
@pytest.mark.parametrize("which,match", [("a_file", ": not a directory"), ("no_config", ": no config.json in it"),
                                         ("bad_json", "config.json: not valid JSON")])
def test_generate_checkpoint_dir_that_is_not_one(capsys, pair, bad_dirs, tmp_path, monkeypatch, flag, backend,
                                                 which, match):
    monkeypatch.setenv("DFLASH_TRT_CACHE", str(tmp_path / "cache"))
    given = {"--model": pair[0], "--drafter": pair[1], flag: str(bad_dirs / which)}
    line = one_line(capsys, "generate", ["generate", "--model", given["--model"], "--drafter", given["--drafter"],
                                         "--prompt", "hi", "--backend", backend], match)
    assert str(bad_dirs / which) in line
    assert not os.path.exists(tmp_path / "cache")  # refused before any export
    assert (bad_dirs / "a_file").read_text() == "not a checkpoint"


@pytest.mark.parametrize("argv,match", [
    (["--max-new-tokens", "abc"], "argument --max-new-tokens: invalid int value: 'abc'"),
    (["--gamma", "99"], "gamma 99 outside [1, block_size-1=15]"),
    (["--temperature", "-1"], "temperature must be >= 0 (0 = greedy), got -1.0"),
    (["--temperature", "hot"], "argument --temperature: invalid float value: 'hot'"),
])
def test_generate_bad_values_one_line(capsys, pair, broken_weights, argv, match):
    one_line(capsys, "generate", ["generate", "--model", broken_weights, "--drafter", pair[1], "--prompt", "hi"]
             + argv, match)


def test_generate_without_model_is_one_usage_line(capsys):
    one_line(capsys, "generate", ["generate", "--prompt", "hi"], "the following arguments are required: --model")


def test_generate_missing_prompt_file(capsys, pair, tmp_path):
    one_line(capsys, "generate", ["generate", "--model", pair[0], "--prompt-file", str(tmp_path / "nope.txt")],
             "No such file or directory")


def test_generate_prompt_bytes_over_a_small_vocab(capsys, tmp_path):
    tdir, _ = make_tiny_pair(str(tmp_path), seed=0, target_over=dict(vocab=150))  # no tokenizer.json
    one_line(capsys, "generate", ["generate", "--model", tdir, "--prompt", "caf\u00e9"],
             "token id 195 outside the vocabulary [0, 150)")


@pytest.mark.parametrize("argv,match", [(["--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
                                        (["--max-new-tokens", "abc"], "invalid int value: 'abc'")])
def test_demo_bad_values_one_line(capsys, monkeypatch, pair, argv, match):
    monkeypatch.setattr("dflash_trt.tools.demo.default_pair", lambda: (*pair, "test pair"))
    one_line(capsys, "demo", ["demo"] + argv, match)  # no status line in front of it


def test_demo_bad_gamma(capsys, monkeypatch, pair):
    monkeypatch.setattr("dflash_trt.tools.demo.default_pair", lambda: (*pair, "test pair"))
    one_line(capsys, "demo", ["demo", "--gamma", "0", "--backend", "torch"], "gamma 0 outside")


def test_a_real_bug_still_raises(monkeypatch, pair):
    def boom(args):
        raise KeyError("a bug")

    monkeypatch.setattr("dflash_trt.tools.generate.run", boom)
    with pytest.raises(KeyError):
        cli.main(["generate", "--model", pair[0], "--prompt", "hi"])


# ---- export ------------------------------------------------------------------------------------
@pytest.mark.parametrize("flag,value,match", [
    ("--page-size", "0", "pool size page_size (--page-size) must be a positive integer, got 0"),
    ("--prefill-chunk", "0", "pool size prefill_chunk"),
    ("--kv-blocks", "-1", "pool size kv_blocks (--kv-blocks) must be a positive integer, got -1"),
    ("--max-seqs", "0", "pool size max_seqs"),
    ("--max-seq-len", "0", "pool size max_seq_len"),
    ("--ctx-window", "-5", "pool size ctx_window"),
    ("--batch", "0", "--batch must be 'B' (dynamic) or a positive integer, got '0'"),
    ("--batch", "abc", "--batch must be 'B' (dynamic) or a positive integer, got 'abc'"),
])
def test_export_sizes_refused_before_tracing(capsys, broken_weights, pair, tmp_path, flag, value, match):
    out = tmp_path / "out"
    one_line(capsys, "export", ["export", "--model", broken_weights, "--drafter", pair[1], "--out", str(out),
                                flag, value], match)
    assert not out.exists()


# ---- ORT: bf16 export, garbage graph --------------------------------------------------------------
def test_export_k_out_of_range(capsys, broken_weights, tmp_path):
    one_line(capsys, "export", ["export", "--model", broken_weights, "--k", "0,99", "--out", str(tmp_path / "o")],
             "--k values must be in 1..16")
    assert not (tmp_path / "o").exists()


def test_export_out_is_a_regular_file(capsys, pair, tmp_path):
    f = tmp_path / "notes.txt"
    f.write_text("mine")
    one_line(capsys, "export", ["export", "--model", pair[0], "--k", "1", "--out", str(f)],
             f"{f}: exists and is not a directory")
    assert f.read_text() == "mine"


def _copy_export(exported, tmp_path):  # noqa: F811
    d = str(tmp_path / "exp")
    shutil.copytree(exported, d)
    return d


def test_bf16_export_on_ort_cpu_is_refused_up_front(exported):  # noqa: F811
    from dflash_trt.manifest import Manifest
    from dflash_trt.runtime.backends.ort_backend import OrtBackend
    from dflash_trt.runtime.load import UsageError

    man = Manifest.load(exported)
    man.data["kv_dtype"] = "bfloat16"  # what `export --dtype bfloat16` records
    with pytest.raises(UsageError, match="a bfloat16 export cannot run on ONNX Runtime CPU"):
        OrtBackend(man, providers=["CPUExecutionProvider"])


def test_garbage_onnx_is_one_line(exported, tmp_path, capsys):  # noqa: F811
    from dflash_trt.manifest import Manifest, ManifestError
    from dflash_trt.runtime.backends.ort_backend import OrtBackend

    d = _copy_export(exported, tmp_path)
    man = Manifest.load(d)
    rec = man.data["graphs"]["target_k1"]
    with open(os.path.join(d, rec["file"]), "wb") as f:
        f.write(b"not an onnx graph at all")
    man.add_graph("target_k1", rec["file"], rec.get("external_data"))  # re-hash: ORT itself must refuse it
    man.save(d)
    with pytest.raises(ManifestError, match="graph target_k1 .* ONNX Runtime cannot load it"):
        OrtBackend(d, providers=["CPUExecutionProvider"]).session("target_k1")


# ---- compare / build / bench: nothing compared, values that cannot be meant --------------------------
@pytest.mark.parametrize("extra,match", [(["--steps", "-3"], "--steps must be a positive integer, got -3"),
                                         (["--topk", "0"], "--topk must be a positive integer, got 0"),
                                         (["--prompts", "EMPTY"], "no prompts given")])
def test_compare_refuses_to_compare_nothing(capsys, tmp_path, extra, match):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    extra = [str(empty) if x == "EMPTY" else x for x in extra]
    one_line(capsys, "compare", ["compare", "--manifest", str(tmp_path / "no-export")] + extra, match)


def test_compare_report_without_outputs_fails():
    from dflash_trt.tools.compare import CompareReport

    rep = CompareReport(["a", "b"], 1e-4, 1e-4, 1e-6, 10)
    assert not rep.ok and "nothing was compared" in rep.format()


@pytest.mark.parametrize("extra,match", [(["--max-batch", "0"], "--max-batch must be >= 1, got 0"),
                                         (["--opt-batch", "0"], "--opt-batch must be >= 1"),
                                         (["--opt-level", "9"], "--opt-level 9 outside TensorRT's range 0..5"),
                                         (["--opt-level", "-1"], "--opt-level -1 outside")])
def test_build_refuses_values_that_cannot_be_meant(capsys, tmp_path, extra, match):
    one_line(capsys, "build", ["build", "--manifest", str(tmp_path)] + extra, match)


@pytest.mark.parametrize("argv,match", [
    (["generate", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["generate", "--prompts", "MISSING"], "No such file or directory"),
    (["generate", "--prompts", "EMPTY"], "no prompts in the file"),
    (["generate", "--model", "BROKEN", "--drafter", "DRAFTER", "--gamma", "16"], "gamma 16 outside"),
    (["e2e", "--model", "x", "--batch", "abc"], "--batch wants comma-separated batch sizes in 1..64"),
    (["e2e", "--model", "x", "--batch", "0,4"], "--batch wants"),
    (["e2e", "--model", "x", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["e2e", "--model", "x", "--dtype", "int8"], "--dtype 'int8' not supported"),
    (["e2e", "--model", "x", "--step-ks", "1,8"], "--step-ks wants comma-separated K in 1..16 including 1 and 16"),
    (["e2e", "--model", "x", "--step-ks", "1,17,16"], "--step-ks wants"),
    (["host", "--batch", "128"], "--batch values must be in 1..64"),
])
def test_bench_bad_inputs(capsys, tmp_path, pair, broken_weights, argv, match):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    subst = {"MISSING": str(tmp_path / "nope.txt"), "EMPTY": str(empty), "BROKEN": broken_weights,
             "DRAFTER": pair[1]}
    one_line(capsys, "bench", ["bench"] + [subst.get(x, x) for x in argv], match)


def test_generate_compile_needs_cuda_torch(capsys, broken_weights):
    """--compile is the torch backend's GPU steps: on CPU it is refused before any weight loads."""
    one_line(capsys, "generate", ["generate", "--model", broken_weights, "--prompt", "hi", "--compile"],
             "--compile compiles the torch backend's GPU steps: it needs --device cuda --backend torch")
