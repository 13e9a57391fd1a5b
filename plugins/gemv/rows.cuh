// Weight-row streaming of MoE's decode path (moe/decode.cuh): one warp computes dot products of GEMV_RPW rows
// of a matrix w [*, K] with M <= MT rows of 16-bit x staged in shared memory, keeping U 16-byte loads per row
// in flight per lane before any FMA (the weights are the only large stream of a decode step, so what matters is
// the number of loads in flight). w is 16-bit (a chunk: 8 columns) or e4m3 with fp32 128x128 block scales (W8:
// a chunk is 16 columns; its 16 products sum unscaled in fp32, then acc += scale * partial, the gemv_fp8 rule).
#pragma once
#include "common.cuh"
#include "gemv_fp8/fp8_words.cuh"
#ifndef GEMV_WARPS
#error "GEMV_WARPS / GEMV_RPW come from moe/spec.py through NVRTC -D options"
#endif
// U: chunks (16 bytes) per lane per row and pass; a pass covers 32 * U * 8 columns. U = 8 (2048 columns) or
// U = 16 for K > 2048: a 2048-row out_proj of K 4096 has only ~8 warps per SM, so each must hold more loads.

template <bool F16>
__device__ __forceinline__ float2 pair16(unsigned u) {  // two packed 16-bit values -> float
  if (F16) return make_float2(f16_to_f((u16)(u & 0xffffu)), f16_to_f((u16)(u >> 16)));
  return make_float2(__uint_as_float(u << 16), __uint_as_float(u & 0xffff0000u));
}
template <bool F16>
__device__ __forceinline__ float dot8(uint4 a, uint4 b, float acc) {
  const unsigned av[4] = {a.x, a.y, a.z, a.w}, bv[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 p = pair16<F16>(av[i]), q = pair16<F16>(bv[i]);
    acc = fmaf(p.x, q.x, acc);
    acc = fmaf(p.y, q.y, acc);
  }
  return acc;
}
// 16 e4m3 columns (one 16-byte chunk) . the 16 columns of x at xp[0], xp[1], unscaled, fp32 (products exact).
template <bool F16>
__device__ __forceinline__ float dot16_fp8(uint4 q, const uint4* xp) {
  const float lo = dot8<F16>(fp8x8_to16<F16>(make_uint2(q.x, q.y)), xp[0], 0.f);
  return dot8<F16>(fp8x8_to16<F16>(make_uint2(q.z, q.w)), xp[1], lo);
}
template <int R, int U>
__device__ __forceinline__ void load_pass(uint4 (&wv)[R][U], const uint4* const (&wr)[R], int c0, int nch, int lane) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int c = c0 + u * 32 + lane;
#pragma unroll
    for (int r = 0; r < R; ++r) wv[r][u] = c < nch ? ld_stream(wr[r] + c) : make_uint4(0, 0, 0, 0);
  }
}

// acc[r][m] = w[row0 + r] . xs[m] for the R rows of wr (rows clamped to N-1: the caller stores only rows < N),
// fp32, reduced over the warp (every lane holds the sums). wv: the first pass's loads, issued by the caller
// BEFORE it staged xs and synchronised (so they overlap the staging). nch: w's 16-byte chunks a row (K / 8, W8:
// K / 16); xs [M][K / 8] 16-byte chunks. W8: srow[r] is row r's scale row (K / 128 blocks; ignored otherwise).
template <int MT, bool F16, int R, int U, bool W8 = false>
__device__ __forceinline__ void rows_dot(uint4 (&wv)[R][U], const uint4* const (&wr)[R], const uint4* __restrict__ xs,
                                         int M, int nch, int lane, float (&acc)[R][MT],
                                         const float* const (&srow)[R]) {
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int m = 0; m < MT; ++m) acc[r][m] = 0.f;
  for (int c0 = 0;;) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = c0 + u * 32 + lane;
      if (c >= nch) break;
      float sc[R];
#pragma unroll
      for (int r = 0; r < R; ++r) sc[r] = W8 ? __ldg(srow[r] + (c >> 3)) : 1.f;  // chunk c: columns 16c..16c+15
#pragma unroll
      for (int m = 0; m < MT; ++m) {
        if (m < M) {
          if (W8) {
            const uint4* xp = xs + m * 2 * nch + 2 * c;
#pragma unroll
            for (int r = 0; r < R; ++r) acc[r][m] = fmaf(sc[r], dot16_fp8<F16>(wv[r][u], xp), acc[r][m]);
          } else {
            const uint4 xv = xs[m * nch + c];
#pragma unroll
            for (int r = 0; r < R; ++r) acc[r][m] = dot8<F16>(wv[r][u], xv, acc[r][m]);
          }
        }
      }
    }
    c0 += 32 * U;
    if (c0 >= nch) break;
    load_pass(wv, wr, c0, nch, lane);
  }
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int m = 0; m < MT; ++m) acc[r][m] = warp_sum(acc[r][m]);
}

// Row `row` of w [*, K]: K 16-bit elements, or (W8) K bytes.
template <bool W8>
__device__ __forceinline__ const uint4* w_row(const void* w, i64 row, int K) {
  return W8 ? (const uint4*)((const unsigned char*)w + row * K) : (const uint4*)((const u16*)w + row * K);
}
// The warp's row pointers: rows row0.. of w [N, K] (clamped to N-1).
template <bool W8, int R>
__device__ __forceinline__ void row_ptrs(const uint4* (&wr)[R], const void* w, int row0, int N, int K) {
#pragma unroll
  for (int r = 0; r < R; ++r) wr[r] = w_row<W8>(w, min(row0 + r, N - 1), K);
}
