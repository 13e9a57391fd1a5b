// Shared device helpers for the dflash CUDA kernels (NVRTC-compiled; no CUDA toolkit headers
// needed). dtype codes: 0 = float32, 1 = bfloat16, 2 = float16.
#pragma once
typedef unsigned short u16;
typedef long long i64;
#define INFINITY __int_as_float(0x7f800000)

#define DT_F32 0
#define DT_BF16 1
#define DT_F16 2

__device__ __forceinline__ float bf16_to_f(u16 h) { return __uint_as_float(((unsigned)h) << 16); }
__device__ __forceinline__ u16 f_to_bf16(float f) {
  u16 r; asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f)); return r;
}
__device__ __forceinline__ float f16_to_f(u16 h) {
  float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f;
}
__device__ __forceinline__ u16 f_to_f16(float f) {
  u16 r; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(f)); return r;
}
// Load element i of a tensor with runtime dtype code as float.
__device__ __forceinline__ float ldf(const void* p, int dt, i64 i) {
  if (dt == DT_F32) return ((const float*)p)[i];
  u16 h = ((const u16*)p)[i];
  return dt == DT_BF16 ? bf16_to_f(h) : f16_to_f(h);
}
__device__ __forceinline__ void stf(void* p, int dt, i64 i, float v) {
  if (dt == DT_F32) ((float*)p)[i] = v;
  else ((u16*)p)[i] = dt == DT_BF16 ? f_to_bf16(v) : f_to_f16(v);
}
// Load 4 consecutive elements (index i must be a multiple of 4, base 8/16-byte aligned).
__device__ __forceinline__ float4 ld4(const void* p, int dt, i64 i) {
  if (dt == DT_F32) return *(const float4*)((const float*)p + i);
  uint2 u = *(const uint2*)((const u16*)p + i);
  u16 a = u.x & 0xffff, b = u.x >> 16, c = u.y & 0xffff, d = u.y >> 16;
  if (dt == DT_BF16) return make_float4(bf16_to_f(a), bf16_to_f(b), bf16_to_f(c), bf16_to_f(d));
  return make_float4(f16_to_f(a), f16_to_f(b), f16_to_f(c), f16_to_f(d));
}
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
// warp_sum / warp_max of N values at once, their shuffle rounds interleaved: 5 dependent rounds for all N
template <int N>
__device__ __forceinline__ void warp_sum_n(float (&v)[N]) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1)
#pragma unroll
    for (int i = 0; i < N; ++i) v[i] += __shfl_xor_sync(0xffffffffu, v[i], o);
}
template <int N>
__device__ __forceinline__ void warp_max_n(float (&v)[N]) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1)
#pragma unroll
    for (int i = 0; i < N; ++i) v[i] = fmaxf(v[i], __shfl_xor_sync(0xffffffffu, v[i], o));
}
// Programmatic dependent launch (cuda_launch.launch(pdl=True)): a kernel launched that way may start before the
// previous kernel on its stream has finished (Inductor's PDL kernels let the next one start once their loads are
// done). pdl_wait() returns once that kernel (and, through its own wait, every earlier one) has completed and its
// writes are visible: call it before the first read of anything an earlier kernel writes and before the first write.
// A kernel lets its dependent start early (pdl_trigger) only once every CTA has done its LAST read of memory (the
// first thread of a CTA to trigger counts for all of its warps: trigger after a barrier that follows every read): a
// dependent that started before that could write into memory we still read (Inductor reuses a dead buffer's
// storage, and its PDL kernels wait only for the buffers the previous kernel names). Reading our outputs stays safe
// (every dependent waits before it reads them, and Inductor's kernels wait before they trigger their own). Kernels
// without a trigger let the next kernel start when their CTAs have exited. Both are no-ops in a normal launch and
// below sm_90.
__device__ __forceinline__ void pdl_wait() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_trigger() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
// A 16-byte load of data read once (weight streams): non-coherent path, not kept in L1.
__device__ __forceinline__ uint4 ld_stream(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
// d += a (16x16, row-major fragments a0..a3) * b (16x8, col-major b0, b1) on tensor cores, fp32 accumulate; bf16 or
// f16 inputs (mma.sync.m16n8k16: the gemv and the paged-attention tensor-core pass).
template <bool F16>
__device__ __forceinline__ void mma16816(float (&d)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                         unsigned b0, unsigned b1) {
  if (F16)
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  else
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
// Raw bits of element i of a tensor with dtype code dt: only the load, so that a run of loads stays in flight;
// rawf converts them once all are issued.
__device__ __forceinline__ unsigned rawld(const void* p, int dt, i64 i) {
  unsigned r;
  if (dt == DT_F32) r = ((const unsigned*)p)[i];
  else r = ((const u16*)p)[i];
  return r;
}
__device__ __forceinline__ float rawf(unsigned r, int dt) {
  return dt == DT_F32 ? __uint_as_float(r) : dt == DT_BF16 ? bf16_to_f((u16)r) : f16_to_f((u16)r);
}
