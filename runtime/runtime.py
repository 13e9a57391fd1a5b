"""The speculative-decoding runtime: owns the pools and sequences, launches graphs through a backend,
and funnels every state change through commit(). numpy + a Device; no torch or tensorrt here.

Step kinds (all end in commit with n rows):
  prefill  target_prefill over chunks of the prompt (n = valid rows of the chunk)
  decode   target_k1 on the bonus token (n = 1) — also the gated-off path, ctx still appended
  spec     drafter_block -> target_k{γ+1} -> greedy accept -> n = accepted + 1
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from dflash_trt.abi import DRAFTER_BLOCK, DRAFTER_CTX, PREFILL, PoolSizes, pool_specs, target_graph
from dflash_trt.runtime import snapshot
from dflash_trt.runtime.commit import commit
from dflash_trt.runtime.ctx import CtxWindow
from dflash_trt.runtime.devices.host import HostDevice
from dflash_trt.runtime.gating import Gate
from dflash_trt.runtime.pools import BlockAllocator, SlotPool
from dflash_trt.runtime.sequence import Sequence


class CapacityError(ValueError):
    """A request does not fit the runtime's sizes (prompt + new tokens over max_seq_len, ...)."""


@dataclass
class GenStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    target_steps: int = 0  # target decode/verify launches after prefill
    spec_steps: int = 0
    accepted: list = field(default_factory=list)  # accepted drafts per spec step
    seconds: float = 0.0

    @property
    def tau(self) -> float:
        """Acceptance length: tokens gained per spec (verify) step, accepted drafts + bonus."""
        return (sum(self.accepted) + len(self.accepted)) / max(len(self.accepted), 1)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0


class Runtime:
    def __init__(self, backend, target_cfg, drafter_cfg=None, sizes: PoolSizes = PoolSizes(),
                 device=None, gate: Gate | None = None):
        self.backend = backend
        self.tcfg, self.dcfg, self.sizes = target_cfg, drafter_cfg, sizes
        self.device = device or HostDevice()
        self.pools = {
            name: self.device.zeros(shape, dtype)
            for name, (shape, dtype) in pool_specs(target_cfg, drafter_cfg, sizes, backend.kv_dtype).items()
        }
        self.kv_alloc = BlockAllocator(sizes.kv_blocks, "target kv pages")
        self.dkv_alloc = BlockAllocator(sizes.dkv_blocks, "drafter ctx pages")
        self.slots = SlotPool(sizes.max_seqs, "sequence state slots")
        self.gate = gate or Gate()
        self._next_id = 0
        self.eos = set(target_cfg.eos_token_ids)

    # ---- sequence lifetime ----------------------------------------------------------------
    def add_sequence(self, prompt: list[int]) -> Sequence:
        if not prompt:
            raise CapacityError("empty prompt: at least one token is needed")
        bad = [t for t in prompt if not 0 <= int(t) < self.tcfg.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} outside the vocabulary [0, {self.tcfg.vocab_size})")
        slot = self.slots.alloc()
        for name in ("gdn_pool", "conv_pool"):  # a fresh sequence starts from zero state
            self.pools[name][:, slot] = 0
        ctx = None
        if self.dcfg is not None:
            ctx = CtxWindow(self.sizes.ctx_window, self.sizes.page_size, self.dkv_alloc, self.sizes.max_append)
        seq = Sequence(self._next_id, [int(t) for t in prompt], slot, self.sizes.max_blocks, ctx=ctx)
        self._next_id += 1
        return seq

    def release(self, seq: Sequence) -> None:
        if seq.slot < 0:
            return
        if seq.pages:
            self.kv_alloc.free(seq.pages)
        seq.pages = []
        if seq.ctx is not None:
            seq.ctx.release()
        self.slots.free(seq.slot)
        seq.slot = -1

    def save_sequence(self, seq: Sequence, path: str, extra: dict | None = None) -> str:
        """Snapshot seq's state (KV rows, GDN/conv slot, ctx rows + positions, tokens, bonus) between steps
        to the directory `path` (safetensors + JSON, written atomically); runtime/snapshot.py has the format."""
        return snapshot.save_sequence(self, seq, path, extra)

    def restore_sequence(self, path: str) -> Sequence:
        """A live sequence in the state saved at `path`, on fresh pages and slot; continues token-identically.
        Refuses a snapshot of another model/config (SnapshotMismatch names the fields)."""
        return snapshot.restore_sequence(self, path)

    # ---- graph launches ---------------------------------------------------------------
    def _target_inputs(self, seqs, ids, T):
        B = len(seqs)
        return {
            "input_ids": np.asarray(ids, dtype=np.int64).reshape(B, T),
            "positions": np.array([[s.seq_len + i for i in range(T)] for s in seqs], dtype=np.int64),
            "slot": np.array([s.slot for s in seqs], dtype=np.int64),
            "seq_len": np.array([s.seq_len for s in seqs], dtype=np.int64),
            "block_table": np.stack([s.block_table() for s in seqs]),
            "kv_pool": self.pools["kv_pool"], "gdn_pool": self.pools["gdn_pool"], "conv_pool": self.pools["conv_pool"],
        }

    def _ctx_rows(self, seqs, out):
        """drafter_ctx on the target step's ctx_hidden rows (padded to the graph's static R)."""
        if self.dcfg is None:
            return None
        R = self.sizes.max_append
        ctx_in = self.device.pad_rows(out["ctx_hidden"], R)
        pos = np.array([[s.seq_len + i for i in range(R)] for s in seqs], dtype=np.int64)
        return self.backend.run(DRAFTER_CTX, {"ctx_hidden": ctx_in, "positions": pos})["dkv_rows"]

    def _step(self, graph, seqs, ids, T, extra=None):
        inputs = self._target_inputs(seqs, ids, T)
        inputs.update(extra or {})
        out = self.backend.run(graph, inputs)
        return out, self._ctx_rows(seqs, out)

    def prefill(self, seq: Sequence) -> None:
        """Run the prompt through target_prefill chunks; sets seq.bonus to the first new token."""
        C = self.sizes.prefill_chunk
        toks = seq.tokens
        for lo in range(0, len(toks), C):
            chunk = toks[lo:lo + C]
            ids = np.zeros((1, C), dtype=np.int64)
            ids[0, :len(chunk)] = chunk
            out, dkv = self._step(PREFILL, [seq], ids, C, {"valid_len": np.array([len(chunk)], dtype=np.int64)})
            commit(self, [seq], out, [len(chunk)], dkv)
        seq.bonus = int(out["argmax"][0, len(chunk) - 1])

    def decode_step(self, seqs) -> list[list[int]]:
        """Plain K=1 step on each sequence's bonus token; returns the new token per sequence."""
        out, dkv = self._step(target_graph(1), seqs, [[s.bonus] for s in seqs], 1)
        commit(self, seqs, out, [1] * len(seqs), dkv)
        new = []
        for b, s in enumerate(seqs):
            s.bonus = int(out["argmax"][b, 0])
            new.append([s.bonus])
        return new

    def spec_step(self, seqs, gamma: int) -> tuple[list[list[int]], list[int]]:
        """propose -> verify K=γ+1 -> greedy accept -> commit. Returns (new tokens, accepted counts)."""
        d = self.dcfg
        Bs = d.block_size
        if not 1 <= gamma <= Bs - 1:
            raise ValueError(f"gamma {gamma} outside [1, block_size-1={Bs - 1}]")
        B = len(seqs)
        vis = [s.ctx.visible() for s in seqs]
        block = np.full((B, Bs), d.mask_token_id, dtype=np.int64)
        block[:, 0] = [s.bonus for s in seqs]
        drafts = self.backend.run(DRAFTER_BLOCK, {
            "block_ids": block,
            "positions": np.array([[s.seq_len + i for i in range(Bs)] for s in seqs], dtype=np.int64),
            "block_table": np.stack([v[0] for v in vis]).astype(np.int64),
            "kv_start": np.array([v[1] for v in vis], dtype=np.int64),
            "kv_len": np.array([v[2] for v in vis], dtype=np.int64),
            "dkv_pool": self.pools["dkv_pool"],
        })["drafts"][:, :gamma]
        K = gamma + 1
        ids = np.concatenate([block[:, :1], drafts], axis=1)
        out, dkv = self._step(target_graph(K), seqs, ids, K)
        am = out["argmax"]
        # greedy accept: longest prefix with draft_i == target argmax_{i-1}; bonus = argmax at the first miss
        match = drafts == am[:, :gamma]
        acc = np.where(match.all(1), gamma, match.argmin(1))
        commit(self, seqs, out, acc + 1, dkv)
        new = []
        for b, s in enumerate(seqs):
            m = int(acc[b])
            s.bonus = int(am[b, m])
            new.append([int(t) for t in drafts[b, :m]] + [s.bonus])
        return new, [int(a) for a in acc]

    # ---- the generation loop ----------------------------------------------------------
    def generate(self, prompt: list[int], max_new_tokens: int, gamma: int | None = None,
                 spec: bool = True, on_step=None) -> tuple[list[int], GenStats]:
        """Greedy generation of one sequence; spec decoding when a drafter is present and spec=True.
        The sequence's pages and slot are always given back, also when a step raises."""
        use_spec = spec and self.dcfg is not None
        gamma = gamma if gamma is not None else (self.dcfg.block_size - 1 if use_spec else 0)
        need = len(prompt) + max_new_tokens + (gamma + 1 if use_spec else 1)
        if need > self.sizes.max_seq_len:
            raise CapacityError(
                f"prompt of {len(prompt)} tokens + {max_new_tokens} new tokens (+ verify width) needs {need} "
                f"positions; this runtime holds max_seq_len={self.sizes.max_seq_len}"
            )
        stats = GenStats(prompt_tokens=len(prompt))
        seq = self.add_sequence(prompt)
        t0 = time.perf_counter()
        try:
            self.prefill(seq)
            new = [seq.bonus]
            self.gate.reset()
            while len(new) < max_new_tokens and new[-1] not in self.eos:
                if use_spec and self.gate.spec_on():
                    toks, acc = self.spec_step([seq], gamma)
                    self.gate.record(acc[0], gamma)
                    stats.spec_steps += 1
                    stats.accepted.append(acc[0])
                    toks = toks[0]
                else:
                    toks = self.decode_step([seq])[0]
                    self.gate.tick()
                stats.target_steps += 1
                new.extend(toks)
                if on_step is not None:
                    on_step(self, seq)
            new = new[:max_new_tokens]
            if self.eos and any(t in self.eos for t in new):
                new = new[: next(i for i, t in enumerate(new) if t in self.eos) + 1]
        finally:
            stats.seconds = time.perf_counter() - t0
            self.release(seq)
        stats.new_tokens = len(new)
        return new, stats
