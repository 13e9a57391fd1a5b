// MoeExperts: routed SwiGLU experts as a grouped GEMM (spec.py says the grid; reference.py the math).
// A "pair" p = n*k + j is (token n, its j-th selected expert). moe_plan groups the pairs by expert; then one CTA
// per (row tile, active-expert slot) streams that expert's rows from HBM once and applies them to all its pairs.
// bf16 / fp16: mma.sync m16n8k16 with fp32 accumulate. The reduction index k is permuted inside each 32-column
// chunk (the same permutation for both operands, so the dot products are unchanged): thread (g, tq) of a warp
// loads 8 consecutive elements [8tq, 8tq+8) of a row with one 16-byte load; elements 0-3 feed the first
// k16 step, 4-7 the second. fp32: plain FMA (test / tiny-model path).
// FP8 weights (W8A16: e4m3 [E, rows, K] with fp32 block scales [E, rows/128, K/128], W = fp8 * scale of its
// 128x128 block; x 16-bit): the same tiles, passes and epilogue; a lane loads its 8 columns of a row as 8 bytes
// and fp8x8_to16 makes them the words a 16-bit row's 16-byte load gives. A warp's 32-column chunk lies in one
// 128-column scale block and a tile's 16 rows in one 128-row block, so each chunk's products go to a zeroed
// partial and acc += scale * partial: the unscaled fp8 values (exact in 16 bits) meet x on the tensor cores and
// each weight is scaled once in fp32, as gemv_fp8 does.
#include "common.cuh"
#include "gemv_fp8/fp8_words.cuh"
#ifndef MOE_WARPS
#error "MOE_WARPS / MOE_PASS come from moe/spec.py through NVRTC -D options"
#endif
#define NT (MOE_PASS / 8)  // 8-column mma tiles per pass
#define NTHREADS (MOE_WARPS * 32)

__device__ __forceinline__ int load_id(const void* idx, int idx64, int p) {
  return idx64 ? (int)((const i64*)idx)[p] : ((const int*)idx)[p];
}
__device__ __forceinline__ float silu(float v) { return v / (1.f + __expf(-v)); }

// ---- plan: counts -> offsets, active experts, pairs grouped by expert (one CTA of PLAN threads) -------------
// act_e/act_off/act_cnt [M]: slot j < n_active holds the j-th expert (ascending id) that any pair chose;
// slots past n_active get count 0. entries [P]: pair ids, expert e's at [act_off, act_off + act_cnt).
extern "C" __global__ void __launch_bounds__(1024) moe_plan(
    const void* __restrict__ idx, int idx64, int P, int E, int M, int* __restrict__ act_e,
    int* __restrict__ act_off, int* __restrict__ act_cnt, int* __restrict__ entries) {
  extern __shared__ int sm[];
  int* cnt = sm;      // [E]
  int* pos = sm + E;  // [E] next free entry of expert e
  __shared__ int wc[32], wa[32], carry[2];
  const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, nw = blockDim.x >> 5;
  for (int e = tid; e < E; e += blockDim.x) cnt[e] = 0;
  if (tid == 0) carry[0] = carry[1] = 0;
  __syncthreads();
  for (int p = tid; p < P; p += blockDim.x) {
    const int e = load_id(idx, idx64, p);
    if (e >= 0 && e < E) atomicAdd(&cnt[e], 1);
  }
  __syncthreads();
  for (int base = 0; base < E; base += blockDim.x) {  // exclusive scans of cnt and of (cnt > 0)
    const int e = base + tid, c = e < E ? cnt[e] : 0, a = c > 0;
    int ic = c, ia = a;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int x = __shfl_up_sync(0xffffffffu, ic, o), y = __shfl_up_sync(0xffffffffu, ia, o);
      if (lane >= o) { ic += x; ia += y; }
    }
    if (lane == 31) { wc[w] = ic; wa[w] = ia; }
    __syncthreads();
    if (w == 0) {
      int x = lane < nw ? wc[lane] : 0, y = lane < nw ? wa[lane] : 0;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int xx = __shfl_up_sync(0xffffffffu, x, o), yy = __shfl_up_sync(0xffffffffu, y, o);
        if (lane >= o) { x += xx; y += yy; }
      }
      if (lane < nw) { wc[lane] = x; wa[lane] = y; }
    }
    __syncthreads();
    const int xc = carry[0] + (w ? wc[w - 1] : 0) + ic - c;
    const int xa = carry[1] + (w ? wa[w - 1] : 0) + ia - a;
    if (e < E) {
      pos[e] = xc;
      if (a) { act_e[xa] = e; act_off[xa] = xc; act_cnt[xa] = c; }
    }
    __syncthreads();
    if (tid == 0) { carry[0] += wc[nw - 1]; carry[1] += wa[nw - 1]; }
    __syncthreads();
  }
  for (int j = carry[1] + tid; j < M; j += blockDim.x) { act_e[j] = 0; act_off[j] = 0; act_cnt[j] = 0; }
  for (int p = tid; p < P; p += blockDim.x) {
    const int e = load_id(idx, idx64, p);
    if (e >= 0 && e < E) entries[atomicAdd(&pos[e], 1)] = p;
  }
}

// ---- the grouped GEMM CTA: 32 weight rows (two 16-row tiles at row0 / row1) x the expert's pairs -------------
// KIND 0 (gate_up): B row of pair p = x[p / k] (K = H); tile 0 = gate rows i0.., tile 1 = up rows I+i0..;
//   epilogue h[p, i0 + r] = silu(gate) * up in x's dtype.
// KIND 1 (down): B row of pair p = h[p] (K = I); rows r0..r0+31 of down; epilogue y[p, r0 + r] fp32.
struct Plan {
  const int *act_e, *act_off, *act_cnt, *entries;
};

template <int KIND>
__device__ __forceinline__ void row_bases(int tile, int I, int& r0, int& r1) {
  if (KIND == 0) { r0 = tile * 16; r1 = I + tile * 16; }
  else { r0 = tile * 32; r1 = tile * 32 + 16; }
}

// Columns [k, k + 8) of a weight row as four words of 16-bit pairs: one 16-byte load (16-bit weights) or one
// 8-byte load converted (W8: e4m3). row: the row's element at this lane's first column.
template <bool W8, bool F16>
__device__ __forceinline__ uint4 load_cols8(const void* row, int k) {
  if constexpr (W8) return fp8x8_to16<F16>(*(const uint2*)((const unsigned char*)row + k));
  else return *(const uint4*)((const u16*)row + k);
}
template <bool W8>
__device__ __forceinline__ const void* weight_at(const void* W, i64 i) {
  return W8 ? (const void*)((const unsigned char*)W + i) : (const void*)((const u16*)W + i);
}

// One 32-column chunk of both 16-row tiles against one 8-column tile of B: two k16 steps each (the permutation
// above: words x, y the first, z, w the second).
template <bool F16>
__device__ __forceinline__ void mma_chunk(float (&d0)[4], float (&d1)[4], const uint4& a00, const uint4& a01,
                                          const uint4& a10, const uint4& a11, const uint4& b) {
  mma16816<F16>(d0, a00.x, a01.x, a00.y, a01.y, b.x, b.y);
  mma16816<F16>(d0, a00.z, a01.z, a00.w, a01.w, b.z, b.w);
  mma16816<F16>(d1, a10.x, a11.x, a10.y, a11.y, b.x, b.y);
  mma16816<F16>(d1, a10.z, a11.z, a10.w, a11.w, b.z, b.w);
}

// W [E, rows, K] in B's 16-bit dtype, or e4m3 with scale [E, rows/128, K/128] (W8); B rows 16-bit; out: h (KIND 0,
// B's dtype, [P, I]) or y (KIND 1, fp32, [P, H]).
template <int KIND, bool F16, bool W8>
__device__ __forceinline__ void gemm_mma(const void* __restrict__ W, const float* __restrict__ scale, int rows, int K,
                                         const u16* __restrict__ B, int topk, int I, Plan pl, void* __restrict__ out,
                                         int out_ld) {
  const int j = blockIdx.y, cnt = pl.act_cnt[j];
  if (cnt == 0) return;  // slot past the active experts (uniform per CTA)
  const int e = pl.act_e[j], off = pl.act_off[j];
  int r0, r1;
  row_bases<KIND>(blockIdx.x, I, r0, r1);
  const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, g = lane >> 2, tq = lane & 3;
  const void* w00 = weight_at<W8>(W, ((i64)e * rows + r0 + g) * K + tq * 8);
  const void* w01 = weight_at<W8>(W, ((i64)e * rows + r0 + g + 8) * K + tq * 8);
  const void* w10 = weight_at<W8>(W, ((i64)e * rows + r1 + g) * K + tq * 8);
  const void* w11 = weight_at<W8>(W, ((i64)e * rows + r1 + g + 8) * K + tq * 8);
  const int kb = K >> 7;  // W8: scale blocks per row of blocks; the tiles' rows of scales
  const float* s0row = W8 ? scale + ((i64)e * (rows >> 7) + (r0 >> 7)) * kb : nullptr;
  const float* s1row = W8 ? scale + ((i64)e * (rows >> 7) + (r1 >> 7)) * kb : nullptr;
  __shared__ float red[MOE_WARPS][2 * NT * 4][32];
  __shared__ int ent[MOE_PASS];
  for (int t0 = 0; t0 < cnt; t0 += MOE_PASS) {
    const int nt = min(NT, (cnt - t0 + 7) >> 3);
    if (tid < MOE_PASS) ent[tid] = t0 + tid < cnt ? pl.entries[off + t0 + tid] : -1;
    __syncthreads();
    const u16* brow[NT];
#pragma unroll
    for (int n = 0; n < NT; ++n) {
      const int p = ent[n * 8 + g];
      brow[n] = p < 0 ? nullptr : B + (i64)(KIND == 0 ? p / topk : p) * K + tq * 8;
    }
    float acc[2][NT][4];
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
      for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[m][n][c] = 0.f;
#pragma unroll 2
    for (int k0 = w * 32; k0 < K; k0 += MOE_WARPS * 32) {
      const uint4 a00 = load_cols8<W8, F16>(w00, k0), a01 = load_cols8<W8, F16>(w01, k0);
      const uint4 a10 = load_cols8<W8, F16>(w10, k0), a11 = load_cols8<W8, F16>(w11, k0);
      const float s0 = W8 ? __ldg(s0row + (k0 >> 7)) : 1.f, s1 = W8 ? __ldg(s1row + (k0 >> 7)) : 1.f;
#pragma unroll
      for (int n = 0; n < NT; ++n) {
        if (n < nt) {
          const uint4 b = brow[n] ? *(const uint4*)(brow[n] + k0) : make_uint4(0, 0, 0, 0);
          if constexpr (W8) {  // this chunk's products, scaled into acc
            float p0[4] = {0.f, 0.f, 0.f, 0.f}, p1[4] = {0.f, 0.f, 0.f, 0.f};
            mma_chunk<F16>(p0, p1, a00, a01, a10, a11, b);
#pragma unroll
            for (int c = 0; c < 4; ++c) {
              acc[0][n][c] = fmaf(s0, p0[c], acc[0][n][c]);
              acc[1][n][c] = fmaf(s1, p1[c], acc[1][n][c]);
            }
          } else {
            mma_chunk<F16>(acc[0][n], acc[1][n], a00, a01, a10, a11, b);
          }
        }
      }
    }
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
      for (int n = 0; n < NT; ++n)
#pragma unroll
        for (int c = 0; c < 4; ++c) red[w][(m * NT + n) * 4 + c][lane] = acc[m][n][c];
    __syncthreads();
    // C fragment: c0,c1 = (row g, cols 2tq, 2tq+1), c2,c3 = (row g+8, same cols); value v = (n*4 + c)*32 + lane
    for (int v = tid; v < NT * 4 * 32; v += NTHREADS) {
      const int ln = v & 31, c = (v >> 5) & 3, n = v >> 7;
      const int col = n * 8 + 2 * (ln & 3) + (c & 1), r = (ln >> 2) + (c & 2 ? 8 : 0);
      const int p = ent[col];
      if (p < 0) continue;
      float a = 0.f, b = 0.f;
#pragma unroll
      for (int ww = 0; ww < MOE_WARPS; ++ww) {
        a += red[ww][n * 4 + c][ln];
        b += red[ww][(NT + n) * 4 + c][ln];
      }
      if (KIND == 0) {
        const float hv = silu(a) * b;
        u16 hb;
        if (F16) asm("cvt.rn.f16.f32 %0, %1;" : "=h"(hb) : "f"(hv));
        else hb = f_to_bf16(hv);
        ((u16*)out)[(i64)p * out_ld + r0 + r] = hb;
      } else {
        ((float*)out)[(i64)p * out_ld + r0 + r] = a;
        ((float*)out)[(i64)p * out_ld + r1 + r] = b;
      }
    }
    __syncthreads();  // red / ent reused by the next pass
  }
}

// fp32: warp w owns 4 of the CTA's 32 rows (local row l < 16 -> row0 + l, else row1 + l - 16), lanes stride K;
// 8 pairs per pass.
template <int KIND>
__device__ __forceinline__ void gemm_f32(const float* __restrict__ W, int rows, int K, const float* __restrict__ B,
                                         int topk, int I, Plan pl, float* __restrict__ out, int out_ld) {
  const int j = blockIdx.y, cnt = pl.act_cnt[j];
  if (cnt == 0) return;
  const int e = pl.act_e[j], off = pl.act_off[j];
  int r0, r1;
  row_bases<KIND>(blockIdx.x, I, r0, r1);
  const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
  __shared__ float res[32][9];
  __shared__ int ent[8];
  const float* wr[4];
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const int l = w * 4 + q;
    wr[q] = W + ((i64)e * rows + (l < 16 ? r0 + l : r1 + l - 16)) * K;
  }
  for (int t0 = 0; t0 < cnt; t0 += 8) {
    if (tid < 8) ent[tid] = t0 + tid < cnt ? pl.entries[off + t0 + tid] : -1;
    __syncthreads();
    const float* br[8];
#pragma unroll
    for (int t = 0; t < 8; ++t) {
      const int p = ent[t];
      br[t] = p < 0 ? nullptr : B + (i64)(KIND == 0 ? p / topk : p) * K;
    }
    float acc[4][8];
#pragma unroll
    for (int q = 0; q < 4; ++q)
#pragma unroll
      for (int t = 0; t < 8; ++t) acc[q][t] = 0.f;
    for (int k = lane; k < K; k += 32) {
      float wv[4];
#pragma unroll
      for (int q = 0; q < 4; ++q) wv[q] = wr[q][k];
#pragma unroll
      for (int t = 0; t < 8; ++t) {
        if (br[t]) {
          const float b = br[t][k];
#pragma unroll
          for (int q = 0; q < 4; ++q) acc[q][t] = fmaf(wv[q], b, acc[q][t]);
        }
      }
    }
#pragma unroll
    for (int q = 0; q < 4; ++q)
#pragma unroll
      for (int t = 0; t < 8; ++t) {
        const float s = warp_sum(acc[q][t]);
        if (lane == 0) res[w * 4 + q][t] = s;
      }
    __syncthreads();
    {
      const int l = tid >> 3, t = tid & 7, p = ent[t];  // NTHREADS = 256 = 32 rows x 8 pairs
      if (p >= 0) {
        if (KIND == 0) {
          if (l < 16) out[(i64)p * out_ld + r0 + l] = silu(res[l][t]) * res[l + 16][t];
        } else {
          out[(i64)p * out_ld + (l < 16 ? r0 + l : r1 + l - 16)] = res[l][t];
        }
      }
    }
    __syncthreads();
  }
}

#define PLAN_ARGS const int *act_e, const int *act_off, const int *act_cnt, const int *entries
#define PLAN_OF Plan{act_e, act_off, act_cnt, entries}

// gate_up [E, 2I, H]; x [N, H]; h [P, I] (x's dtype). Grid (I/16, M).
#define MOE_GATE_UP_MMA(NAME, F16)                                                                            \
  extern "C" __global__ void __launch_bounds__(NTHREADS) NAME(                                               \
      const u16* gate_up, const u16* x, int H, int I, int topk, PLAN_ARGS, u16* h) {                         \
    gemm_mma<0, F16, false>(gate_up, nullptr, 2 * I, H, x, topk, I, PLAN_OF, h, I);                          \
  }
// down [E, H, I]; h [P, I]; y [P, H] fp32. Grid (H/32, M).
#define MOE_DOWN_MMA(NAME, F16)                                                                               \
  extern "C" __global__ void __launch_bounds__(NTHREADS) NAME(                                               \
      const u16* down, const u16* h, int H, int I, int topk, PLAN_ARGS, float* y) {                          \
    gemm_mma<1, F16, false>(down, nullptr, H, I, h, topk, I, PLAN_OF, y, H);                                 \
  }
MOE_GATE_UP_MMA(moe_gate_up_bf16, false)
MOE_GATE_UP_MMA(moe_gate_up_f16, true)
MOE_DOWN_MMA(moe_down_bf16, false)
MOE_DOWN_MMA(moe_down_f16, true)

// FP8 experts (W8A16): gate_up [E, 2I, H] e4m3 + scale [E, 2I/128, H/128]; down [E, H, I] e4m3 + scale
// [E, H/128, I/128]; H and I multiples of 128 (spec.check_fp8). Grids as above.
#define MOE_FP8(SFX, F16)                                                                                     \
  extern "C" __global__ void __launch_bounds__(NTHREADS) moe_gate_up_fp8_##SFX(                             \
      const unsigned char* gate_up, const float* scale, const u16* x, int H, int I, int topk, PLAN_ARGS,      \
      u16* h) {                                                                                              \
    gemm_mma<0, F16, true>(gate_up, scale, 2 * I, H, x, topk, I, PLAN_OF, h, I);                             \
  }                                                                                                          \
  extern "C" __global__ void __launch_bounds__(NTHREADS) moe_down_fp8_##SFX(                                \
      const unsigned char* down, const float* scale, const u16* h, int H, int I, int topk, PLAN_ARGS,         \
      float* y) {                                                                                            \
    gemm_mma<1, F16, true>(down, scale, H, I, h, topk, I, PLAN_OF, y, H);                                    \
  }
MOE_FP8(bf16, false)
MOE_FP8(f16, true)

extern "C" __global__ void __launch_bounds__(NTHREADS) moe_gate_up_f32(
    const float* gate_up, const float* x, int H, int I, int topk, PLAN_ARGS, float* h) {
  gemm_f32<0>(gate_up, 2 * I, H, x, topk, I, PLAN_OF, h, I);
}
extern "C" __global__ void __launch_bounds__(NTHREADS) moe_down_f32(
    const float* down, const float* h, int H, int I, int topk, PLAN_ARGS, float* y) {
  gemm_f32<1>(down, H, I, h, topk, I, PLAN_OF, y, H);
}

// y[n, c] = sum_j w[n, j] * y_pair[n*k + j, c] (j ascending; pairs with an id outside [0, E) add nothing).
// Grid (ceil(H / 256), N), 256 threads.
extern "C" __global__ void __launch_bounds__(256) moe_combine(
    const float* __restrict__ y_pair, const void* __restrict__ idx, int idx64, const void* __restrict__ w, int w_dt,
    int H, int topk, int E, void* __restrict__ out, int out_dt) {
  const int n = blockIdx.y, c = blockIdx.x * 256 + threadIdx.x;
  if (c >= H) return;
  float s = 0.f;
  for (int jj = 0; jj < topk; ++jj) {
    const int p = n * topk + jj, e = load_id(idx, idx64, p);
    if (e >= 0 && e < E) s += ldf(w, w_dt, p) * y_pair[(i64)p * H + c];
  }
  stf(out, out_dt, (i64)n * H + c, s);
}

// ---- router (route.cuh): softmax in fp32 -> the k largest probabilities -> renormalised when norm -------------
#include "moe/route.cuh"

// ---- decode path (N <= spec.DECODE_TOKENS): per-pair weight streaming (decode.cuh) ---------------------------------
#include "gemv/rows.cuh"
#include "decode.cuh"
