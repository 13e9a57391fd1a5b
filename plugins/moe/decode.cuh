// MoeExperts for a decode step (N <= spec.DECODE_TOKENS tokens, 16-bit): every (token, k) pair p is a GEMV over
// its expert's rows, streamed as the dense decode projections are (gemv/rows.cuh), instead of the grouped GEMM's
// plan + tensor-core tiles. At N*k <= 32 pairs the experts rarely repeat, and the grouped kernels' fixed costs
// (plan launch, 32-row CTAs with few k-steps each, smem reduction) made them run at half the HBM rate.
// moe_dec_gate_up -> gu [P, 2I] fp32; moe_dec_down -> y_pair [P, H] fp32 (h = silu(g)*u rounded to x's dtype
// once, as the grouped path's epilogue does); then moe_combine as in the grouped path. Pairs with an expert id
// outside [0, E) are skipped here and dropped by moe_combine.
#pragma once
#include "gemv/rows.cuh"

// Grid (ceil(2I / (GEMV_WARPS * GEMV_RPW)), P); dynamic smem H * 2 bytes (the pair's token row of x).
template <bool F16>
__device__ __forceinline__ void dec_gate_up(const u16* __restrict__ gate_up, const u16* __restrict__ x,
                                            const void* __restrict__ idx, int idx64, int topk, int E, int H, int I,
                                            float* __restrict__ gu) {
  extern __shared__ uint4 xs[];
  const int p = blockIdx.y, e = load_id(idx, idx64, p);
  if (e < 0 || e >= E) return;  // uniform per CTA
  const int nch = H >> 3, tid = threadIdx.x, lane = tid & 31, rows = 2 * I;
  const int row0 = (blockIdx.x * GEMV_WARPS + (tid >> 5)) * GEMV_RPW;
  const uint4* wr[GEMV_RPW];
  row_ptrs(wr, gate_up + (i64)e * rows * H, row0, rows, H);
  uint4 wv[GEMV_RPW][8];
  load_pass(wv, wr, 0, nch, lane);
  const uint4* xr = (const uint4*)(x + (i64)(p / topk) * H);
  for (int i = tid; i < nch; i += GEMV_WARPS * 32) xs[i] = xr[i];
  __syncthreads();
  float acc[GEMV_RPW][1];
  rows_dot<1, F16, 8>(wv, wr, xs, 1, nch, lane, acc);
#pragma unroll
  for (int r = 0; r < GEMV_RPW; ++r)
    if (lane == 0 && row0 + r < rows) gu[(i64)p * rows + row0 + r] = acc[r][0];
}

// Grid (ceil(H / (GEMV_WARPS * GEMV_RPW)), P); dynamic smem I * 2 bytes (the pair's h).
template <bool F16>
__device__ __forceinline__ void dec_down(const u16* __restrict__ down, const float* __restrict__ gu,
                                         const void* __restrict__ idx, int idx64, int E, int H, int I,
                                         float* __restrict__ y_pair) {
  extern __shared__ uint4 hs[];
  const int p = blockIdx.y, e = load_id(idx, idx64, p);
  if (e < 0 || e >= E) return;
  const int nch = I >> 3, tid = threadIdx.x, lane = tid & 31;
  const int row0 = (blockIdx.x * GEMV_WARPS + (tid >> 5)) * GEMV_RPW;
  const uint4* wr[GEMV_RPW];
  row_ptrs(wr, down + (i64)e * H * I, row0, H, I);
  uint4 wv[GEMV_RPW][8];
  load_pass(wv, wr, 0, nch, lane);
  u16* h = (u16*)hs;
  const float* g = gu + (i64)p * 2 * I;
  for (int i = tid; i < I; i += GEMV_WARPS * 32) {
    const float v = silu(g[i]) * g[I + i];
    h[i] = F16 ? f_to_f16(v) : f_to_bf16(v);
  }
  __syncthreads();
  float acc[GEMV_RPW][1];
  rows_dot<1, F16, 8>(wv, wr, hs, 1, nch, lane, acc);
#pragma unroll
  for (int r = 0; r < GEMV_RPW; ++r)
    if (lane == 0 && row0 + r < H) y_pair[(i64)p * H + row0 + r] = acc[r][0];
}

#define MOE_DEC(SFX, F16)                                                                                    \
  extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32) moe_dec_gate_up_##SFX(                      \
      const u16* gate_up, const u16* x, const void* idx, int idx64, int topk, int E, int H, int I, float* gu) { \
    dec_gate_up<F16>(gate_up, x, idx, idx64, topk, E, H, I, gu);                                             \
  }                                                                                                          \
  extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32) moe_dec_down_##SFX(                         \
      const u16* down, const float* gu, const void* idx, int idx64, int E, int H, int I, float* y_pair) {     \
    dec_down<F16>(down, gu, idx, idx64, E, H, I, y_pair);                                                    \
  }
MOE_DEC(bf16, false)
MOE_DEC(f16, true)
