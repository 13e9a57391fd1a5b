"""The attention rows of `dflash-trt bench kernels`: dflash::paged_attention (split-KV pass + combine) against
its own bytes floor, in captured CUDA graphs after warm-up. bf16: decode rows run the CUDA-core pass (kernel.cu),
verify and drafter blocks the tensor-core pass (mma.cuh); `plan` says how the keys were split.

Shapes: the 0.9B Qwen3.5-text attention (Hq 16 / Hkv 2 / hd 128) and Qwen3.5-MoE's (Hq 16 / Hkv 2 / hd 256),
bf16, batch 1, 16-row pages; decode (T=1, causal), verify (T=16, causal) and the drafter's non-causal block
of 16, at 256 and 8192 cached rows.
  bytes = cached K and V rows read + new K/V rows read + q read + o written; floor = bytes / the device copy
  bandwidth measured in the same run (bench_kernels.copy_bandwidth).
  cold = one graph of N calls, each on another layer of a pool of N layers (N * layer bytes >= COLD_BYTES,
  well past the 50 MB L2), so K/V come from HBM as in a model step; hot = N calls on the same layer.
Targets: decode at 256 rows <= 10 us a call; decode at 8192 rows <= 1.3x its bytes floor (cold).
"""
from __future__ import annotations

from dflash_trt.tools.bench import graph_replay_ms

HQ, HKV, BS = 16, 2, 16
COLD_BYTES = 192 << 20
CASES = (  # name, hd, T, causal, cached rows
    ("decode", 128, 1, True, 256), ("decode", 128, 1, True, 8192),
    ("decode", 256, 1, True, 256), ("decode", 256, 1, True, 8192),
    ("verify16", 128, 16, True, 256), ("verify16", 128, 16, True, 8192),
    ("verify16", 256, 16, True, 256), ("verify16", 256, 16, True, 8192),
    ("drafter16", 128, 16, False, 256), ("drafter16", 128, 16, False, 8192),
)


def _graph_us(calls, replays):
    """us per call of `calls` (a list of thunks) captured in one CUDA graph, after warm-up."""
    return graph_replay_ms(calls, replays)[1] * 1e3 / len(calls)


def bench_case(name, hd, T, causal, rows, bw, replays=5):
    import torch
    from dflash_trt.plugins.paged_attention import spec
    MB = -(-(rows + T) // BS)
    layer_bytes = 2 * MB * BS * HKV * hd * 2
    N = max(8, min(1024, -(-COLD_BYTES // layer_bytes)))
    gen = torch.Generator(device="cuda").manual_seed(rows + hd + T)
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen, dtype=torch.bfloat16)  # noqa: E731
    pool = r(N, 2, MB, BS, HKV, hd)
    q, kn, vn = r(1, T, HQ, hd), r(1, T, HKV, hd), r(1, T, HKV, hd)
    bt = torch.arange(MB, device="cuda", dtype=torch.int32)[None]
    ks = torch.zeros(1, device="cuda", dtype=torch.int32)
    kl = torch.full((1,), rows, device="cuda", dtype=torch.int32)
    op = torch.ops.dflash.paged_attention
    call = lambda layer: (lambda: op(q, kn, vn, pool, layer, bt, ks, kl, causal, hd ** -0.5))  # noqa: E731
    cold = _graph_us([call(i) for i in range(N)], replays)
    hot = _graph_us([call(0)] * N, replays)
    nbytes = 2 * (rows + T) * HKV * hd * 2 + 2 * T * HQ * hd * 2
    floor = nbytes / bw * 1e6
    tiles, nsplit, groups = spec.split_plan(1, T, HQ, HKV, hd, MB * BS, spec.mma_tiles(*("bfloat16",) * 3))
    return {"name": name, "hd": hd, "T": T, "causal": causal, "rows": rows, "cold_us": cold, "hot_us": hot,
            "bytes": nbytes, "floor_us": floor, "cold_over_floor": cold / floor, "layers": N,
            "splits": nsplit, "tiles_per_split": tiles, "row_groups": groups}


def run(bw, replays=5):
    """Prints the attention table; returns (rows, targets)."""
    print(f"\npaged_attention (Hq {HQ} / Hkv {HKV}, bf16, batch 1, pages of {BS}; us per call in CUDA graphs)")
    hdr = (f"{'case':>9} {'hd':>3} {'T':>2} {'rows':>5} | {'cold us':>8} {'hot us':>7} | {'bytes':>9} {'floor us':>8}"
           f" {'cold/floor':>10} | plan")
    print(hdr)
    print("-" * len(hdr))
    out = []
    for case in CASES:
        row = bench_case(*case, bw=bw, replays=replays)
        out.append(row)
        print(f"{row['name']:>9} {row['hd']:>3} {row['T']:>2} {row['rows']:>5} | {row['cold_us']:8.2f} {row['hot_us']:7.2f}"
              f" | {row['bytes']:9d} {row['floor_us']:8.2f} {row['cold_over_floor']:9.2f}x | {row['splits']} splits x"
              f" {row['tiles_per_split']} tiles, {row['row_groups']} row groups, {row['layers']} layers", flush=True)
    targets = {}
    for row in out:
        if row["name"] == "decode" and row["rows"] == 256:
            targets[f"decode hd{row['hd']} 256 rows <= 10 us"] = row["cold_us"] <= 10
        if row["name"] == "decode" and row["rows"] == 8192:
            targets[f"decode hd{row['hd']} 8192 rows <= 1.3x floor"] = row["cold_over_floor"] <= 1.3
    for k, v in targets.items():
        print(f"  {k}: {'hit' if v else 'miss'}")
    return out, targets
