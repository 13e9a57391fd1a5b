"""Continuous-batching harness shared by the CPU and GPU batch tests: requests join mid-run, leave at their
own lengths (and one by release), and after every step the ctx invariant (DESIGN §5) is checked on the
state the step left — host bookkeeping, the window the device attended, the drafter K/V rows in the pool,
and (with nothing else in flight) the per-slot device state."""
import numpy as np
import torch
from spec_helpers import TableDrafter

from dflash_trt.abi import PoolSizes
from dflash_trt.runtime.backends.graph_executor import GraphStepExecutor
from dflash_trt.runtime.backends.torch_backend import TorchBackend
from dflash_trt.runtime.devices.torch_cpu import TorchCpuDevice
from dflash_trt.runtime.runtime import Runtime


def dense_ctx_rows(target, drafter, tokens):
    """Drafter ctx K/V rows for every position of `tokens`, from one dense target pass: [Ld,2,T,H,hd]."""
    dev = next(target.parameters()).device
    ids = torch.tensor([tokens], device=dev)
    with torch.no_grad():
        out = target.forward_full(ids, want_logits=False)
        pos = torch.arange(ids.shape[1], device=dev)[None]
        return drafter.ctx(out["ctx_hidden"], pos)["dkv_rows"][:, :, 0].float().cpu().numpy()


def make_invariant_check(rt, full_rows: dict, log: list, atol=2e-4):
    """on_step hook: full_rows[tuple(prompt)] = dense ctx rows of that prompt + its greedy continuation."""
    W = rt.sizes.ctx_window

    def check(rt_, req, plan, res, b):
        seq = req.seq
        n = int(res.n[b])
        before = seq.seq_len - n
        if rt.dcfg is not None:
            ctx = seq.ctx
            pos = ctx.positions_visible()
            assert ctx.total == seq.seq_len and ctx.ctx_len == min(seq.seq_len, W)
            assert np.array_equal(pos, np.arange(seq.seq_len - len(pos), seq.seq_len))
            if plan.kind == "spec" and res.kv_len is not None:  # the window the step's drafter attended
                assert int(res.kv_len[b] - res.kv_start[b]) == min(before, W)
            bt, start, end = ctx.visible()
            rows = rt.device.gather_rows(rt.pools["dkv_pool"], bt, start, end - start)
            dense = full_rows[tuple(req.prompt)]
            known = pos < dense.shape[2]  # a last step may commit rows past the reference's tokens
            np.testing.assert_allclose(rows[:, :, known], dense[:, :, pos[known]], atol=atol, rtol=1e-3)
        state = getattr(rt.executor, "steps", None)
        if state is not None and not rt.scheduler.inflight:  # nothing else in flight: device == host
            st = state.state
            assert int(st.seq_len[seq.slot]) == seq.seq_len and int(st.bonus[seq.slot]) == seq.bonus
        log.append((tuple(req.prompt), plan.kind, plan.bucket, n))
    return check


def run_batch(rt, prompts, max_new, joins, gamma, spec=True, release_at=None, check=None):
    """Requests for prompts[i] join at scheduler step joins[i] with max_new[i] tokens; release_at =
    (step, prompt index) releases one mid-run. Returns ({prompt index: tokens}, {prompt index: request})."""
    reqs, step = {}, 0
    while True:
        for i, j in enumerate(joins):
            if j == step and i not in reqs:
                reqs[i] = rt.add_request(prompts[i], max_new[i], gamma=gamma, spec=spec)
                if check is not None:
                    rt.scheduler.on_step = check
        if release_at is not None and release_at[0] == step and release_at[1] in reqs:
            rt.release_request(reqs[release_at[1]])
        rt.step()
        step += 1
        if len(reqs) == len(prompts) and not rt.scheduler.has_work:
            break
        assert step < 10_000
    return {i: r.tokens for i, r in reqs.items()}, reqs


# ---- the batch tests' sizes and requests, and a runtime over the GPU executor's CPU twin ----
SIZES = PoolSizes(kv_blocks=160, page_size=4, max_seq_len=128, max_seqs=6, dkv_blocks=160, ctx_window=12,
                  prefill_chunk=16)
N_NEW = [20, 9, 24, 14, 6]
JOINS = [0, 0, 2, 5, 6]


def graph_runtime(target, drafter, prompts, greedy, inflight=1, sizes=SIZES):
    d = TableDrafter(drafter, [list(p) + g for p, g in zip(prompts, greedy)], target.cfg.vocab_size,
                     sizes.max_seq_len)
    return Runtime(TorchBackend(target, d), target.cfg, drafter.cfg, sizes, device=TorchCpuDevice(),
                   executor=lambda rt: GraphStepExecutor(rt, inflight=inflight))


def full(rt):
    """Every page and state slot back in its pool."""
    return (rt.kv_alloc.num_free == rt.kv_alloc.num_total and rt.dkv_alloc.num_free == rt.dkv_alloc.num_total
            and rt.slots.num_free == rt.slots.num_total)
