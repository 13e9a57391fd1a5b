"""Bad input gets a specific error naming the file/tensor/field, and pools stay consistent."""
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash_trt.abi import PoolSizes
from dflash_trt.config import ConfigError
from dflash_trt.export.checkpoint import CheckpointError, load_drafter, load_target
from dflash_trt.runtime.backends.torch_backend import TorchBackend
from dflash_trt.runtime.pools import PoolExhausted
from dflash_trt.runtime.runtime import CapacityError, Runtime
from dflash_trt.tools.tiny import make_tiny_pair


@pytest.fixture(scope="module")
def pair_dir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("p"))
    return make_tiny_pair(d, seed=1)


def copy(src, tmp_path, name="c"):
    dst = str(tmp_path / name)
    shutil.copytree(src, dst)
    return dst


def edit_json(path, fn):
    cfg = json.load(open(path))
    fn(cfg)
    json.dump(cfg, open(path, "w"))


def test_missing_config(pair_dir, tmp_path):
    d = copy(pair_dir[0], tmp_path)
    os.remove(os.path.join(d, "config.json"))
    with pytest.raises(ConfigError, match=r"config\.json: file not found"):
        load_target(d)


def test_corrupt_config(pair_dir, tmp_path):
    d = copy(pair_dir[0], tmp_path)
    open(os.path.join(d, "config.json"), "w").write("{not json")
    with pytest.raises(ConfigError, match=r"config\.json: not valid JSON"):
        load_target(d)


def test_config_missing_field(pair_dir, tmp_path):
    d = copy(pair_dir[0], tmp_path)
    edit_json(os.path.join(d, "config.json"), lambda c: c.pop("linear_num_key_heads"))
    with pytest.raises(ConfigError, match="missing required field 'linear_num_key_heads'"):
        load_target(d)


def test_moe_config_without_expert_fields_is_refused_by_name(pair_dir, tmp_path):
    """num_experts alone is not enough: the MoE fields it needs are named (and the dense weights do not
    silently load as an MoE model)."""
    d = copy(pair_dir[0], tmp_path)
    edit_json(os.path.join(d, "config.json"), lambda c: c.update(num_experts=8))
    with pytest.raises(ConfigError, match="missing required field 'num_experts_per_tok'"):
        load_target(d)
    edit_json(os.path.join(d, "config.json"), lambda c: c.update(num_experts_per_tok=2, moe_intermediate_size=16))
    with pytest.raises(ConfigError, match="missing required field 'shared_expert_intermediate_size'"):
        load_target(d)
    edit_json(os.path.join(d, "config.json"), lambda c: c.update(shared_expert_intermediate_size=16))
    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.0\.mlp\.experts\.0\.gate_proj\.weight'"):
        load_target(d)


def test_missing_weight_file(pair_dir, tmp_path):
    d = copy(pair_dir[0], tmp_path)
    os.remove(os.path.join(d, "model.safetensors"))
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_target(d)


def test_pickle_only_is_refused(pair_dir, tmp_path):
    d = copy(pair_dir[0], tmp_path)
    os.remove(os.path.join(d, "model.safetensors"))
    open(os.path.join(d, "pytorch_model.bin"), "wb").write(b"\x80\x04")
    with pytest.raises(CheckpointError, match="safetensors only"):
        load_target(d)


def test_corrupt_weight_file(pair_dir, tmp_path):
    d = copy(pair_dir[0], tmp_path)
    open(os.path.join(d, "model.safetensors"), "wb").write(b"\x10\x00\x00\x00garbage")
    with pytest.raises(CheckpointError, match=r"model\.safetensors: not a readable safetensors file"):
        load_target(d)


def test_missing_tensor_named(pair_dir, tmp_path):
    d = copy(pair_dir[0], tmp_path)
    p = os.path.join(d, "model.safetensors")
    w = load_file(p)
    del w["model.layers.0.linear_attn.A_log"]
    save_file(w, p)
    with pytest.raises(CheckpointError, match="missing tensor 'model.layers.0.linear_attn.A_log'"):
        load_target(d)


def test_wrong_shape_named(pair_dir, tmp_path):
    d = copy(pair_dir[0], tmp_path)
    p = os.path.join(d, "model.safetensors")
    w = load_file(p)
    w["model.layers.3.self_attn.k_proj.weight"] = torch.zeros(3, 3)
    save_file(w, p)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor 'model.layers.3.self_attn.k_proj.weight' "
                                              r"has shape \(3, 3\), expected \(32, 64\)"):
        load_target(d)


def test_missing_shard(pair_dir, tmp_path):
    d = copy(pair_dir[0], tmp_path)
    os.rename(os.path.join(d, "model.safetensors"), os.path.join(d, "model-00001-of-00002.safetensors"))
    json.dump({"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}},
              open(os.path.join(d, "model.safetensors.index.json"), "w"))
    with pytest.raises(CheckpointError, match="shard 'model-00002-of-00002.safetensors' is listed"):
        load_target(d)


@pytest.mark.parametrize("change,msg", [
    (lambda c: c.update(hidden_size=32), "drafter hidden_size 32 != target hidden_size 64"),
    (lambda c: c["dflash_config"].update(target_layer_ids=[1, 4]), r"target_layer_ids \[4\] out of range"),
    (lambda c: c.update(num_target_layers=8), "num_target_layers 8 != target num_hidden_layers 4"),
])
def test_incompatible_drafter(pair_dir, tmp_path, change, msg):
    target = load_target(pair_dir[0])
    d = copy(pair_dir[1], tmp_path)
    edit_json(os.path.join(d, "config.json"), change)
    with pytest.raises(ConfigError, match=msg):
        load_drafter(d, target)


def test_drafter_fc_width_mismatch(pair_dir, tmp_path):
    target = load_target(pair_dir[0])
    d = copy(pair_dir[1], tmp_path)
    edit_json(os.path.join(d, "config.json"), lambda c: c["dflash_config"].update(target_layer_ids=[0, 1, 2]))
    with pytest.raises(ConfigError, match=r"fc.weight is \(64, 128\); with 3 taps .* must be \(64, 192\)"):
        load_drafter(d, target)


def runtime(pair_dir, **sizes):
    target = load_target(pair_dir[0])
    drafter = load_drafter(pair_dir[1], target)
    base = dict(kv_blocks=64, page_size=4, max_seq_len=128, dkv_blocks=64, ctx_window=16, prefill_chunk=16)
    base.update(sizes)
    return Runtime(TorchBackend(target, drafter), target.cfg, drafter.cfg, PoolSizes(**base))


def test_prompt_over_capacity(pair_dir):
    rt = runtime(pair_dir)
    with pytest.raises(CapacityError, match=r"prompt of 120 tokens \+ 20 new tokens .* max_seq_len=128"):
        rt.generate(list(range(120)), 20)
    assert rt.slots.num_free == rt.slots.num_total and rt.kv_alloc.num_free == rt.kv_alloc.num_total


def test_bad_token_id(pair_dir):
    rt = runtime(pair_dir)
    with pytest.raises(ValueError, match="token id 999 outside the vocabulary"):
        rt.generate([1, 999], 4)
    assert rt.slots.num_free == rt.slots.num_total


@pytest.mark.parametrize("spec", [False, True])
def test_kv_pages_exhausted_frees_everything(pair_dir, spec):
    rt = runtime(pair_dir, kv_blocks=10)  # 40 rows of KV: prompt 30 + a few steps, then exhaustion
    with pytest.raises(PoolExhausted, match=r"target kv pages pool exhausted: asked for 1, only 0 free"):
        rt.generate(list(range(30)), 60, gamma=3, spec=spec)
    assert rt.kv_alloc.num_free == rt.kv_alloc.num_total
    assert rt.dkv_alloc.num_free == rt.dkv_alloc.num_total
    assert rt.slots.num_free == rt.slots.num_total
    out, _ = rt.generate(list(range(8)), 8, spec=spec)  # the runtime is still usable
    assert len(out) == 8
