"""The spec of PagedAttention and of its commit kernel kv_write (DESIGN §3). Math: reference.py.

PagedAttention(q, k_new, v_new, kv_pool, block_table, kv_start, kv_len; layer, causal, scale, window) -> o
  q [B,T,Hq,hd]; k_new, v_new [B,T,Hkv,hd] (one dtype); kv_pool [L,2,num_blocks,block_size,Hkv,hd]
  (read-only); block_table [B,max_blocks]; kv_start, kv_len [B] (int32 or int64). Row t attends the
  cached logical rows [kv_start, kv_len) of its pages and the T new rows (new rows <= t when causal).
  window W > 0 (sliding attention): with the Lc = kv_len - kv_start cached rows first, row t (key index Lc + t)
  sees key index s only if Lc + t - s < W, the window counting the row itself. Callers keep the attended rows
  at contiguous positions ending just before the new rows, so this is position(q) - position(key) < W.
  window 0: no window (every earlier behaviour).
  GQA: q-head h reads kv-head h // (Hq/Hkv). o [B,T,Hq,hd] in q's dtype. scale 0 means hd ** -0.5.
kv_write (runtime commit, all layers in one launch): kv_pool [L,2,num_blocks,block_size,Hkv,hd] in place;
  rows [L,2,B,T,Hkv,hd] (K, V); block_table [B,max_blocks]; pos, n [B]: row t < n[b] of sequence b goes
  to its logical row pos[b] + t in every layer; negative page ids are skipped.
"""
from __future__ import annotations

import math

from dflash_trt.plugins.opspec import (FLOATS, INTS, Attr, OpSpec, Port, check_float_dtypes, dtype_name, kernel_need,
                                       need)

KERNEL_HD = (64, 128, 256)  # head dims the attention kernel is instantiated for
NT, KT = 128, 32            # kernel tiling: threads per CTA, keys per K/V tile (kernel.cu)
# Split-KV plan: enough (key split x row group x kv head x batch) CTAs for about two waves of a 132-SM GPU, from
# shapes only (never from kv_len), so the grid and the workspace are fixed for a captured graph.
SPLIT_CTAS = 256
MAX_SPLITS = SPLIT_CTAS     # split_plan never plans more (the combine pass keeps (max, sum) of each in smem)
COMBINE_THREADS = 256
COMBINE_LOADS = 8           # splits a combine thread merges per round, their loads in flight together (CB)


def rows_per_cta(hd: int, small: bool = False) -> int:
    """Query rows (t, q-head) of one kv head per CTA. Full: 4 rows x 8 dims of fp32 accumulator per thread.
    Small (a decode step's GQA group): the fewest the thread mapping allows, a multiple of 8, of the NT/32 score
    warps and of the NT / (hd/8) rows of a P.V pass."""
    return max(8, NT * 8 // hd) if small else 32 * NT // hd


MMA_ROWS = 16 * (NT // 32)  # query rows per CTA of the tensor-core split pass (mma.cuh): 16 per warp


def mma_tiles(q_dtype: str, p_dtype: str, n_dtype: str) -> bool:
    """Whether a verify / drafter block runs the tensor-core split pass (mma.cuh): q and the K/V tiles share one
    16-bit dtype. fp32 tiles (an fp32 model, or new rows of another dtype than the pool) keep the CUDA-core pass."""
    t = tile_dtype(p_dtype, n_dtype)
    return t != "float32" and dtype_name(q_dtype) == t


def cta_rows(hd: int, G: int, T: int, mma: bool = False) -> int:
    """The R the launcher runs for G*T query rows per kv head. CUDA cores: the small R when it pads fewer rows
    (row groups x R) than the full R, else the full R (fewer row groups read the K/V tiles fewer times). With
    mma_tiles: MMA_ROWS, also for a decode step's GQA group of a few rows (the tensor-core pass streams the tiles
    nearer the copy rate than the CUDA-core small pass: docs/PERF.md). The small R is below both big ones, so R and
    `mma` name the kernel."""
    full, small = rows_per_cta(hd), rows_per_cta(hd, small=True)
    if mma:
        return MMA_ROWS
    return small if -(-G * T // small) * small < -(-G * T // full) * full else full


TILE_SUFFIX = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}  # kernel entry per tile dtype


def tile_dtype(p_dtype: str, n_dtype: str) -> str:
    """The dtype of the shared-memory K/V tiles: the pool's, fp32 when the new rows have another dtype."""
    p_dtype, n_dtype = dtype_name(p_dtype), dtype_name(n_dtype)
    return p_dtype if p_dtype == n_dtype else "float32"


def tile_elem_bytes(p_dtype: str, n_dtype: str) -> int:
    return 4 if tile_dtype(p_dtype, n_dtype) == "float32" else 2


def kernel_name(hd: int, p_dtype: str, n_dtype: str, rows: int = 0, mma: bool = False) -> str:
    """The split pass's entry for `rows` query rows per CTA (0: the full R): paged_attention_hd{hd}_{tile dtype}
    (kernel.cu, CUDA cores), + _small for the small R, + _mma for MMA_ROWS with mma_tiles (mma.cuh)."""
    suffix = "_mma" if mma and rows == MMA_ROWS else "_small" if rows and rows != rows_per_cta(hd) else ""
    return f"paged_attention_hd{hd}_{TILE_SUFFIX[tile_dtype(p_dtype, n_dtype)]}{suffix}"


def smem_bytes(hd: int, elem_bytes: int = 4, rows: int = 0, mma: bool = False) -> int:
    """Dynamic shared memory of the split pass at head dim hd and `rows` query rows per CTA (0: the full R).
    CUDA cores: Q rows, tile probabilities and rescale factors (fp32) + 2 stages of K and V tiles with 16-byte
    padded rows. Tensor cores (mma and rows == MMA_ROWS): the 16-bit Q rows and the tiles, all rows padded."""
    if mma and rows == MMA_ROWS:
        return (MMA_ROWS + 2 * 2 * KT) * (hd * 2 + 16)
    R = rows or rows_per_cta(hd)
    return R * (hd + KT + 1) * 4 + 2 * 2 * KT * (hd * elem_bytes + 16)


def split_plan(B: int, T: int, Hq: int, Hkv: int, hd: int, max_rows: int, mma: bool = False) -> tuple:
    """(tiles per split, number of splits, row groups) for at most max_rows cached rows (block table width x
    block_size) + T new rows: about SPLIT_CTAS CTAs, at most ceil(SPLIT_CTAS / (B * Hkv * row groups)) splits
    (the workspace bound below relies on it). Splits cover the cached rows; the last one also takes the
    new rows and anything past max_rows. One split means no workspace and no combine pass."""
    groups = -(-(Hq // Hkv) * T // cta_rows(hd, Hq // Hkv, T, mma))
    want = min(-(-SPLIT_CTAS // (B * Hkv * groups)), max(1, -(-max_rows // KT)))
    tiles = max(1, -(-max_rows // (want * KT)))
    if tiles > 1 and max_rows - want * (tiles - 1) * KT <= (tiles - 1) * KT:
        tiles -= 1  # e.g. 8192 rows + a page: the last split takes one more tile rather than 1/3 fewer splits
    nsplit = min(want, max(1, -(-max_rows // (tiles * KT))))
    return tiles, nsplit, groups


COMBINE_PACK_ROWS = 256     # calls with more output rows than this pack several rows per combine CTA


def combine_groups(nsplit: int, hd: int, rows: int) -> tuple:
    """(ng, rpc) of the combine pass for `rows` output rows (B*T*Hq) of nsplit splits: ng groups of hd/4 threads per
    row, rpc rows per CTA = COMBINE_THREADS / (ng * hd/4); rpc * nsplit <= MAX_SPLITS (the CTA's rows keep their
    (max, sum) pairs in shared memory). Up to COMBINE_PACK_ROWS rows: one row per CTA, all its threads on it. Above:
    the fewest groups (a power of two) whose first COMBINE_LOADS loads cover the splits, so a batch's verify block
    takes a few CTAs (packing pays only for many rows; figures: docs/PERF.md)."""
    tpg = hd // 4
    ng = COMBINE_THREADS // tpg
    if rows > COMBINE_PACK_ROWS:
        ng = 1
        while ng * COMBINE_LOADS < nsplit and 2 * ng * tpg <= COMBINE_THREADS:
            ng *= 2
    return ng, COMBINE_THREADS // (ng * tpg)


def workspace_bytes(B: int, T: int, Hq: int, Hkv: int, hd: int, max_rows: int, mma: bool = False) -> int:
    """fp32 partials of the split pass for exactly these shapes: acc [B*T*Hq, nsplit, hd] then
    (max, sum) [B*T*Hq, nsplit, 2]; 0 for one split."""
    _, nsplit, _ = split_plan(B, T, Hq, Hkv, hd, max_rows, mma)
    return 0 if nsplit == 1 else B * T * Hq * nsplit * (hd + 2) * 4


def workspace_bound(B: int, T: int, Hq: int, hd: int) -> int:
    """>= workspace_bytes of every shape with B' <= B, T' <= T, Hq' <= Hq (any Hkv, max_rows, kernel head dim),
    for a workspace sized once from a profile's max shapes: B*T*Hq*nsplit <= SPLIT_CTAS*R + B*T*Hq since
    nsplit <= ceil(SPLIT_CTAS / (B*Hkv*groups)) and G*T <= R*groups, R <= max(full R of its head dim, MMA_ROWS)."""
    per_cta = max(max(rows_per_cta(h), MMA_ROWS) * (h + 2) for h in KERNEL_HD)
    return (SPLIT_CTAS * per_cta + B * T * Hq * (hd + 2)) * 4


def check_dims(B, T, Hq, Hkv, hd, block_size) -> None:
    """The attention kernel's shape limits (launcher and the plugin)."""
    kernel_need(hd in KERNEL_HD, f"paged_attention: unsupported head dim {hd}; supported: {KERNEL_HD}")
    kernel_need(Hkv > 0 and Hq % Hkv == 0, f"paged_attention: Hq={Hq} must be a multiple of Hkv={Hkv}")
    kernel_need(B > 0 and T > 0 and block_size > 0,
                f"paged_attention: need B, T, block_size >= 1 (got {B}, {T}, {block_size})")


def check_kv_write_dims(B, T, Hkv, hd, block_size, L) -> None:
    kernel_need(min(B, T, Hkv, hd, block_size, L) > 0,
                f"kv_write: bad shape L={L} B={B} T={T} Hkv={Hkv} hd={hd} block_size={block_size}")


def _output_shapes(ins):
    return [list(ins[0])]


def _check_shapes(d, attrs):
    q, k, v, pool, bt, ks, kl = (tuple(x) for x in d)
    B = q[0] if q else None
    need(len(q) == 4 and len(k) == 4 and k == v and k[:2] == q[:2] and k[3] == q[3],
         f"PagedAttention: q {q} [B,T,Hq,hd], k_new/v_new {k}/{v} [B,T,Hkv,hd]")
    need(len(pool) == 6 and pool[1] == 2 and pool[4:] == k[2:],
         f"PagedAttention: kv_pool {pool} must be [L,2,num_blocks,block_size,Hkv,hd] with Hkv,hd = {k[2:]}")
    need(len(bt) == 2 and bt[0] == B, f"PagedAttention: block_table {bt} must be [B,max_blocks], B={B}")
    need(math.prod(ks) == B and math.prod(kl) == B, f"PagedAttention: kv_start {ks}/kv_len {kl} need B={B}")
    layer = int(attrs["layer"])
    need(0 <= layer < pool[0], f"PagedAttention: layer {layer} not in [0, {pool[0]})")


def _check_kernel(d, dtypes):
    check_float_dtypes("PagedAttention", dtypes)
    (B, T, Hq, hd), Hkv, BS = d[0], d[1][2], d[3][3]
    check_dims(B, T, Hq, Hkv, hd, BS)


SPEC = OpSpec(
    name="PagedAttention",
    inputs=(Port("q", "q", "[B,T,Hq,hd]"), Port("k_new", "n", "[B,T,Hkv,hd]"), Port("v_new", "n", "[B,T,Hkv,hd]"),
            Port("kv_pool", "p", "[L,2,num_blocks,block_size,Hkv,hd]"), Port("block_table", "i0", "[B,max_blocks]"),
            Port("kv_start", "i1", "[B]"), Port("kv_len", "i2", "[B]")),
    outputs=(Port("o", "q", "[B,T,Hq,hd]"),),
    attrs=(Attr("layer", "int", 0, "kv_pool layer"), Attr("causal", "int", 1, "1: new row t sees new rows <= t"),
           Attr("scale", "float", 0.0, "0: hd ** -0.5"),
           Attr("window", "int", 0, "W > 0: key index s visible to row t iff Lc + t - s < W; 0: none")),
    groups={"q": FLOATS, "n": FLOATS, "p": FLOATS, "i0": INTS, "i1": INTS, "i2": INTS},
    output_shapes=_output_shapes, check_shapes=_check_shapes, check_kernel=_check_kernel,
    doc="T query rows attend a sequence's cached K/V pages plus the T new rows",
    cuda_defines={"NT": NT, "KT": KT, "COMBINE_THREADS": COMBINE_THREADS, "MAX_SPLITS": MAX_SPLITS,
                  "COMBINE_LOADS": COMBINE_LOADS,
                  **{f"R_{kind.upper()}_{hd}": rows_per_cta(hd, kind == "small") for hd in KERNEL_HD
                     for kind in ("full", "small")}},
)
INDEX_INPUTS = tuple(i for i, p in enumerate(SPEC.inputs) if p.group.startswith("i"))  # int32 in the kernel


def check_kv_write_shapes(pool, rows, block_table, pos, n) -> None:
    """Shapes of one layer-batched kv_write call (tuples)."""
    need(len(pool) == 6 and pool[1] == 2, f"kv_write: kv_pool {pool} must be [L,2,num_blocks,block_size,Hkv,hd]")
    need(len(rows) == 6 and rows[:2] == pool[:2] and rows[4:] == pool[4:],
         f"kv_write: rows {rows} must be [L,2,B,T,Hkv,hd] with L,Hkv,hd of the pool {pool}")
    B = rows[2]
    need(len(block_table) == 2 and block_table[0] == B, f"kv_write: block_table {block_table} must be [B={B},max_blocks]")
    need(math.prod(pos) == B and math.prod(n) == B, f"kv_write: pos {pos} / n {n} must have B={B} entries")
