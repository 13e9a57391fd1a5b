"""The one config object per model: parsed from a Hugging Face config.json, validated up front.

TargetConfig covers Qwen3-Next (`qwen3_next`, dense or sparse-MoE MLPs), Qwen3.5 text (`qwen3_5_text`),
Qwen3.5-MoE text (`qwen3_5_moe_text`) and multimodal Qwen3.5 / Qwen3.5-MoE (`qwen3_5`, `qwen3_5_moe`, text
decoder under `text_config`). DrafterConfig covers the z-lab DFlash format.
Every error names the file and the field, so a user can fix the checkpoint rather than the code.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from dflash_trt import config_fields as fields
from dflash_trt.config_fields import ConfigError, read_json
from dflash_trt.quant import Fp8Config, parse_quant

__all__ = ["ConfigError", "DrafterConfig", "TargetConfig", "cache_root", "moe_layers", "read_json"]


def cache_root() -> str:
    """Where built artifacts are cached (ONNX exports, NVRTC modules, ...): $DFLASH_TRT_CACHE when set and
    non-empty, else ~/.cache/dflash_trt."""
    return os.environ.get("DFLASH_TRT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "dflash_trt")


_int = fields.integer


def _rope(cfg: dict, path: str) -> tuple[float, float]:
    """rope_theta / partial_rotary_factor at top level (transformers 4) or in rope_parameters (5)."""
    rp, rs = fields.obj(cfg, "rope_parameters", path), fields.obj(cfg, "rope_scaling", path)
    theta = fields.number(cfg, "rope_theta", path, None, positive=True)
    if theta is None:
        theta = fields.number(rp, "rope_theta", path, 10000.0, positive=True, name="rope_parameters.rope_theta")
    partial = fields.number(cfg, "partial_rotary_factor", path, None, positive=True, maximum=1.0)
    if partial is None:
        partial = fields.number(rp, "partial_rotary_factor", path, 1.0, positive=True, maximum=1.0,
                                name="rope_parameters.partial_rotary_factor")
    rope_type = rp.get("rope_type", rs.get("rope_type", rs.get("type", "default")))
    if rope_type not in ("default", "mrope", None):
        raise ConfigError(f"{path}: rope type '{rope_type}' is not supported (only plain/multi-axis RoPE)")
    return theta, partial


def _moe_fields(cfg: dict, path: str, n_layers: int) -> dict:
    """The sparse-MoE fields as TargetConfig keywords ({} for a dense model); each checked by name."""
    n_exp = _int(cfg, "num_experts", path, 0, minimum=0)
    if n_exp == 0:
        return {}
    top_k = _int(cfg, "num_experts_per_tok", path)
    if top_k > n_exp:
        raise ConfigError(f"{path}: field 'num_experts_per_tok' {top_k} > num_experts {n_exp}")
    dense = cfg.get("mlp_only_layers") or []
    if not isinstance(dense, list) or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n_layers
                                          for i in dense):
        raise ConfigError(f"{path}: field 'mlp_only_layers' must list layer indices in 0..{n_layers - 1}, "
                          f"got {dense!r}")
    norm = fields.boolean(cfg, "norm_topk_prob", path, True)
    return dict(num_experts=n_exp, num_experts_per_tok=top_k,
                moe_intermediate_size=_int(cfg, "moe_intermediate_size", path),
                shared_expert_intermediate_size=_int(cfg, "shared_expert_intermediate_size", path),
                norm_topk_prob=norm, decoder_sparse_step=_int(cfg, "decoder_sparse_step", path, 1),
                mlp_only_layers=sorted(set(dense)))


def moe_layers(moe: dict, n_layers: int) -> list[int]:
    """Layer indices with a sparse-MoE MLP for _moe_fields' result (before a TargetConfig exists)."""
    if not moe:
        return []
    return [i for i in range(n_layers)
            if i not in moe["mlp_only_layers"] and (i + 1) % moe["decoder_sparse_step"] == 0]


@dataclass
class TargetConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    layer_types: list[str]  # "full_attention" | "linear_attention" per layer
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    partial_rotary_factor: float
    rms_norm_eps: float
    lin_num_k_heads: int
    lin_num_v_heads: int
    lin_k_dim: int
    lin_v_dim: int
    conv_kernel: int
    tie_word_embeddings: bool
    gdn_layout: str  # "qkvz" (Qwen3-Next: in_proj_qkvz + in_proj_ba) | "split" (Qwen3.5: qkv, z, b, a)
    eos_token_ids: list[int] = field(default_factory=list)
    # sparse MoE (num_experts 0: every MLP dense). A layer is MoE when num_experts > 0, it is not in
    # mlp_only_layers and (i + 1) % decoder_sparse_step == 0 — HF's Qwen3NextDecoderLayer rule; Qwen3.5-MoE
    # has neither field (every layer MoE, top-k always renormalised), which the defaults reproduce.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    quant: Fp8Config | None = None  # FP8 block-wise checkpoint (dflash_trt.quant); None: unquantized

    def __post_init__(self):
        if isinstance(self.quant, dict):  # read back from a manifest, where asdict wrote it as an object
            self.quant = Fp8Config(block=tuple(self.quant["block"]), skip=tuple(self.quant["skip"]))

    def is_moe_layer(self, i: int) -> bool:
        return self.num_experts > 0 and i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.num_layers) if self.is_moe_layer(i)]

    # ---- derived shapes (the graph ABI sizes) ----
    @property
    def attn_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "full_attention"]

    @property
    def gdn_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t != "full_attention"]

    @property
    def conv_dim(self) -> int:
        return 2 * self.lin_num_k_heads * self.lin_k_dim + self.lin_num_v_heads * self.lin_v_dim

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @classmethod
    def from_dict(cls, raw: dict, path: str = "config.json") -> "TargetConfig":
        mt = raw.get("model_type")
        if mt in ("qwen3_5", "qwen3_5_moe") or (mt is None and "text_config" in raw):
            cfg = dict(raw.get("text_config") or {})
            if not cfg:
                raise ConfigError(f"{path}: model_type '{mt or 'qwen3_5'}' needs a 'text_config' object")
            cfg.setdefault("tie_word_embeddings", raw.get("tie_word_embeddings", False))
            if "eos_token_id" not in cfg and "eos_token_id" in raw:
                cfg["eos_token_id"] = raw["eos_token_id"]
            layout = "split"
        elif mt in ("qwen3_5_text", "qwen3_5_moe_text"):
            cfg, layout = raw, "split"
        elif mt == "qwen3_next":
            cfg, layout = raw, "qkvz"
        else:
            raise ConfigError(
                f"{path}: model_type '{mt}' is not supported (expected qwen3_next, qwen3_5_text, qwen3_5, "
                "qwen3_5_moe_text or qwen3_5_moe)"
            )
        fields.refuse_unsupported(raw, path, quant_ok=True)
        quant = parse_quant(raw.get("quantization_config"), path)
        if cfg is not raw:
            fields.refuse_unsupported(cfg, path, "text_config.", quant_ok=True)
            if cfg.get("quantization_config") is not None:  # multimodal releases keep it at top level
                if quant is not None:
                    raise ConfigError(f"{path}: fields 'quantization_config' and 'text_config.quantization_config' "
                                      "are both set (one quantization, stated once)")
                quant = parse_quant(cfg["quantization_config"], path, "text_config.")
        n_layers = _int(cfg, "num_hidden_layers", path)
        layer_types = fields.str_list(cfg, "layer_types", path, ("full_attention", "linear_attention"), n_layers)
        if layer_types is None:
            interval = _int(cfg, "full_attention_interval", path, 4)
            layer_types = [
                "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers)
            ]
        moe = _moe_fields(cfg, path, n_layers)
        theta, partial = _rope(cfg, path)
        n_heads = _int(cfg, "num_attention_heads", path)
        hidden = _int(cfg, "hidden_size", path)
        c = cls(
            model_type=mt or "qwen3_5",
            vocab_size=_int(cfg, "vocab_size", path),
            hidden_size=hidden,
            # only dense layers use intermediate_size: Qwen3.5-MoE configs (every layer MoE) omit it
            intermediate_size=(_int(cfg, "intermediate_size", path) if len(moe_layers(moe, n_layers)) < n_layers
                               else _int(cfg, "intermediate_size", path, 0, minimum=0)),
            num_layers=n_layers,
            layer_types=list(layer_types),
            num_heads=n_heads,
            num_kv_heads=_int(cfg, "num_key_value_heads", path, n_heads),
            head_dim=_int(cfg, "head_dim", path, hidden // n_heads),
            rope_theta=theta,
            partial_rotary_factor=partial,
            rms_norm_eps=fields.number(cfg, "rms_norm_eps", path, 1e-6, positive=True),
            lin_num_k_heads=_int(cfg, "linear_num_key_heads", path),
            lin_num_v_heads=_int(cfg, "linear_num_value_heads", path),
            lin_k_dim=_int(cfg, "linear_key_head_dim", path),
            lin_v_dim=_int(cfg, "linear_value_head_dim", path),
            conv_kernel=_int(cfg, "linear_conv_kernel_dim", path, 4),
            tie_word_embeddings=fields.boolean(cfg, "tie_word_embeddings", path, False),
            gdn_layout=layout,
            eos_token_ids=fields.int_list(cfg, "eos_token_id", path, single_ok=True) or [],
            quant=quant,
            **moe,
        )
        c.validate(path)
        return c

    def validate(self, path: str = "config.json") -> None:
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"{path}: num_attention_heads {self.num_heads} not a multiple of num_key_value_heads")
        if self.lin_num_v_heads % self.lin_num_k_heads:
            raise ConfigError(f"{path}: linear_num_value_heads not a multiple of linear_num_key_heads")
        if self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            raise ConfigError(f"{path}: partial_rotary_factor gives odd or oversized rotary dim {self.rotary_dim}")
        if self.conv_kernel < 2:
            raise ConfigError(f"{path}: linear_conv_kernel_dim must be >= 2")
        bad = [t for t in self.layer_types if t not in ("full_attention", "linear_attention")]
        if bad:
            raise ConfigError(f"{path}: unknown layer type '{bad[0]}'")


# DFlash2-era fields of a drafter architecture we do not implement: refused by name, never ignored
_DRAFTER_UNSUPPORTED = ("mask_embedding",)
# DFlash2: a grouped dynamic causal conv around each layer's attention and MLP, and a candidate selector over the
# drafter's top-k; all four or none (DFlash1)
_DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


def _dflash2_fields(merged: dict, path: str, hidden: int) -> dict:
    """The DFlash2 sizes: all four fields or none; the conv groups must tile hidden_size."""
    given = [k for k in _DFLASH2_FIELDS if merged.get(k) is not None]
    if not given:
        return {}
    missing = [k for k in _DFLASH2_FIELDS if k not in given]
    if missing:
        raise ConfigError(f"{path}: DFlash2 field(s) {given} given without {missing} (a DFlash2 drafter needs all of "
                          f"{list(_DFLASH2_FIELDS)})")
    out = {k: _int(merged, k, path, minimum=1) for k in _DFLASH2_FIELDS}
    if hidden % out["conv_group_size"]:
        raise ConfigError(f"{path}: conv_group_size {out['conv_group_size']} does not divide hidden_size {hidden}")
    return out


@dataclass
class DrafterConfig:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    block_size: int
    target_layer_ids: list[int]
    mask_token_id: int
    num_target_layers: int | None = None
    # per layer: "full_attention" (bidirectional over all ctx + block) | "sliding_attention" (DESIGN §2b)
    layer_types: list[str] = field(default_factory=list)
    sliding_window: int = 0  # 0: no window; else a query at p sees keys with p - key < sliding_window
    is_causal: bool | None = None  # set: overrides causality within the block for every layer
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float = 0.0  # c > 0: logits = c * tanh(logits / c)
    draft_vocab_size: int | None = None  # checked against the target's vocab in check_against
    vocab_field: str = "draft_vocab_size"  # which config field draft_vocab_size came from (for the message)
    conv_kernel_size: int = 0  # DFlash2 (all four > 0) or DFlash1 (all four 0)
    conv_group_size: int = 0
    selector_rank: int = 0
    selector_top_k: int = 0

    @property
    def dflash2(self) -> bool:
        """Grouped dynamic convs around attention and MLP, and the candidate selector picking the drafts."""
        return self.selector_top_k > 0

    def layer_causal(self, i: int) -> bool:
        """Causal within the block for drafter layer i: is_causal when set, else sliding layers only."""
        if self.is_causal is not None:
            return bool(self.is_causal)
        return self._types()[i] == "sliding_attention"

    def layer_window(self, i: int) -> int:
        """Attention window of drafter layer i (0 = none): sliding layers only."""
        return self.sliding_window if self._types()[i] == "sliding_attention" else 0

    def _types(self) -> list[str]:
        return self.layer_types or ["full_attention"] * self.num_layers

    @classmethod
    def from_dict(cls, raw: dict, path: str = "config.json") -> "DrafterConfig":
        dc = raw.get("dflash_config") or {}
        if not isinstance(dc, dict):
            raise ConfigError(f"{path}: 'dflash_config' must be an object")

        # dflash_config first, then top level: the released checkpoints mix both
        merged = {**raw, **{k: v for k, v in dc.items() if v is not None}}
        for key in _DRAFTER_UNSUPPORTED:
            if merged.get(key) is not None:
                raise ConfigError(f"{path}: field '{key}' is not supported (a learned mask embedding in place of "
                                  "the target's embedding of mask_token_id is not implemented)")
        fields.refuse_unsupported(merged, path)
        taps = fields.int_list(merged, "target_layer_ids", path)
        if taps is None:
            raise ConfigError(f"{path}: missing 'dflash_config.target_layer_ids' (or top-level target_layer_ids)")
        if merged.get("mask_token_id") is None:
            raise ConfigError(f"{path}: missing 'dflash_config.mask_token_id' (or top-level mask_token_id)")
        rs, rp = fields.obj(merged, "rope_scaling", path), fields.obj(merged, "rope_parameters", path)
        if rs and rs.get("rope_type", rs.get("type", "default")) != "default":
            raise ConfigError(f"{path}: field 'rope_scaling' {rs!r} is not supported (YaRN and other rope "
                              "scaling: plain RoPE only)")
        if rp.get("rope_type", "default") != "default":
            raise ConfigError(f"{path}: field 'rope_parameters.rope_type' {rp['rope_type']!r} is not supported "
                              "(YaRN and other rope scaling: plain RoPE only)")
        theta, partial = _rope(merged, path)  # refuses YaRN / linear / dynamic rope scaling by its type
        if partial != 1.0:
            raise ConfigError(f"{path}: field 'partial_rotary_factor' {partial} is not supported (full RoPE only)")
        n_heads = _int(merged, "num_attention_heads", path)
        hidden = _int(merged, "hidden_size", path)
        n_layers = _int(merged, "num_hidden_layers", path)
        types = fields.str_list(merged, "layer_types", path, ("full_attention", "sliding_attention"), n_layers)
        types = types or ["full_attention"] * n_layers
        window = 0
        if "sliding_attention" in types and fields.boolean(merged, "use_sliding_window", path, True):
            window = _int(merged, "sliding_window", path)
        # the drafter borrows the target's embedding and lm_head: its vocabulary (draft_vocab_size, else the
        # vocab_size its config.json states) must be the target's
        dvs_field = "draft_vocab_size" if merged.get("draft_vocab_size") is not None else "vocab_size"
        c = cls(
            hidden_size=hidden,
            intermediate_size=_int(merged, "intermediate_size", path),
            num_layers=n_layers,
            num_heads=n_heads,
            num_kv_heads=_int(merged, "num_key_value_heads", path, n_heads),
            head_dim=_int(merged, "head_dim", path, hidden // n_heads),
            rms_norm_eps=fields.number(merged, "rms_norm_eps", path, 1e-6, positive=True),
            rope_theta=theta,
            block_size=_int(merged, "block_size", path, 16),
            target_layer_ids=taps,
            mask_token_id=_int(merged, "mask_token_id", path, minimum=0),
            num_target_layers=_int(merged, "num_target_layers", path, None),
            layer_types=types,
            sliding_window=window,
            is_causal=fields.boolean(merged, "is_causal", path, None),
            input_embedding_scale=fields.number(merged, "input_embedding_scale", path, 1.0),
            output_multiplier=fields.number(merged, "output_multiplier", path, 1.0),
            final_logit_softcapping=fields.number(merged, "final_logit_softcapping", path, 0.0, minimum=0),
            draft_vocab_size=_int(merged, dvs_field, path, None),
            vocab_field=dvs_field,
            **_dflash2_fields(merged, path, hidden),
        )
        if c.num_heads % c.num_kv_heads:
            raise ConfigError(f"{path}: num_attention_heads not a multiple of num_key_value_heads")
        if not 2 <= c.block_size <= 16:
            raise ConfigError(f"{path}: block_size {c.block_size} outside 2..16 (verify width K = block_size <= 16)")
        return c

    def check_against(self, target: TargetConfig, path: str = "drafter config.json") -> None:
        """A drafter is only usable with the target it was trained on; say exactly what differs."""
        if self.hidden_size != target.hidden_size:
            raise ConfigError(
                f"{path}: drafter hidden_size {self.hidden_size} != target hidden_size {target.hidden_size}"
            )
        bad = [t for t in self.target_layer_ids if not 0 <= t < target.num_layers]
        if bad:
            raise ConfigError(
                f"{path}: target_layer_ids {bad} out of range for a target with {target.num_layers} layers"
            )
        if self.num_target_layers is not None and self.num_target_layers != target.num_layers:
            raise ConfigError(
                f"{path}: num_target_layers {self.num_target_layers} != target num_hidden_layers {target.num_layers}"
            )
        if self.selector_top_k > target.vocab_size:
            raise ConfigError(f"{path}: selector_top_k {self.selector_top_k} > target vocab {target.vocab_size}")
        if self.draft_vocab_size is not None and self.draft_vocab_size != target.vocab_size:
            raise ConfigError(f"{path}: field '{self.vocab_field}' {self.draft_vocab_size} != target vocab "
                              f"{target.vocab_size} is not supported (no draft-to-target token map)")
        if not 0 <= self.mask_token_id < target.vocab_size:
            raise ConfigError(f"{path}: mask_token_id {self.mask_token_id} outside target vocab {target.vocab_size}")
