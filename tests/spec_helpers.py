"""Drafters with known behaviour for lossless tests: backends that answer drafter_block themselves."""
import numpy as np

from dflash_trt.abi import DRAFTER_BLOCK


class ScriptedDrafter:
    """Wraps a backend; drafter_block proposes the target's own greedy continuation `greedy` (token at
    absolute position p is greedy[p]; or a list of such lists, one per batch row) for the first
    j(step, gamma_max, row) drafts and a guaranteed-wrong token after."""

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
        for b in range(B):
            seq = self.greedy[b] if isinstance(self.greedy[0], list) else self.greedy
            j = self.right_count(self.step, Bs - 1) if B == 1 else self.right_count(self.step, Bs - 1, b)
            for i in range(Bs - 1):
                p = int(pos[b, i + 1])
                right = seq[p] if p < len(seq) else 0
                drafts[b, i] = right if i < j else (right + 1) % self.vocab
        self.step += 1
        return {"drafts": drafts}
