"""DrafterConfig reads the fields of the released DFlash checkpoints and refuses, one line naming
the field, everything it does not implement."""
import os

import pytest

from dflash_trt.config import ConfigError, DrafterConfig, TargetConfig
from dflash_trt.export.checkpoint import load_drafter, load_target
from dflash_trt.tools.tiny import make_tiny_pair, tiny_drafter_config, tiny_target_config


def released_like(**over) -> dict:
    """A DFlash2-era config shaped like the released ones: block size and taps nested in dflash_config,
    mixed sliding/full layers, rope_parameters, scaling fields."""
    cfg = tiny_drafter_config(tiny_target_config(), layers=3, block_size=None)
    del cfg["block_size"], cfg["rope_theta"]
    cfg["dflash_config"].update(block_size=8, is_causal=False)
    cfg.update(layer_types=["sliding_attention", "sliding_attention", "full_attention"], sliding_window=5,
               use_sliding_window=True, rope_parameters={"rope_type": "default", "rope_theta": 1e7}, rms_norm_eps=1e-5,
               input_embedding_scale=2.0, output_multiplier=0.5, final_logit_softcapping=30.0, attention_bias=False,
               hidden_act="silu")
    cfg.update(over)
    return cfg


def test_released_fields_read():
    c = DrafterConfig.from_dict(released_like())
    assert c.block_size == 8 and c.rope_theta == 1e7 and c.rms_norm_eps == 1e-5
    assert c.layer_types == ["sliding_attention", "sliding_attention", "full_attention"] and c.sliding_window == 5
    assert (c.input_embedding_scale, c.output_multiplier, c.final_logit_softcapping) == (2.0, 0.5, 30.0)
    assert [c.layer_causal(i) for i in range(3)] == [False] * 3  # is_causal: false overrides every layer
    assert [c.layer_window(i) for i in range(3)] == [5, 5, 0]


def test_per_layer_causality_without_is_causal():
    cfg = released_like()
    del cfg["dflash_config"]["is_causal"]
    c = DrafterConfig.from_dict(cfg)
    assert [c.layer_causal(i) for i in range(3)] == [True, True, False]  # sliding => causal, full => not


def test_dflash_config_wins_over_top_level():
    cfg = released_like(block_size=16)
    assert DrafterConfig.from_dict(cfg).block_size == 8
    cfg["dflash_config"]["sliding_window"] = 3
    assert DrafterConfig.from_dict(cfg).sliding_window == 3


def test_use_sliding_window_false_disables_windows():
    c = DrafterConfig.from_dict(released_like(use_sliding_window=False))
    assert [c.layer_window(i) for i in range(3)] == [0, 0, 0]


def test_defaults_are_the_plain_dflash():
    c = DrafterConfig.from_dict(tiny_drafter_config(tiny_target_config()))
    assert c.layer_types == ["full_attention"] and c.sliding_window == 0 and c.is_causal is None
    assert (c.input_embedding_scale, c.output_multiplier, c.final_logit_softcapping) == (1.0, 1.0, 0.0)
    assert not c.layer_causal(0) and c.layer_window(0) == 0


@pytest.mark.parametrize("field,value,msg", [
    ("conv_kernel_size", 4, "DFlash2 field"), ("conv_group_size", 2, "DFlash2 field"),
    ("selector_rank", 8, "DFlash2 field"), ("selector_top_k", 4, "DFlash2 field"),
    ("mask_embedding", "mask_embedding.safetensors", "field 'mask_embedding' is not supported"),
])
def test_dflash2_fields_refused(field, value, msg):
    """A learned mask embedding is not implemented; a DFlash2 field alone is not a DFlash2 drafter."""
    for where in ("top", "nested"):
        cfg = released_like()
        (cfg if where == "top" else cfg["dflash_config"])[field] = value
        with pytest.raises(ConfigError, match=rf"^config.json: {msg}"):
            DrafterConfig.from_dict(cfg, "config.json")


@pytest.mark.parametrize("over,field", [
    ({"attention_bias": True}, "attention_bias"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}}, "rope_parameters.rope_type"),
    ({"layer_types": ["sliding_attention", "linear_attention", "full_attention"]}, "layer_types"),
    ({"layer_types": ["full_attention"]}, "layer_types"),
    ({"sliding_window": 0}, "sliding_window"),
    ({"sliding_window": None}, "sliding_window"),
    ({"is_causal": "yes"}, "is_causal"),
    ({"final_logit_softcapping": -1.0}, "final_logit_softcapping"),
    ({"input_embedding_scale": "2"}, "input_embedding_scale"),
])
def test_bad_or_unsupported_field_named(over, field):
    cfg = released_like(**over)
    cfg["dflash_config"].pop(field, None)
    with pytest.raises(ConfigError, match=rf"^config.json: .*'{field}'") as e:
        DrafterConfig.from_dict(cfg, "config.json")
    assert "\n" not in str(e.value)


def test_draft_vocab_size_other_than_target_refused():
    t = TargetConfig.from_dict(tiny_target_config())
    DrafterConfig.from_dict(released_like(draft_vocab_size=t.vocab_size)).check_against(t)
    with pytest.raises(ConfigError, match=r"field 'draft_vocab_size' 100 != target vocab 259 is not supported"):
        DrafterConfig.from_dict(released_like(draft_vocab_size=100)).check_against(t, "config.json")


def test_drafter_vocab_size_other_than_target_refused():
    """Released drafter configs state the target's vocab_size; another one means another tokenizer."""
    t = TargetConfig.from_dict(tiny_target_config())
    DrafterConfig.from_dict(released_like(vocab_size=t.vocab_size)).check_against(t)
    with pytest.raises(ConfigError, match=r"field 'vocab_size' 300 != target vocab 259 is not supported"):
        DrafterConfig.from_dict(released_like(vocab_size=300)).check_against(t, "config.json")


@pytest.mark.parametrize("tensor", ["embed_tokens.weight", "lm_head.weight", "mask_embedding",
                                    "layers.0.self_attn.q_proj.bias"])
def test_own_embedding_or_bias_tensor_refused(tmp_path, tensor):
    import torch
    from safetensors.torch import load_file, save_file

    tdir, ddir = make_tiny_pair(str(tmp_path))
    f = os.path.join(ddir, "model.safetensors")
    w = load_file(f)
    w[tensor] = torch.zeros(4)
    save_file(w, f)
    with pytest.raises(ConfigError, match=rf"drafter tensor '{tensor}' is not supported"):
        load_drafter(ddir, load_target(tdir))
