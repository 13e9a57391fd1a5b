// moe_route, the router's top-k of a sparse MoE block (reference.route's math in one launch); included by
// kernel.cu after its helpers.
#pragma once
#include "common.cuh"

// Softmax in fp32 -> the k largest probabilities (descending) -> renormalised when norm.
// reference.route's math in one launch (torch's softmax + topk cost two sort kernels per layer). One CTA per token
// row n (grid N, blockDim a multiple of 32, <= MOE_ROUTE_THREADS). Dynamic shared memory: p [E], sel [k] floats.
// Selection by rank, not k rounds of a block-wide argmax (k barriers and serial merges; docs/PERF.md): expert e's
// rank is the number of experts ahead of it (a larger probability, or an equal one and a lower id), so rank < k puts
// e in slot `rank`; a thread stops counting once k are ahead. Each reduction uses its own
// buffer. Equal probabilities go to the lowest expert id. A row with a NaN or infinite logit (its probabilities
// all NaN) selects id E in every slot (outside [0, E): moe_experts drops such pairs), weight -inf (NaN when norm).
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

// How many of p[0..E) rank ahead of p[e] = v, counting up to k (shared-memory reads: one address a warp, broadcast).
__device__ __forceinline__ int rank_of(const float* p, int E, int e, float v, int k) {
  int ahead = 0;
  for (int f = 0; f < E && ahead < k; ++f) {
    const float o = p[f];
    ahead += (o > v) | ((o == v) & (f < e));
  }
  return ahead;
}

extern "C" __global__ void __launch_bounds__(MOE_ROUTE_THREADS) moe_route(
    const void* __restrict__ logits, int l_dt, int N, int E, int k, int norm, i64* __restrict__ idx,
    void* __restrict__ w, int w_dt) {
  extern __shared__ float route_sm[];
  float* p = route_sm;        // [E] probabilities
  float* sel = route_sm + E;  // [k] the selected probabilities, descending
  __shared__ float red[2][32];
  const int n = blockIdx.x, tid = threadIdx.x;
  if (n >= N) return;
  const i64 row = (i64)n * E;
  float m = -INFINITY;
  for (int e = tid; e < E; e += blockDim.x) {
    p[e] = ldf(logits, l_dt, row + e);
    m = fmaxf(m, p[e]);
  }
  m = block_reduce<true>(m, red[0]);
  float s = 0.f;
  for (int e = tid; e < E; e += blockDim.x) {
    p[e] = expf(p[e] - m);
    s += p[e];
  }
  s = block_reduce<false>(s, red[1]);
  for (int e = tid; e < E; e += blockDim.x) p[e] /= s;  // divided like torch's softmax (not times 1/s)
  __syncthreads();  // every probability written before any is ranked
  if (s != s) {  // NaN in the row (uniform: s is the block's): nothing is selected
    for (int j = tid; j < k; j += blockDim.x) {
      idx[(i64)n * k + j] = E;
      stf(w, w_dt, (i64)n * k + j, norm ? __int_as_float(0x7fc00000) : -INFINITY);
    }
    return;
  }
  for (int e = tid; e < E; e += blockDim.x) {
    const int r = rank_of(p, E, e, p[e], k);
    if (r < k) { sel[r] = p[e]; idx[(i64)n * k + r] = e; }
  }
  __syncthreads();  // sel complete
  float total = 0.f;  // the selected probabilities summed in descending order
  if (norm)
    for (int r = 0; r < k; ++r) total += sel[r];
  for (int j = tid; j < k; j += blockDim.x) stf(w, w_dt, (i64)n * k + j, norm ? sel[j] / total : sel[j]);
}
