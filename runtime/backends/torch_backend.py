"""Torch backend: runs the reference modules (export/target.py, export/drafter.py) for each graph.
Pools arrive as numpy arrays and are viewed, not copied (torch.from_numpy), and never written."""
from __future__ import annotations

import numpy as np
import torch

from ...abi import DRAFTER_BLOCK, DRAFTER_CTX, PREFILL, parse_target_graph


def _t(a):
    return torch.from_numpy(np.ascontiguousarray(a))


class TorchBackend:
    name = "torch"

    def __init__(self, target, drafter=None, want_logits: bool = False):
        self.target, self.drafter, self.want_logits = target, drafter, want_logits
        self.kv_dtype = str(next(target.parameters()).dtype).replace("torch.", "")
        if self.kv_dtype not in ("float32", "float64"):
            raise ValueError(f"the host runtime keeps pools in numpy; target dtype {self.kv_dtype} is not supported "
                             "there (load the target in float32)")

    @torch.no_grad()
    def run(self, graph: str, inputs: dict) -> dict:
        x = {k: _t(v) for k, v in inputs.items()}
        if parse_target_graph(graph) is not None or graph == PREFILL:
            out = self.target.step(
                x["input_ids"], x["positions"], x["slot"], x["seq_len"], x["block_table"],
                x["kv_pool"], x["gdn_pool"], x["conv_pool"], valid_len=x.get("valid_len"),
                want_logits=self.want_logits,
            )
        elif graph == DRAFTER_CTX:
            out = self.drafter.ctx(x["ctx_hidden"], x["positions"])
        elif graph == DRAFTER_BLOCK:
            out = self.drafter.block(x["block_ids"], x["positions"], x["block_table"], x["kv_start"],
                                     x["kv_len"], x["dkv_pool"], want_logits=self.want_logits)
        else:
            raise ValueError(f"unknown graph '{graph}'")
        return {k: v.detach().numpy() for k, v in out.items() if v is not None}
