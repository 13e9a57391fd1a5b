"""`dflash-trt bench kernels`: GDN verify+fold (our NVRTC kernels) vs fla-core vs the HBM floor; then the
paged-attention rows (tools/bench_attention.py: split-KV decode / verify / drafter block vs its bytes floor).

Work per (B, K) on Qwen3-Next GDN shapes (Hk=16, Hv=32, dk=dv=128, bf16 q/k/v, fp32 state):
  ours = gdn_wy16 (K rows from the read-only state slot: O + fold data) then gdn_fold (n=K rows
         folded into the slot in place): what a speculative verify + commit costs.
  decode (K = 1 only) = gdn_decode: the plain decode step's one row, its state committed in place (one read and one
         write of the state; floor: 2 state passes + io).
  fla  = the fastest of fused_recurrent_gated_delta_rule / chunk_gated_delta_rule over the same K
         rows from the same state with output_final_state=True (O + final state). This is *less*
         work than ours (no rollback-able commit), so it is a lower bound for fla.
  floor = bytes that must move / device copy bandwidth measured in this run; bytes = state read
         (verify) + state read + write (commit) + q, k, v, g, beta read + o write.
Both sides timed eagerly (launch overhead included) and inside captured CUDA graphs (REPS calls
per graph; launch overhead excluded). Prints a table with the GPU name and writes JSON.
"""
from __future__ import annotations

import sys

from dflash_trt.args import ArgumentParser
from dflash_trt.files import write_json
from dflash_trt.log import progress
from dflash_trt.tools.bench import graph_replay_ms

HK, HV, DK, DV = 16, 32, 128, 128


def _time_eager(fn, iters):
    import torch
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1e3 / iters  # us


def _time_graph(fn, reps, replays):
    """us per call of fn captured reps times in one CUDA graph."""
    return graph_replay_ms([fn] * reps, replays, warm=3)[1] * 1e3 / reps


def copy_bandwidth(nbytes=1 << 30):
    import torch
    x = torch.empty(nbytes // 4, device="cuda", dtype=torch.float32)
    y = torch.empty_like(x)
    t = _time_eager(lambda: y.copy_(x), 20)
    return 2 * nbytes / (t * 1e-6)  # bytes/s (read + write)


def state_bytes(B):
    return B * HV * DK * DV * 4


def floor_bytes(B, K):
    state = state_bytes(B)
    io = B * K * (2 * HK * DK * 2 + HV * DV * 2 + 2 * HV * 4 + HV * DV * 2)
    return 3 * state + io


def bench_one(B, K, iters, reps, replays, fla, cgs):
    import torch
    from dflash_trt.plugins.gdn import launch
    gen = torch.Generator(device="cuda").manual_seed(B * 31 + K)
    r = lambda *s, dt=torch.bfloat16: torch.randn(*s, device="cuda", generator=gen).to(dt)
    q, k, v = r(B, K, HK, DK), r(B, K, HK, DK), r(B, K, HV, DV)
    g = -torch.rand(B, K, HV, device="cuda", generator=gen) * 0.5
    beta = torch.rand(B, K, HV, device="cuda", generator=gen)
    pool = r(B, HV, DK, DV, dt=torch.float32) * 0.1
    slot = torch.arange(B, device="cuda", dtype=torch.int32)
    n = torch.full((B,), K, device="cuda", dtype=torch.int32)
    o = torch.empty(B, K, HV, DV, device="cuda", dtype=torch.bfloat16)
    kh = torch.empty(B, K, HK, DK, device="cuda")
    vf = torch.empty(B, K, HV, DV, device="cuda")
    gf, bf = torch.empty(B, K, HV, device="cuda"), torch.empty(B, K, HV, device="cuda")
    shp = dict(B=B, T=K, Hk=HK, Hv=HV, dk=DK, dv=DV)
    row = {"B": B, "K": K}

    def ours(cg, verify=True, fold=True):
        def f():
            st = torch.cuda.current_stream().cuda_stream
            if verify:
                launch.gdn_wy16(q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(), beta.data_ptr(), pool.data_ptr(),
                                slot.data_ptr(), o.data_ptr(), kh.data_ptr(), vf.data_ptr(), gf.data_ptr(),
                                bf.data_ptr(), 0,
                                in_dtype="bfloat16", gb_dtype="float32", o_dtype="bfloat16", stream=st, cg=cg, **shp)
            if fold:
                launch.gdn_fold(pool.data_ptr(), slot.data_ptr(), kh.data_ptr(), vf.data_ptr(), gf.data_ptr(),
                                bf.data_ptr(), n.data_ptr(), stream=st, cg=cg, **shp)
        return f

    row["ours_eager_us"] = _time_eager(ours(0), iters)  # cg 0 = the launcher's automatic choice
    row["ours_graph_us"] = _time_graph(ours(0), reps, replays)
    for cg in cgs:
        row[f"ours_graph_cg{cg}_us"] = _time_graph(ours(cg), reps, replays)
    row["ours_cg"] = launch._gdn_cg(B, HV, DK, DV, 0, (1, 2, 4))
    row["ours_verify_graph_us"] = _time_graph(ours(0, fold=False), reps, replays)
    row["ours_fold_graph_us"] = _time_graph(ours(0, verify=False), reps, replays)
    if K == 1:  # the plain decode step's kernel: the row committed where the state is read
        def decode():
            torch.ops.dflash.gdn_decode(q, k, v, g, beta, pool[None], 0, slot, n)
        row["decode_graph_us"] = _time_graph(decode, reps, replays)
    if fla is not None:
        best = {}
        for name, fn in (("fused_recurrent", fla.fused_recurrent_gated_delta_rule),
                         ("chunk", fla.chunk_gated_delta_rule)):
            def f(fn=fn):
                fn(q, k, v, g=g, beta=beta, scale=DK ** -0.5, initial_state=pool, output_final_state=True,
                   use_qk_l2norm_in_kernel=True)
            try:
                best[name] = (_time_eager(f, iters), _time_graph(f, reps, replays))
            except Exception as e:  # report, keep going
                row[f"fla_{name}_error"] = f"{type(e).__name__}: {e}"[:200]
        if best:
            ne = min(best, key=lambda x: best[x][0])
            ng = min(best, key=lambda x: best[x][1])
            row.update(fla_eager_us=best[ne][0], fla_eager_path=ne, fla_graph_us=best[ng][1], fla_graph_path=ng,
                       fla_all={k2: {"eager_us": a, "graph_us": b2} for k2, (a, b2) in best.items()})
    return row


def main(argv=None):
    p = ArgumentParser(prog="dflash-trt bench kernels", description=__doc__.splitlines()[0])
    p.add_argument("--ks", default="1,2,4,8,16")
    p.add_argument("--bs", default="1,8,64")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--reps", type=int, default=20, help="calls per captured graph")
    p.add_argument("--replays", type=int, default=10)
    p.add_argument("--cg", default="1,2,4", help="extra: gdn column-group factors timed inside graphs (JSON)")
    p.add_argument("--no-fla", action="store_true")
    p.add_argument("--no-gdn", action="store_true", help="skip the GDN rows")
    p.add_argument("--no-attn", action="store_true", help="skip the paged-attention rows (tools/bench_attention.py)")
    p.add_argument("--json", default="bench_kernels.json")
    a = p.parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("bench kernels: needs a CUDA GPU", file=sys.stderr)
        return 2
    import dflash_trt.plugins.torch_ops  # noqa: F401
    fla = None
    if not a.no_fla:
        try:
            import fla.ops.gated_delta_rule as fla
        except Exception as e:
            print(f"fla-core not importable ({e}); timing ours only", file=sys.stderr)
    name = torch.cuda.get_device_name()
    bw = copy_bandwidth()
    cgs = [int(c) for c in a.cg.split(",")]
    rows = []
    print(f"GPU: {name}   copy bandwidth {bw / 1e12:.2f} TB/s   shapes Hk={HK} Hv={HV} dk={DK} dv={DV} (us per call)")
    hdr = (f"{'B':>3} {'K':>3} | {'ours eager':>10} {'ours graph':>10} | {'fla eager':>9} {'fla graph':>9} {'fla path':>15}"
           f" | {'x fla(gr)':>9} | {'floor':>7} {'ours/floor':>10}")
    print(hdr)
    print("-" * len(hdr))
    for B in [] if a.no_gdn else [int(x) for x in a.bs.split(",")]:
        for K in [int(x) for x in a.ks.split(",")]:
            row = bench_one(B, K, a.iters, a.reps, a.replays, fla, cgs)
            row["floor_bytes"] = floor_bytes(B, K)
            row["floor_us"] = row["floor_bytes"] / bw * 1e6
            row["ours_over_floor"] = row["ours_graph_us"] / row["floor_us"]
            if "decode_graph_us" in row:  # one state pass fewer than verify + fold
                row["decode_floor_us"] = (row["floor_bytes"] - state_bytes(B)) / bw * 1e6
            if "fla_graph_us" in row:
                row["speedup_vs_fla_graph"] = row["fla_graph_us"] / row["ours_graph_us"]
                row["speedup_vs_fla_eager"] = row["fla_eager_us"] / row["ours_eager_us"]
            rows.append(row)
            f = lambda key, w, fmt=".1f": f"{row[key]:{w}{fmt}}" if key in row else f"{'-':>{w}}"
            print(f"{B:>3} {K:>3} | {f('ours_eager_us', 10)} {f('ours_graph_us', 10)} | {f('fla_eager_us', 9)} "
                  f"{f('fla_graph_us', 9)} {row.get('fla_graph_path', '-'):>15} | {f('speedup_vs_fla_graph', 8, '.2f')}x"
                  f" | {f('floor_us', 7)} {f('ours_over_floor', 9, '.2f')}x | verify {row['ours_verify_graph_us']:.1f}"
                  f" fold {row['ours_fold_graph_us']:.1f} (cg{row['ours_cg']})" + (
                      f" | decode {row['decode_graph_us']:.1f} (floor {row['decode_floor_us']:.1f})"
                      if "decode_graph_us" in row else ""), flush=True)
    # the GDN kernel's targets, at K=16: >= 1.5x fla's fastest path at batch 8 and 64; within 2x of the floor at 64
    k16 = [r_ for r_ in rows if r_["K"] == 16 and r_["B"] in (8, 64) and "speedup_vs_fla_graph" in r_]
    b64 = [r_ for r_ in rows if r_["B"] == 64 and r_["K"] == 16]
    summary = {
        "target_1.5x_fla_at_K16_B8_B64": all(r_["speedup_vs_fla_graph"] >= 1.5 for r_ in k16) if k16 else None,
        "target_2x_floor_at_K16_B64": all(r_["ours_over_floor"] <= 2.0 for r_ in b64) if b64 else None,
    }
    print("targets:", summary)
    out = {"gpu": name, "copy_bandwidth_Bps": bw, "shapes": {"Hk": HK, "Hv": HV, "dk": DK, "dv": DV},
           "rows": rows, "targets": summary}
    if not a.no_attn:
        from dflash_trt.tools import bench_attention
        out["attention_rows"], out["attention_targets"] = bench_attention.run(bw)
    write_json(a.json, out)
    progress(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
