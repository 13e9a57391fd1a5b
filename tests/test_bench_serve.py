"""`dflash-trt bench serve` on the shipped pair (CPU): it starts the server, drives concurrent streaming clients
through the `openai` client and reports every request, its tokens and latencies; bad options are one line."""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("openai")
pytest.importorskip("fastapi")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bench(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "dflash_trt.cli", "bench", "serve", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_reports_every_request(tmp_path):
    out = tmp_path / "r.json"
    r = _bench("--clients", "3", "--requests", "5", "--max-tokens", "12", "--json", str(out),
               "--model", "models/target", "--drafter", "models/drafter", "--max-seqs", "3")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "3 clients, 5 requests x <= 12 tokens (0 failed)" in r.stdout and "TTFT p50" in r.stdout
    s = json.load(open(out))["summary"]
    assert s["requests"] == 5 and s["failed"] == 0 and 5 <= s["tokens"] <= 60 and s["tau"] >= 1
    assert 0 < s["ttft_p50_ms"] <= s["ttft_p99_ms"] and s["tok_s"] > 0


def test_bad_options_are_one_line():
    r = _bench("--clients", "0", "--model", "models/target")
    assert r.returncode == 2 and "--clients must be >= 1" in r.stderr and "Traceback" not in r.stderr
    r = _bench("--clients", "2")
    assert r.returncode == 2 and "give --url of a running server" in r.stderr
    r = _bench("--url", "http://127.0.0.1:9", "--model", "models/target")
    assert r.returncode == 2 and "--url drives a running server" in r.stderr
