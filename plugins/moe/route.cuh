// moe_route, the router's top-k of a sparse MoE block (reference.route's math in one launch); included by
// kernel.cu after its helpers.
#pragma once
#include "common.cuh"

// Softmax in fp32 -> the k largest probabilities (descending) -> renormalised when norm.
// reference.route's math in one launch (torch's softmax + topk cost two sort kernels per layer). One CTA per token
// row n (grid N, blockDim a multiple of 32, <= MOE_ROUTE_THREADS). Dynamic shared memory: p [E], sel [k] floats.
// Thread t only ever touches p[e] for e = t (mod blockDim): the strided loops below keep p thread-private, so the
// only barriers are those of the block reductions. Reduction number r uses buffer r & 1 and one barrier: a thread
// writing buffer b again has passed the barrier of the reduction in between, which every reader of b's previous
// values reached only after reading them.
// Equal probabilities go to the lowest expert id. A row with NaN logits selects id E in every slot (outside [0, E):
// moe_experts drops such pairs).
__device__ __forceinline__ void arg_better(float& v, int& i, float ov, int oi) {
  if (ov > v || (ov == v && oi < i)) { v = ov; i = oi; }
}

template <bool MAX>
__device__ __forceinline__ float block_reduce(float v, float* red) {
  const int lane = threadIdx.x & 31, nw = blockDim.x >> 5;
  v = MAX ? warp_max(v) : warp_sum(v);
  if (lane == 0) red[threadIdx.x >> 5] = v;
  __syncthreads();
  float r = red[0];
  for (int q = 1; q < nw; ++q) r = MAX ? fmaxf(r, red[q]) : r + red[q];  // fixed order: deterministic
  return r;
}

extern "C" __global__ void __launch_bounds__(MOE_ROUTE_THREADS) moe_route(
    const void* __restrict__ logits, int l_dt, int N, int E, int k, int norm, i64* __restrict__ idx,
    void* __restrict__ w, int w_dt) {
  extern __shared__ float route_sm[];
  float* p = route_sm;        // [E] probabilities; a selected expert's entry becomes -inf
  float* sel = route_sm + E;  // [k] the selected probabilities, descending
  __shared__ float rv[2][32];
  __shared__ int ri[2][32];
  const int n = blockIdx.x, tid = threadIdx.x, lane = tid & 31, nw = blockDim.x >> 5;
  if (n >= N) return;
  const i64 row = (i64)n * E;
  float m = -INFINITY;
  for (int e = tid; e < E; e += blockDim.x) {
    p[e] = ldf(logits, l_dt, row + e);
    m = fmaxf(m, p[e]);
  }
  m = block_reduce<true>(m, rv[0]);
  float s = 0.f;
  for (int e = tid; e < E; e += blockDim.x) {
    p[e] = expf(p[e] - m);
    s += p[e];
  }
  s = block_reduce<false>(s, rv[1]);
  for (int e = tid; e < E; e += blockDim.x) p[e] /= s;  // divided like torch's softmax (not times 1/s)
  float total = 0.f;  // sum of the selected probabilities, descending order (every thread holds it)
  for (int r = 0; r < k; ++r) {
    float bv = -INFINITY;
    int bi = E;
    for (int e = tid; e < E; e += blockDim.x)
      if (p[e] > bv) { bv = p[e]; bi = e; }  // ascending e, strict >: the lowest id among equals
#pragma unroll
    for (int o = 16; o > 0; o >>= 1)
      arg_better(bv, bi, __shfl_xor_sync(0xffffffffu, bv, o), __shfl_xor_sync(0xffffffffu, bi, o));
    if (lane == 0) { rv[r & 1][tid >> 5] = bv; ri[r & 1][tid >> 5] = bi; }
    __syncthreads();
    bv = rv[r & 1][0];
    bi = ri[r & 1][0];
    for (int q = 1; q < nw; ++q) arg_better(bv, bi, rv[r & 1][q], ri[r & 1][q]);
    if (bi < E && bi % blockDim.x == tid) p[bi] = -INFINITY;  // its owner removes the winner
    if (tid == 0) { sel[r] = bv; idx[(i64)n * k + r] = bi; }
    total += bv;
  }
  __syncthreads();  // sel complete
  for (int j = tid; j < k; j += blockDim.x) stf(w, w_dt, (i64)n * k + j, norm ? sel[j] / total : sel[j]);
}
