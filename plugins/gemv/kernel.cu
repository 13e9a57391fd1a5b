// Projections of decode and verify steps: y[m, n] = sum_k x[m, k] w[n, k] for 1-16 rows of x (spec.py), on
// tensor cores (gemv/mma.cuh).
#include "common.cuh"
#include "gemv/mma.cuh"

// mma_n{8-row tiles of x}_u{32-column chunks per warp per pass}_{dtype}; spec.kernel_name picks one
#define MMA(NT, U, DT, F16)                                                                                  \
  extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32)                                            \
      mma_n##NT##_u##U##_##DT(const u16* w, const u16* x, void* y, int M, int N, int K, int y_f32) {        \
    mma_body<NT, F16, U>(w, x, y, M, N, K, y_f32);                                                          \
  }
#define MMA_U(NT, DT, F16) MMA(NT, 1, DT, F16) MMA(NT, 2, DT, F16) MMA(NT, 4, DT, F16) MMA(NT, 8, DT, F16)
MMA_U(1, bf16, false)
MMA_U(2, bf16, false)
MMA_U(1, f16, true)
MMA_U(2, f16, true)
