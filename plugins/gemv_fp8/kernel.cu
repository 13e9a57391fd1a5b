// W8A16 projections of decode and verify steps: y[m, n] = sum_k x[m, k] fp8(w[n, k]) scale_inv[n/128, k/128] for
// 1-16 rows of x (spec.py), on tensor cores: gemv/mma.cuh's body with the FP8 weight stream of mma_fp8.cuh.
#include "common.cuh"
#include "gemv/mma.cuh"
#include "gemv_fp8/mma_fp8.cuh"
#include "gemv/bulk.cuh"
#if !defined(GEMV_WARPS) || !defined(GEMV_NARROW_WARPS)
#error "GEMV_WARPS / GEMV_NARROW_WARPS (warps per CTA) come from gemv_fp8/spec.py through NVRTC -D options"
#endif

// fp8[b]_n{8-row tiles of x}_u{64-column chunks per warp per pass}_w{warps per CTA}_{dtype of x}[_swiglu];
// spec.kernel_name picks one. fp8_: the register stream (mma_body); fp8b_: the weights through shared memory
// (gemv/bulk.cuh, sm_90 and newer: W consumer warps and one producer warp), the same sums. ENTRY expands its
// arguments (the warp macros) before ENTRY_ pastes them into the name; STREAM is REGS or BULK (bulk.cuh).
#define ENTRY_(STREAM, PFX, NT, U, W, DT, F16, SFX, SWIGLU)                                                      \
  extern "C" __global__ void STREAM##_BOUNDS(W)                                                                 \
      PFX##_n##NT##_u##U##_w##W##_##DT##SFX(const unsigned char* w, const float* scale, const u16* x, void* y,  \
                                            int M, int N, int K, int y_f32) {                                   \
    MmaW8<NT, F16, U, SWIGLU> s(w, scale, x, M, N, K);                                                          \
    STREAM##_RUN(NT, F16, U, W, SWIGLU);                                                                        \
  }
#define ENTRY(STREAM, PFX, NT, U, W, DT, F16) \
  ENTRY_(STREAM, PFX, NT, U, W, DT, F16, , false) ENTRY_(STREAM, PFX, NT, U, W, DT, F16, _swiglu, true)
#define VARIANTS(STREAM, PFX, NT, DT, F16)                                                                      \
  ENTRY(STREAM, PFX, NT, 1, GEMV_WARPS, DT, F16) ENTRY(STREAM, PFX, NT, 2, GEMV_WARPS, DT, F16)                 \
  ENTRY(STREAM, PFX, NT, 4, GEMV_WARPS, DT, F16) ENTRY(STREAM, PFX, NT, 2, GEMV_NARROW_WARPS, DT, F16)
#define ALL_VARIANTS(STREAM, PFX)                                                                  \
  VARIANTS(STREAM, PFX, 1, bf16, false) VARIANTS(STREAM, PFX, 2, bf16, false)                      \
  VARIANTS(STREAM, PFX, 1, f16, true) VARIANTS(STREAM, PFX, 2, f16, true)

ALL_VARIANTS(REGS, fp8)
#if __CUDA_ARCH__ >= 900
ALL_VARIANTS(BULK, fp8b)
#endif

#include "gemv_fp8/quant.cuh"  // fp8_quant_groups_{bf16,f16}: W8A8's activations (reference.quantize_activations)
