"""The reason a checkpoint tensor is left over (bound to no parameter), named in its one-line refusal."""
from __future__ import annotations

import re

_QUANT_SUFFIXES = ("weight_scale_inv", "weight_scale", "input_scale", "scale_inv", ".qweight", ".qzeros",
                   ".scales", ".g_idx", ".absmax", ".quant_map")


def why_unused(key: str, layers: str, n_layers: int, used=frozenset()) -> str:
    """Why checkpoint tensor `key` binds to no parameter: the clause of its refusal. layers: the prefix of the
    decoder layers' keys; used: the keys that did bind."""
    if key.endswith(".weight_scale_inv"):
        w = key.removesuffix("_scale_inv")
        if w in used:
            return (f"the FP8 scale of '{w}', which config.json does not make FP8: no quantization_config, its "
                    "skip list names the module, or transformers never converts it")
        return f"an FP8 scale without its weight '{w}'"
    if key.endswith(_QUANT_SUFFIXES):
        return "a quantization tensor of a format not loaded: only FP8 block-wise weights with weight_scale_inv"
    if key.endswith(".bias"):
        return "a bias: these projections have none here"
    m = re.match(re.escape(layers) + r"layers\.(\d+)\.", key)
    if m and int(m.group(1)) >= n_layers:
        return f"layer {m.group(1)} is beyond num_hidden_layers {n_layers}"
    return "unknown tensor"
