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
    res = json.loads(out.read_text())
    rows = {(r["kind"], r["batch"]): r for r in res["rows"]}
    serve = {(r["kind"], r["batch"]): r for r in res["serve"]}  # the serving run: at the widest batch, 4 per row
    assert set(serve) == {("plain", 4), ("dflash", 4)}
    assert all(r["requests"] == 16 and 0 < r["window_us_median"] <= r["window_us_p90"] <= r["window_us_max"]
               for r in serve.values())
    assert set(rows) == {("plain", 1), ("plain", 4), ("dflash", 1), ("dflash", 4)}
    assert all(r["host_us_per_step"] > 0 for r in rows.values())
    # 32 new tokens after the prefill's: one per plain launch, 4 per spec launch; scheduler steps also count the
    # last collect and the launches in flight when a request completes (their rows are dropped)
    assert 32 <= rows["plain", 1]["steps"] <= 34 and 8 <= rows["dflash", 1]["steps"] <= 11
    rt = made[-1]  # the serving runs used it last: its pools are full again
    assert rt.kv_alloc.num_free == rt.kv_alloc.num_total and rt.slots.num_free == rt.slots.num_total


def test_a_request_keeps_its_next_steps_pages(monkeypatch):
    """At each collect, a request that steps again keeps its pages up to its next step's worst case (its rows so
    far, its step still in flight, the next step's K rows; KV and drafter ctx), never fewer than its rows in flight
    need: the next plan finds them rather than taking back pages just given back. So over a batch-4 DFlash run the
    pools give pages back only when a request ends (one free call per pool), not at every step (the scheduler
    before: ~1.5 frees a request and step)."""
    from dflash_trt.runtime.commit import cdiv
    from dflash_trt.runtime.pools import BlockAllocator

    frees, held = [], []
    real_free = BlockAllocator.free
    monkeypatch.setattr(BlockAllocator, "free", lambda self, b: (frees.append(self.name), real_free(self, b))[1])
    real = bench_host.host_us_per_step

    def on_step(rt, req, plan, res, b):
        if req.wants_step:
            ps = rt.sizes.page_size
            seq, ctx = req.seq, req.seq.ctx
            rows = req.rows_in_flight
            held.append((cdiv(seq.seq_len + rows, ps), len(seq.pages), cdiv(seq.seq_len + rows + plan.K, ps),
                         cdiv(ctx.end + rows, ps), ctx.num_pages, cdiv(ctx.end + rows + plan.K, ps)))

    def spy(rt, batch, spec, gamma, new_tokens, prompt_len=40):
        if not (spec and batch == 4 and new_tokens > 16):
            return real(rt, batch, spec, gamma, new_tokens, prompt_len)
        add = rt.add_request

        def add_hooked(*a, **k):  # the runtime makes the run's scheduler on its first request
            req = add(*a, **k)
            rt.scheduler.on_step = on_step
            return req
        monkeypatch.setattr(rt, "add_request", add_hooked)
        frees.clear()
        out = real(rt, batch, spec, gamma, new_tokens, prompt_len)
        assert len(frees) <= 2 * batch, frees  # each request's release: its KV pages and its ctx pages
        return out

    monkeypatch.setattr(bench_host, "host_us_per_step", spy)
    assert bench_host.main(["--batch", "4", "--max-new-tokens", "65"]) == 0
    assert len(held) > 20 and [h for h in held if not (h[0] <= h[1] <= h[2] and h[3] <= h[4] <= h[5])] == [], held
