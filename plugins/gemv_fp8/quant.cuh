// Activation quantization of W8A8 (reference.quantize_activations): x [M, K] 16-bit, K a multiple of 128 ->
// xq [M, K] e4m3 and s [K/128][ld_s] fp32 (row m's scale of group g at s[g * ld_s + m]: the column-major A-scale
// layout the block-scaled GEMM reads). One warp per (row, group of 128 channels), 4 channels a lane:
// s = max(amax, 1e-10) / 448, xq = e4m3(x / s) rounded to nearest even and saturated to +-448, as the reference.
#pragma once
#include "common.cuh"

// two floats -> two e4m3 bytes (lo in the low byte), round to nearest even, saturating (PTX: sm_89+)
__device__ __forceinline__ unsigned short f2_to_e4m3x2(float lo, float hi) {
  unsigned short r = 0;
#if __CUDA_ARCH__ >= 890
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
#else
  __trap();
#endif
  return r;
}

template <bool F16>
__device__ __forceinline__ void quant_groups(const u16* x, unsigned char* xq, float* s, int M, int K, int ld_s) {
  const long long warp = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31, groups = K >> 7;
  if (warp >= (long long)M * groups) return;
  const int m = (int)(warp / groups), g = (int)(warp % groups);
  const long long off = (long long)m * K + g * 128 + lane * 4;
  const uint2 u = *reinterpret_cast<const uint2*>(x + off);
  const u16 h[4] = {(u16)(u.x & 0xffff), (u16)(u.x >> 16), (u16)(u.y & 0xffff), (u16)(u.y >> 16)};
  float v[4], a = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    v[i] = F16 ? f16_to_f(h[i]) : bf16_to_f(h[i]);
    a = fmaxf(a, fabsf(v[i]));
  }
#pragma unroll
  for (int o = 16; o; o >>= 1) a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, o));
  const float sc = fmaxf(a, 1e-10f) / 448.f;
  const unsigned q = (unsigned)f2_to_e4m3x2(v[0] / sc, v[1] / sc) | ((unsigned)f2_to_e4m3x2(v[2] / sc, v[3] / sc) << 16);
  *reinterpret_cast<unsigned*>(xq + off) = q;
  if (lane == 0) s[(long long)g * ld_s + m] = sc;
}

extern "C" __global__ void __launch_bounds__(256)
    fp8_quant_groups_bf16(const u16* x, unsigned char* xq, float* s, int M, int K, int ld_s) {
  quant_groups<false>(x, xq, s, M, K, ld_s);
}
extern "C" __global__ void __launch_bounds__(256)
    fp8_quant_groups_f16(const u16* x, unsigned char* xq, float* s, int M, int K, int ld_s) {
  quant_groups<true>(x, xq, s, M, K, ld_s);
}
