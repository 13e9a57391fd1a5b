// The split pass of paged attention on tensor cores (mma.sync.m16n8k16, bf16 or f16 q and K/V tiles, fp32
// accumulation), for verify and drafter blocks: the CUDA-core pass (kernel.cu) spends a 16-row verify block's time
// on fp32 FMAs and shared-memory reads, far above its bytes floor (figures: docs/PERF.md).
// Same CTA share, key tiles, pipeline, online softmax (exp2 domain) and outputs as the CUDA-core pass; R = 16 * NW
// query rows per CTA, warp w owning rows 16w .. 16w + 15 (FlashAttention-2's layout):
//   S = Q K^T: A = Q rows from shared memory (ldmatrix), B = K tile rows (ldmatrix), then scaled by scale * log2(e)
//   in fp32 and masked; row max and sum over the 4 lanes of a row (quad shuffles).
//   O += P V: the S accumulators are P's A fragments in place (no shared-memory round trip). P is split as
//   hi + lo, two 16-bit values (|P - hi - lo| <= 2^-16 P), and multiplied twice, so O keeps about the fp32
//   accuracy of the CUDA-core pass rather than P rounded to 8 bits; B = V tile rows (ldmatrix.trans).
#pragma once
#include "tiles.cuh"

__device__ __forceinline__ void ldsm_x4(unsigned (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldsm_x4_t(unsigned (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(p)));
}
// (x0, x1) -> one register of two 16-bit values, x0 in the low half (the lower k index of a fragment)
template <bool F16>
__device__ __forceinline__ unsigned pack2(float x0, float x1) {
  unsigned r;
  if (F16)
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(x1), "f"(x0));
  else
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(x1), "f"(x0));
  return r;
}
template <bool F16>
__device__ __forceinline__ float half_lo(unsigned r) {
  return F16 ? f16_to_f((u16)(r & 0xffff)) : __uint_as_float(r << 16);
}
template <bool F16>
__device__ __forceinline__ float half_hi(unsigned r) {
  return F16 ? f16_to_f((u16)(r >> 16)) : __uint_as_float(r & 0xffff0000u);
}
// hi + lo == (x0, x1) to 16 more bits
template <bool F16>
__device__ __forceinline__ void split2(float x0, float x1, unsigned& hi, unsigned& lo) {
  hi = pack2<F16>(x0, x1);
  lo = pack2<F16>(x0 - half_lo<F16>(hi), x1 - half_hi<F16>(hi));
}

template <int HD, bool F16>
__device__ __forceinline__ void attn_split_mma(const AttnArgs& a) {
  constexpr int TD = F16 ? DT_F16 : DT_BF16;
  constexpr int R = 16 * NW;
  constexpr int RS = KvTile<HD, TD>::RS;  // padded Q, K/V tile row (bytes): no bank conflicts
  constexpr int NKT = KT / 8;      // key n-tiles of S
  constexpr int NDT = HD / 8;      // dim n-tiles of O
  extern __shared__ __align__(16) unsigned char smem[];
  unsigned char* Qs = smem;               // [R][RS] q rows as given (16-bit)
  unsigned char* tiles = smem + R * RS;   // [2 stages][K, V][KT][RS]
  const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, g = lane >> 2, c4 = lane & 3;
  const int split = blockIdx.x, nsplit = gridDim.x;
  const CtaShare c(a, R);
  if (c.k0 >= c.k1) return c.write_empty(a);
  const int ntiles = (c.k1 - c.k0 + KT - 1) / KT;
  int nblk[KvTile<HD, TD>::KPT];
  kv_pipe_start<HD, TD, true>(a, c, tiles, ntiles, nblk);
  constexpr int QC = R * HD / 8 / NT, QB = QC < 8 ? QC : 8;  // Q chunks a thread; in flight at once
  static_assert(QC % QB == 0, "Q chunks per thread");
#pragma unroll
  for (int i0 = 0; i0 < QC; i0 += QB) {  // Q rows, 16-byte chunks, QB loads in flight; rows past nr are zeros
    uint4 v[QB];
#pragma unroll
    for (int u = 0; u < QB; ++u) {
      const int i = tid + NT * (i0 + u), r = i / (HD / 8), ch = i % (HD / 8);
      v[u] = r < c.nr ? *(const uint4*)((const u16*)a.q + (i64)c.orow(a, r) * HD + ch * 8) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < QB; ++u) {
      const int i = tid + NT * (i0 + u);
      *(uint4*)(Qs + (i / (HD / 8)) * RS + (i % (HD / 8)) * 16) = v[u];
    }
  }
  const int wr = 16 * w;           // the warp's first row
  const bool active = wr < c.nr;   // warp-uniform: a warp past the CTA's rows only loads and syncs
  int lo[2], lim[2];               // visible keys of the lane's rows wr + g and wr + g + 8
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = wr + g + 8 * h;
    if (r < c.nr) c.visible(a, r, lo[h], lim[h]);
    else lo[h] = lim[h] = 0;       // no visible key: p = 0, never stored
  }
  const float qscale = a.scale * 1.4426950408889634f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f}, o[NDT][4];
#pragma unroll
  for (int d = 0; d < NDT; ++d) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.f;
  for (int it = 0; it < ntiles; ++it) {
    const int j0 = c.k0 + it * KT;
    kv_pipe_next<HD, TD, true>(a, c, tiles, it, ntiles, j0, nblk);
    const unsigned char* Kt = tiles + (it & 1) * 2 * KT * RS;
    const unsigned char* Vt = Kt + KT * RS;
    if (active) {
      float s[NKT][4];  // (row g: keys 8j + 2c4, +1), (row g + 8: the same keys)
#pragma unroll
      for (int j = 0; j < NKT; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
      for (int kk = 0; kk < HD / 16; ++kk) {
        unsigned qa[4], kb[4];
        ldsm_x4(qa, Qs + (wr + (lane & 15)) * RS + (kk * 16 + (lane >> 4) * 8) * 2);
#pragma unroll
        for (int jp = 0; jp < NKT / 2; ++jp) {  // key n-tiles 2jp, 2jp + 1
          ldsm_x4(kb, Kt + (16 * jp + (lane >> 4) * 8 + (lane & 7)) * RS + (kk * 16 + ((lane >> 3) & 1) * 8) * 2);
          mma16816<F16>(s[2 * jp], qa[0], qa[1], qa[2], qa[3], kb[0], kb[1]);
          mma16816<F16>(s[2 * jp + 1], qa[0], qa[1], qa[2], qa[3], kb[2], kb[3]);
        }
      }
      float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int j = 0; j < NKT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int h = e >> 1, key = j0 + 8 * j + 2 * c4 + (e & 1);
          const float v = key < c.k1 && key >= lo[h] && key < lim[h] ? s[j][e] * qscale : -INFINITY;
          s[j][e] = v;
          mx[h] = fmaxf(mx[h], v);
        }
      float corr[2], mref[2], sum[2] = {0.f, 0.f};
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
        mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
        const float m_new = fmaxf(m[h], mx[h]);
        const bool none = m_new == -INFINITY;  // no visible key for this row yet
        corr[h] = none ? 1.f : exp2f(m[h] - m_new);
        mref[h] = none ? 0.f : m_new;
        m[h] = m_new;
      }
#pragma unroll
      for (int j = 0; j < NKT; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float p = exp2f(s[j][e] - mref[e >> 1]);  // masked: exp2(-inf) = 0
          s[j][e] = p;
          sum[e >> 1] += p;
        }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        sum[h] += __shfl_xor_sync(0xffffffffu, sum[h], 1);
        sum[h] += __shfl_xor_sync(0xffffffffu, sum[h], 2);
        l[h] = l[h] * corr[h] + sum[h];
      }
#pragma unroll
      for (int d = 0; d < NDT; ++d) o[d][0] *= corr[0], o[d][1] *= corr[0], o[d][2] *= corr[1], o[d][3] *= corr[1];
#pragma unroll
      for (int kk = 0; kk < KT / 16; ++kk) {  // keys 16kk..16kk+15: S tiles 2kk, 2kk+1 = P's A
        unsigned ph[4], pl[4], vb[4];
        split2<F16>(s[2 * kk][0], s[2 * kk][1], ph[0], pl[0]);
        split2<F16>(s[2 * kk][2], s[2 * kk][3], ph[1], pl[1]);
        split2<F16>(s[2 * kk + 1][0], s[2 * kk + 1][1], ph[2], pl[2]);
        split2<F16>(s[2 * kk + 1][2], s[2 * kk + 1][3], ph[3], pl[3]);
#pragma unroll
        for (int dp = 0; dp < NDT / 2; ++dp) {  // dim n-tiles 2dp, 2dp + 1
          ldsm_x4_t(vb, Vt + (16 * kk + ((lane >> 3) & 1) * 8 + (lane & 7)) * RS + (16 * dp + (lane >> 4) * 8) * 2);
          mma16816<F16>(o[2 * dp], ph[0], ph[1], ph[2], ph[3], vb[0], vb[1]);
          mma16816<F16>(o[2 * dp], pl[0], pl[1], pl[2], pl[3], vb[0], vb[1]);
          mma16816<F16>(o[2 * dp + 1], ph[0], ph[1], ph[2], ph[3], vb[2], vb[3]);
          mma16816<F16>(o[2 * dp + 1], pl[0], pl[1], pl[2], pl[3], vb[2], vb[3]);
        }
      }
    }
    __syncthreads();  // the next iteration's prefetch overwrites this stage
  }
  if (!active) return;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = wr + g + 8 * h;
    if (r >= c.nr) continue;
    const i64 row = c.orow(a, r);
    if (nsplit == 1) {
      const float inv = 1.f / l[h];
#pragma unroll
      for (int d = 0; d < NDT; ++d) {
        const i64 ob = row * HD + 8 * d + 2 * c4;
        stf(a.o, a.o_dt, ob, o[d][2 * h] * inv);
        stf(a.o, a.o_dt, ob + 1, o[d][2 * h + 1] * inv);
      }
    } else {
      float* dst = a.ws_acc + (row * nsplit + split) * HD + 2 * c4;
#pragma unroll
      for (int d = 0; d < NDT; ++d) *(float2*)(dst + 8 * d) = make_float2(o[d][2 * h], o[d][2 * h + 1]);
      if (c4 == 0) ((float2*)a.ws_ml)[row * nsplit + split] = make_float2(m[h], l[h]);
    }
  }
}
