// What both split passes of paged attention share (kernel.cu: CUDA cores; mma.cuh: tensor cores): the arguments,
// the CTA's share of a call (batch, kv head, query rows, key range), and the cp.async loads of K/V key tiles.
#pragma once
#include "common.cuh"
#define NW (NT / 32)

__device__ __forceinline__ unsigned smem_addr(const void* p) {
  unsigned a;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
  return a;
}
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr(dst)), "l"(src));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_wait1() { asm volatile("cp.async.wait_group 1;\n" ::); }

struct AttnArgs {
  const void *q, *k_new, *v_new, *pool;
  int q_dt, n_dt, p_dt, o_dt, layer, num_blocks, block_size, max_blocks, T, Hq, Hkv, causal, window, tiles;
  i64 k_rs, v_rs;  // elements between (b, t) rows of k_new / v_new (slices of wider projection rows)
  const int *block_table, *kv_start, *kv_len;
  void* o;
  float* ws_acc;  // [B*T*Hq][nsplit][HD] unnormalised sums of p * v
  float* ws_ml;   // [B*T*Hq][nsplit][2] (running max in the exp2 domain, sum of p)
  float scale;
};

// The CTA's share, grid (split, row group * Hkv + kv head, batch): query rows r0 + [0, nr) of the kv head's G*T
// (t-major (t, q-head of the GQA group) pairs) and keys [k0, k1) of the key index space [0, Lc + T).
struct CtaShare {
  int b, hkv, G, T, r0, nr, ks0, Lc, Ltot, k0, k1, bsh;  // bsh: log2(block_size), -1 if not a power of two
  __device__ __forceinline__ CtaShare(const AttnArgs& a, int R) {
    const int split = blockIdx.x, nsplit = gridDim.x;
    b = blockIdx.z, hkv = blockIdx.y % a.Hkv;
    G = a.Hq / a.Hkv, T = a.T;
    r0 = (blockIdx.y / a.Hkv) * R, nr = min(R, G * T - r0);
    ks0 = a.kv_start[b], Lc = a.kv_len[b] - ks0, Ltot = Lc + T;
    const int t_first = r0 / G, t_last = (r0 + nr - 1) / G;
    const int cta_lim = a.causal ? Lc + t_last + 1 : Ltot;
    const int cta_lo = a.window > 0 ? max(0, Lc + t_first - a.window + 1) : 0;
    const int S = a.tiles * KT;
    bsh = (a.block_size & (a.block_size - 1)) == 0 ? __ffs(a.block_size) - 1 : -1;
    k0 = max(split * S, cta_lo);
    k1 = split == nsplit - 1 ? cta_lim : min(split * S + S, cta_lim);  // the last split takes any rest
  }
  // logical row p -> its page index and row within the page: shifts for a power-of-two block size (a division per
  // key made the prologue a large share of the instructions executed; docs/PERF.md)
  __device__ __forceinline__ int page_of(const AttnArgs& a, int p) const {
    return bsh >= 0 ? p >> bsh : p / a.block_size;
  }
  __device__ __forceinline__ int slot_of(const AttnArgs& a, int p) const {
    return bsh >= 0 ? p & (a.block_size - 1) : p % a.block_size;
  }
  // row of o (and of the workspace) for the CTA's query row r
  __device__ __forceinline__ int orow(const AttnArgs& a, int r) const {
    const int rr = r0 + r;
    return (b * T + rr / G) * a.Hq + hkv * G + rr % G;
  }
  // keys [lo, lim) of the key index space are visible to the CTA's query row r
  __device__ __forceinline__ void visible(const AttnArgs& a, int r, int& lo, int& lim) const {
    const int t = (r0 + r) / G;
    lim = a.causal ? Lc + t + 1 : Ltot;
    lo = a.window > 0 ? Lc + t - a.window + 1 : 0;
  }
  // No key of this split is visible to any row of the CTA (never with one split): an empty partial
  // (m = -inf, l = 0) that the combine pass skips.
  __device__ __forceinline__ void write_empty(const AttnArgs& a) const {
    for (int r = threadIdx.x; r < nr; r += NT)
      ((float2*)a.ws_ml)[(i64)orow(a, r) * gridDim.x + blockIdx.x] = make_float2(-INFINITY, 0.f);
  }
};

// Keys [j0, j1) of the key index space -> K and V tiles at `base` ([K, V][KT][RS], RS bytes a padded row, raw bytes
// in 16-byte chunks when the source has the tile dtype TD). Thread owns chunk cc of keys jb + JSTEP*u.
// Two steps, so a tile's page ids are read one tile ahead of its copies: tile_pages issues the page-id loads of the
// thread's keys (independent loads, nothing waits on them), load_kv_tile issues every cp.async of the tile from
// them. Reading a tile's page ids just before its copies stalled each prefetch for a global-memory round trip.
// ZERO: tile rows past j1 are zeroed (the tensor-core pass multiplies whole tiles; p = 0 times a stale NaN is NaN).
template <int HD, int TD>
struct KvTile {
  static constexpr int ES = TD == DT_F32 ? 4 : 2;
  static constexpr int CPR = HD * ES / 16;  // 16-byte chunks per K/V row
  static constexpr int RS = HD * ES + 16;
  static constexpr int JSTEP = NT / CPR, KPT = KT / JSTEP;  // keys a pass of the CTA covers; keys per thread
};

template <int HD, int TD>
__device__ __forceinline__ void tile_pages(const AttnArgs& a, const CtaShare& c, int j0, int j1,
                                           int (&blk)[KvTile<HD, TD>::KPT]) {
  using M = KvTile<HD, TD>;
  const int jb = threadIdx.x / M::CPR;
#pragma unroll
  for (int u = 0; u < M::KPT; ++u) {
    const int j = j0 + jb + M::JSTEP * u, p = c.ks0 + j;
    blk[u] = j < j1 && j < c.Lc ? a.block_table[(i64)c.b * a.max_blocks + c.page_of(a, p)] : 0;
  }
}

template <int HD, int TD, bool ZERO>
__device__ __forceinline__ void load_kv_tile(const AttnArgs& a, const CtaShare& c, unsigned char* base, int j0,
                                             int j1, const int (&blk)[KvTile<HD, TD>::KPT]) {
  using M = KvTile<HD, TD>;
  constexpr int ES = M::ES, RS = M::RS, JSTEP = M::JSTEP, KPT = M::KPT;
  const int cc = threadIdx.x % M::CPR, jb = threadIdx.x / M::CPR;
  const i64 vofs = (i64)a.num_blocks * a.block_size * a.Hkv * HD;  // K -> V in the pool
  const i64 lbase = (i64)a.layer * 2 * vofs;
#pragma unroll
  for (int u = 0; u < KPT; ++u) {
    const int jl = jb + JSTEP * u, j = j0 + jl;
    unsigned char* dst = base + jl * RS + cc * 16;
    if (j >= j1) {
      if (ZERO) {
        *(uint4*)dst = make_uint4(0, 0, 0, 0);
        *(uint4*)(dst + KT * RS) = make_uint4(0, 0, 0, 0);
      }
      continue;
    }
    const void *ksrc, *vsrc;
    i64 e, ve;
    int sdt;
    if (j < c.Lc) {
      const int p = c.ks0 + j;
      ksrc = vsrc = a.pool, sdt = a.p_dt;
      e = lbase + (((i64)blk[u] * a.block_size + c.slot_of(a, p)) * a.Hkv + c.hkv) * HD;
      ve = e + vofs;
    } else {
      ksrc = a.k_new, vsrc = a.v_new, sdt = a.n_dt;
      e = ((i64)c.b * c.T + (j - c.Lc)) * a.k_rs + c.hkv * HD;
      ve = ((i64)c.b * c.T + (j - c.Lc)) * a.v_rs + c.hkv * HD;
    }
    if (sdt == TD) {
      cp_async16(dst, (const unsigned char*)ksrc + e * ES + cc * 16);
      cp_async16(dst + KT * RS, (const unsigned char*)vsrc + ve * ES + cc * 16);
    } else {  // TD is fp32 here: 4 elements per chunk
      *(float4*)dst = ld4(ksrc, sdt, e + cc * 4);
      *(float4*)(dst + KT * RS) = ld4(vsrc, sdt, ve + cc * 4);
    }
  }
}

// The 2-stage pipeline of a CTA's key tiles [k0, k1), both split passes: tile t goes to stage t & 1 of `tiles`, and
// its page ids are read one tile ahead of its copies (nblk: those of the next tile to copy). Each issue is one
// cp.async group.
// kv_pipe_start: tile 0's copies issued, tile 1's page ids in flight beside tile 0's.
template <int HD, int TD, bool ZERO>
__device__ __forceinline__ void kv_pipe_start(const AttnArgs& a, const CtaShare& c, unsigned char* tiles, int ntiles,
                                              int (&nblk)[KvTile<HD, TD>::KPT]) {
  int blk[KvTile<HD, TD>::KPT];
  tile_pages<HD, TD>(a, c, c.k0, min(c.k0 + KT, c.k1), blk);
  if (ntiles > 1) tile_pages<HD, TD>(a, c, c.k0 + KT, min(c.k0 + 2 * KT, c.k1), nblk);
  load_kv_tile<HD, TD, ZERO>(a, c, tiles, c.k0, min(c.k0 + KT, c.k1), blk);
  cp_commit();
}
// kv_pipe_next, at tile it (keys from j0): tile it + 1's copies issued into the other stage, tile it + 2's page ids
// read; returns once tile it has landed in stage it & 1 (its group waited for, then a barrier for every thread's).
template <int HD, int TD, bool ZERO>
__device__ __forceinline__ void kv_pipe_next(const AttnArgs& a, const CtaShare& c, unsigned char* tiles, int it,
                                             int ntiles, int j0, int (&nblk)[KvTile<HD, TD>::KPT]) {
  if (it + 1 < ntiles) {
    load_kv_tile<HD, TD, ZERO>(a, c, tiles + ((it + 1) & 1) * 2 * KT * KvTile<HD, TD>::RS, j0 + KT,
                               min(j0 + 2 * KT, c.k1), nblk);
    if (it + 2 < ntiles) tile_pages<HD, TD>(a, c, j0 + 2 * KT, min(j0 + 3 * KT, c.k1), nblk);
  }
  cp_commit();
  cp_wait1();
  __syncthreads();
}

// The arguments of both split passes' entries (kernel.cu), in the launcher's order (launch.py).
#define ATTN_PARAMS                                                                                      \
  const void *q, int q_dt, const void *k_new, const void *v_new, int n_dt, const void *pool, int p_dt,    \
      int layer, int num_blocks, int block_size, const int *block_table, int max_blocks,                  \
      const int *kv_start, const int *kv_len, void *o, int o_dt, int T, int Hq, int Hkv, int causal,      \
      int window, float scale, float *ws_acc, float *ws_ml, int tiles, int k_rs, int v_rs
#define ATTN_ARGS(a)                                                                                     \
  AttnArgs a;                                                                                            \
  a.q = q, a.k_new = k_new, a.v_new = v_new, a.pool = pool, a.q_dt = q_dt, a.n_dt = n_dt;                \
  a.p_dt = p_dt, a.o_dt = o_dt, a.layer = layer, a.num_blocks = num_blocks;                              \
  a.block_size = block_size, a.max_blocks = max_blocks, a.T = T, a.Hq = Hq, a.Hkv = Hkv;                 \
  a.causal = causal, a.window = window, a.tiles = tiles, a.block_table = block_table;                    \
  a.kv_start = kv_start, a.kv_len = kv_len, a.o = o, a.ws_acc = ws_acc, a.ws_ml = ws_ml;                 \
  a.scale = scale, a.k_rs = k_rs, a.v_rs = v_rs
