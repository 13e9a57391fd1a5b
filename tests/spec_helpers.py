"""Drafters with known behaviour for lossless tests: backends that answer drafter_block themselves."""
import numpy as np

from dflash_trt.abi import DRAFTER_BLOCK
from dflash_trt.runtime.interfaces import BackendDefaults


class ScriptedDrafter(BackendDefaults):
    """Wraps a backend; drafter_block proposes the target's own greedy continuation `greedy` (token at
    absolute position p is greedy[p]; or a list of such lists, one per batch row) for the first
    j(step, gamma_max, row) drafts and a guaranteed-wrong token after. `at` holds the positions of the block being
    drafted (per row: the bonus token's first), for a j that depends on where in the text the step is."""

    def __init__(self, inner, greedy, vocab, right_count=lambda step, gamma_max: gamma_max):
        self.inner, self.greedy, self.vocab, self.right_count = inner, greedy, vocab, right_count
        self.name, self.kv_dtype = inner.name, inner.kv_dtype
        self.step = 0

    def run(self, graph, inputs):
        if not graph.startswith(DRAFTER_BLOCK):  # drafter_block or drafter_block_b{γ+1}
            return self.inner.run(graph, inputs)
        self.inner.run(graph, inputs)  # still exercise the real drafter graph on the real ctx
        pos = inputs["positions"]
        B, Bs = pos.shape
        self.at = pos[:, 0].tolist()
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


class TableDrafter:
    """A drafter for the device (fused) step path with known behaviour: ctx rows and the block graph are the
    real drafter's, but the drafts come from a table of the target's greedy continuations (token after
    (position, token)), right for the first j drafts (j a fixed function of the block's position, mostly
    0..4, every third block up to block_size - 1) and wrong after — all in
    torch on the drafter's device, so it runs inside the step (and its CUDA graph) and every accept count
    occurs. `greedy`: full token lists (prompt + greedy continuation), one per prompt."""

    def __init__(self, inner, greedy, vocab, max_pos):
        import torch

        self.inner, self.cfg, self.vocab = inner, inner.cfg, vocab
        dev = next(inner.parameters()).device
        table = torch.zeros(max_pos + 1, vocab, dtype=torch.int64)
        for seq in greedy:
            for p in range(len(seq) - 1):
                table[p, seq[p]] = seq[p + 1]
        self.table = table.to(dev)

    def ctx(self, ctx_hidden, positions):
        return self.inner.ctx(ctx_hidden, positions)

    def block(self, block_ids, positions, block_table, kv_start, kv_len, dkv_pool, want_logits=False,
              temperature=None, draft_u=None):  # a DFlash1 stand-in: the DFlash2 selector's draws are not used
        import torch

        self.inner.block(block_ids, positions, block_table, kv_start, kv_len, dkv_pool)  # the real graph runs
        B, Bs = block_ids.shape
        tok, drafts = block_ids[:, 0], []
        for i in range(Bs - 1):
            tok = self.table[positions[:, i].clamp(max=self.table.shape[0] - 1), tok]
            drafts.append(tok)
        drafts = torch.stack(drafts, 1)
        p0 = positions[:, :1]
        right = torch.where(p0 % 3 == 0, (p0 * 5 + 1) % Bs, (p0 * 7 + 3) % 5)
        wrong = (drafts + 1) % self.vocab
        return {"drafts": torch.where(torch.arange(Bs - 1, device=drafts.device)[None] < right, drafts, wrong)}
