// The FP8 weight stream of gemv/mma.cuh's mma_body (W8A16): w float8_e4m3fn [N, K] with fp32 scales
// scale_inv [ceil(N/128), ceil(K/128)], x 16-bit. The tile walk, pass pipeline and epilogue are mma_body's.
//
// Column permutation: one 16-byte load of w is 16 fp8 columns, so lane (g, c) loads columns 16c..16c+15 of w rows g
// and g+8 (a 64-column chunk per 4 lanes) and the same 16 columns of x as TWO 16-byte loads. The 16 fp8 become
// 8 words of 16-bit pairs (fp8x4_to16); mma step s (0..3) takes words 2s, 2s+1 of w and of x, so the A and B
// fragments hold the same physical columns at every logical k slot and the four steps sum the 64 columns once.
//
// Scales: a chunk (64 columns from a multiple of 64) lies in one 128-column scale block and a tile (16 rows from a
// multiple of 16; SWIGLU: 8 gate rows, and their up rows when I % 128 == 0) in one 128-row block per half, so a
// slot's products go to a zeroed fp32 partial and acc += scale * partial: the UNSCALED fp8 values (exact in bf16
// and f16) meet x on the tensor cores and each weight is scaled once, in fp32, as W = fp8 * scale_inv is.
#pragma once
#include "common.cuh"
#include "gemv/mma.cuh"
#include "gemv_fp8/fp8_words.cuh"

template <bool F16>
__device__ __forceinline__ void fp8x16_to16(const uint4& q, unsigned (&o)[8]) {
  const unsigned in[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    o[2 * i] = fp8x2_to16<F16>(in[i], 0x9180u);      // columns 4i, 4i+1
    o[2 * i + 1] = fp8x2_to16<F16>(in[i], 0xb3a2u);  // columns 4i+2, 4i+3
  }
}

// mma_body's Stream (interface: gemv/mma.cuh MmaW16). Rows of w are K bytes: mma_rows and mma_load_w take them as
// rows of K/2 16-bit elements (K % 16 == 0), nv = K / 16 vectors of 16 fp8 each. sg / sh: the scale of a slot's
// chunk for the tile's rows g and g+8 (one scale row for a plain tile; SWIGLU: gate's and up's).
template <int NT, bool F16, int U, bool SWIGLU>
struct MmaW8 {
  const u16* w;
  const float* scale;
  int N, K, nv, kb;
  const float *srow_g, *srow_h;
  const uint4 *wg, *wh, *xr[NT];
  bool xok[NT];
  uint4 a[U], b[U], xv[NT][U][2];
  float sg[U], sh[U];
  __device__ __forceinline__ MmaW8(const unsigned char* w_, const float* scale_, const u16* x, int M, int N_, int K_)
      : w((const u16*)w_), scale(scale_), N(N_), K(K_) {
    const int g = (threadIdx.x & 31) >> 2, c = threadIdx.x & 3;
    nv = K >> 4;
    kb = (K + 127) >> 7;
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      xok[t] = t * 8 + g < M;
      xr[t] = (const uint4*)(x + (i64)min(t * 8 + g, M - 1) * K) + 2 * c;
    }
  }
  __device__ __forceinline__ void rows(int n0) {
    mma_rows<SWIGLU>(wg, wh, w, n0, N, K >> 1);
    scale_rows(n0);
  }
  __device__ __forceinline__ void scale_rows(int n0) {
    srow_g = scale + (i64)(n0 >> 7) * kb;
    srow_h = SWIGLU ? scale + (i64)((N / 2 + n0) >> 7) * kb : srow_g;
  }
  __device__ __forceinline__ void load_w(int ch0, int u0, int u1) {
    mma_load_w<U>(a, b, wg, wh, ch0, nv, u0, u1);
    load_scales(ch0, u0, u1);
  }
  __device__ __forceinline__ void load_scales(int ch0, int u0, int u1) {
#pragma unroll
    for (int u = u0; u < u1; ++u) {  // one scale per chunk, the same for every lane: an L1 broadcast
      const bool ok = (ch0 + u) * 4 < nv;
      sg[u] = ok ? __ldg(srow_g + ((ch0 + u) >> 1)) : 0.f;
      sh[u] = SWIGLU ? (ok ? __ldg(srow_h + ((ch0 + u) >> 1)) : 0.f) : sg[u];
    }
  }
  __device__ __forceinline__ void load_x(int ch0, int u0, int u1) {
    const uint4 zero = make_uint4(0, 0, 0, 0);
    const int c = threadIdx.x & 3;
#pragma unroll
    for (int u = u0; u < u1; ++u) {
      const bool ok = (ch0 + u) * 4 + c < nv;
#pragma unroll
      for (int t = 0; t < NT; ++t) {
        xv[t][u][0] = ok && xok[t] ? __ldg(xr[t] + (ch0 + u) * 8) : zero;
        xv[t][u][1] = ok && xok[t] ? __ldg(xr[t] + (ch0 + u) * 8 + 1) : zero;
      }
    }
  }
  __device__ __forceinline__ void load(int ch0, int u0, int u1) {
    load_w(ch0, u0, u1);
    load_x(ch0, u0, u1);
  }
  __device__ __forceinline__ void mma(int u, float (&acc)[NT][4]) {
    unsigned wa[8], wb[8];
    fp8x16_to16<F16>(a[u], wa);
    fp8x16_to16<F16>(b[u], wb);
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      const unsigned xw[8] = {xv[t][u][0].x, xv[t][u][0].y, xv[t][u][0].z, xv[t][u][0].w,
                              xv[t][u][1].x, xv[t][u][1].y, xv[t][u][1].z, xv[t][u][1].w};
      float p[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int s = 0; s < 4; ++s)
        mma16816<F16>(p, wa[2 * s], wb[2 * s], wa[2 * s + 1], wb[2 * s + 1], xw[2 * s], xw[2 * s + 1]);
      // D fragment: p0, p1 row of w g (scale sg), p2, p3 row g + 8 (sh)
      acc[t][0] = fmaf(sg[u], p[0], acc[t][0]);
      acc[t][1] = fmaf(sg[u], p[1], acc[t][1]);
      acc[t][2] = fmaf(sh[u], p[2], acc[t][2]);
      acc[t][3] = fmaf(sh[u], p[3], acc[t][3]);
    }
  }
};
