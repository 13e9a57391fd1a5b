"""The spec of GdnChunkWY16 and of its commit kernel gdn_fold (DESIGN §3). Math: reference.py.

GdnChunkWY16(q, k, v, g, beta, state; scale) -> o, state_out, k_hat, v_f32, g_f32, beta_f32
  q, k [B,T,Hk,dk], v [B,T,Hv,dv] (one float dtype); g, beta [B,T,Hv] (one float dtype);
  state [B,Hv,dk,dv] float32, read-only. o [B,T,Hv,dv] in q's dtype; state_out [B,Hv,dk,dv];
  fold data (float32): k_hat [B,T,Hk,dk] (l2-normalised k), v_f32 [B,T,Hv,dv], g_f32, beta_f32 [B,T,Hv] (the
  row inputs as the recurrence reads them). Value head h reads key head h // (Hv/Hk). scale 0 means dk ** -0.5.
gdn_fold (runtime commit, all layers in one launch): pool [L,slots,Hv,dk,dv] float32 in place;
  fold data k_hat [L,B,T,Hk,dk], v [L,B,T,Hv,dv], g, beta [L,B,T,Hv] float32; slot [B] (none: slot b),
  n [B]: pool[l, slot[b]] <- state after the first n[b] rows, replayed one row at a time by the recurrence
  (so n rows at once == n one-row folds, bit for bit); n = 0 or slot < 0 leaves it untouched.
"""
from __future__ import annotations

from dflash_trt.plugins.opspec import FLOATS, Attr, OpSpec, Port, check_float_dtypes, kernel_need, need

CHUNK = 16  # rows per chunk: (I+A)^-1 = (I-A)(I+A^2)(I+A^4)(I+A^8) is exact only for C <= 16
L2NORM_EPS = 1e-6  # inside the rsqrt, as HF Qwen3Next's l2norm
# a raw gate value (a and b both) that makes a row an identity update: softplus and sigmoid of it are exactly 0 in
# fp32 (exp underflows), so g = 0 and beta = 0 -- how a prefill's padding rows leave the state alone
IDENTITY_GATE = -1.0e4
STATE_DTYPES = ("float32",)  # the design keeps GDN state (and fold data) in fp32

# CUDA kernel limits (kernel.cu instantiates exactly these variants)
KERNEL_DK = (64, 128)
WY16_CG = {64: (1, 2), 128: (1, 2, 4)}  # column-group factors: a CTA owns 32*cg state columns
FOLD_CG = {64: (1, 2), 128: (1, 2)}
DECODE_CG = FOLD_CG  # gdn_decode: the fold's layout (its state update is the fold's row, fold.cuh fold_row)
CHUNK_ROWS = (4, 8, 16)                  # chunk-row variants of gdn_wy16 (the smallest >= min(T, 16))
# auto cg: the largest allowed one that still gives >= this many CTAs (cg1 best at B=1, cg4 at B>=8; docs/PERF.md)
AUTO_CG_MIN_CTAS = 256
WY16_RPT = (32, 16, 8)  # state rows per thread: a CTA has 32 * (dk / rpt) * cg threads
# rows-per-thread forms instantiated per (dk, cg): the narrow forms only at cg 1 (what a narrow grid runs)
WY16_FORMS = {(dk, cg): WY16_RPT if cg == 1 else (32,) for dk, cgs in WY16_CG.items() for cg in cgs}
# auto rpt by grid size and dk (one gdn_wy16 call per form and grid timed: docs/PERF.md).
# Below a full grid the best form has 8 warps on each column tile (dk / rpt = 8): p16 at dk 128, p8 at dk 64.
# The rule looks at the grid and dk only, never at T: a verify row and the decode of the same position then sum the
# state's rows in one order (trained pair, bf16: their outputs are bit-identical given the same state;
# tests/test_bf16_verify_consistency.py).
WIDE_GRID_CTAS = 512    # from here the grid fills the GPU: 32 rows a thread (fewest warps)
NARROW_GRID_CTAS = 32   # under this, 8 rows a thread
MID_GRID_WARPS = 8      # between the two: warps per column tile (dk / rpt), at most what p8 gives


def chunk_rows(T: int) -> int:
    return next(r for r in CHUNK_ROWS if T <= r or r == CHUNK_ROWS[-1])


def auto_rpt(ctas: int, dk: int = 128) -> int:
    """State rows per thread of gdn_wy16 for a grid of `ctas` CTAs at key dim dk (the table above WIDE_GRID_CTAS)."""
    if ctas >= WIDE_GRID_CTAS:
        return 32
    return max(WY16_RPT[-1], dk // MID_GRID_WARPS) if ctas >= NARROW_GRID_CTAS else WY16_RPT[-1]


def wy16_name(dk: int, cg: int, rpt: int, T: int) -> str:
    return f"gdn_wy16_dk{dk}_cg{cg}_p{rpt}_r{chunk_rows(T)}"


def wy16_dyn_smem(dk: int, cg: int, rpt: int, T: int) -> int:
    """Dynamic shared memory of gdn_wy16 (kernel.cu): the W.S and Q.S partials of the dk / rpt state-row groups,
    [groups][2][R][32 cg] fp32, then U [R][32 cg]."""
    R, dvt = chunk_rows(T), 32 * cg
    return (dk // rpt * 2 + 1) * R * dvt * 4


def kernel_variants() -> list[str]:
    """Every kernel kernel.cu instantiates (tests check the PTX holds exactly these)."""
    wy = [wy16_name(dk, cg, p, r) for (dk, cg), ps in WY16_FORMS.items() for p in ps for r in CHUNK_ROWS]
    fold = [f"gdn_fold_dk{dk}_cg{cg}" for dk, cgs in FOLD_CG.items() for cg in cgs]
    return wy + fold + [f"gdn_decode_dk{dk}_cg{cg}" for dk, cgs in DECODE_CG.items() for cg in cgs]


def check_dims(B, T, Hk, Hv, dk, dv, cg=1) -> None:
    """The kernels' shape limits (launchers and the plugin)."""
    kernel_need(dk in KERNEL_DK, f"gdn: unsupported key head dim dk={dk}; supported: {KERNEL_DK}")
    kernel_need(dv > 0 and dv % (32 * cg) == 0, f"gdn: value head dim dv={dv} must be a positive multiple of {32 * cg}")
    kernel_need(Hk > 0 and Hv % Hk == 0, f"gdn: Hv={Hv} must be a multiple of Hk={Hk}")
    kernel_need(B > 0 and T > 0, f"gdn: need B >= 1 and T >= 1 (got B={B}, T={T})")


def _output_shapes(ins):
    q, v = ins[0], ins[2]
    B, T, dk, Hv, dv = q[0], q[1], q[3], v[2], v[3]
    return [[B, T, Hv, dv], [B, Hv, dk, dv], list(q), [B, T, Hv, dv], [B, T, Hv], [B, T, Hv]]


def _check_shapes(d, attrs=None):
    q, k, v, g, beta, s = (tuple(x) for x in d)
    need(len(q) == 4 and k == q, f"GdnChunkWY16: q {q} and k {k} must both be [B,T,Hk,dk]")
    need(len(v) == 4 and v[:2] == q[:2], f"GdnChunkWY16: v {v} must be [B,T,Hv,dv] with q's B,T")
    need(g == beta == v[:3], f"GdnChunkWY16: g {g} and beta {beta} must be [B,T,Hv] = {v[:3]}")
    need(s == (q[0], v[2], q[3], v[3]), f"GdnChunkWY16: state {s} must be [B,Hv,dk,dv]")


def _check_kernel(d, dtypes):
    check_float_dtypes("GdnChunkWY16", dtypes)
    (B, T, Hk, dk), (_, _, Hv, dv) = d[0], d[2]
    check_dims(B, T, Hk, Hv, dk, dv)


SPEC = OpSpec(
    name="GdnChunkWY16",
    inputs=(Port("q", "x", "[B,T,Hk,dk]"), Port("k", "x", "[B,T,Hk,dk]"), Port("v", "x", "[B,T,Hv,dv]"),
            Port("g", "g", "[B,T,Hv]"), Port("beta", "g", "[B,T,Hv]"), Port("state", "f32", "[B,Hv,dk,dv]")),
    outputs=(Port("o", "x", "[B,T,Hv,dv]"), Port("state_out", "f32", "[B,Hv,dk,dv]"),
             Port("k_hat", "f32", "[B,T,Hk,dk]"), Port("v_f32", "f32", "[B,T,Hv,dv]"), Port("g_f32", "f32", "[B,T,Hv]"),
             Port("beta_f32", "f32", "[B,T,Hv]")),
    attrs=(Attr("scale", "float", 0.0, "0: dk ** -0.5"),),
    groups={"x": FLOATS, "g": FLOATS, "f32": STATE_DTYPES},
    output_shapes=_output_shapes, check_shapes=_check_shapes, check_kernel=_check_kernel,
    doc="gated delta rule over T tokens in chunks of 16 from a read-only state",
    cuda_defines={"L2EPS": f"{L2NORM_EPS!r}f"},
)


def check_fold_shapes(pool, k_hat, v, g, beta, slot, n) -> None:
    """Shapes of one layer-batched gdn_fold call (tuples; slot None = row b uses slot b)."""
    need(len(pool) == 5, f"gdn_fold: pool {pool} must be [L,slots,Hv,dk,dv]")
    L, S, Hv, dk, dv = pool
    need(len(k_hat) == 5 and k_hat[0] == L and k_hat[4] == dk, f"gdn_fold: k_hat {k_hat} must be [L={L},B,T,Hk,dk={dk}]")
    B, T, Hk = k_hat[1:4]
    need(v == (L, B, T, Hv, dv), f"gdn_fold: v {v} must be [L,B,T,Hv,dv] = {(L, B, T, Hv, dv)}")
    need(g == beta == (L, B, T, Hv), f"gdn_fold: g {g} and beta {beta} must be [L,B,T,Hv] = {(L, B, T, Hv)}")
    need(n == (B,), f"gdn_fold: n {n} must be [B] = {(B,)}")
    need(slot is None and B <= S or slot == (B,), f"gdn_fold: slot {slot} must be [B] = {(B,)} (or none with B <= slots)")
