"""One failing step fails only what it must: an exception in any phase of a scheduler step (admit, prefill, plan,
launch, collect, commit.finish, the on_step hook) fails the requests it belongs to (state "failed", the exception
recorded, slot and pages given back) and reaches the caller of rt.step(); every other request of the batch goes on
to the tokens of its solo run, nothing stays running, and every pool comes back full. Run on the host executor and
on the GPU executor's logic eagerly on CPU (TorchCpuDevice, one step in flight); on a GPU, launch and collect faults
on the CUDA-graph executor with the trained pair."""
import os

import numpy as np
import pytest
import torch
from spec_helpers import TableDrafter

from dflash_trt.abi import PoolSizes
from dflash_trt.export.checkpoint import load_drafter, load_target
from dflash_trt.runtime import commit
from dflash_trt.runtime.backends.graph_executor import GraphStepExecutor
from dflash_trt.runtime.backends.torch_backend import TorchBackend
from dflash_trt.runtime.devices.torch_cpu import TorchCpuDevice
from dflash_trt.runtime.host_step import HostStepExecutor
from dflash_trt.runtime.runtime import Runtime
from dflash_trt.tools.tiny import make_tiny_pair

pytestmark = pytest.mark.usefixtures("one_thread")
# prompts shorter than a prefill chunk: a reserve for a sequence with rows committed is a step's (the plan's)
SIZES = PoolSizes(kv_blocks=64, page_size=4, max_seq_len=64, max_seqs=4, dkv_blocks=64, ctx_window=12,
                  prefill_chunk=16)
N_NEW, GAMMA = 16, 3
JOINS = [0, 0, 2]  # A and B from the start, C joins at step 2 (its admission and prefill are its own)
A, B, C = range(3)
PHASES = ["admit", "prefill", "plan", "launch", "collect", "finish", "on_step"]


class Injected(RuntimeError):
    """The fault the tests inject."""


class Fault:
    """Wraps a function so that its n-th call for which `when(*args)` holds raises Injected (before the real call,
    or after it: its work done, its result lost); `args` keeps that call's arguments."""

    def __init__(self, n=1, when=lambda *a, **k: True, after=False):
        self.n, self.when, self.after, self.hits, self.args, self.error = n, when, after, 0, None, None

    def wrap(self, fn):
        def wrapped(*a, **k):
            hit = self.when(*a, **k) and self._count()
            out = fn(*a, **k) if self.after or not hit else None
            if hit:
                self.args, self.error = a, Injected(f"injected fault in {fn.__name__}")
                raise self.error
            return out
        return wrapped

    def _count(self) -> bool:
        self.hits += 1
        return self.hits == self.n


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    tdir, ddir = make_tiny_pair(str(tmp_path_factory.mktemp("pair")), seed=3)
    target = load_target(tdir)
    drafter = load_drafter(ddir, target)
    rng = np.random.default_rng(4)
    prompts = [[int(t) for t in rng.integers(0, 250, n)] for n in (11, 7, 13)]
    rt = Runtime(TorchBackend(target, drafter), target.cfg, drafter.cfg, SIZES)
    solo = [rt.generate(p, N_NEW, spec=False)[0] for p in prompts]
    return target, drafter, prompts, solo


def make_runtime(pair, executor, device=None):
    target, drafter, prompts, solo = pair
    # drafts from the target's own continuations, right for a varying count: every accept length occurs
    d = TableDrafter(drafter, [p + s for p, s in zip(prompts, solo)], target.cfg.vocab_size, SIZES.max_seq_len)
    return Runtime(TorchBackend(target, d), target.cfg, drafter.cfg, SIZES, device=device,
                   executor=executor)


def full(rt):
    return (rt.kv_alloc.num_free == rt.kv_alloc.num_total and rt.dkv_alloc.num_free == rt.dkv_alloc.num_total
            and rt.slots.num_free == rt.slots.num_total)


def serve(rt, prompts, n_new, spec, hook=None):
    """A server loop: requests join at JOINS, a step that raises is reported and the loop steps on.
    Returns (requests, exceptions raised by rt.step())."""
    reqs, raised, step = {}, [], 0
    while len(reqs) < len(prompts) or rt.has_work:
        for i, j in enumerate(JOINS):
            if j == step:
                reqs[i] = rt.add_request(prompts[i], n_new, gamma=GAMMA if spec else None, spec=spec)
                rt.scheduler.on_step = hook
        try:
            rt.step()
        except Injected as e:
            raised.append(e)
        step += 1
        assert step < 300, "a request never finished"
    return reqs, raised


def inject(phase, rt, prompts, monkeypatch):
    """Arm one fault of `phase` on rt. Returns (fault, on_step hook, the prompt indices it belongs to: a function of
    the faulted call's arguments)."""
    of = {tuple(p): i for i, p in enumerate(prompts)}
    ex, hook = rt.executor, None
    if phase == "admit":  # C's admission
        f = Fault(when=lambda prompt, **k: prompt == prompts[C])
        monkeypatch.setattr(rt, "add_sequence", f.wrap(rt.add_sequence))
        return f, hook, lambda a: {C}
    if phase == "prefill":  # the prefill launch holding C
        f = Fault(when=lambda seqs, chunks: any(s.tokens == prompts[C] for s in seqs))
        monkeypatch.setattr(ex, "launch_prefill", f.wrap(ex.launch_prefill))
        return f, hook, lambda a: {of[tuple(s.tokens)] for s in a[0]}
    if phase == "launch":  # the second step's launch, its work done on the device and its result lost
        f = Fault(n=2, after=True)
        monkeypatch.setattr(ex, "launch", f.wrap(ex.launch))
        return f, hook, lambda a: {of[tuple(r.prompt)] for r in a[0].reqs}
    if phase == "collect":  # the second step's collect
        plans = []  # (pending, plan) of every step launched
        launch = ex.launch
        monkeypatch.setattr(ex, "launch", lambda plan: plans.append((launch(plan), plan)) or plans[-1][0])
        f = Fault(n=2, after=True, when=lambda p: any(p is q for q, _ in plans))
        monkeypatch.setattr(ex, "collect", f.wrap(ex.collect))
        return f, hook, lambda a: {of[tuple(r.prompt)] for q, plan in plans if q is a[0] for r in plan.reqs}
    # B's third step (A, B and C in the batch), in its plan's reserve / its commit.finish / the hook
    if phase == "plan":
        f = Fault(n=3, when=lambda seq, *a, **k: seq.tokens == prompts[B] and seq.seq_len > 0)
        monkeypatch.setattr(commit, "reserve", f.wrap(commit.reserve))
    elif phase == "finish":
        f = Fault(n=3, when=lambda seq, *a, **k: seq.tokens == prompts[B] and seq.bonus is not None)
        monkeypatch.setattr(commit, "finish", f.wrap(commit.finish))
    else:
        f = Fault(n=3, when=lambda rt_, req, *a: req.prompt == prompts[B])
        hook = f.wrap(lambda *a: None)
    return f, hook, lambda a: {B}


def check_outcome(rt, pair, reqs, raised, fault, belongs):
    """The fault's requests failed with it, the others equal their solo runs, no pool leaks, nothing is stuck."""
    prompts, solo = pair[2], pair[3]
    assert fault.error is not None, "the fault never fired"
    assert raised == [fault.error]  # reached the caller of rt.step(), once
    failed = {i for i, r in reqs.items() if r.status == "failed"}
    assert failed == belongs(fault.args)
    assert failed != set(reqs), "no request was left to continue"
    for i, r in reqs.items():
        if i in failed:
            assert r.finish_reason == "error" and r.error is fault.error
            assert r.tokens == solo[i][: len(r.tokens)] and r.seq is None
        else:
            assert r.status == "finished" and r.tokens == solo[i], i
    assert full(rt) and not rt.has_work and not rt.scheduler.inflight


def run_fault(pair, phase, spec, executor, monkeypatch, device=None):
    rt = make_runtime(pair, executor, device)
    fault, hook, belongs = inject(phase, rt, pair[2], monkeypatch)
    reqs, raised = serve(rt, pair[2], N_NEW, spec, hook)
    check_outcome(rt, pair, reqs, raised, fault, belongs)
    # the runtime serves the next batch as if nothing had happened
    monkeypatch.undo()
    again, raised = serve(rt, pair[2], N_NEW, spec)
    assert not raised and [again[i].tokens for i in range(3)] == pair[3] and full(rt)


@pytest.mark.parametrize("spec", [False, True], ids=["plain", "dflash"])
@pytest.mark.parametrize("phase", PHASES)
def test_a_fault_on_the_host_executor_fails_only_its_requests(pair, phase, spec, monkeypatch):
    run_fault(pair, phase, spec, HostStepExecutor, monkeypatch)


@pytest.mark.parametrize("spec", [False, True], ids=["plain", "dflash"])
@pytest.mark.parametrize("phase", PHASES)
def test_a_fault_on_the_device_executor_logic_fails_only_its_requests(pair, phase, spec, monkeypatch):
    """The GPU executor's logic on CPU tensors: one step in flight, the device advancing seq_len / bonus itself."""
    run_fault(pair, phase, spec, lambda rt: GraphStepExecutor(rt, inflight=1), monkeypatch, TorchCpuDevice())


def test_a_failing_zero_slot_gives_the_slot_back(pair, monkeypatch):
    """add_sequence fails after taking a slot (its state could not be zeroed): the slot goes back with the error."""
    rt = make_runtime(pair, HostStepExecutor)
    monkeypatch.setattr(rt.executor, "zero_slot", Fault().wrap(rt.executor.zero_slot))
    req = rt.add_request(pair[2][A], 4, spec=False)
    with pytest.raises(Injected, match="zero_slot"):
        rt.step()
    assert req.status == "failed" and isinstance(req.error, Injected) and full(rt) and not rt.has_work


# ------------------------------------------------------------------ the CUDA-graph executor (GPU)
MODELS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models")


@pytest.mark.gpu
@pytest.mark.skipif(not os.path.isfile(os.path.join(MODELS, "drafter", "config.json")), reason="no trained pair")
@pytest.mark.parametrize("spec", [False, True], ids=["plain", "dflash"])
@pytest.mark.parametrize("phase", ["launch", "collect"])
def test_a_fault_on_the_cuda_graph_executor_fails_only_its_requests(phase, spec, monkeypatch):
    """The trained pair (fp32) on a CudaDevice, steps as CUDA graphs one in flight: a launch whose work reached the
    device and whose result was lost, or a lost collect, fails that step's rows; the others' tokens equal the
    stored CPU reference; the device state of the slots freed is reset by the next request's prefill."""
    from reference_tokens import load_reference

    from dflash_trt.runtime.devices.cuda import CudaDevice

    ref = load_reference()
    if ref is None:
        pytest.fail("tests/data/trained_greedy_128.json is missing or from other checkpoints")
    t = load_target(os.path.join(MODELS, "target"), torch.float32).cuda()
    d = load_drafter(os.path.join(MODELS, "drafter"), t, torch.float32).cuda()
    sizes = PoolSizes(max_seq_len=512, kv_blocks=256, dkv_blocks=256, max_seqs=8, ctx_window=256)
    rt = Runtime(TorchBackend(t, d), t.cfg, d.cfg, sizes, device=CudaDevice())
    assert isinstance(rt.executor, GraphStepExecutor)
    prompts, n_new = ref["prompt_ids"][:3], 32
    solo = [tk[:n_new] for tk in ref["tokens"][:3]]
    fault, hook, belongs = inject(phase, rt, prompts, monkeypatch)
    reqs, raised = serve(rt, prompts, n_new, spec, hook)
    check_outcome(rt, (t, d, prompts, solo), reqs, raised, fault, belongs)
    monkeypatch.undo()
    again, raised = serve(rt, prompts, n_new, spec)
    assert not raised and [again[i].tokens for i in range(3)] == solo and full(rt)
