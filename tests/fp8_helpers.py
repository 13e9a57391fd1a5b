"""FP8 block-wise checkpoints written by the tests in Qwen's release layout (float8_e4m3fn `weight` + float32
`weight_scale_inv` per 128x128 block), with the W8A16 oracle beside them: the same model with every quantized weight
replaced by its dequantized value. Written independently of modeling/fp8.py."""
import json
import os

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from dflash_trt.quant import Fp8Config

B = 128


def skip_list(n_layers: int, prefix: str = "model.") -> list[str]:
    """What Qwen's FP8 releases keep unquantized: embeddings, lm_head, norms, the GDN a/b projections, conv1d,
    routers and shared-expert gates (full module names, plus one suffix-style pattern as transformers matches)."""
    out = ["lm_head", prefix + "embed_tokens", prefix + "norm", "linear_attn.in_proj_b"]
    for i in range(n_layers):
        L = f"{prefix}layers.{i}."
        out += [L + "input_layernorm", L + "post_attention_layernorm", L + "linear_attn.in_proj_a",
                L + "linear_attn.conv1d", L + "mlp.gate", L + "mlp.shared_expert_gate"]
    return out


def quantize(w):
    """w fp32 [..., N, K] -> (float8_e4m3fn [..., N, K], fp32 scale_inv [..., ceil(N/128), ceil(K/128)]), amax/448
    per block (written independently of modeling/fp8.py)."""
    N, K = w.shape[-2:]
    blocks = F.pad(w, (0, -K % B, 0, -N % B)).unflatten(-1, (-1, B)).unflatten(-3, (-1, B))
    s = (blocks.abs().amax(dim=(-3, -1)) / 448).clamp(min=1e-8).float()
    return (w / expand(s, N, K)).clamp(-448, 448).to(torch.float8_e4m3fn), s


def expand(s, N, K):
    return s.repeat_interleave(B, -2).repeat_interleave(B, -1)[..., :N, :K]


def dequantize(q, s):
    return q.float() * expand(s, *q.shape[-2:])


def fp8_checkpoint(hf_dir: str, out: str, oracle: str, skip: list[str], keep=()) -> dict:
    """Quantize the HF checkpoint at hf_dir to `out` (Qwen's tensor names and dtypes) and write the W8A16 oracle
    (same config, every quantized weight replaced by its dequantized value) to `oracle`. keep: weight names left
    unquantized although the skip list converts them (for refusal tests). Returns the FP8 tensors."""
    sd, q = load_file(os.path.join(hf_dir, "model.safetensors")), Fp8Config(skip=tuple(skip))
    fp8, ref = {}, {}
    for k, w in sd.items():
        module = k.removesuffix(".weight")
        if k.endswith(".weight") and w.dim() == 2 and q.converts(module) and k not in keep:
            fp8[k], fp8[k + "_scale_inv"] = quantize(w)
            ref[k] = dequantize(fp8[k], fp8[k + "_scale_inv"])
        else:
            fp8[k] = ref[k] = w
    cfg = json.load(open(os.path.join(hf_dir, "config.json")))
    for d, tensors, c in ((oracle, ref, cfg), (out, fp8, dict(cfg, quantization_config=dict(
            quant_method="fp8", fmt="e4m3", weight_block_size=[128, 128], activation_scheme="dynamic",
            modules_to_not_convert=skip)))):
        os.makedirs(d, exist_ok=True)
        save_file(tensors, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
        json.dump(c, open(os.path.join(d, "config.json"), "w"))
    return fp8
