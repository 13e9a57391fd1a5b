"""The server's engine loop in-process (no HTTP): a step fault fails only the requests of that step and the loop
goes on serving; a refused submission leaves nothing queued; max_queue refuses at once; abort releases; the pools
are full afterwards. The shipped pair on CPU (torch)."""
import os
import threading

import pytest

pytest.importorskip("torch")
pytestmark = pytest.mark.usefixtures("one_thread")

from dflash_trt.api.engine import Engine  # noqa: E402
from dflash_trt.api.params import SamplingParams  # noqa: E402
from dflash_trt.runtime.load import load_runtime  # noqa: E402
from dflash_trt.runtime.sequence import TokenIdError  # noqa: E402
from dflash_trt.serve.loop import EngineLoop, QueueFull  # noqa: E402
from dflash_trt.serve.metrics import Metrics  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET, DRAFTER = os.path.join(ROOT, "models", "target"), os.path.join(ROOT, "models", "drafter")


class Injected(RuntimeError):
    pass


@pytest.fixture(scope="module")
def loop():
    rt, codec = load_runtime(TARGET, DRAFTER)
    lp = EngineLoop(Engine(rt, codec), Metrics(), max_queue=4).start()
    yield lp
    lp.close()


def run(loop, prompts, params, timeout=60):
    """Submit and wait; returns the tracks (ended)."""
    done, ended = threading.Event(), []

    def sink(track, delta, tokens):
        if track.finished:
            ended.append(track)
            if len(ended) == len(prompts) * params.n:
                done.set()

    ids = [loop.engine.codec.encode(p) if isinstance(p, str) else p for p in prompts]
    tracks = loop.submit(ids, params, sink).result(timeout)
    assert done.wait(timeout)
    return tracks


def pools_full(loop, timeout=10.0):
    """The loop's snapshot (taken after it delivered a step) shows nothing pending and every pool full."""
    for _ in range(int(timeout / 0.05)):
        h = loop.metrics.health()
        if h["pending"] == 0 and all(p["free"] == p["total"] for p in h["pools"].values()):
            return True
        threading.Event().wait(0.05)
    return False


def test_step_fault_fails_only_its_requests(loop, monkeypatch):
    rt, codec = loop.engine.rt, loop.engine.codec
    want = rt.generate(codec.encode("import os\n"), 12, spec=False)[0]
    launch, calls = rt.executor.launch, []

    def faulty(plan):
        calls.append(plan)
        if len(calls) == 3:
            raise Injected("injected step fault")
        return launch(plan)

    monkeypatch.setattr(rt.executor, "launch", faulty)
    bad = run(loop, ["def f(x):\n"], SamplingParams(max_tokens=12))
    assert bad[0].finish_reason == "error" and isinstance(bad[0].error, Injected)
    good = run(loop, ["import os\n", "import os\n"], SamplingParams(max_tokens=12))  # the loop serves on
    assert [list(t.token_ids) for t in good] == [want, want]
    assert loop.metrics.requests["error"] == 1 and pools_full(loop)


def test_refusals_leave_nothing_queued(loop):
    with pytest.raises(TokenIdError):  # the second prompt is refused: the first is not left queued either
        loop.submit([[5, 6], [5, 10 ** 6]], SamplingParams(max_tokens=4), lambda *a: None).result(30)
    with pytest.raises(QueueFull, match="max_queue=4"):
        loop.submit([[5]] * 5, SamplingParams(max_tokens=4), lambda *a: None)
    assert loop.metrics.requests["rejected"] == 5
    run(loop, ["x"], SamplingParams(max_tokens=3))
    assert pools_full(loop)


def test_abort_releases(loop):
    started = threading.Event()
    tracks = loop.submit([[5, 6, 7]], SamplingParams(max_tokens=1500, ignore_eos=True),
                         lambda t, d, k: started.set()).result(30)
    assert started.wait(30)
    loop.abort(tracks)
    assert pools_full(loop)
    assert tracks[0].finish_reason == "abort" and len(tracks[0].token_ids) < 1500 and pools_full(loop)
