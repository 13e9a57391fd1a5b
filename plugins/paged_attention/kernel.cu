// Paged attention over a sequence's cached K/V pages + T new rows (split-KV, flash-decoding style),
// and the KV page scatter.
// kv_pool [L, 2, num_blocks, block_size, Hkv, HD]; block_table [B, max_blocks] (int32);
// cached logical rows [kv_start[b], kv_len[b]) followed by the T new rows (k_new/v_new [B,T,Hkv,HD]).
// Key index j in [0, Lc + T): j < Lc is cached row kv_start + j, j >= Lc is new row j - Lc.
// window > 0 (sliding attention): query row t (key index Lc + t) sees key j only if Lc + t - j < window.
//
// Pass 1, paged_attention_hd{HD}_{bf16|f16|f32}[_small|_mma] (the K/V tile dtype; _small: fewer query rows R per
// CTA, for a decode step's GQA group of G*T = 8 rows, where a verify block has 128; _mma: the same pass on tensor
// cores for 16-bit q and tiles, mma.cuh; spec.cta_rows and spec.mma_tiles pick):
// grid (split, row group * Hkv + kv head, batch). A CTA owns R query rows (t-major (t, q-head of the GQA group)
// pairs of one kv head) and the keys [split*S, split*S + S) of the key index space, S = tiles_per_split * KT
// chosen on the host from shapes (spec.py). It streams its keys through a 2-stage cp.async pipeline of KT-key
// K/V tiles (raw bytes, 16-byte chunks; read once per split per kv head and row group) and keeps an online
// softmax in fp32, exp2 domain. With one split it writes o; otherwise the unnormalised partial (acc, max, sum)
// of each row to the workspace.
// Pass 2, paged_attention_combine: merges the splits' partials of each output row (several rows per CTA).
// Nothing on the host depends on data: empty splits (past kv_len, before a window, after the causal
// limit of every row of the CTA) write an empty partial (m = -inf, l = 0) and the combine skips them.
// NT (threads per CTA) and KT (keys per tile, one per lane when scoring) come from paged_attention/spec.py
// through NVRTC -D options: the launcher sizes grid, shared memory and workspace from them.
#if !defined(NT) || !defined(KT) || !defined(COMBINE_THREADS) || !defined(MAX_SPLITS) || !defined(COMBINE_LOADS)
#error "NT, KT, COMBINE_THREADS, COMBINE_LOADS and MAX_SPLITS come from paged_attention/spec.py through NVRTC -D options"
#endif
#include "common.cuh"
#include "tiles.cuh"
#include "mma.cuh"

// 8 consecutive elements of a shared-memory tile row (element e0, a multiple of 8) as floats.
template <int TD>
__device__ __forceinline__ void ld8s(const unsigned char* row, int e0, float* f) {
  if (TD == DT_F32) {
    const float4 a = *(const float4*)(row + e0 * 4), b = *(const float4*)(row + e0 * 4 + 16);
    f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w; f[4] = b.x; f[5] = b.y; f[6] = b.z; f[7] = b.w;
  } else {
    const uint4 u = *(const uint4*)(row + e0 * 2);
    const unsigned w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if (TD == DT_BF16) {
        f[2 * i] = __uint_as_float(w[i] << 16);
        f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
      } else {
        f[2 * i] = f16_to_f((u16)(w[i] & 0xffff));
        f[2 * i + 1] = f16_to_f((u16)(w[i] >> 16));
      }
    }
  }
}

// TD: the dtype of the shared-memory tiles (the pool's; fp32 when k_new has another dtype than the pool).
// R: query rows per CTA, a multiple of NW (score rows per warp) and of NT / (HD / 8) (rows per P.V pass).
template <int HD, int TD, int R>
__device__ __forceinline__ void attn_split(const AttnArgs& a) {
  constexpr int RW = R / NW;          // rows per warp when scoring
  constexpr int TPR = HD / 8;         // threads per row in P.V, 8 dims each
  constexpr int RP = NT / TPR;        // rows per P.V pass
  constexpr int RPT = R / RP;         // P.V rows per thread
  constexpr int RS = KvTile<HD, TD>::RS;  // padded row stride (bytes): no bank conflicts
  extern __shared__ __align__(16) unsigned char smem[];
  float* Qs = (float*)smem;           // [R][HD], pre-scaled by scale * log2(e)
  float* Ps = Qs + R * HD;            // [R][KT] probabilities of the current tile
  float* Cs = Ps + R * KT;            // [R] rescale factor of the current tile, then the final sum
  unsigned char* tiles = (unsigned char*)(Cs + R);  // [2 stages][K, V][KT][RS]
  const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
  const int split = blockIdx.x, nsplit = gridDim.x;
  const CtaShare c(a, R);
  const int nr = c.nr, k0 = c.k0, k1 = c.k1;
  auto orow = [&](int r) { return c.orow(a, r); };
  if (k0 >= k1) return c.write_empty(a);
  const int ntiles = (k1 - k0 + KT - 1) / KT;
  int nblk[KvTile<HD, TD>::KPT];
  kv_pipe_start<HD, TD, false>(a, c, tiles, ntiles, nblk);
  {  // Q rows: all loads in flight together, then scaled into shared memory
    constexpr int QPT = R * HD / (4 * NT);
    const float qscale = a.scale * 1.4426950408889634f;
    float4 qv[QPT];
#pragma unroll
    for (int u = 0; u < QPT; ++u) {
      const int e4 = (tid + NT * u) * 4, r = e4 / HD, d = e4 % HD;
      qv[u] = r < nr ? ld4(a.q, a.q_dt, (i64)orow(r) * HD + d) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
#pragma unroll
    for (int u = 0; u < QPT; ++u) {
      const float4 v = qv[u];
      *(float4*)(Qs + (tid + NT * u) * 4) = make_float4(v.x * qscale, v.y * qscale, v.z * qscale, v.w * qscale);
    }
  }
  float m[RW], l[RW], acc[RPT][8];
#pragma unroll
  for (int i = 0; i < RW; ++i) m[i] = -INFINITY, l[i] = 0.f;
#pragma unroll
  for (int i = 0; i < RPT; ++i)
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[i][e] = 0.f;
  const int d0 = (tid % TPR) * 8, rsub = tid / TPR;
  int vlo[RW], vlim[RW];  // keys visible to the warp's score rows, once (a division by G each)
#pragma unroll
  for (int i = 0; i < RW; ++i) c.visible(a, w + NW * i, vlo[i], vlim[i]);
  for (int it = 0; it < ntiles; ++it) {
    const int j0 = k0 + it * KT, nk = min(KT, k1 - j0);
    kv_pipe_next<HD, TD, false>(a, c, tiles, it, ntiles, j0, nblk);
    const unsigned char* Kt = tiles + (it & 1) * 2 * KT * RS;
    const unsigned char* Vt = Kt + KT * RS;
    // scores: warp w scores rows w + NW*i, lane = key
    float dot[RW];
#pragma unroll
    for (int i = 0; i < RW; ++i) dot[i] = 0.f;
#pragma unroll 4
    for (int e0 = 0; e0 < HD; e0 += 8) {
      float kf[8];
      ld8s<TD>(Kt + lane * RS, e0, kf);
#pragma unroll
      for (int i = 0; i < RW; ++i) {  // every row, also those >= nr (zero Q, never stored): no branch
        const float4 qa = *(const float4*)(Qs + (w + NW * i) * HD + e0);
        const float4 qb = *(const float4*)(Qs + (w + NW * i) * HD + e0 + 4);
        dot[i] += qa.x * kf[0] + qa.y * kf[1] + qa.z * kf[2] + qa.w * kf[3] + qb.x * kf[4] + qb.y * kf[5] +
                  qb.z * kf[6] + qb.w * kf[7];
      }
    }
    // online softmax of the warp's RW rows, their shuffle reductions interleaved (warp_max_n / warp_sum_n)
    float s[RW], red[RW], corr[RW];
#pragma unroll
    for (int i = 0; i < RW; ++i) {
      const int r = w + NW * i, j = j0 + lane;
      s[i] = r < nr && lane < nk && j >= vlo[i] && j < vlim[i] ? dot[i] : -INFINITY;
      red[i] = s[i];
    }
    warp_max_n(red);
#pragma unroll
    for (int i = 0; i < RW; ++i) {
      const float m_new = fmaxf(m[i], red[i]);
      const bool none = m_new == -INFINITY;  // no visible key for this row yet
      s[i] = none ? 0.f : exp2f(s[i] - m_new);  // p
      corr[i] = none ? 1.f : exp2f(m[i] - m_new);
      m[i] = m_new;
      red[i] = s[i];
    }
    warp_sum_n(red);
#pragma unroll
    for (int i = 0; i < RW; ++i) {
      const int r = w + NW * i;
      l[i] = l[i] * corr[i] + red[i];
      if (r < nr) {
        Ps[r * KT + lane] = s[i];
        if (lane == 0) Cs[r] = corr[i];
      }
    }
    __syncthreads();
    // P.V: thread owns dims d0..d0+7 of rows rsub + RP*i
#pragma unroll
    for (int i = 0; i < RPT; ++i) {
      if (rsub + RP * i < nr) {
        const float c = Cs[rsub + RP * i];
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[i][e] *= c;
      }
    }
#pragma unroll 4
    for (int jl = 0; jl < nk; ++jl) {
      float vf[8];
      ld8s<TD>(Vt + jl * RS, d0, vf);
#pragma unroll
      for (int i = 0; i < RPT; ++i) {  // every row, as above
        const float p = Ps[(rsub + RP * i) * KT + jl];
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[i][e] += p * vf[e];
      }
    }
    __syncthreads();  // the next iteration's prefetch overwrites this stage
  }
#pragma unroll
  for (int i = 0; i < RW; ++i) {
    const int r = w + NW * i;
    if (r < nr && lane == 0) {
      Cs[r] = l[i];
      if (nsplit > 1) ((float2*)a.ws_ml)[(i64)orow(r) * nsplit + split] = make_float2(m[i], l[i]);
    }
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < RPT; ++i) {
    const int r = rsub + RP * i;
    if (r >= nr) continue;
    if (nsplit == 1) {
      const float inv = 1.f / Cs[r];
      const i64 ob = (i64)orow(r) * HD + d0;
#pragma unroll
      for (int e = 0; e < 8; ++e) stf(a.o, a.o_dt, ob + e, acc[i][e] * inv);
    } else {
      float4* dst = (float4*)(a.ws_acc + ((i64)orow(r) * nsplit + split) * HD + d0);
      dst[0] = make_float4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]);
      dst[1] = make_float4(acc[i][4], acc[i][5], acc[i][6], acc[i][7]);
    }
  }
}

// One entry per (head dim, tile dtype, rows per CTA): the launcher picks the tile dtype (spec.tile_dtype) and R
// (spec.rows_per_cta). Not one kernel that branches over the three dtypes at run time: that is several times the
// code and, with per-row branches in the score and P.V loops, slower per call (docs/PERF.md).
// The full R (4 rows x 8 dims of acc per thread) fits a verify block; the small R a decode step's GQA group,
// which at the full R computed 4x (hd128) to 32x (hd64, G=2) the rows it keeps.
#define PAGED_ATTN(HD, TDN, TD, R, SUF)                                                     \
  extern "C" __global__ void __launch_bounds__(NT) paged_attention_hd##HD##_##TDN##SUF(ATTN_PARAMS) { \
    pdl_wait();                                                                             \
    ATTN_ARGS(a);                                                                           \
    attn_split<HD, TD, R>(a);                                                               \
  }
#define PAGED_ATTN_R(HD, R, SUF) \
  PAGED_ATTN(HD, bf16, DT_BF16, R, SUF) PAGED_ATTN(HD, f16, DT_F16, R, SUF) PAGED_ATTN(HD, f32, DT_F32, R, SUF)
// R_FULL / R_SMALL: spec.rows_per_cta(hd, small) (NVRTC -D options)
PAGED_ATTN_R(64, R_FULL_64, )
PAGED_ATTN_R(64, R_SMALL_64, _small)
PAGED_ATTN_R(128, R_FULL_128, )
PAGED_ATTN_R(128, R_SMALL_128, _small)
PAGED_ATTN_R(256, R_FULL_256, )
PAGED_ATTN_R(256, R_SMALL_256, _small)
// The tensor-core split pass (mma.cuh) for 16-bit q and K/V tiles: 16 query rows per warp.
#define PAGED_ATTN_MMA(HD, TDN, F16)                                                                   \
  extern "C" __global__ void __launch_bounds__(NT) paged_attention_hd##HD##_##TDN##_mma(ATTN_PARAMS) { \
    pdl_wait();                                                                                  \
    ATTN_ARGS(a);                                                                                \
    attn_split_mma<HD, F16>(a);                                                                  \
  }
#define PAGED_ATTN_MMA_HD(HD) PAGED_ATTN_MMA(HD, bf16, false) PAGED_ATTN_MMA(HD, f16, true)
PAGED_ATTN_MMA_HD(64)
PAGED_ATTN_MMA_HD(128)
PAGED_ATTN_MMA_HD(256)

// Pass 2: o[row] = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s over the splits with l_s > 0 (every row
// has one: its own key, or the new rows). grid ceil(nrows / rpc): a CTA merges rpc rows, each with ng groups of
// hd/4 threads (4 dims each); group g of a row merges splits g, g + ng, ... CB at a time (their loads in flight
// together), then the row's groups are summed in shared memory. spec.combine_groups picks ng and rpc =
// COMBINE_THREADS / (ng * hd/4): one row per CTA for a few rows; for many (a batch's verify block, a few splits each)
// the fewest groups whose first CB loads cover the splits, so they take a few CTAs rather than one 256-thread CTA per
// row with most groups idle (figures: docs/PERF.md, `combine_groups`).
// nsplit <= MAX_SPLITS and rpc * nsplit <= MAX_SPLITS (spec.py).
#define CB COMBINE_LOADS
extern "C" __global__ void __launch_bounds__(COMBINE_THREADS) paged_attention_combine(
    const float* __restrict__ ws_acc, const float* __restrict__ ws_ml, void* __restrict__ o, int o_dt,
    int nsplit, int hd, int ng, int nrows) {
  pdl_wait();
  __shared__ float red[COMBINE_THREADS * 4];
  __shared__ float2 mls[MAX_SPLITS];
  __shared__ float wmax[COMBINE_THREADS / 32], gsum[COMBINE_THREADS];
  const int tid = threadIdx.x, tpg = hd / 4, tpr = tpg * ng;  // threads per group / per row (powers of two)
  const int rl = tid / tpr, w = tid % tpr, g = w / tpg, d = (w % tpg) * 4;
  const int row = blockIdx.x * (COMBINE_THREADS / tpr) + rl;
  const bool live = row < nrows;
  const float2* ml = (const float2*)ws_ml + (i64)row * nsplit;
  float2* rml = mls + rl * nsplit;
  float mx = -INFINITY;
  for (int s = w; live && s < nsplit; s += tpr) {
    const float2 v = ml[s];
    rml[s] = v;
    if (v.y > 0.f) mx = fmaxf(mx, v.x);
  }
  // the row's max: its lanes of a warp by shuffles (a row's tpr threads are aligned), its warps in shared memory
  for (int off = min(tpr, 32) / 2; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
  if (tpr > 32 && (tid & 31) == 0) wmax[tid >> 5] = mx;
  __syncthreads();
  for (int i = 0; tpr > 32 && i < tpr / 32; ++i) mx = fmaxf(mx, wmax[rl * (tpr / 32) + i]);
  const float* accp = ws_acc + (i64)row * nsplit * hd + d;
  float L = 0.f;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int s0 = g; live && s0 < nsplit; s0 += CB * ng) {
    float wt[CB];
    float4 x[CB];
#pragma unroll
    for (int u = 0; u < CB; ++u) {
      const int s = s0 + u * ng;
      const float2 v = s < nsplit ? rml[s] : make_float2(-INFINITY, 0.f);
      wt[u] = v.y > 0.f ? exp2f(v.x - mx) : 0.f;
      L += wt[u] * v.y;
      // empty splits wrote no acc
      x[u] = wt[u] > 0.f ? *(const float4*)(accp + (i64)s * hd) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
#pragma unroll
    for (int u = 0; u < CB; ++u)
      acc.x += wt[u] * x[u].x, acc.y += wt[u] * x[u].y, acc.z += wt[u] * x[u].z, acc.w += wt[u] * x[u].w;
  }
  *(float4*)(red + (rl * ng + g) * hd + d) = acc;
  gsum[tid] = L;  // the same in every thread of a group
  __syncthreads();
  if (g == 0 && live) {
    float Lt = 0.f;
    for (int i = 0; i < ng; ++i) Lt += gsum[rl * tpr + i * tpg];
    for (int i = 1; i < ng; ++i) {
      const float4 x = *(const float4*)(red + (rl * ng + i) * hd + d);
      acc.x += x.x, acc.y += x.y, acc.z += x.z, acc.w += x.w;
    }
    const float inv = 1.f / Lt;
    const i64 ob = (i64)row * hd + d;
    stf(o, o_dt, ob, acc.x * inv), stf(o, o_dt, ob + 1, acc.y * inv);
    stf(o, o_dt, ob + 2, acc.z * inv), stf(o, o_dt, ob + 3, acc.w * inv);
  }
}

// Scatter rows t < n[b] of every layer to logical positions pos[b] + t of the sequence's pages:
// rows [L, 2, B, T, Hkv, HD] (K then V) -> pool [L, 2, num_blocks, block_size, Hkv, HD].
// grid (T*Hkv, B, L). Negative block ids are skipped; n and pos are read on the device (graph capturable).
extern "C" __global__ void kv_write(void* __restrict__ pool, int p_dt, int num_blocks, int block_size,
                                    const int* __restrict__ block_table, int max_blocks,
                                    const void* __restrict__ rows, int n_dt, const int* __restrict__ pos,
                                    const int* __restrict__ n, int B, int T, int Hkv, int HD) {
  pdl_wait();
  const int b = blockIdx.y, l = blockIdx.z, t = blockIdx.x / Hkv, h = blockIdx.x % Hkv;
  if (t >= n[b]) return;
  const int p = pos[b] + t;
  const int blk = block_table[(i64)b * max_blocks + p / block_size];
  if (blk < 0) return;
  const i64 vofs = (i64)num_blocks * block_size * Hkv * HD;  // K -> V in the pool
  const i64 rofs = (i64)B * T * Hkv * HD;                    // K -> V in the rows
  const i64 dst = (i64)l * 2 * vofs + (((i64)blk * block_size + p % block_size) * Hkv + h) * HD;
  const i64 src = (i64)l * 2 * rofs + (((i64)b * T + t) * Hkv + h) * HD;
  for (int d = threadIdx.x; d < HD; d += blockDim.x) {
    stf(pool, p_dt, dst + d, ldf(rows, n_dt, src + d));
    stf(pool, p_dt, dst + vofs + d, ldf(rows, n_dt, src + rofs + d));
  }
}
