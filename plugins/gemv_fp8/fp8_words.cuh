// e4m3 weight bytes as the 16-bit words a tensor-core mma takes (bf16 or f16 pairs), exact: the FP8 weight
// streams of gemv_fp8 (mma_fp8.cuh) and of the MoE experts (moe/kernel.cu) share this conversion.
#pragma once
#include "common.cuh"

// 4 e4m3 bytes -> two words of 16-bit pairs (lo: bytes 0, 1; hi: bytes 2, 3), exact. A byte permute puts each byte
// in the low byte of its 16-bit half with its sign replicated over the high byte; one shift moves exponent+mantissa
// into the 16-bit format's fields (bf16: bits 10..4, f16: 13..7) and a sign copy to bit 15, and one mask keeps those
// (the bits a shift carries across the halves fall outside it). That leaves the value 2^-120 (bf16) / 2^-8 (f16)
// times the e4m3 value, subnormals included; one fma by that power of two (+ -0: zeros keep their sign) restores it.
// No overflow: e4m3's max 448 fits both formats. The e4m3fn NaN byte (0x7f / 0xff) becomes +-480 (checkpoints hold
// none). sel: 0x9180 (bytes 0, 1) or 0xB3A2 (bytes 2, 3): byte i, then 8 | i (its sign replicated).
template <bool F16>
__device__ __forceinline__ unsigned fp8x2_to16(unsigned q, unsigned sel) {
  unsigned p;  // [b_lo, sign(b_lo), b_hi, sign(b_hi)]; prmt itself: __byte_perm ignores a nibble's sign bit
  asm("prmt.b32 %0, %1, 0, %2;" : "=r"(p) : "r"(q), "r"(sel));
  const unsigned r = (p << (F16 ? 7 : 4)) & (F16 ? 0xbf80bf80u : 0x87f087f0u);
  const unsigned k = F16 ? 0x5c005c00u : 0x7b807b80u;  // 2^8 (f16) / 2^120 (bf16), in both halves
  unsigned d;
  if (F16)
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(r), "r"(k), "r"(0x80008000u));
  else
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(r), "r"(k), "r"(0x80008000u));
  return d;
}
// 8 e4m3 bytes (columns 0..7) -> the four words a 16-byte load of 8 16-bit columns gives (x: 0, 1 ... w: 6, 7).
template <bool F16>
__device__ __forceinline__ uint4 fp8x8_to16(const uint2& q) {
  return make_uint4(fp8x2_to16<F16>(q.x, 0x9180u), fp8x2_to16<F16>(q.x, 0xb3a2u), fp8x2_to16<F16>(q.y, 0x9180u),
                    fp8x2_to16<F16>(q.y, 0xb3a2u));
}
