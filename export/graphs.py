"""Which model method implements which graph of the ABI: the one dispatch shared by the exporter
(export/onnx_export.py traces it) and the torch backend (runtime/backends/torch_backend.py runs it)."""
from __future__ import annotations

from dflash_trt.abi import DRAFTER_BLOCK, DRAFTER_CTX, PREFILL, parse_drafter_block, parse_target_graph
from dflash_trt.modeling.regions import EAGER


def run_graph(name: str, target, drafter, x: dict, want_logits: bool = False, regions=EAGER) -> dict:
    """Run graph `name` on inputs `x` (ABI input names -> tensors); returns its outputs by ABI name. regions: how
    the target's step runs its pieces (modeling/regions.py)."""
    if parse_target_graph(name) is not None or name == PREFILL:
        return target.step(x["input_ids"], x["positions"], x["slot"], x["seq_len"], x["block_table"],
                           x["kv_pool"], x["gdn_pool"], x["conv_pool"], valid_len=x.get("valid_len"),
                           want_logits=want_logits, gdn_commit=x.get("gdn_commit"), regions=regions)
    if drafter is None:
        raise ValueError(f"graph '{name}' needs a drafter")
    if name == DRAFTER_CTX:
        return drafter.ctx(x["ctx_hidden"], x["positions"])
    bs = parse_drafter_block(name, drafter.cfg.block_size)
    if bs is not None:  # the block length is the inputs' (drafter.block runs any Bs)
        if x["block_ids"].shape[1] != bs:
            raise ValueError(f"graph '{name}' runs blocks of {bs} slots, got block_ids {tuple(x['block_ids'].shape)}")
        return drafter.block(x["block_ids"], x["positions"], x["block_table"], x["kv_start"], x["kv_len"],
                             x["dkv_pool"], want_logits=want_logits, temperature=x.get("temperature"),
                             draft_u=x.get("draft_u"))
    raise ValueError(f"unknown graph '{name}' (expected target_k<K>, {PREFILL}, {DRAFTER_CTX}, {DRAFTER_BLOCK})")
