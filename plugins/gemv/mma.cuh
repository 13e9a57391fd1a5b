// Skinny GEMM on tensor cores for decode and verify steps: y[m, n] = sum_k x[m, k] w[n, k] for M <= 16 rows of
// x, one kernel body for every M (spec.py says why: a row's sums must not depend on how many rows came with it).
//
// A CTA owns 16 rows of w (one m16 tile of mma.m16n8k16, w as the row-major A operand) and the M rows of x (the
// col-major B operand: 8 rows of x per n-tile, NT = 1 or 2 tiles). Its W warps split K into 32-column
// chunks (warp j takes chunks j*U .. j*U+U-1, then the next pass W*U further on) and the partial sums
// meet in shared memory, added in warp order: fixed, so a row's result depends only on (N, K).
//
// Column permutation: lane (g = lane/4, c = lane%4) loads ONE 16-byte vector per chunk per operand row: columns
// 8c..8c+7 of w rows g and g+8 and of x row g (and g+8 when NT = 2). mma step 1 takes words .x/.y of them,
// step 2 words .z/.w; the A and B fragments then hold the same physical columns at every logical k slot, so
// the two steps sum all 32 columns once (a sum over k does not care in which order the columns are visited).
#pragma once
#include "common.cuh"

// Lane (g, c)'s row pointers into the tile of w from row n0: rows n0 + g and n0 + g + 8 (clamped to N-1).
// SWIGLU (w = [gate; up], N/2 rows each): gate row n0 + g and its up row N/2 + n0 + g (clamped to N/2-1 and N-1).
template <bool SWIGLU>
__device__ __forceinline__ void mma_rows(const uint4*& wg, const uint4*& wh, const u16* w, int n0, int N, int K) {
  const int g = (threadIdx.x & 31) >> 2, c = threadIdx.x & 3;
  if constexpr (SWIGLU) {
    const int r = min(n0 + g, N / 2 - 1);
    wg = (const uint4*)(w + (i64)r * K) + c;
    wh = (const uint4*)(w + (i64)(N / 2 + r) * K) + c;
  } else {
    wg = (const uint4*)(w + (i64)min(n0 + g, N - 1) * K) + c;
    wh = (const uint4*)(w + (i64)min(n0 + g + 8, N - 1) * K) + c;
  }
}

// Slots u0 .. u1-1 of a pass of a lane's loads: chunks ch0 + u (32 columns each) of its rows g, g+8 of the tile
// of w and rows g (, g+8) of x; vectors past K (nv = K / 8) and rows of x past M are zeros. x through the read-only
// path (__ldg: what __restrict__ gave when the pointers were kernel arguments; x is an earlier kernel's output).
template <int U>
__device__ __forceinline__ void mma_load_w(uint4 (&a)[U], uint4 (&b)[U], const uint4* wg, const uint4* wh, int ch0,
                                           int nv, int u0 = 0, int u1 = U) {
  const uint4 zero = make_uint4(0, 0, 0, 0);
  const int c = threadIdx.x & 3;
#pragma unroll
  for (int u = u0; u < u1; ++u) {
    const int v = (ch0 + u) * 4;
    const bool ok = v + c < nv;
    a[u] = ok ? ld_stream(wg + v) : zero;
    b[u] = ok ? ld_stream(wh + v) : zero;
  }
}
template <int NT, int U>
__device__ __forceinline__ void mma_load_x(uint4 (&xv)[NT][U], const uint4* const (&xr)[NT], const bool (&xok)[NT],
                                           int ch0, int nv, int u0 = 0, int u1 = U) {
  const uint4 zero = make_uint4(0, 0, 0, 0);
  const int c = threadIdx.x & 3;
#pragma unroll
  for (int u = u0; u < u1; ++u) {
    const int v = (ch0 + u) * 4;
#pragma unroll
    for (int t = 0; t < NT; ++t) xv[t][u] = v + c < nv && xok[t] ? __ldg(xr[t] + v) : zero;
  }
}
template <int NT, int U>
__device__ __forceinline__ void mma_load(uint4 (&a)[U], uint4 (&b)[U], uint4 (&xv)[NT][U], const uint4* wg,
                                         const uint4* wh, const uint4* const (&xr)[NT], const bool (&xok)[NT], int ch0,
                                         int nv, int u0 = 0, int u1 = U) {
  mma_load_w<U>(a, b, wg, wh, ch0, nv, u0, u1);
  mma_load_x<NT, U>(xv, xr, xok, ch0, nv, u0, u1);
}

// silu(gate) * up of two of the GEMM's fp32 sums, rounded as eager torch rounds F.silu(gate) * up of the 16-bit
// projections: each sum to 16 bits, silu in fp32 (expf, not the fast exp) to 16 bits, the product to 16 bits.
template <bool F16>
__device__ __forceinline__ u16 swiglu_out(float gs, float us) {
  auto r16 = [](float v) { return F16 ? f16_to_f(f_to_f16(v)) : bf16_to_f(f_to_bf16(v)); };
  const float g = r16(gs), s = r16(g / (1.f + expf(-g))), p = s * r16(us);
  return F16 ? f_to_f16(p) : f_to_bf16(p);
}

// The 16-bit weight stream of mma_body (its Stream): a lane's rows of w and x, its U slots of loads in flight, and
// a slot's two mma steps (the column permutation above). gemv_fp8/mma_fp8.cuh is the FP8 one; the interface:
//   rows(n0)            point the lane at the tile of output rows from n0 (mma_rows)
//   load_w / load_x / load(ch0, u0, u1)   slots u0 .. u1-1 of the pass from chunk ch0 (zeros past K or M)
//   mma(u, acc)         slot u's products added to acc (D fragments, fp32)
//   nv                  16-byte vectors of w a row: chunk ch (4 vectors a row) exists while ch * 4 < nv
template <int NT, bool F16, int U, bool SWIGLU>
struct MmaW16 {
  const u16* w;
  int N, K, nv;
  const uint4 *wg, *wh, *xr[NT];
  bool xok[NT];
  uint4 a[U], b[U], xv[NT][U];
  __device__ __forceinline__ MmaW16(const u16* w_, const u16* x, int M, int N_, int K_) : w(w_), N(N_), K(K_) {
    const int g = (threadIdx.x & 31) >> 2, c = threadIdx.x & 3;
    nv = K >> 3;
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      xok[t] = t * 8 + g < M;
      xr[t] = (const uint4*)(x + (i64)min(t * 8 + g, M - 1) * K) + c;
    }
  }
  __device__ __forceinline__ void rows(int n0) { mma_rows<SWIGLU>(wg, wh, w, n0, N, K); }
  __device__ __forceinline__ void scale_rows(int) {}  // 16-bit weights carry no scales (bulk.cuh calls both)
  __device__ __forceinline__ void load_scales(int, int, int) {}
  __device__ __forceinline__ void load_w(int ch0, int u0, int u1) { mma_load_w<U>(a, b, wg, wh, ch0, nv, u0, u1); }
  __device__ __forceinline__ void load_x(int ch0, int u0, int u1) { mma_load_x<NT, U>(xv, xr, xok, ch0, nv, u0, u1); }
  __device__ __forceinline__ void load(int ch0, int u0, int u1) {
    mma_load<NT, U>(a, b, xv, wg, wh, xr, xok, ch0, nv, u0, u1);
  }
  __device__ __forceinline__ void mma(int u, float (&acc)[NT][4]) {
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      mma16816<F16>(acc[t], a[u].x, b[u].x, a[u].y, b[u].y, xv[t][u].x, xv[t][u].y);
      mma16816<F16>(acc[t], a[u].z, b[u].z, a[u].w, b[u].w, xv[t][u].z, xv[t][u].w);
    }
  }
};

// A warp's D fragments into its partial tile: d0, d1 = (row of w g, rows of x 2c, 2c+1); d2, d3 = (row of w g + 8,
// same rows of x).
template <int NT, int W>
__device__ __forceinline__ void mma_store_part(float (&part)[W][NT * 8][17], const float (&acc)[NT][4]) {
  const int warp = threadIdx.x >> 5, g = (threadIdx.x & 31) >> 2, c = threadIdx.x & 3;
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    part[warp][t * 8 + 2 * c][g] = acc[t][0];
    part[warp][t * 8 + 2 * c + 1][g] = acc[t][1];
    part[warp][t * 8 + 2 * c][g + 8] = acc[t][2];
    part[warp][t * 8 + 2 * c + 1][g + 8] = acc[t][3];
  }
}

// The epilogue of a tile from row n0: the W warps' partials (part, written before a barrier) added in warp order and
// stored as y rows (SWIGLU: silu(gate) * up). Threads 0 .. W*32-1 share the work.
template <int NT, bool F16, int W, bool SWIGLU>
__device__ __forceinline__ void mma_epilogue(const float (&part)[W][NT * 8][17], void* __restrict__ y, int n0, int M,
                                             int N, int y_f32) {
  const int tid = threadIdx.x;
  if constexpr (SWIGLU) {
    const int I = N / 2;
    for (int j = tid; j < NT * 8 * 8; j += W * 32) {
      const int m = j >> 3, r = j & 7;  // gate row n0 + r of w is tile row r, its up row tile row r + 8
      float gs = 0.f, us = 0.f;
#pragma unroll
      for (int q = 0; q < W; ++q) gs += part[q][m][r], us += part[q][m][r + 8];
      if (m < M && n0 + r < I) ((u16*)y)[(i64)m * I + n0 + r] = swiglu_out<F16>(gs, us);
    }
  } else {
    for (int j = tid; j < NT * 8 * 16; j += W * 32) {
      const int m = j >> 4, r = j & 15;  // consecutive threads: consecutive rows of w (coalesced y)
      float s = 0.f;
#pragma unroll
      for (int q = 0; q < W; ++q) s += part[q][m][r];
      if (m < M && n0 + r < N) {
        const i64 o = (i64)m * N + n0 + r;
        if (y_f32)
          ((float*)y)[o] = s;
        else
          ((u16*)y)[o] = F16 ? f_to_f16(s) : f_to_bf16(s);
      }
    }
  }
}

// Persistent: the grid is the CTAs the device holds at once (launch.py), each CTA walks tiles blockIdx.x,
// + gridDim.x, ... and issues the next tile's first loads BEFORE the current tile's epilogue (partials to shared
// memory, barrier, sum over warps, stores), so the weight stream does not pause for it (figures: docs/PERF.md).
// Static smem: the warps' partial tiles. Rows of w past N re-read row N-1 and rows of x past M read zeros;
// neither is stored. y_f32: y is fp32 (logits), else x's dtype.
// SWIGLU (the SwiGLU MLP's fused gate/up projection, w = [gate; up]): a tile is 8 gate rows and their 8 up rows
// (mma_rows), the same products summed in the same order as the plain kernel's for those rows, and the epilogue
// stores y [M, N/2] = silu(gate) * up (swiglu_out): no elementwise kernel between the MLP's two projections.
// S: the weight stream (MmaW16 above; FP8: gemv_fp8/mma_fp8.cuh), which owns the loads and the products; this body
// owns the tile walk, the pass pipeline and the epilogue, the same for both.
template <int NT, bool F16, int U, int W, bool SWIGLU, class S>
__device__ __forceinline__ void mma_body(S& s, void* __restrict__ y, int M, int N, int y_f32) {
  __shared__ float part[W][NT * 8][17];  // [warp][row of x][row of w] (+1: fewer conflicts)
  const int warp = threadIdx.x >> 5;
  constexpr int TR = SWIGLU ? 8 : 16;  // output rows of a tile (SWIGLU: 8 gate rows, each with its up row)
  const int tiles = SWIGLU ? (N / 2 + TR - 1) / TR : (N + TR - 1) / TR;
  int tile = blockIdx.x;
  s.rows(tile * TR);
  // The first pass's weight loads go out before the PDL wait (weights are never written by a step's kernels): under
  // a programmatic launch they overlap the previous kernel's tail. x is an earlier kernel's output: after the wait.
  s.load_w(warp * U, 0, U);
  pdl_wait();
  s.load_x(warp * U, 0, U);
  for (;;) {
    float acc[NT][4];
#pragma unroll
    for (int t = 0; t < NT; ++t) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.f;
    // A pass's loads are issued before its trip (consumed across the back edge, ptxas cannot sink them next to
    // their mma: it did when they sat in the loop body, 40 registers and one load in flight). Two stages of U/2
    // slots: a stage's loads for the next pass go out as soon as its mma is done, while the other stage's loads
    // still fly, so the lane's U * (2 + NT) loads in flight never drain to zero at a pass boundary (a drained
    // wait is a large share of a narrow call; docs/PERF.md).
    constexpr int H = U > 1 ? U / 2 : U;  // slots per stage
    for (int ch0 = warp * U;;) {
      const int next = ch0 + W * U;
      const bool more = next * 4 < s.nv;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        s.mma(u, acc);
        if (u % H == H - 1 && more) s.load(next, u + 1 - H, u + 1);
      }
      if (!more) break;
      ch0 = next;
    }
    const int n0 = tile * TR;
    tile += gridDim.x;
    if (tile < tiles) {  // the next tile's loads fly during this tile's epilogue
      s.rows(tile * TR);
      s.load(warp * U, 0, U);
    }
    mma_store_part<NT, W>(part, acc);
    __syncthreads();
    // Past the barrier every warp's loads of its last tile went into its mmas: this CTA reads no more memory, so
    // the next kernel may start (common.cuh; one thread's trigger counts for the whole CTA, hence after the barrier).
    if (tile >= tiles) pdl_trigger();
    mma_epilogue<NT, F16, W, SWIGLU>(part, y, n0, M, N, y_f32);
    if (tile >= tiles) break;
    __syncthreads();  // part is rewritten by the next tile
  }
}
