// GEMV of decode steps: y[n] = sum_k x[k] w[n, k] for one row of x (spec.py; rows_dot takes M <= MT rows).
// x is staged once per CTA in shared memory; warp w streams GEMV_RPW rows of w (rows.cuh).
#include "common.cuh"
#include "gemv/rows.cuh"

// Grid: ceil(N / (GEMV_WARPS * GEMV_RPW)) CTAs of GEMV_WARPS warps; dynamic smem: M * K * 2 bytes.
// Rows past N re-read row N-1 (no early exit: every thread reaches the barrier) and store nothing.
// y_f32: y is fp32 (logits: no 16-bit rounding of the sums), else x's dtype.
template <int MT, bool F16, int U>
__device__ __forceinline__ void gemv_body(const u16* __restrict__ w, const u16* __restrict__ x,
                                          void* __restrict__ y, int M, int N, int K, int y_f32) {
  extern __shared__ uint4 xs[];  // [M][K / 8]
  const int nch = K >> 3, tid = threadIdx.x, lane = tid & 31;
  const int row0 = (blockIdx.x * GEMV_WARPS + (tid >> 5)) * GEMV_RPW;
  const uint4* wr[GEMV_RPW];
  row_ptrs(wr, w, row0, N, K);
  uint4 wv[GEMV_RPW][U];
  load_pass(wv, wr, 0, nch, lane);  // the first weight loads fly while x is staged
  for (int i = tid; i < M * nch; i += GEMV_WARPS * 32) xs[i] = ((const uint4*)x)[i];
  __syncthreads();
  float acc[GEMV_RPW][MT];
  rows_dot<MT, F16, GEMV_RPW, U>(wv, wr, xs, M, nch, lane, acc);
#pragma unroll
  for (int r = 0; r < GEMV_RPW; ++r)
#pragma unroll
    for (int m = 0; m < MT; ++m)
      if (lane == 0 && m < M && row0 + r < N) {
        const i64 i = (i64)m * N + row0 + r;
        if (y_f32)
          ((float*)y)[i] = acc[r][m];
        else
          ((u16*)y)[i] = F16 ? f_to_f16(acc[r][m]) : f_to_bf16(acc[r][m]);
      }
}

#define GEMV(NAME, MT, F16, U)                                                                            \
  extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32) NAME(const u16* w, const u16* x, void* y, \
                                                                     int M, int N, int K, int y_f32) { \
    gemv_body<MT, F16, U>(w, x, y, M, N, K, y_f32);                                                      \
  }
// gemv_u{chunks per lane}_{dtype}: spec.kernel_name picks one
GEMV(gemv_u8_bf16, 1, false, 8)
GEMV(gemv_u16_bf16, 1, false, 16)
GEMV(gemv_u8_f16, 1, true, 8)
GEMV(gemv_u16_f16, 1, true, 16)
