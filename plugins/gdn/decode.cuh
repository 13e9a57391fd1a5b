// gdn_decode: one row per sequence (T = 1) of the gated delta rule that commits its own state, included by
// gdn/kernel.cu after fold.cuh (fold_row, gdn_gates, l2norm_factor). Instantiates gdn_decode_dk{DK}_cg{CG} for each
// (DK, CG) of spec.DECODE_CG.
// A plain decode step commits exactly its one row, so the state can be folded where it is read: one read and one
// write of the state, where gdn_wy16 (read) + gdn_fold (read + write) take three passes. The new state is
// fold_row's (the bits gdn_fold leaves from gdn_wy16's fold data of the same row: gates, l2norm and v conversion
// are the same functions), so decode and speculative steps carry one state; o = S_new^T q_hat sums the state rows
// in the fold's order (equal to gdn_wy16's o in exact arithmetic, not bit for bit).
// pool[slot[b]] is written in place when n[b] > 0 and slot[b] >= 0; slot < 0 reads a zero state and writes nothing.
// q, k [B, Hk, DK] rows rs_qk apart, v [B, Hv, DV] rows rs_v apart; g, beta [B, Hv] rows rs_gb apart (with A_log and
// dt_bias [Hv]: the raw gate columns a, b); pool [num_slots, Hv, DK, DV] fp32 (one layer); o [B, Hv, DV].
// grid (DV / (32 * CG), Hv, B), DK * CG threads in the fold's layout.
template <int DK, int CG>
__device__ __forceinline__ void gdn_decode_body(
    const void* __restrict__ q, const void* __restrict__ k, const void* __restrict__ v, int in_dt,
    const void* __restrict__ g, const void* __restrict__ beta, int gb_dt,
    const void* __restrict__ A_log, const void* __restrict__ dt_bias, int p_dt,
    float* __restrict__ pool, const int* __restrict__ slot, const int* __restrict__ n,
    void* __restrict__ o, int o_dt, int Hk, int Hv, int DV, float scale, int rs_qk, int rs_v, int rs_gb) {
  constexpr int DVT = 32 * CG, NT = DK * CG, C4 = DVT / 4, RS = NT / C4, NR = DK / RS, E = DK / 32;
  static_assert(RS == DK / 8 && NR == 8 && RS <= 32 && NT >= 64, "fold layout, two warps for k and q");
  __shared__ __align__(16) float Ks[DK];
  __shared__ __align__(16) float Qs[DK];
  __shared__ __align__(16) float Vs[DVT];
  __shared__ float gate[2];
  const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, r0 = tid % RS, c4 = tid / RS;
  const int b = blockIdx.z, hv = blockIdx.y, d0 = blockIdx.x * DVT, hk = hv / (Hv / Hk);
  const i64 sl = slot ? (i64)slot[b] : (i64)b;
  const bool commit = sl >= 0 && n[b] > 0;
  float* base = pool + (sl < 0 ? 0 : sl * Hv + hv) * (i64)DK * DV + d0 + 4 * c4;
  // every load in flight before any waits: the state tile, then the row's k (warp 0), q (warp 1), v and gates
  float4 s[NR];
#pragma unroll
  for (int m = 0; m < NR; ++m)
    s[m] = sl >= 0 ? *(const float4*)(base + (i64)(r0 + m * RS) * DV) : make_float4(0.f, 0.f, 0.f, 0.f);
  uint4 rx = make_uint4(0u, 0u, 0u, 0u);
  if (w < 2) rx = rawld_row<E>(w ? q : k, in_dt, (i64)b * rs_qk + hk * DK + lane * E);
  const unsigned rv = tid < DVT ? rawld(v, in_dt, (i64)b * rs_v + hv * DV + d0 + tid) : 0u;
  unsigned rg = 0u, rb = 0u, ra = 0u, rd = 0u;
  if (tid == 0) {
    rg = rawld(g, gb_dt, (i64)b * rs_gb + hv);
    rb = rawld(beta, gb_dt, (i64)b * rs_gb + hv);
    if (A_log) { ra = rawld(A_log, p_dt, hv); rd = rawld(dt_bias, p_dt, hv); }
  }
  if (w < 2) {
    float x[E];
#pragma unroll
    for (int e = 0; e < E; ++e) x[e] = row_elem<E>(rx, e, in_dt);
    const float r = l2norm_factor<E>(x, w ? scale : 1.f);
    float* dst = w ? Qs : Ks;
#pragma unroll
    for (int e = 0; e < E; ++e) dst[lane * E + e] = x[e] * r;
  }
  if (tid < DVT) Vs[tid] = rawf(rv, in_dt);
  if (tid == 0) {
    float gi = rawf(rg, gb_dt), bi = rawf(rb, gb_dt);
    if (A_log) gdn_gates(gi, bi, rawf(ra, p_dt), rawf(rd, p_dt));
    gate[0] = gi;
    gate[1] = bi;
  }
  __syncthreads();
  fold_row<NR, RS>(s, Ks, r0, expf(gate[0]), gate[1], *(const float4*)&Vs[4 * c4]);
  float4 po = make_float4(0.f, 0.f, 0.f, 0.f);  // this thread's rows of S_new^T q_hat
#pragma unroll
  for (int m = 0; m < NR; ++m) {
    const float qv = Qs[r0 + m * RS];
    po.x += qv * s[m].x; po.y += qv * s[m].y; po.z += qv * s[m].z; po.w += qv * s[m].w;
  }
  quad_sum<RS>(po);
  if (r0 == 0) {
    const i64 oi = ((i64)b * Hv + hv) * DV + d0 + 4 * c4;
    stf(o, o_dt, oi, po.x); stf(o, o_dt, oi + 1, po.y); stf(o, o_dt, oi + 2, po.z); stf(o, o_dt, oi + 3, po.w);
  }
  if (commit) {
#pragma unroll
    for (int m = 0; m < NR; ++m) *(float4*)(base + (i64)(r0 + m * RS) * DV) = s[m];
  }
}

#define GDN_DECODE(DK, CG)                                                                                    \
  extern "C" __global__ void __launch_bounds__(DK * CG) gdn_decode_dk##DK##_cg##CG(                           \
      const void* q, const void* k, const void* v, int in_dt, const void* g, const void* beta, int gb_dt,     \
      const void* A_log, const void* dt_bias, int p_dt, float* pool, const int* slot, const int* n, void* o,  \
      int o_dt, int Hk, int Hv, int DV, float scale, int rs_qk, int rs_v, int rs_gb) {                        \
    pdl_wait();                                                                                               \
    gdn_decode_body<DK, CG>(q, k, v, in_dt, g, beta, gb_dt, A_log, dt_bias, p_dt, pool, slot, n, o, o_dt, Hk,  \
                            Hv, DV, scale, rs_qk, rs_v, rs_gb);                                               \
  }
