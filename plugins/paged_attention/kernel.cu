// Paged attention over a sequence's cached K/V pages + T new rows, and the KV page scatter.
// kv_pool [L, 2, num_blocks, block_size, Hkv, HD]; block_table [B, max_blocks] (int32);
// cached logical rows [kv_start[b], kv_len[b]) followed by the T new rows (k_new/v_new [B,T,Hkv,HD]).
// One warp per query row (t, q-head); a CTA holds NWARP rows of one kv head (GQA: the K/V tile in
// shared memory is shared by the q-heads of the group). Online softmax in fp32, exp2 domain.
// window > 0 (sliding attention): query row t (key index Lc + t) sees key index j only if Lc + t - j < window;
// window 0 means no lower bound, and then every index below is what it was before windows existed.
#include "common.cuh"
// NWARP (warps = query rows per CTA) and KT (keys per tile, one per lane when scoring) come from
// paged_attention/spec.py through NVRTC -D options: the launcher sizes grid and shared memory from them.
#if !defined(NWARP) || !defined(KT)
#error "NWARP and KT come from paged_attention/spec.py through NVRTC -D options"
#endif

template <int HD>
__device__ __forceinline__ void paged_attention_body(
    const void* __restrict__ q, int q_dt, const void* __restrict__ k_new, const void* __restrict__ v_new,
    int n_dt, const void* __restrict__ pool, int p_dt, int layer, int num_blocks, int block_size,
    const int* __restrict__ block_table, int max_blocks, const int* __restrict__ kv_start,
    const int* __restrict__ kv_len, void* __restrict__ o, int o_dt, int T, int Hq, int Hkv,
    int causal, int window, float scale) {
  constexpr int E = HD / 32, KS = HD + 1;
  extern __shared__ float smem[];
  float* Qs = smem;               // [NWARP][HD]
  float* Ks = Qs + NWARP * HD;    // [KT][HD+1]
  float* Vs = Ks + KT * KS;       // [KT][HD+1]
  const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
  const int b = blockIdx.z, hkv = blockIdx.y, G = Hq / Hkv;
  const int r = blockIdx.x * NWARP + w;
  const bool valid = r < G * T;
  const int t = valid ? r / G : T - 1, hq = hkv * G + (valid ? r % G : 0);
  const int ks0 = kv_start[b], Lc = kv_len[b] - ks0, Ltot = Lc + T;
  const int t_last = min(T - 1, ((int)blockIdx.x * NWARP + NWARP - 1) / G);
  const int cta_lim = causal ? Lc + t_last + 1 : Ltot;
  const int lim = causal ? Lc + t + 1 : Ltot;
  // first visible key of this row / of the CTA's first row (rows of a CTA are ordered by t, so it is the min)
  const int lo = window > 0 ? max(0, Lc + t - window + 1) : 0;
  const int cta_lo = window > 0 ? max(0, Lc + ((int)blockIdx.x * NWARP) / G - window + 1) : 0;
  const float qscale = scale * 1.4426950408889634f;
  const i64 qbase = (((i64)b * T + t) * Hq + hq) * HD;
#pragma unroll
  for (int e = 0; e < E; ++e) Qs[w * HD + lane + 32 * e] = valid ? ldf(q, q_dt, qbase + lane + 32 * e) * qscale : 0.f;
  const i64 vofs = (i64)num_blocks * block_size * Hkv * HD;
  const i64 lbase = (i64)layer * 2 * vofs;
  float m = -INFINITY, l = 0.f, acc[E];
#pragma unroll
  for (int e = 0; e < E; ++e) acc[e] = 0.f;
  for (int j0 = cta_lo; j0 < cta_lim; j0 += KT) {
    __syncthreads();
    for (int e4 = tid * 4; e4 < KT * HD; e4 += NWARP * 32 * 4) {
      const int j = e4 / HD, d = e4 % HD, jj = j0 + j;
      float4 kv = make_float4(0.f, 0.f, 0.f, 0.f), vv = kv;
      if (jj < cta_lim) {
        if (jj < Lc) {
          const int p = ks0 + jj;
          const int blk = block_table[(i64)b * max_blocks + p / block_size];
          const i64 a = lbase + (((i64)blk * block_size + p % block_size) * Hkv + hkv) * HD + d;
          kv = ld4(pool, p_dt, a);
          vv = ld4(pool, p_dt, a + vofs);
        } else {
          const i64 a = (((i64)b * T + (jj - Lc)) * Hkv + hkv) * HD + d;
          kv = ld4(k_new, n_dt, a);
          vv = ld4(v_new, n_dt, a);
        }
      }
      float* kd = Ks + j * KS + d;
      float* vd = Vs + j * KS + d;
      kd[0] = kv.x; kd[1] = kv.y; kd[2] = kv.z; kd[3] = kv.w;
      vd[0] = vv.x; vd[1] = vv.y; vd[2] = vv.z; vd[3] = vv.w;
    }
    __syncthreads();
    // a tile with no visible key of this row is skipped whole: m stays -inf-free (lo <= Lc + t < lim)
    if (!valid || j0 >= lim || j0 + KT <= lo) continue;
    const int jj = j0 + lane;
    const bool vis = jj >= lo && jj < lim;
    float sc = -INFINITY;
    if (vis) {
      float dot = 0.f;
      const float* kr = Ks + lane * KS;
      const float* qr = Qs + w * HD;
#pragma unroll 8
      for (int d = 0; d < HD; ++d) dot += qr[d] * kr[d];
      sc = dot;
    }
    const float m_new = fmaxf(m, warp_max(sc));  // finite: some key of [max(j0, lo), lim) is in this tile
    const float p = vis ? exp2f(sc - m_new) : 0.f;
    const float corr = exp2f(m - m_new);
    l = l * corr + warp_sum(p);
#pragma unroll
    for (int e = 0; e < E; ++e) acc[e] *= corr;
    const int nk = min(KT, lim - j0);
    for (int j = 0; j < nk; ++j) {
      const float pj = __shfl_sync(0xffffffffu, p, j);
      const float* vr = Vs + j * KS + lane;
#pragma unroll
      for (int e = 0; e < E; ++e) acc[e] += pj * vr[32 * e];
    }
    m = m_new;
  }
  if (valid) {
    const float inv = 1.f / l;
#pragma unroll
    for (int e = 0; e < E; ++e) stf(o, o_dt, qbase + lane + 32 * e, acc[e] * inv);
  }
}

#define PAGED_ATTN(HD)                                                                            \
  extern "C" __global__ void __launch_bounds__(NWARP * 32) paged_attention_hd##HD(               \
      const void* q, int q_dt, const void* k_new, const void* v_new, int n_dt, const void* pool,  \
      int p_dt, int layer, int num_blocks, int block_size, const int* block_table,                \
      int max_blocks, const int* kv_start, const int* kv_len, void* o, int o_dt, int T, int Hq,   \
      int Hkv, int causal, int window, float scale) {                                             \
    paged_attention_body<HD>(q, q_dt, k_new, v_new, n_dt, pool, p_dt, layer, num_blocks,          \
                             block_size, block_table, max_blocks, kv_start, kv_len, o, o_dt, T,   \
                             Hq, Hkv, causal, window, scale);                                     \
  }
PAGED_ATTN(64)
PAGED_ATTN(128)
PAGED_ATTN(256)

// Scatter rows t < n[b] of every layer to logical positions pos[b] + t of the sequence's pages:
// rows [L, 2, B, T, Hkv, HD] (K then V) -> pool [L, 2, num_blocks, block_size, Hkv, HD].
// grid (T*Hkv, B, L). Negative block ids are skipped; n and pos are read on the device (graph capturable).
extern "C" __global__ void kv_write(void* __restrict__ pool, int p_dt, int num_blocks, int block_size,
                                    const int* __restrict__ block_table, int max_blocks,
                                    const void* __restrict__ rows, int n_dt, const int* __restrict__ pos,
                                    const int* __restrict__ n, int B, int T, int Hkv, int HD) {
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
