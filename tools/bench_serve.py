"""`dflash-trt bench serve`: concurrent streaming clients (the official `openai` client) against `dflash-trt serve`
— started here on a free localhost port, or a running one (--url) — reporting aggregate output tokens/s, time to
first token and inter-token latency (p50 / p99), and the server's τ from /metrics.

Latencies are client-side, as a user sees them: TTFT from sending the request to the first content chunk; ITL
per request as (last chunk - first chunk) / (tokens - 1) (vLLM's TPOT), and the gaps between chunks (a DFlash step
sends several tokens in one chunk, so chunk gaps are step times and ITL is per token)."""
from __future__ import annotations

import os
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request

from dflash_trt.args import ArgumentParser
from dflash_trt.files import write_json
from dflash_trt.runtime.load import UsageError

PROMPTS = ["def fibonacci(n):\n    ", "import os\n", "class Stack:\n    def push(self, item):\n", "for i in range(",
           "# parse the header\n", "    return self._data[", "def main():\n", "if __name__ == "]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(serve_args: list[str], timeout: float = 600.0, port: int | None = None, output=None, env=None,
                 cwd=None):
    """(process, base url) of `dflash-trt serve` with these options on `port` (default: a free one), once /health
    answers; UsageError if it exits or does not answer in `timeout` s. output: where its stdout and stderr go
    (default: its stderr to ours)."""
    port = port or free_port()
    proc = subprocess.Popen([sys.executable, "-m", "dflash_trt.cli", "serve", *serve_args, "--port", str(port)],
                            stdout=output or subprocess.DEVNULL, stderr=output or sys.stderr, env=env, cwd=cwd)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + timeout
    while True:
        try:
            urllib.request.urlopen(url + "/health", timeout=2).read()
            return proc, url
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                proc.kill()
                raise UsageError(f"dflash-trt serve {' '.join(serve_args)} did not start (exit {proc.poll()})")
            time.sleep(0.5)


def one_request(client, model: str, prompt: str, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    chunks, tokens = [], 0
    stream = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0,
                                       stream=True, stream_options={"include_usage": True})
    for ev in stream:
        if ev.choices and ev.choices[0].text:
            chunks.append(time.perf_counter())
        if ev.usage is not None:
            tokens = ev.usage.completion_tokens
    if not chunks:
        return dict(tokens=tokens, ttft=None, itl=None, gaps=[], end=time.perf_counter())
    itl = (chunks[-1] - chunks[0]) / (tokens - 1) if tokens > 1 else None
    return dict(tokens=tokens, ttft=chunks[0] - t0, itl=itl, gaps=[b - a for a, b in zip(chunks, chunks[1:])],
                end=chunks[-1])


def drive(url: str, clients: int, requests: int, max_tokens: int, prompts: list[str]) -> dict:
    """`clients` threads, each sending its share of `requests` one after another; the results of every request."""
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=3600)
    model = client.models.list().data[0].id
    one_request(client, model, prompts[0], 8)  # warm-up: first-use compiles and captures
    results, errors, lock = [], [], threading.Lock()

    def worker(w):
        for i in range(w, requests, clients):
            try:
                r = one_request(client, model, prompts[i % len(prompts)], max_tokens)
            except Exception as e:  # a failed request is reported, not hidden in a thread
                with lock:
                    errors.append(f"{type(e).__name__}: {e}")
                continue
            with lock:
                results.append(r)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(w,)) for w in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return dict(results=results, errors=errors, seconds=time.perf_counter() - t0)


def _pct(xs, q):
    xs = sorted(x for x in xs if x is not None)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))] * 1e3 if xs else float("nan")


def summarize(run: dict) -> dict:
    rs = run["results"]
    gaps = [g for r in rs for g in r["gaps"]]
    return dict(requests=len(rs), failed=len(run["errors"]), tokens=sum(r["tokens"] for r in rs),
                seconds=run["seconds"], tok_s=sum(r["tokens"] for r in rs) / run["seconds"],
                ttft_p50_ms=_pct([r["ttft"] for r in rs], 50), ttft_p99_ms=_pct([r["ttft"] for r in rs], 99),
                itl_p50_ms=_pct([r["itl"] for r in rs], 50), itl_p99_ms=_pct([r["itl"] for r in rs], 99),
                chunk_gap_p50_ms=_pct(gaps, 50), chunk_gap_p99_ms=_pct(gaps, 99),
                mean_tokens_per_chunk=statistics.mean(r["tokens"] / max(len(r["gaps"]) + 1, 1) for r in rs)
                if rs else float("nan"))


def server_tau(url: str) -> float | None:
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    for line in text.splitlines():
        if line.startswith("dflash_trt_tau "):
            return float(line.split()[1])
    return None


def main(argv=None) -> int:
    p = ArgumentParser(prog="dflash-trt bench serve")
    p.add_argument("--url", help="a running server (http://HOST:PORT); default: start `dflash-trt serve` here")
    p.add_argument("--clients", type=int, default=16, help="concurrent streaming clients")
    p.add_argument("--requests", type=int, default=64, help="requests in all, spread over the clients")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompts", help="file: prompts separated by lines with only '---' (default: 8 code prompts)")
    p.add_argument("--json", help="write the results here")
    a, serve_args = p.parse_known_args(argv)
    for flag, v in (("--clients", a.clients), ("--requests", a.requests), ("--max-tokens", a.max_tokens)):
        if v < 1:
            raise UsageError(f"{flag} must be >= 1, got {v}")
    if a.url and serve_args:
        raise UsageError(f"--url drives a running server; {' '.join(serve_args)} are `dflash-trt serve` options")
    if not a.url and "--model" not in serve_args:
        raise UsageError("give --url of a running server, or `dflash-trt serve` options (--model DIR ...) to start one")
    prompts = PROMPTS
    if a.prompts:
        with open(a.prompts, encoding="utf-8") as f:
            prompts = [s.strip("\n") for s in f.read().split("\n---\n") if s.strip()]
        if not prompts:
            raise UsageError(f"--prompts {a.prompts}: no prompts in the file")
    proc, url = (None, a.url.rstrip("/")) if a.url else start_server(serve_args)
    try:
        s = summarize(drive(url, a.clients, a.requests, a.max_tokens, prompts))
        s["tau"] = server_tau(url)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    where = a.url or " ".join(serve_args)
    print(f"bench serve: {where}; {a.clients} clients, {s['requests']} requests x <= {a.max_tokens} tokens "
          f"({s['failed']} failed)")
    print(f"  {s['tokens']} tokens in {s['seconds']:.2f} s: {s['tok_s']:.1f} tok/s; tau {s['tau']}")
    print(f"  TTFT p50 {s['ttft_p50_ms']:.1f} ms  p99 {s['ttft_p99_ms']:.1f} ms; ITL p50 {s['itl_p50_ms']:.2f} ms  "
          f"p99 {s['itl_p99_ms']:.2f} ms; chunk gap p50 {s['chunk_gap_p50_ms']:.2f} ms  p99 "
          f"{s['chunk_gap_p99_ms']:.2f} ms ({s['mean_tokens_per_chunk']:.2f} tokens per chunk)")
    if a.json:
        write_json(a.json, dict(summary=s, server=where, clients=a.clients, max_tokens=a.max_tokens))
    return 0 if s["failed"] == 0 else 1
