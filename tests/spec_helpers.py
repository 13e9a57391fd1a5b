"""Drafters with known behaviour for lossless tests: backends that answer drafter_block themselves."""
import numpy as np

from dflash_trt.abi import DRAFTER_BLOCK


class ScriptedDrafter:
    """Wraps a backend; drafter_block proposes the target's own greedy continuation `greedy` (token at
    absolute position p is greedy[p]) for the first j(step) drafts and a guaranteed-wrong token after."""

    def __init__(self, inner, greedy, vocab, right_count=lambda step, gamma_max: gamma_max):
        self.inner, self.greedy, self.vocab, self.right_count = inner, greedy, vocab, right_count
        self.name, self.kv_dtype = inner.name, inner.kv_dtype
        self.step = 0

    def run(self, graph, inputs):
        if graph != DRAFTER_BLOCK:
            return self.inner.run(graph, inputs)
        self.inner.run(graph, inputs)  # still exercise the real drafter graph on the real ctx
        pos = inputs["positions"]
        B, Bs = pos.shape
        drafts = np.zeros((B, Bs - 1), dtype=np.int64)
        j = self.right_count(self.step, Bs - 1)
        for b in range(B):
            for i in range(Bs - 1):
                p = int(pos[b, i + 1])
                right = self.greedy[p] if p < len(self.greedy) else 0
                drafts[b, i] = right if i < j else (right + 1) % self.vocab
        self.step += 1
        return {"drafts": drafts}
