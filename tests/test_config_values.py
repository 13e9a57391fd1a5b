"""Config values that cannot be meant are refused where they are read, one line naming the field."""
import pytest

from dflash_trt.config import ConfigError, DrafterConfig, TargetConfig
from dflash_trt.tools.tiny import tiny_drafter_config, tiny_target_config


@pytest.mark.parametrize("field,value", [
    ("num_key_value_heads", 0), ("vocab_size", "abc"), ("hidden_size", -256), ("num_hidden_layers", 0),
    ("head_dim", 0), ("linear_num_key_heads", 1.5), ("intermediate_size", True), ("linear_conv_kernel_dim", -1),
])
def test_target_field_must_be_positive_integer(field, value):
    cfg = tiny_target_config()
    cfg[field] = value
    with pytest.raises(ConfigError, match=rf"config.json: field '{field}' must be an integer >= 1, got {value!r}"):
        TargetConfig.from_dict(cfg, "config.json")


def test_full_attention_interval_zero():
    cfg = tiny_target_config()
    del cfg["layer_types"]
    cfg["full_attention_interval"] = 0
    with pytest.raises(ConfigError, match="field 'full_attention_interval' must be an integer >= 1, got 0"):
        TargetConfig.from_dict(cfg, "config.json")


@pytest.mark.parametrize("field,value", [("num_hidden_layers", 0), ("block_size", "16"), ("num_attention_heads", -4)])
def test_drafter_field_must_be_positive_integer(field, value):
    cfg = tiny_drafter_config(tiny_target_config())
    cfg[field] = value
    with pytest.raises(ConfigError, match=rf"field '{field}' must be an integer >= 1, got {value!r}"):
        DrafterConfig.from_dict(cfg, "config.json")


def test_drafter_tap_and_mask_ids_non_negative():
    cfg = tiny_drafter_config(tiny_target_config())
    cfg["dflash_config"]["target_layer_ids"] = [1, -1]
    with pytest.raises(ConfigError, match="field 'target_layer_ids' must be an integer >= 0, got -1"):
        DrafterConfig.from_dict(cfg, "config.json")
