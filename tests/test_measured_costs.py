"""Auto draft length weighs widths by step times measured on the device (runtime/draft_length.py MeasuredCosts, fed by
the graph executor as it builds each decode / spec key): the estimate of a width not measured yet, the choice it
changes (plain decoding where a spec step costs twice a plain one), and the executor timing each new step key once
(a TorchCpuDevice that claims step graphs and wall-clock events), losslessly; a sampled run takes the model's widths,
so a seeded run's tokens do not depend on the measured times."""
import time

import pytest

from dflash_trt.abi import PoolSizes
from dflash_trt.export.checkpoint import load_drafter, load_target
from dflash_trt.runtime.backends.graph_executor import TIMED_RUNS, GraphStepExecutor
from dflash_trt.runtime.backends.torch_backend import TorchBackend
from dflash_trt.runtime.devices.torch_cpu import TorchCpuDevice
from dflash_trt.runtime.draft_length import CostModel, DraftLength, MeasuredCosts
from dflash_trt.runtime.runtime import Runtime
from dflash_trt.tools.tiny import make_tiny_pair

pytestmark = pytest.mark.usefixtures("one_thread")


def test_estimates_from_what_was_measured():
    m, model = MeasuredCosts(), CostModel()
    assert m.seconds(8, 1) == model.seconds(8, 1)  # nothing measured: the default model
    m.add(1, 1, 3.0e-3)
    assert m.seconds(1, 1) == 3.0e-3 and m.seconds(1, 16) == 3.0e-3  # the nearest measured bucket
    assert m.seconds(4, 1) == pytest.approx(3.0e-3 * model.seconds(4, 1) / model.seconds(1, 1))  # scaled model
    m.add(16, 1, 6.0e-3)  # a spec width: the others of its kind scale from it, not from plain decoding
    assert m.seconds(4, 1) == pytest.approx(6.0e-3 * model.seconds(4, 1) / model.seconds(16, 1))
    m.add(2, 1, 5.0e-3)
    assert m.seconds(4, 1) == pytest.approx(5.0e-3 + 1.0e-3 * 2 / 14)  # linear between measured spec widths
    assert m.seconds(1, 1) == 3.0e-3 and m.has(16, 1) and not m.has(16, 4)
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="positive"):
            m.add(4, 1, bad)


def test_measured_costs_turn_an_unprofitable_spec_step_into_plain_decoding():
    """A first draft accepted 40% of the time, a second half as often after it (1.6 tokens a step at best): by the
    default model (a spec step 1.2-1.5x plain) drafting pays; with spec steps measured at 1.7-2x plain (a 27B FP8
    step) it does not, and the measured costs pick plain decoding."""
    def settle(costs):
        dl = DraftLength([1, 2, 4, 8, 16], costs)
        for step in range(200):
            K = dl.choose(1)
            if K > 1:
                dl.record(K, [min(K - 1, (0, 0, 0, 1, 2)[step % 5])])
        return [dl.choose(1) for _ in range(20)]
    measured = MeasuredCosts()
    for K, ms in ((1, 3.3), (2, 5.6), (4, 5.8), (8, 6.1), (16, 6.7)):
        measured.add(K, 1, ms / 1e3)
    assert max(settle(CostModel())) > 1
    assert settle(measured).count(1) >= 19  # plain, but for a probe
    dl = DraftLength([1, 2, 4, 8, 16], measured)
    assert dl.choose(1) > 1  # the prior: half of the drafts accepted
    for _ in range(40):
        dl.record(dl.choose(1), [0])
    assert dl.choose(1) == 1  # greedy: the measured costs
    measured.model = CostModel(draft=-0.9)  # a model under which drafting is free: a sampled step drafts
    assert dl.choose(1, sampled=True) > 1


class EventClock(TorchCpuDevice):
    """The GPU executor's path on CPU: it claims step graphs (its captures fail: each key runs eagerly) and its
    timing events read the wall clock."""
    graph_steps = True

    class Event:
        t = None

    def __init__(self):
        super().__init__()
        self.timed = 0

    def new_event(self, timing=False):
        return self.Event() if timing else None

    def record(self, event):
        if event is not None:
            event.t = time.perf_counter()

    def elapsed_ms(self, start, end):
        self.timed += 1
        return (end.t - start.t) * 1e3


def test_the_graph_executor_times_each_new_step_key_once(tmp_path):
    tdir, ddir = make_tiny_pair(str(tmp_path), seed=5)
    target = load_target(tdir)
    drafter = load_drafter(ddir, target)
    sizes = PoolSizes(kv_blocks=64, page_size=4, max_seq_len=96, max_seqs=2, dkv_blocks=64, ctx_window=12,
                      prefill_chunk=16)
    prompt = [3, 17, 92, 5, 41, 8, 60]
    plain = Runtime(TorchBackend(target, drafter), target.cfg, drafter.cfg, sizes).generate(prompt, 24, spec=False)[0]
    dev = EventClock()
    rt = Runtime(TorchBackend(target, drafter), target.cfg, drafter.cfg, sizes, device=dev,
                 executor=lambda r: GraphStepExecutor(r, inflight=1))
    assert rt.generate(prompt, 24)[0] == plain  # auto width over measured costs: still the greedy tokens
    assert rt.generate(prompt, 24)[0] == plain
    spec_keys = {(k[1], k[2]) for k in rt.executor.buffers if k[0] != "prefill"}
    assert spec_keys and set(rt.step_costs.table) == spec_keys  # every decode / spec key, no prefill
    assert dev.timed == len(spec_keys)  # once each, the second run reuses them
    assert all(s > 0 for s in rt.step_costs.table.values()) and TIMED_RUNS >= 1
    rt.step_costs.table = {k: v * (1 + 9 * (k[0] > 1)) for k, v in rt.step_costs.table.items()}  # spec 10x plain
    seeded = [rt.generate(prompt, 24, temperature=0.9, seed=11)[0] for _ in range(2)]
    rt.step_costs.table = {(1, 1): 1.0, **{(k, 1): 1.0 + 1e-3 * k for k in (2, 3, 4, 8, 16)}}  # spec ~ free
    assert seeded[0] == seeded[1] == rt.generate(prompt, 24, temperature=0.9, seed=11)[0]  # the model's widths
