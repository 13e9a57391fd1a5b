// Projections of decode and verify steps: y[m, n] = sum_k x[m, k] w[n, k] for 1-16 rows of x (spec.py), on
// tensor cores (gemv/mma.cuh).
#include "common.cuh"
#include "gemv/mma.cuh"
#include "gemv/bulk.cuh"
#if !defined(GEMV_WARPS) || !defined(GEMV_NARROW_WARPS)
#error "GEMV_WARPS / GEMV_NARROW_WARPS (warps per CTA) come from gemv/spec.py through NVRTC -D options"
#endif

// mma_n{8-row tiles of x}_u{32-column chunks per warp per pass}_w{warps per CTA}_{dtype}[_swiglu]; spec.kernel_name
// picks one. MMA expands its arguments (the warp macros) before MMA_ pastes them into the name.
#define MMA_(NT, U, W, DT, F16, SFX, SWIGLU)                                                                       \
  extern "C" __global__ void __launch_bounds__(W * 32)                                                           \
      mma_n##NT##_u##U##_w##W##_##DT##SFX(const u16* w, const u16* x, void* y, int M, int N, int K, int y_f32) { \
    MmaW16<NT, F16, U, SWIGLU> s(w, x, M, N, K);                                                                 \
    mma_body<NT, F16, U, W, SWIGLU>(s, y, M, N, y_f32);                                                          \
  }
#define MMA(NT, U, W, DT, F16) MMA_(NT, U, W, DT, F16, , false) MMA_(NT, U, W, DT, F16, _swiglu, true)
#define MMA_U(NT, DT, F16)                                                                              \
  MMA(NT, 1, GEMV_WARPS, DT, F16) MMA(NT, 2, GEMV_WARPS, DT, F16) MMA(NT, 4, GEMV_WARPS, DT, F16)     \
  MMA(NT, 8, GEMV_WARPS, DT, F16) MMA(NT, 4, GEMV_NARROW_WARPS, DT, F16)

MMA_U(1, bf16, false)
MMA_U(2, bf16, false)
MMA_U(1, f16, true)
MMA_U(2, f16, true)

// mmab_...: the same kernels with the weight stream through shared memory (bulk.cuh; sm_90 and newer): W consumer
// warps and one producer warp.
#if __CUDA_ARCH__ >= 900
#define MMAB_(NT, U, W, DT, F16, SFX, SWIGLU)                                                                      \
  extern "C" __global__ void __launch_bounds__((W + 1) * 32, 1)                                                  \
      mmab_n##NT##_u##U##_w##W##_##DT##SFX(const u16* w, const u16* x, void* y, int M, int N, int K, int y_f32) { \
    MmaW16<NT, F16, U, SWIGLU> s(w, x, M, N, K);                                                                 \
    bulk_body<NT, F16, U, W, SWIGLU>(s, w, y, M, N, y_f32);                                                      \
  }
#define MMAB(NT, U, W, DT, F16) MMAB_(NT, U, W, DT, F16, , false) MMAB_(NT, U, W, DT, F16, _swiglu, true)
#define MMAB_U(NT, DT, F16)                                                                                  \
  MMAB(NT, 1, GEMV_WARPS, DT, F16) MMAB(NT, 2, GEMV_WARPS, DT, F16) MMAB(NT, 4, GEMV_WARPS, DT, F16)       \
  MMAB(NT, 8, GEMV_WARPS, DT, F16) MMAB(NT, 4, GEMV_NARROW_WARPS, DT, F16)

MMAB_U(1, bf16, false)
MMAB_U(2, bf16, false)
MMAB_U(1, f16, true)
MMAB_U(2, f16, true)
#endif
