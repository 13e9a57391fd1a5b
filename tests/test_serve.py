"""`dflash-trt serve` on the shipped pair (CPU, torch) in a subprocess, driven by the official `openai` client:
completions and chat, streamed and not, equal `LLM.generate` greedy; stop strings; n=2 with a seed; 8 concurrent
clients x 4 requests; bad parameters (400, the next request fine), a full queue (503); a client that closes its
stream mid-way has its request released; the pools are full afterwards (/health)."""
import contextlib
import tempfile
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("torch")
pytestmark = pytest.mark.usefixtures("one_thread")

from dflash_trt import LLM, SamplingParams  # noqa: E402
from dflash_trt.runtime.load import UsageError  # noqa: E402
from dflash_trt.tools.bench_serve import PROMPTS, start_server  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET, DRAFTER = os.path.join(ROOT, "models", "target"), os.path.join(ROOT, "models", "drafter")
MAX_QUEUE = 8


@contextlib.contextmanager
def served(args: list, port: int | None = None):
    """`dflash-trt serve ARGS --port PORT` (a free port by default) in a subprocess; yields its URL once /health
    answers, stops it after."""
    with tempfile.TemporaryFile("w+") as log:
        try:
            proc, url = start_server(args, timeout=120, port=port, output=log, cwd=ROOT,
                                     env={**os.environ, "OMP_NUM_THREADS": "1"})
        except UsageError:
            log.seek(0)
            pytest.fail(f"server did not start:\n{log.read()}")
        try:
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()


@pytest.fixture(scope="module")
def server():
    with served(["--model", TARGET, "--drafter", DRAFTER, "--max-queue", str(MAX_QUEUE)]) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def llm():
    return LLM(TARGET, DRAFTER)


def health(url) -> dict:
    return json.loads(urllib.request.urlopen(url + "/health", timeout=10).read())


def metric(url, line_prefix) -> float:
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    return float(next(ln.split()[-1] for ln in text.splitlines() if ln.startswith(line_prefix)))


def settled(url, timeout=30.0) -> dict:
    """/health once nothing is pending; the pools then must be full."""
    deadline = time.time() + timeout
    while True:
        h = health(url)
        if h["pending"] == 0 and h["running"] == 0 or time.time() > deadline:
            return h
        time.sleep(0.1)


def assert_pools_full(url):
    h = settled(url)
    assert h["pending"] == 0 and all(p["free"] == p["total"] for p in h["pools"].values()), h


def expected(llm, prompt, **kw):
    return llm.generate(prompt, SamplingParams(**kw))[0].outputs[0].text


def test_models_and_health(client, server):
    assert [m.id for m in client.models.list().data] == ["target"]
    assert_pools_full(server)


def test_completions_equal_llm_greedy(client, llm, server):
    want = expected(llm, PROMPTS[0], max_tokens=32)
    r = client.completions.create(model="target", prompt=PROMPTS[0], max_tokens=32, temperature=0)
    assert r.choices[0].text == want and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 32 and r.usage.prompt_tokens == len(llm.codec.encode(PROMPTS[0]))
    chunks = list(client.completions.create(model="target", prompt=PROMPTS[0], max_tokens=32, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == want and chunks[-1].choices[0].finish_reason == "length"
    assert len(chunks) > 1
    assert_pools_full(server)


def test_chat_equal_llm_greedy(client, llm):
    messages = [{"role": "user", "content": "Write a stack class."}]
    want = llm.chat(messages, SamplingParams(max_tokens=24))[0].outputs[0].text
    r = client.chat.completions.create(model="target", messages=messages, max_tokens=24, temperature=0)
    assert r.choices[0].message.content == want and r.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model="target", messages=messages, max_tokens=24, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "length"
    off = llm.chat(messages, SamplingParams(max_tokens=8), chat_template_kwargs={"enable_thinking": False})
    r = client.chat.completions.create(model="target", messages=messages, max_tokens=8, temperature=0,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.choices[0].message.content == off[0].outputs[0].text


def test_stop_strings(client, llm):
    full = expected(llm, PROMPTS[2], max_tokens=40)
    stop = full[10:14]
    want = llm.generate(PROMPTS[2], SamplingParams(max_tokens=40, stop=[stop]))[0].outputs[0]
    assert want.finish_reason == "stop" and stop not in want.text
    r = client.completions.create(model="target", prompt=PROMPTS[2], max_tokens=40, temperature=0, stop=[stop])
    assert (r.choices[0].text, r.choices[0].finish_reason) == (want.text, "stop")
    chunks = list(client.completions.create(model="target", prompt=PROMPTS[2], max_tokens=40, temperature=0,
                                            stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == want.text


def test_logprobs_equal_llm(client, llm, server):
    """logprobs (completions: k; chat: logprobs + top_logprobs), streamed and not, are LLM.generate's values (which
    tests/test_logprobs.py checks against transformers)."""
    want = llm.generate(PROMPTS[0], SamplingParams(max_tokens=16, logprobs=3))[0].outputs[0]
    lps, tops = [e.logprob for e in want.logprobs], [[llm.codec.decode([i]) for i, _ in e.top] for e in want.logprobs]
    r = client.completions.create(model="target", prompt=PROMPTS[0], max_tokens=16, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert lp.tokens == [llm.codec.decode([t]) for t in want.token_ids]
    assert lp.token_logprobs == pytest.approx(lps, abs=1e-5) and [list(d) for d in lp.top_logprobs] == tops
    assert lp.text_offset[0] == 0 and lp.text_offset[-1] == len(want.text) - len(lp.tokens[-1])
    chunks = list(client.completions.create(model="target", prompt=PROMPTS[0], max_tokens=16, temperature=0,
                                            logprobs=3, stream=True))
    streamed = [x for c in chunks if c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs]
    offsets = [x for c in chunks if c.choices[0].logprobs for x in c.choices[0].logprobs.text_offset]
    assert streamed == pytest.approx(lps, abs=1e-5) and offsets == lp.text_offset
    messages = [{"role": "user", "content": "Write a stack class."}]
    want = llm.chat(messages, SamplingParams(max_tokens=12, logprobs=2))[0].outputs[0]
    r = client.chat.completions.create(model="target", messages=messages, max_tokens=12, temperature=0, logprobs=True,
                                       top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx([e.logprob for e in want.logprobs], abs=1e-5)
    assert [len(c.top_logprobs) for c in content] == [2] * len(want.token_ids)
    assert "".join(c.token for c in content) == want.text  # the shipped tokenizer: whole characters
    chunks = client.chat.completions.create(model="target", messages=messages, max_tokens=12, temperature=0,
                                            logprobs=True, stream=True)
    streamed = [x.logprob for c in chunks if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.content]
    assert streamed == pytest.approx([e.logprob for e in want.logprobs], abs=1e-5)
    r = client.completions.create(model="target", prompt=PROMPTS[0], max_tokens=4, temperature=0)
    assert r.choices[0].logprobs is None
    assert_pools_full(server)


def test_n_and_seed(client):
    kw = dict(model="target", prompt=PROMPTS[1], max_tokens=20, temperature=0.9, seed=77, n=2)
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    texts = [c.text for c in sorted(a.choices, key=lambda c: c.index)]
    assert len(texts) == 2 and texts[0] != texts[1]
    assert texts == [c.text for c in sorted(b.choices, key=lambda c: c.index)]


def test_concurrent_clients(client, llm, server):
    want = {(p, m): expected(llm, p, max_tokens=m) for p in PROMPTS for m in (8, 24)}
    got, errors = {}, []

    def worker(w):
        try:
            for j in range(4):
                p, m = PROMPTS[(w + j) % len(PROMPTS)], (8, 24)[j % 2]
                if j == 3:
                    chunks = client.completions.create(model="target", prompt=p, max_tokens=m, temperature=0,
                                                       stream=True)
                    got[w, j] = (p, m, "".join(c.choices[0].text for c in chunks))
                else:
                    r = client.completions.create(model="target", prompt=p, max_tokens=m, temperature=0)
                    got[w, j] = (p, m, r.choices[0].text)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    assert len(got) == 32 and all(text == want[p, m] for p, m, text in got.values())
    assert_pools_full(server)


def test_bad_requests_then_fine(client, server):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="target", prompt="x", max_tokens=4, temperature=-1)
    assert e.value.status_code == 400 and "temperature" in e.value.body["message"]
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="target", prompt="x", max_tokens=100000)
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError, match="logprobs") as e:
        client.completions.create(model="target", prompt="x", max_tokens=4, logprobs=21)
    assert e.value.body["param"] == "logprobs"
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(model="target", messages=[{"role": "user", "content": "x"}], top_logprobs=2)
    with pytest.raises(openai.BadRequestError, match="role robot") as e:
        client.chat.completions.create(model="target", messages=[{"role": "robot", "content": "x"}])
    assert e.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError, match="not served"):
        client.completions.create(model="other", prompt="x", max_tokens=4)
    with pytest.raises(openai.InternalServerError) as e:  # 9 completions in one request > --max-queue 8
        client.completions.create(model="target", prompt=["x"] * (MAX_QUEUE + 1), max_tokens=4)
    assert e.value.status_code == 503 and e.value.body["code"] == "queue_full"
    r = client.completions.create(model="target", prompt=PROMPTS[0], max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason == "length"
    assert_pools_full(server)


def test_client_closing_stream_releases_request(client, server):
    aborted = metric(server, 'dflash_trt_requests_total{outcome="abort"}')
    stream = client.completions.create(model="target", prompt=PROMPTS[0], max_tokens=1800, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))
    deadline = time.time() + 10  # /health is the engine's snapshot after its step: the chunk may arrive first
    while health(server)["running"] != 1 and time.time() < deadline:
        time.sleep(0.05)
    assert health(server)["running"] == 1
    stream.close()
    deadline = time.time() + 30
    while metric(server, 'dflash_trt_requests_total{outcome="abort"}') < aborted + 1 and time.time() < deadline:
        time.sleep(0.1)
    assert metric(server, 'dflash_trt_requests_total{outcome="abort"}') == aborted + 1
    assert_pools_full(server)


def test_serve_tensor_parallel_equals_llm(llm):
    """`serve --tensor-parallel 2` on the CPU (rank 0 serves, rank 1 follows): greedy and seeded sampled completions
    equal the single-process LLM's, also after a client closed its stream mid-way; the pools are full afterwards."""
    greedy = expected(llm, PROMPTS[0], max_tokens=24)
    sampled = expected(llm, PROMPTS[1], max_tokens=16, temperature=0.8, seed=3)
    with served(["--model", TARGET, "--drafter", DRAFTER, "--tensor-parallel", "2"]) as url:
        c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        stream = c.completions.create(model="target", prompt=PROMPTS[0], max_tokens=400, temperature=0,
                                      stream=True, extra_body={"ignore_eos": True})
        next(iter(stream))
        stream.close()  # aborted on rank 0 and, by its number, on rank 1
        r = c.completions.create(model="target", prompt=PROMPTS[0], max_tokens=24, temperature=0)
        s = c.completions.create(model="target", prompt=PROMPTS[1], max_tokens=16, temperature=0.8, seed=3)
        assert (r.choices[0].text, s.choices[0].text) == (greedy, sampled)
        assert_pools_full(url)


def test_serve_tensor_parallel_refused_before_any_rank_starts(capsys):
    from dflash_trt.cli import main

    assert main(["serve", "--model", TARGET, "--tensor-parallel", "3"]) == 2
    err = capsys.readouterr().err
    assert "num_attention_heads = 4 does not divide over 3 ranks" in err and err.count("\n") == 1
