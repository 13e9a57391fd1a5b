// Skinny GEMM of decode steps: y[m, n] = sum_k x[m, k] w[n, k] for M <= 4 rows of x (spec.py).
// The weights are the only large stream, so the kernel is organised around keeping many 16-byte
// loads of w in flight: x (M rows) is staged once per CTA in shared memory; warp w streams
// ROWS_PER_WARP rows of w; each lane loads U chunks of 8 elements per row before any FMA (16 loads
// in flight per lane), then the warp reduces its partial dot products with shuffles.
#include "common.cuh"
#ifndef GEMV_WARPS
#error "GEMV_WARPS / GEMV_RPW come from gemv/spec.py through NVRTC -D options"
#endif
#define U 8  // chunks per lane per row and pass: a pass covers 32 * U * 8 = 2048 columns

__device__ __forceinline__ uint4 ld_stream(const void* p) {  // read once: keep it out of L1
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
template <bool F16>
__device__ __forceinline__ float2 pair(unsigned u) {  // two packed 16-bit values -> float
  if (F16) return make_float2(f16_to_f((u16)(u & 0xffffu)), f16_to_f((u16)(u >> 16)));
  return make_float2(__uint_as_float(u << 16), __uint_as_float(u & 0xffff0000u));
}
template <bool F16>
__device__ __forceinline__ float dot8(uint4 a, uint4 b, float acc) {
  const unsigned av[4] = {a.x, a.y, a.z, a.w}, bv[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 p = pair<F16>(av[i]), q = pair<F16>(bv[i]);
    acc = fmaf(p.x, q.x, acc);
    acc = fmaf(p.y, q.y, acc);
  }
  return acc;
}

__device__ __forceinline__ void load_pass(uint4 (&wv)[GEMV_RPW][U], const uint4* const (&wr)[GEMV_RPW], int c0,
                                          int nch, int lane) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int c = c0 + u * 32 + lane;
#pragma unroll
    for (int r = 0; r < GEMV_RPW; ++r) wv[r][u] = c < nch ? ld_stream(wr[r] + c) : make_uint4(0, 0, 0, 0);
  }
}

// Grid: ceil(N / (GEMV_WARPS * GEMV_RPW)) CTAs of GEMV_WARPS warps; dynamic smem: M * K * 2 bytes.
// Rows past N re-read row N-1 (no early exit: every thread reaches the barrier) and store nothing.
template <int MT, bool F16>
__device__ __forceinline__ void gemv_body(const u16* __restrict__ w, const u16* __restrict__ x,
                                          u16* __restrict__ y, int M, int N, int K) {
  extern __shared__ uint4 xs[];  // [M][K / 8]
  const int nch = K >> 3, tid = threadIdx.x, lane = tid & 31;
  const int row0 = (blockIdx.x * GEMV_WARPS + (tid >> 5)) * GEMV_RPW;
  const uint4* wr[GEMV_RPW];
#pragma unroll
  for (int r = 0; r < GEMV_RPW; ++r) wr[r] = (const uint4*)(w + (i64)min(row0 + r, N - 1) * K);
  uint4 wv[GEMV_RPW][U];
  load_pass(wv, wr, 0, nch, lane);  // the first weight loads fly while x is staged
  for (int i = tid; i < M * nch; i += GEMV_WARPS * 32) xs[i] = ((const uint4*)x)[i];
  __syncthreads();
  float acc[GEMV_RPW][MT];
#pragma unroll
  for (int r = 0; r < GEMV_RPW; ++r)
#pragma unroll
    for (int m = 0; m < MT; ++m) acc[r][m] = 0.f;
  for (int c0 = 0;;) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = c0 + u * 32 + lane;
      if (c >= nch) break;
#pragma unroll
      for (int m = 0; m < MT; ++m) {
        if (m < M) {
          const uint4 xv = xs[m * nch + c];
#pragma unroll
          for (int r = 0; r < GEMV_RPW; ++r) acc[r][m] = dot8<F16>(wv[r][u], xv, acc[r][m]);
        }
      }
    }
    c0 += 32 * U;
    if (c0 >= nch) break;
    load_pass(wv, wr, c0, nch, lane);
  }
#pragma unroll
  for (int r = 0; r < GEMV_RPW; ++r)
#pragma unroll
    for (int m = 0; m < MT; ++m) {
      const float s = warp_sum(acc[r][m]);
      if (lane == 0 && m < M && row0 + r < N) y[(i64)m * N + row0 + r] = F16 ? f_to_f16(s) : f_to_bf16(s);
    }
}

#define GEMV(NAME, MT, F16)                                                                               \
  extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32) NAME(const u16* w, const u16* x, u16* y, \
                                                                     int M, int N, int K) {            \
    gemv_body<MT, F16>(w, x, y, M, N, K);                                                                \
  }
GEMV(gemv_m1_bf16, 1, false)
GEMV(gemv_m4_bf16, 4, false)
GEMV(gemv_m1_f16, 1, true)
GEMV(gemv_m4_f16, 4, true)
