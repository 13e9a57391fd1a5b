// gdn_fold: the fold-accepted commit of GdnChunkWY16's fold data (DESIGN §3), included by gdn/kernel.cu after
// common.cuh. Instantiates gdn_fold_dk{DK}_cg{CG} for each (DK, CG) of spec.FOLD_CG.
// Rows are replayed one at a time rather than folded in closed form over V' rows (one pass, but other fp32
// roundings than n one-row steps); the rows' serial dependence (u_i needs S_(i-1)) is the cost (docs/PERF.md).
#define CH 16  // rows per shared-memory batch

// Sum p over the RS lanes that hold one column quad's rows: a fixed butterfly, so every lane ends with the same bits.
template <int RS>
__device__ __forceinline__ void quad_sum(float4& p) {
#pragma unroll
  for (int off = 1; off < RS; off <<= 1) {
    p.x += __shfl_xor_sync(0xffffffffu, p.x, off);
    p.y += __shfl_xor_sync(0xffffffffu, p.y, off);
    p.z += __shfl_xor_sync(0xffffffffu, p.z, off);
    p.w += __shfl_xor_sync(0xffffffffu, p.w, off);
  }
}

// One row of the recurrence on a thread's NR rows r0 + m*RS of four state columns (s): S' = e^g S; u = beta (v -
// S'^T k_hat); S = S' + k_hat u^T, with k_hat the row's [DK] keys, vv its four values, dec = e^g and bt = beta. The dk
// sum is a fixed butterfly over the RS lanes of one column quad (the same bits in every lane). Every kernel that
// commits a GDN row runs this function, so a state committed by any of them has the same bits.
template <int NR, int RS>
__device__ __forceinline__ void fold_row(float4 (&s)[NR], const float* k_hat, int r0, float dec, float bt, float4 vv) {
  float4 pr = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
  for (int m = 0; m < NR; ++m) {  // S' = e^g S, and this thread's rows of S'^T k_hat
    const float kv = k_hat[r0 + m * RS];
    s[m].x *= dec; s[m].y *= dec; s[m].z *= dec; s[m].w *= dec;
    pr.x += kv * s[m].x; pr.y += kv * s[m].y; pr.z += kv * s[m].z; pr.w += kv * s[m].w;
  }
  quad_sum<RS>(pr);
  const float4 u = make_float4(bt * (vv.x - pr.x), bt * (vv.y - pr.y), bt * (vv.z - pr.z), bt * (vv.w - pr.w));
#pragma unroll
  for (int m = 0; m < NR; ++m) {  // S = S' + k_hat u^T
    const float kv = k_hat[r0 + m * RS];
    s[m].x += kv * u.x; s[m].y += kv * u.y; s[m].z += kv * u.z; s[m].w += kv * u.w;
  }
}

// Fold the first n[b] rows of fold data into pool[l, slot[b]] in place, every layer l in one launch, one row at a
// time by the recurrence: S' = e^g S; u = beta (v - S'^T k_hat); S = S' + k_hat u^T. Each row's arithmetic is
// the same whatever n, T, CG or the launch (the dk reduction: a fixed butterfly over the RS lanes of one column
// quad, which leaves the same bits in every lane), so folding n rows at once gives exactly the state of n
// one-row folds: speculative and plain decoding carry one state. No barrier a row: only shuffles.
// n <= 0 or slot < 0: no-op. pool [L, num_slots, Hv, DK, DV]; k_hat [L, B, T, Hk, DK]; v [L, B, T, Hv, DV];
// g, beta [L, B, T, Hv]. grid (DV / (32*CG), Hv, L*B): blockIdx.z = l*B + b. n, slot read on the device.
template <int DK, int CG>
__device__ __forceinline__ void gdn_fold_body(
    float* __restrict__ pool, const int* __restrict__ slot, const float* __restrict__ k_hat,
    const float* __restrict__ v, const float* __restrict__ g, const float* __restrict__ beta,
    const int* __restrict__ n, int B, int num_slots, int T, int Hk, int Hv, int DV) {
  // thread (r0, c4) holds rows r0 + m*RS (m < NR) of columns 4*c4..4*c4+3: RS = DK/8 row groups at every CG,
  // the RS lanes of one column quad adjacent in a warp (r0 = lane % RS)
  constexpr int DVT = 32 * CG, NT = DK * CG, C4 = DVT / 4, RS = NT / C4, NR = DK / RS;
  static_assert(RS == DK / 8 && NR == 8 && RS <= 32, "fold layout");
  __shared__ __align__(16) float Ks[CH][DK];
  __shared__ __align__(16) float Vs[CH][DVT];
  __shared__ float gs[CH], bs[CH];
  const int tid = threadIdx.x, r0 = tid % RS, c4 = tid / RS;
  const int l = blockIdx.z / B, b = blockIdx.z % B;
  const int hv = blockIdx.y, d0 = blockIdx.x * DVT, hk = hv / (Hv / Hk);
  int nb = n[b];
  const i64 sl = slot ? (i64)slot[b] : (i64)b;
  if (nb <= 0 || sl < 0) return;
  nb = min(nb, T);
  // this layer's pool and fold data (the rest of the body indexes within one layer)
  pool += (i64)l * num_slots * Hv * DK * DV;
  k_hat += (i64)l * B * T * Hk * DK;
  v += (i64)l * B * T * Hv * DV;
  g += (i64)l * B * T * Hv;
  beta += (i64)l * B * T * Hv;
  float* base = pool + (sl * Hv + hv) * (i64)DK * DV + d0 + 4 * c4;
  float4 s[NR];
#pragma unroll
  for (int m = 0; m < NR; ++m) s[m] = *(const float4*)(base + (i64)(r0 + m * RS) * DV);
  constexpr int D4 = DK / 4, V4 = DVT / 4, KPT = CH * D4 / NT, VPT = (CH * V4 + NT - 1) / NT;
  static_assert(CH * D4 % NT == 0, "fold split");
  for (int i0 = 0; i0 < nb; i0 += CH) {
    const int cnt = min(CH, nb - i0);
    // the batch's rows to shared memory, all loads in flight together
    float4 kr[KPT], vr[VPT];
#pragma unroll
    for (int u = 0; u < KPT; ++u) {
      const int e = tid + u * NT, i = e / D4, d4 = e % D4;
      kr[u] = i < cnt ? *(const float4*)(k_hat + (((i64)b * T + i0 + i) * Hk + hk) * DK + 4 * d4)
                      : make_float4(0.f, 0.f, 0.f, 0.f);
    }
#pragma unroll
    for (int u = 0; u < VPT; ++u) {
      const int e = tid + u * NT, i = e / V4, cc4 = e % V4;
      vr[u] = i < cnt && e < CH * V4 ? *(const float4*)(v + (((i64)b * T + i0 + i) * Hv + hv) * DV + d0 + 4 * cc4)
                                     : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    const float gr = tid < cnt ? g[((i64)b * T + i0 + tid) * Hv + hv] : 0.f;
    const float br = tid < cnt ? beta[((i64)b * T + i0 + tid) * Hv + hv] : 0.f;
    __syncthreads();  // the previous batch's rows are no longer read
#pragma unroll
    for (int u = 0; u < KPT; ++u) {
      const int e = tid + u * NT, i = e / D4, d4 = e % D4;
      *(float4*)&Ks[i][4 * d4] = kr[u];
    }
#pragma unroll
    for (int u = 0; u < VPT; ++u) {
      const int e = tid + u * NT, i = e / V4, cc4 = e % V4;
      if (e < CH * V4) *(float4*)&Vs[i][4 * cc4] = vr[u];
    }
    if (tid < CH) { gs[tid] = gr; bs[tid] = br; }
    __syncthreads();
#pragma unroll 1
    for (int i = 0; i < cnt; ++i)
      fold_row<NR, RS>(s, Ks[i], r0, expf(gs[i]), bs[i], *(const float4*)&Vs[i][4 * c4]);
  }
#pragma unroll
  for (int m = 0; m < NR; ++m) *(float4*)(base + (i64)(r0 + m * RS) * DV) = s[m];
}

#define GDN_FOLD(DK, CG)                                                                          \
  extern "C" __global__ void __launch_bounds__(DK * CG) gdn_fold_dk##DK##_cg##CG(                 \
      float* pool, const int* slot, const float* k_hat, const float* v, const float* g,           \
      const float* beta, const int* n, int B, int num_slots, int T, int Hk, int Hv, int DV) {     \
    pdl_wait();                                                                                   \
    gdn_fold_body<DK, CG>(pool, slot, k_hat, v, g, beta, n, B, num_slots, T, Hk, Hv, DV);         \
  }
