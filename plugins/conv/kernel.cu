// Depthwise causal conv kernels (GDN short conv). x [B,T,C]; conv state [*, C, W-1] (pool indexed
// by slot[b] when slot != null, else by b); weight [C, W].
#include "common.cuh"
#ifndef MAXW
#error "MAXW (the widest conv kernel) comes from conv/spec.py through NVRTC -D options"
#endif

// y[b,t,c] = silu(sum_w weight[c,w] * col[t+w]), col = [state (W-1 cols) | x_1..x_T]. One thread per
// (b, t, c): its W loads are independent (a thread walking t serially made a 16-row verify latency-bound).
extern "C" __global__ void conv_verify(const void* __restrict__ x, int x_dt,
                                       const void* __restrict__ state, int s_dt,
                                       const int* __restrict__ slot,
                                       const void* __restrict__ weight, int w_dt,
                                       void* __restrict__ y, int y_dt, int T, int C, int W, int x_rs) {
  pdl_wait();
  const int c = blockIdx.x * blockDim.x + threadIdx.x, t = blockIdx.y, b = blockIdx.z;
  if (c >= C) return;
  const i64 sl = slot ? (i64)slot[b] : (i64)b;
  float acc = 0.f;
#pragma unroll
  for (int j = 0; j < MAXW; ++j) {
    if (j >= W) break;
    const int src = t + j;  // column index in [state | x]
    float v = 0.f;
    if (src >= W - 1) v = ldf(x, x_dt, ((i64)b * T + src - (W - 1)) * x_rs + c);  // rows x_rs apart
    else if (sl >= 0) v = ldf(state, s_dt, (sl * C + c) * (W - 1) + src);
    acc += ldf(weight, w_dt, (i64)c * W + j) * v;
  }
  stf(y, y_dt, ((i64)b * T + t) * C + c, acc / (1.f + expf(-acc)));
}

// In place, every layer l in one launch: pool[l, slot[b]] = last W-1 columns of
// [pool[l, slot[b]] | x_1..x_n[b]]. n <= 0 or slot < 0: no-op. pool [L, num_slots, C, W-1];
// x [L, B, T, C]; grid (ceil(C/128), B, L). n and slot are read on the device (graph capturable).
extern "C" __global__ void conv_roll(void* __restrict__ pool, int s_dt, const int* __restrict__ slot,
                                     const void* __restrict__ x, int x_dt,
                                     const int* __restrict__ n, int B, int num_slots, int T, int C, int W) {
  pdl_wait();
  const int c = blockIdx.x * blockDim.x + threadIdx.x, b = blockIdx.y, l = blockIdx.z;
  if (c >= C) return;
  const i64 sl = slot ? (i64)slot[b] : (i64)b;
  const int nb = min(n[b], T);
  if (nb <= 0 || sl < 0) return;
  const i64 base = (((i64)l * num_slots + sl) * C + c) * (W - 1);
  const i64 xl = (i64)l * B * T * C;  // this layer's columns
  float old[MAXW];
#pragma unroll
  for (int j = 0; j < MAXW; ++j) old[j] = j < W - 1 ? ldf(pool, s_dt, base + j) : 0.f;
  for (int j = 0; j < W - 1; ++j) {
    const int src = nb + j;  // column index in [state | x]
    float val;
    if (src < W - 1) {
      val = 0.f;
#pragma unroll
      for (int u = 0; u < MAXW; ++u) if (u == src) val = old[u];
    } else {
      val = ldf(x, x_dt, xl + ((i64)b * T + (src - (W - 1))) * C + c);
    }
    stf(pool, s_dt, base + j, val);
  }
}
