"""The loader uses every tensor and config field that changes the math exactly, or refuses it by name in one line:
quantized checkpoints, biases, wrong dtypes, extra or missing layers, non-finite weights, index paths outside the
checkpoint, a tensor in two shards, config values of the wrong type or range."""
import json
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch
from refusal_helpers import refused
from safetensors.torch import load_file, save_file

from dflash_trt import cli
from dflash_trt.config import ConfigError, DrafterConfig, TargetConfig
from dflash_trt.export.checkpoint import CheckpointError, load_drafter, load_target
from dflash_trt.tools.tiny import make_tiny_pair, tiny_drafter_config, tiny_target_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHIPPED_T, SHIPPED_D = os.path.join(ROOT, "models", "target"), os.path.join(ROOT, "models", "drafter")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    torch.set_num_threads(1)  # tiny matmuls: threads only contend on a shared 2-core box
    return make_tiny_pair(str(tmp_path_factory.mktemp("pair")), seed=3)


def altered(src, dst, weights=None, config=None):
    """A copy of checkpoint dir `src` at `dst` with its tensors / config.json changed in place by the callables."""
    dst = str(dst)
    shutil.copytree(src, dst)
    if weights:
        p = os.path.join(dst, "model.safetensors")
        w = load_file(p)
        weights(w)
        save_file(w, p)
    if config:
        p = os.path.join(dst, "config.json")
        cfg = json.load(open(p))
        config(cfg)
        json.dump(cfg, open(p, "w"))
    return dst


NORM, DOWN = "model.norm.weight", "model.layers.0.mlp.down_proj.weight"
Q = "model.layers.3.self_attn.q_proj.weight"
K_BIAS = "model.layers.3.self_attn.k_proj.bias"


def _fp8(w):
    w[Q + "_scale_inv"] = torch.ones(1, 1)
    w[Q] = w[Q].to(torch.float8_e4m3fn)


@pytest.mark.parametrize("weights,config,err,names", [
    (None, lambda c: c.update(quantization_config={"quant_method": "awq", "bits": 4}), ConfigError,
     ["'quantization_config'", "'awq'"]),
    (_fp8, None, CheckpointError, [Q + "_scale_inv", "not make FP8"]),
    (lambda w: w.update({Q: w[Q].to(torch.float8_e4m3fn)}), None, CheckpointError, [Q, "float8_e4m3fn"]),
    (lambda w: w.update({Q: w[Q].to(torch.int8)}), None, CheckpointError, [Q, "int8"]),
    (lambda w: w.update({Q + "_scale_inv": torch.ones(1, 1)}), None, CheckpointError,
     [Q + "_scale_inv", "FP8 scale"]),
    (lambda w: w.update({Q.replace("weight", "qweight"): torch.ones(1, 1)}), None, CheckpointError,
     [Q.replace("weight", "qweight"), "quantization tensor"]),
], ids=["config", "fp8-unconfigured", "fp8-weight", "int8-weight", "scale-tensor", "awq-tensor"])
def test_quantized_checkpoint_refused(pair, tmp_path, weights, config, err, names):
    """Quantized checkpoints other than FP8 block-wise (tests/test_fp8_checkpoint.py), and FP8 tensors without a
    quantization_config, are refused by name."""
    d = altered(pair[0], tmp_path / "t", weights, config)
    refused(lambda: load_target(d), err, *names)


def _truncate(cfg):
    cfg["num_hidden_layers"] = 3
    cfg["layer_types"] = cfg["layer_types"][:3]


def _grow(cfg):
    cfg["num_hidden_layers"] = 5
    cfg["layer_types"] = cfg["layer_types"] + ["linear_attention"]


@pytest.mark.parametrize("weights,config,err,names", [
    (None, lambda c: c.update(attention_bias=True), ConfigError, ["'attention_bias'"]),
    (lambda w: w.update({Q.replace("weight", "bias"): torch.zeros(64)}), None, CheckpointError,
     [Q.replace("weight", "bias"), "a bias"]),
    (lambda w: w.update({"model.layers.0.mlp.gate_proj.bias": torch.zeros(128)}), None, CheckpointError,
     ["model.layers.0.mlp.gate_proj.bias", "a bias"]),
    (lambda w: w.update({NORM: w[NORM].to(torch.int32)}), None, CheckpointError, [NORM, "int32"]),
    (None, _truncate, CheckpointError, ["'model.layers.3.", "layer 3 is beyond num_hidden_layers 3"]),
    (None, _grow, CheckpointError, ["missing tensor 'model.layers.4."]),
    (lambda w: w.update({"model.rotary_emb.inv_freq": torch.ones(4)}), None, CheckpointError,
     ["'model.rotary_emb.inv_freq'", "unknown tensor"]),
    (None, lambda c: c.update(tie_word_embeddings=True), CheckpointError,
     ["'lm_head.weight' differs from 'model.embed_tokens.weight'"]),
], ids=["attention_bias", "q-bias", "gate-bias", "int-norm", "extra-layers", "missing-layer", "unknown", "untied-copy"])
def test_target_tensor_used_or_refused(pair, tmp_path, weights, config, err, names):
    d = altered(pair[0], tmp_path / "t", weights, config)
    refused(lambda: load_target(d), err, *names)


@pytest.mark.parametrize("weights,config,err,names", [
    (lambda w: w.update({"norm.weight": w["norm.weight"].to(torch.int32)}), None, CheckpointError,
     ["'norm.weight'", "int32"]),
    (lambda w: w.update({"layers.1.input_layernorm.weight": torch.ones(64)}), None, CheckpointError,
     ["'layers.1.input_layernorm.weight'", "layer 1 is beyond num_hidden_layers 1"]),
    (lambda w: w.update({"norm.bias": torch.ones(64)}), None, CheckpointError, ["'norm.bias'", "a bias"]),
    (lambda w: w.update({"norm.weight": torch.full((64,), math.nan)}), None, CheckpointError,
     ["'norm.weight'", "non-finite"]),
    (None, lambda c: c.update(quantization_config={"quant_method": "fp8"}), ConfigError, ["'quantization_config'"]),
], ids=["int-norm", "extra-layer", "norm-bias", "nan", "quantized"])
def test_drafter_tensor_used_or_refused(pair, tmp_path, weights, config, err, names):
    target = load_target(pair[0])
    d = altered(pair[1], tmp_path / "d", weights, config)
    refused(lambda: load_drafter(d, target), err, *names)


def test_vision_and_mtp_ignored_by_name(pair, tmp_path):
    """A multimodal checkpoint's vision tower and the mtp.* head are not used and leave the text decoder's
    weights exactly as without them; model.visual.* in a text-only layout is an unknown tensor."""
    base = load_target(pair[0]).state_dict()

    def multimodal(w):
        for k in [k for k in w if k.startswith("model.")]:
            w[k.replace("model.", "model.language_model.", 1)] = w.pop(k)
        w["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 4, dtype=torch.int8)
        w["mtp.fc.weight"] = torch.zeros(4, 4)

    def wrap(cfg):
        text = dict(cfg)
        cfg.clear()
        cfg.update(model_type="qwen3_5", text_config=text, vision_config={"depth": 1})

    d = altered(pair[0], tmp_path / "mm", multimodal, wrap)
    got = load_target(d).state_dict()
    assert got.keys() == base.keys() and all(torch.equal(got[k], base[k]) for k in base)
    d = altered(pair[0], tmp_path / "text", lambda w: w.update({"model.visual.x.weight": torch.zeros(2)}))
    refused(lambda: load_target(d), CheckpointError, "'model.visual.x.weight'", "unknown tensor")


@pytest.mark.parametrize("weights,config,err,names", [
    (lambda w: w[NORM].fill_(math.nan), None, CheckpointError, [NORM, "non-finite"]),
    (lambda w: w[DOWN].view(-1)[5].fill_(math.inf), None, CheckpointError, [DOWN, "non-finite"]),
    (None, lambda c: c.update(rms_norm_eps=-1), ConfigError, ["'rms_norm_eps' must be a finite number > 0"]),
], ids=["nan-norm", "inf-down", "negative-eps"])
def test_non_finite_weights_and_bad_eps_refused(pair, tmp_path, weights, config, err, names):
    d = altered(pair[0], tmp_path / "t", weights, config)
    refused(lambda: load_target(d), err, *names)


def test_float16_overflow_refused(pair, tmp_path):
    d = altered(pair[0], tmp_path / "t", lambda w: w[DOWN].view(-1)[0].fill_(1e6))
    load_target(d)  # finite in float32
    refused(lambda: load_target(d, dtype=torch.float16), CheckpointError, DOWN, "float16 range")


def sharded(src, dst, index_of, extra=None):
    """`src` split into a.safetensors (the norm) and b.safetensors (the rest); index_of(name, shard) -> index
    entry; extra: shard -> {name: tensor} added to that shard file only."""
    dst = str(dst)
    shutil.copytree(src, dst)
    w = load_file(os.path.join(dst, "model.safetensors"))
    os.remove(os.path.join(dst, "model.safetensors"))
    shards = {"a.safetensors": {NORM: w.pop(NORM)}, "b.safetensors": w}
    for shard, ts in (extra or {}).items():
        shards[shard].update(ts)
    index = {}
    for shard, ts in shards.items():
        save_file(ts, os.path.join(dst, shard))
        index.update({k: index_of(k, shard) for k in ts if k not in index})
    json.dump({"weight_map": index}, open(os.path.join(dst, "model.safetensors.index.json"), "w"))
    return dst


@pytest.mark.parametrize("entry", ["../other/a.safetensors", "/etc/passwd", "sub/../../a.safetensors"])
def test_index_path_outside_checkpoint_refused(pair, tmp_path, entry):
    d = sharded(pair[0], tmp_path / "t", lambda k, s: entry if k == NORM else s)
    line = refused(lambda: load_target(d), CheckpointError, NORM, repr(entry), "not a file inside")
    assert line.startswith(os.path.join(d, "model.safetensors.index.json"))


def test_sharded_and_symlinked_shards_load(pair, tmp_path):
    """The positive controls: a plain split, and shards that are symlinks into another folder (the Hugging Face
    cache's snapshot layout) load to the same weights."""
    base = load_target(pair[0]).state_dict()
    d = sharded(pair[0], tmp_path / "t", lambda k, s: s)
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    for s in ("a.safetensors", "b.safetensors"):
        shutil.move(os.path.join(d, s), blobs / s)
        os.symlink(blobs / s, os.path.join(d, s))
    got = load_target(d).state_dict()
    assert all(torch.equal(got[k], base[k]) for k in base)


def test_tensor_in_two_shards(pair, tmp_path):
    """A second copy in a shard the index uses for other tensors is refused naming both; a shard the index never
    names is not read (the index decides)."""
    decoy = {NORM: torch.full((64,), 7.0)}
    d = sharded(pair[0], tmp_path / "t", lambda k, s: "a.safetensors" if k == NORM else s, {"b.safetensors": decoy})
    refused(lambda: load_target(d), CheckpointError, "b.safetensors", NORM, "maps it to a.safetensors")
    d = sharded(pair[0], tmp_path / "u", lambda k, s: s)
    save_file(decoy, os.path.join(d, "c.safetensors"))
    assert torch.equal(load_target(d).norm.weight, load_target(pair[0]).norm.weight)


@pytest.mark.parametrize("field,value,msg", [
    ("vocab_size", 1e12, "must be an integer >= 1"), ("vocab_size", 10 ** 12, "must be an integer <= "),
    ("vocab_size", True, "must be an integer >= 1"), ("hidden_size", 64.0, "must be an integer >= 1"),
    ("eos_token_id", "</s>", "must be an integer >= 0"), ("eos_token_id", [0, "</s>"], "must be an integer"),
    ("rope_theta", "ten thousand", "must be a finite number > 0"), ("rope_theta", math.inf, "finite number"),
    ("layer_types", "linear_attention", "must list 4 layer types"), ("rms_norm_eps", 0, "> 0"),
    ("rms_norm_eps", math.nan, "finite number"), ("tie_word_embeddings", "false", "must be true or false"),
    ("partial_rotary_factor", 2, "<= 1.0"), ("rope_parameters", "default", "must be an object"),
    ("num_experts", 2.5, "must be an integer >= 0"), ("mlp_bias", True, "not supported"),
])
def test_target_config_values(field, value, msg):
    cfg = tiny_target_config()
    cfg[field] = value
    refused(lambda: TargetConfig.from_dict(cfg, "config.json"), ConfigError, f"config.json: field '{field}'", msg)


@pytest.mark.parametrize("field,value,msg", [
    ("rms_norm_eps", -1, "> 0"), ("block_size", 1e12, "must be an integer"), ("rope_theta", "1e4", "finite number"),
    ("input_embedding_scale", "2", "finite number"), ("output_multiplier", math.nan, "finite number"),
    ("is_causal", "yes", "true or false"), ("target_layer_ids", "12", "must be a list of integers"),
    ("mask_token_id", 1.5, "must be an integer >= 0"), ("num_target_layers", "4", "must be an integer"),
    ("final_logit_softcapping", -1.0, ">= 0"), ("vocab_size", -5, "must be an integer >= 1"),
])
def test_drafter_config_values(field, value, msg):
    cfg = tiny_drafter_config(tiny_target_config())
    cfg["dflash_config"].pop(field, None)
    cfg[field] = value
    refused(lambda: DrafterConfig.from_dict(cfg, "config.json"), ConfigError, f"config.json: field '{field}'", msg)


def test_shipped_pair_loads():
    target = load_target(SHIPPED_T)
    drafter = load_drafter(SHIPPED_D, target)
    assert target.cfg.num_layers == 8 and drafter.cfg.num_layers == 2


def test_cli_one_line_per_refusal(tmp_path, capsys):
    """`dflash-trt generate` prints one line and exits 2 for a case of each kind (in process), and the installed
    command does the same (one subprocess)."""
    t = SHIPPED_T
    cases = {
        "quant": altered(t, tmp_path / "q", config=lambda c: c.update(quantization_config={"quant_method": "gptq"})),
        "bias": altered(t, tmp_path / "b", lambda w: w.update({K_BIAS: torch.zeros(128)})),
        "nan": altered(t, tmp_path / "n", lambda w: w[NORM].fill_(math.nan)),
        "config": altered(t, tmp_path / "c", config=lambda c: c.update(eos_token_id="</s>")),
    }
    cases["index"] = sharded(t, tmp_path / "i", lambda k, s: "/etc/passwd" if k == NORM else s)
    want = {"quant": "quantization_config", "bias": K_BIAS, "nan": NORM, "config": "eos_token_id",
            "index": "/etc/passwd"}
    for name, d in cases.items():
        rc = cli.main(["generate", "--model", d, "--drafter", SHIPPED_D, "--prompt", "x", "--max-new-tokens", "2"])
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and len(err) == 1 and err[0].startswith("dflash-trt generate: error: "), (name, err)
        assert want[name] in err[0], err[0]
    exe = os.path.join(os.path.dirname(sys.executable), "dflash-trt")
    r = subprocess.run([exe, "generate", "--model", cases["nan"], "--drafter", SHIPPED_D, "--prompt", "x"],
                       capture_output=True, text=True, timeout=120)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and NORM in lines[0], r.stderr
