"""bf16 on the GPU: the verify step (target_k16) and plain decode (target_k1) see the same positions
with the same tokens, so their logits must agree up to bf16 rounding — per position top-10 KL < 1e-3 over
the 24 held-out prompts of the shipped pair — and the test reports how many DFlash outputs differ from plain
(bf16 argmax near-ties may flip a token; that is what the KL bound is about).

Host executor over TorchDevice("cuda") (our kernels for GDN/conv/attention/commit), with logits recorded from
every target graph launch: for each verify row whose tokens so far equal the plain run's, its logits are
compared with the plain run's logits at that position."""
import json
import os

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = os.path.join(ROOT, "models")
NEW_TOKENS = 64
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not os.path.isfile(os.path.join(MODELS, "drafter", "config.json")), reason="no trained pair in models/")]


class Recorder:
    """Wraps a backend: keeps (positions, input ids, logits) of every target graph launch, on the host."""

    def __init__(self, be):
        self.be, self.rows = be, []
        self.kv_dtype, self.name = be.kv_dtype, be.name

    def __getattr__(self, k):
        return getattr(self.be, k)

    def run(self, graph, inputs):
        out = self.be.run(graph, inputs)
        if graph.startswith("target_k"):
            lg = out["logits"]
            lg = lg.float().cpu().numpy() if hasattr(lg, "cpu") else np.asarray(lg, np.float32)
            pos, ids = np.asarray(inputs["positions"]), np.asarray(inputs["input_ids"])
            self.rows += [(pos[b], ids[b], lg[b]) for b in range(lg.shape[0])]
        return out


# Measured on the H200, rows only before the two runs' outputs part: with cuBLAS for the verify block's projections
# and a 1-row kernel for decode, 1361 rows, max 1.26e-3 (over the bound); with one kernel for 1-16 rows
# (plugins/gemv: a row's projection does not depend on the rows beside it), 1391 rows, max 1.585e-3, DFlash != plain
# on 5 of 24: still over. Module hooks showed every verify row bit-identical to the decode step of its position in
# the first block after prefill; what differed was the GDN state carried between steps (the commit folded n rows by
# the closed form e^(gamma_n - gamma_i), plain decode one row a step: other fp32 roundings, amplified by bf16). Since
# gdn_fold replays the accepted rows one at a time (n rows at once == n one-row folds, bit for bit), the two runs
# carry one state: 1478 rows, max 7.75e-4, mean 7.9e-6, p99 1.5e-4, no row >= 1e-3, DFlash != plain on 1 of 24.
def test_bf16_verify_logits_match_decode_logits():
    import torch

    from dflash_trt.abi import PoolSizes
    from dflash_trt.export.checkpoint import load_drafter, load_target
    from dflash_trt.runtime.backends.torch_backend import TorchBackend
    from dflash_trt.runtime.devices.torch_device import TorchDevice
    from dflash_trt.runtime.host_step import HostStepExecutor
    from dflash_trt.runtime.load import load_codec
    from dflash_trt.runtime.runtime import Runtime
    from dflash_trt.tools.compare import topk_kl

    t = load_target(os.path.join(MODELS, "target"), torch.bfloat16).cuda()
    d = load_drafter(os.path.join(MODELS, "drafter"), t, torch.bfloat16).cuda()
    codec = load_codec(os.path.join(MODELS, "target"))
    rec = Recorder(TorchBackend(t, d, want_logits=True))
    rt = Runtime(rec, t.cfg, d.cfg, PoolSizes(max_seq_len=512, kv_blocks=64, dkv_blocks=96), device=TorchDevice("cuda"),
                 executor=HostStepExecutor)
    prompts = [json.loads(x) for x in open(os.path.join(ROOT, "tests", "prompts_heldout.txt"))
               if x.strip() and not x.startswith("#")]
    kls, differ = [], 0
    for p in prompts:
        ids = codec.encode(p)
        rec.rows = []
        plain, _ = rt.generate(ids, NEW_TOKENS, spec=False)
        full = ids + plain
        decode = {int(pos[0]): lg[0] for pos, _, lg in rec.rows if len(pos) == 1}  # K=1: position -> logits
        rec.rows = []
        spec, _ = rt.generate(ids, NEW_TOKENS, gamma=15)
        differ += spec != plain
        # tokens before the first output where DFlash and plain part are the same in both runs
        same = next((j for j, (a, b) in enumerate(zip(spec, plain)) if a != b), min(len(spec), len(plain)))
        for pos, tok, lg in rec.rows:
            if len(pos) != 16 or int(pos[0]) - len(ids) > same:  # a block after the outputs parted: other context
                continue
            for i in range(16):  # rows whose tokens so far are the plain run's see the same context
                q = int(pos[i])
                if q >= len(full) or int(tok[i]) != full[q] or q not in decode:
                    break
                kls.append(topk_kl(decode[q][None], lg[i][None]))
    kls = np.array(kls)
    report = (f"bf16, {len(prompts)} prompts x {NEW_TOKENS} tokens: DFlash != plain on {differ}; {kls.size} verify "
              f"rows compared, top-10 KL max {kls.max():.3e} mean {kls.mean():.3e} p99 {np.quantile(kls, 0.99):.3e}, "
              f"{int((kls >= 1e-3).sum())} rows >= 1e-3")
    print(report)
    assert kls.size > 500, report
    assert kls.max() < 1e-3, report
