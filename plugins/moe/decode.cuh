// MoeExperts for a decode step (N <= spec.DECODE_TOKENS tokens, 16-bit): every (token, k) pair p is a GEMV over
// its expert's rows, streamed as the dense decode projections are (gemv/rows.cuh), instead of the grouped GEMM's
// plan + tensor-core tiles. At N*k <= 32 pairs the experts rarely repeat, and the grouped kernels' fixed costs
// (plan launch, 32-row CTAs with few k-steps each, smem reduction) keep them well below the HBM rate (docs/PERF.md).
// moe_dec_gate_up -> h [P, I] in x's dtype; moe_dec_down -> y [N, H] (the k-combine of moe_combine fused in, same
// order). Pairs with an expert id outside [0, E) add nothing. W8: the experts' weights are e4m3 with fp32 scales
// [E, rows/128, cols/128] (H and I multiples of 128), each 16-column chunk scaled once in fp32 (gemv/rows.cuh).
// Shared expert (sgu non-null): one more pair per token, after its k routed ones: the shared expert's gate_up
// [2I, H] / down [H, I] (the routed experts' I and format; scales [2I/128, H/128] / [H/128, I/128]) with weight
// sigmoid(its gate logit) rounded to x's dtype (HF's sigmoid of a 16-bit tensor), so a decode step's MoE block is
// these two launches. Its h row is P + n (P = N * k routed pairs).
#pragma once
#include "gemv/rows.cuh"

// A pair's expert: its weights [rows, K] and scale rows (W8). Routed pair (j < k): expert idx[n * k + j] of the
// stacked W [E, rows, K], false for an id outside [0, E); j == k: the shared expert (Wsh, Ssh).
template <bool W8>
__device__ __forceinline__ bool pair_weights(const void* W, const float* S, const void* Wsh, const float* Ssh,
                                             const void* idx, int idx64, int n, int j, int topk, int E, int rows,
                                             int K, const void*& w, const float*& s) {
  if (j == topk) { w = Wsh; s = Ssh; return true; }
  const int e = load_id(idx, idx64, n * topk + j);
  if (e < 0 || e >= E) return false;
  w = w_row<W8>(W, (i64)e * rows, K);
  s = W8 ? S + (i64)e * (rows >> 7) * (K >> 7) : nullptr;  // rows % 128 == 0 (spec.check_fp8)
  return true;
}

// h[p, i] = silu(gate_i . x) * (up_i . x), rounded to x's dtype (as the grouped path's epilogue): warp w of CTA
// (bx, p) streams gate row i = bx * GEMV_WARPS + w and up row I + i of pair p's expert together.
// Grid (I / GEMV_WARPS, P (+ N with a shared expert)); dynamic smem H * 2 bytes (the pair's token row of x).
template <bool F16, bool W8>
__device__ __forceinline__ void dec_gate_up(const void* __restrict__ gate_up, const float* __restrict__ scale,
                                            const u16* __restrict__ x, const void* __restrict__ idx, int idx64,
                                            int N, int topk, int E, int H, int I, u16* __restrict__ h,
                                            const void* __restrict__ sgu, const float* __restrict__ sgus) {
  extern __shared__ uint4 xs[];
  const int p = blockIdx.y, shared = p >= N * topk, n = shared ? p - N * topk : p / topk;
  const void* w;
  const float* sb;
  if (!pair_weights<W8>(gate_up, scale, sgu, sgus, idx, idx64, n, shared ? topk : p % topk, topk, E, 2 * I, H, w, sb))
    return;  // uniform per CTA
  const int nch = H >> (W8 ? 4 : 3), tid = threadIdx.x, lane = tid & 31, i = blockIdx.x * GEMV_WARPS + (tid >> 5);
  const uint4* wr[2] = {w_row<W8>(w, i, H), w_row<W8>(w, I + i, H)};  // I % 32 == 0
  const int kb = H >> 7;
  const float* sr[2] = {W8 ? sb + (i >> 7) * kb : nullptr, W8 ? sb + ((I + i) >> 7) * kb : nullptr};
  uint4 wv[2][W8 ? 4 : 8];
  load_pass(wv, wr, 0, nch, lane);
  const uint4* xr = (const uint4*)(x + (i64)n * H);
  for (int c = tid; c < H >> 3; c += GEMV_WARPS * 32) xs[c] = xr[c];
  __syncthreads();
  float acc[2][1];
  rows_dot<1, F16, 2, W8 ? 4 : 8, W8>(wv, wr, xs, 1, nch, lane, acc, sr);
  const float v = silu(acc[0][0]) * acc[1][0];
  if (lane == 0) h[(i64)p * I + i] = F16 ? f_to_f16(v) : f_to_bf16(v);
}

// Down projection and the k-combine of token n, rows row0 .. row0 + DEC_ROWS of y: warp w streams the rows of
// pairs j = w, w + GEMV_WARPS, ... (DEC_ROWS rows x DEC_U chunks a lane in flight: I is short, so a warp takes
// more rows than the dense GEMV's two), then y = sum_j w_j (down[e_j] . h_j) in ascending j, fp32, as moe_combine
// (the shared expert's term last). Grid (ceil(H / DEC_ROWS), N); dynamic smem: h [J][I] 16-bit + partial sums
// [J][DEC_ROWS] fp32, J = k (+ 1 with a shared expert).
#define DEC_ROWS 8
#define DEC_U 2
// Rows row0.. of a pair's down [H, I] (clamped to H-1) and, W8, their scale rows (DEC_ROWS | 128: one block).
template <bool W8>
__device__ __forceinline__ void dec_rows(const uint4* (&wr)[DEC_ROWS], const float* (&sr)[DEC_ROWS], const void* w,
                                         const float* s, int row0, int H, int I) {
  row_ptrs<W8>(wr, w, row0, H, I);
#pragma unroll
  for (int r = 0; r < DEC_ROWS; ++r) sr[r] = W8 ? s + (min(row0 + r, H - 1) >> 7) * (I >> 7) : nullptr;
}
template <bool F16, bool W8>
__device__ __forceinline__ void dec_down(const void* __restrict__ down, const float* __restrict__ scale,
                                         const u16* __restrict__ hp, const void* __restrict__ idx, int idx64,
                                         const void* __restrict__ tw, int tw_dt, int N, int topk, int E, int H, int I,
                                         void* __restrict__ out, int out_dt, const void* __restrict__ sdn,
                                         const float* __restrict__ sdns, const void* __restrict__ slogit,
                                         int slogit_stride) {
  extern __shared__ uint4 dsm[];
  const int J = topk + (sdn != nullptr);
  u16* h = (u16*)dsm;
  float* part = (float*)(h + J * I);  // J * I * 2 bytes: a multiple of 64 (I % 32 == 0)
  const int n = blockIdx.y, tid = threadIdx.x, lane = tid & 31, nch = I >> (W8 ? 4 : 3), row0 = blockIdx.x * DEC_ROWS;
  const uint4* wr[DEC_ROWS];
  const float* sr[DEC_ROWS];
  uint4 wv[DEC_ROWS][DEC_U];
  const void* w;
  const float* sb;
  int j = tid >> 5;
  bool ok = j < J && pair_weights<W8>(down, scale, sdn, sdns, idx, idx64, n, j, topk, E, H, I, w, sb);
  if (ok) {  // the first pair's loads fly while h is staged
    dec_rows<W8>(wr, sr, w, sb, row0, H, I);
    load_pass(wv, wr, 0, nch, lane);
  }
  const uint4* hsrc = (const uint4*)(hp + (i64)n * topk * I);  // the token's k routed rows of h
  for (int c = tid; c < topk * (I >> 3); c += GEMV_WARPS * 32) dsm[c] = hsrc[c];
  if (J > topk) {  // its shared-expert row (P + n) after them
    const uint4* ssrc = (const uint4*)(hp + ((i64)N * topk + n) * I);
    for (int c = tid; c < I >> 3; c += GEMV_WARPS * 32) dsm[topk * (I >> 3) + c] = ssrc[c];
  }
  __syncthreads();
  for (; j < J; j += GEMV_WARPS) {
    float acc[DEC_ROWS][1];
    if (ok) {
      rows_dot<1, F16, DEC_ROWS, DEC_U, W8>(wv, wr, (const uint4*)(h + j * I), 1, nch, lane, acc, sr);
    } else {
#pragma unroll
      for (int r = 0; r < DEC_ROWS; ++r) acc[r][0] = 0.f;
    }
#pragma unroll
    for (int r = 0; r < DEC_ROWS; ++r)
      if (lane == r) part[j * DEC_ROWS + r] = acc[r][0];
    const int jn = j + GEMV_WARPS;
    ok = jn < J && pair_weights<W8>(down, scale, sdn, sdns, idx, idx64, n, jn, topk, E, H, I, w, sb);
    if (ok) {
      dec_rows<W8>(wr, sr, w, sb, row0, H, I);
      load_pass(wv, wr, 0, nch, lane);
    }
  }
  __syncthreads();
  const int row = row0 + tid;
  if (tid < DEC_ROWS && row < H) {
    float sum = 0.f;
    for (int jj = 0; jj < topk; ++jj) {
      const int p = n * topk + jj, ej = load_id(idx, idx64, p);
      if (ej >= 0 && ej < E) sum += ldf(tw, tw_dt, p) * part[jj * DEC_ROWS + tid];
    }
    if (J > topk) {  // sigmoid of the gate logit (x's dtype), rounded to x's dtype
      const float g = 1.f / (1.f + __expf(-ldf(slogit, out_dt, (i64)n * slogit_stride)));
      sum += (out_dt == DT_BF16 ? bf16_to_f(f_to_bf16(g)) : f16_to_f(f_to_f16(g))) * part[topk * DEC_ROWS + tid];
    }
    stf(out, out_dt, (i64)n * H + row, sum);
  }
}

// FP8 entries take the weights' scale right after the weights; the 16-bit ones have none (nullptr). The shared
// expert's tensors come last (sgu = sdn = nullptr: none).
#define MOE_DEC(SFX, F16, W8, WT, SCALE, SCALE_ARG, SSCALE, SSCALE_ARG)                                          \
  extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32) moe_dec_gate_up_##SFX(                          \
      const WT* gate_up, SCALE const u16* x, const void* idx, int idx64, int N, int topk, int E, int H, int I,   \
      u16* h, const WT* sgu SSCALE) {                                                                            \
    dec_gate_up<F16, W8>(gate_up, SCALE_ARG, x, idx, idx64, N, topk, E, H, I, h, sgu, SSCALE_ARG);              \
  }                                                                                                              \
  extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32) moe_dec_down_##SFX(                             \
      const WT* down, SCALE const u16* h, const void* idx, int idx64, const void* tw, int tw_dt, int N, int topk, \
      int E, int H, int I, void* out, int out_dt, const WT* sdn SSCALE, const void* slogit, int slogit_stride) { \
    dec_down<F16, W8>(down, SCALE_ARG, h, idx, idx64, tw, tw_dt, N, topk, E, H, I, out, out_dt, sdn,            \
                      SSCALE_ARG, slogit, slogit_stride);                                                        \
  }
#define NO_SCALE
#define FP8_SCALE const float* scale,
#define FP8_SSCALE , const float* sscale
MOE_DEC(bf16, false, false, u16, NO_SCALE, nullptr, NO_SCALE, nullptr)
MOE_DEC(f16, true, false, u16, NO_SCALE, nullptr, NO_SCALE, nullptr)
MOE_DEC(fp8_bf16, false, true, unsigned char, FP8_SCALE, scale, FP8_SSCALE, sscale)
MOE_DEC(fp8_f16, true, true, unsigned char, FP8_SCALE, scale, FP8_SSCALE, sscale)
