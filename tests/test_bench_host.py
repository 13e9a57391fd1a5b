"""`dflash-trt bench host` on CPU: the scheduler loop with the device's step stood in. Its requests come out
with their max tokens (the stand-in's n drives the same bookkeeping as a real step), a spec step that accepts
3 drafts needs about a quarter of the plain steps, and the pools are full again afterwards."""
import json

from dflash_trt.tools import bench_host


def test_bench_host_rows_and_pools(tmp_path, monkeypatch):
    made = []
    real = bench_host.host_us_per_step

    def spy(rt, batch, spec, gamma, new_tokens, prompt_len=40):
        out = real(rt, batch, spec, gamma, new_tokens, prompt_len)
        made.append(rt)
        return out

    monkeypatch.setattr(bench_host, "host_us_per_step", spy)
    out = tmp_path / "host.json"
    assert bench_host.main(["--batch", "1,4", "--max-new-tokens", "33", "--json", str(out)]) == 0
    rows = {(r["kind"], r["batch"]): r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {("plain", 1), ("plain", 4), ("dflash", 1), ("dflash", 4)}
    assert all(r["host_us_per_step"] > 0 for r in rows.values())
    # 32 new tokens after the prefill's: one per plain launch, 4 per spec launch; scheduler steps also count the
    # last collect and the launches in flight when a request completes (their rows are dropped)
    assert 32 <= rows["plain", 1]["steps"] <= 34 and 8 <= rows["dflash", 1]["steps"] <= 11
    rt = made[-1]
    assert rt.kv_alloc.num_free == rt.kv_alloc.num_total and rt.slots.num_free == rt.slots.num_total
