// W8A16 projections of decode and verify steps: y[m, n] = sum_k x[m, k] fp8(w[n, k]) scale_inv[n/128, k/128] for
// 1-16 rows of x (spec.py), on tensor cores: gemv/mma.cuh's body with the FP8 weight stream of mma_fp8.cuh.
#include "common.cuh"
#include "gemv/mma.cuh"
#include "gemv_fp8/mma_fp8.cuh"
#include "gemv/bulk.cuh"
#if !defined(GEMV_WARPS) || !defined(GEMV_NARROW_WARPS)
#error "GEMV_WARPS / GEMV_NARROW_WARPS (warps per CTA) come from gemv_fp8/spec.py through NVRTC -D options"
#endif

// fp8_n{8-row tiles of x}_u{64-column chunks per warp per pass}_w{warps per CTA}_{dtype of x}[_swiglu];
// spec.kernel_name picks one. FP8_ expands its arguments (the warp macros) before FP8__ pastes them into the name.
#define FP8__(NT, U, W, DT, F16, SFX, SWIGLU)                                                                    \
  extern "C" __global__ void __launch_bounds__(W * 32)                                                          \
      fp8_n##NT##_u##U##_w##W##_##DT##SFX(const unsigned char* w, const float* scale, const u16* x, void* y,    \
                                           int M, int N, int K, int y_f32) {                                    \
    MmaW8<NT, F16, U, SWIGLU> s(w, scale, x, M, N, K);                                                          \
    mma_body<NT, F16, U, W, SWIGLU>(s, y, M, N, y_f32);                                                         \
  }
#define FP8_(NT, U, W, DT, F16) FP8__(NT, U, W, DT, F16, , false) FP8__(NT, U, W, DT, F16, _swiglu, true)
#define FP8_U(NT, DT, F16) \
  FP8_(NT, 1, GEMV_WARPS, DT, F16) FP8_(NT, 2, GEMV_WARPS, DT, F16) FP8_(NT, 4, GEMV_WARPS, DT, F16) \
  FP8_(NT, 2, GEMV_NARROW_WARPS, DT, F16)

FP8_U(1, bf16, false)
FP8_U(2, bf16, false)
FP8_U(1, f16, true)
FP8_U(2, f16, true)

// fp8b_...: the same kernels with the weight stream through shared memory (gemv/bulk.cuh; sm_90 and newer): W
// consumer warps and one producer warp.
#if __CUDA_ARCH__ >= 900
#define FP8B__(NT, U, W, DT, F16, SFX, SWIGLU)                                                                   \
  extern "C" __global__ void __launch_bounds__((W + 1) * 32, 1)                                                 \
      fp8b_n##NT##_u##U##_w##W##_##DT##SFX(const unsigned char* w, const float* scale, const u16* x, void* y,   \
                                            int M, int N, int K, int y_f32) {                                   \
    MmaW8<NT, F16, U, SWIGLU> s(w, scale, x, M, N, K);                                                          \
    bulk_body<NT, F16, U, W, SWIGLU>(s, w, y, M, N, y_f32);                                                     \
  }
#define FP8B_(NT, U, W, DT, F16) FP8B__(NT, U, W, DT, F16, , false) FP8B__(NT, U, W, DT, F16, _swiglu, true)
#define FP8B_U(NT, DT, F16) \
  FP8B_(NT, 1, GEMV_WARPS, DT, F16) FP8B_(NT, 2, GEMV_WARPS, DT, F16) FP8B_(NT, 4, GEMV_WARPS, DT, F16) \
  FP8B_(NT, 2, GEMV_NARROW_WARPS, DT, F16)

FP8B_U(1, bf16, false)
FP8B_U(2, bf16, false)
FP8B_U(1, f16, true)
FP8B_U(2, f16, true)
#endif

#include "gemv_fp8/quant.cuh"  // fp8_quant_groups_{bf16,f16}: W8A8's activations (reference.quantize_activations)
