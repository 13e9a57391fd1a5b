// Gated DeltaNet kernels: chunked WY verify/prefill (GdnChunkWY16) and the fold-accepted commit (gdn_fold).
// Math: DESIGN §3. One CTA per (dv tile of 32*CG columns, v-head, sequence); dv columns of the
// state are independent in the delta rule, so a CTA owns S[:, tile] (fp32, in registers: warp w
// holds rows kg*RPT..kg*RPT+RPT-1 of column lane) for the whole call. RPT (state rows per thread: 32, 16
// or 8) trades registers per thread for warps per tile: a narrow grid (batch 1, few heads) is latency
// bound, and 2-4x the warps on each tile shorten its serial chains (launch._gdn_rpt picks the form).
// GVA native: v-head h reads k-head h / (Hv/Hk). Inputs q,k [B,T,Hk,DK], v [B,T,Hv,DV], g,beta [B,T,Hv],
// each row (b,t) packed, rows rs_qk / rs_v / rs_gb elements apart: views of wider rows (q|k|v of the conv
// output, the gate columns of the input projection) are read in place, no copy kernel before the call.
// With A_log / dt_bias [Hv] given (dtype p_dt), g and beta are the model's raw gate columns a, b and the
// gates are computed here, in fp32: g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b)
// (reference.gdn_gates) -- no gate kernels before the call.
#include "common.cuh"
#define WS 20   // row stride of the transposed W / Q tiles (bank-conflict free float4 stores)
#ifndef L2EPS
#error "L2EPS (the l2norm epsilon) comes from gdn/spec.py through NVRTC -D options"
#endif

template <int DK, int CG, int R, int RPT>
__device__ __forceinline__ void gdn_wy16_body(
    const void* __restrict__ q, const void* __restrict__ k, const void* __restrict__ v, int in_dt,
    const void* __restrict__ g, const void* __restrict__ beta, int gb_dt,
    const void* __restrict__ A_log, const void* __restrict__ dt_bias, int p_dt,
    const float* __restrict__ state, const int* __restrict__ slot,
    void* __restrict__ o, int o_dt, float* __restrict__ k_hat, float* __restrict__ v_f,
    float* __restrict__ g_f, float* __restrict__ b_f, float* __restrict__ state_out,
    int T, int Hk, int Hv, int DV, float scale, int rs_qk, int rs_v, int rs_gb) {
  constexpr int DVT = 32 * CG, KG = DK / RPT, NT = 32 * KG * CG, NW = NT / 32, KP = DK + 4;
  static_assert(DK % RPT == 0 && DK >= 32, "state rows per thread");
  static_assert(R * KP <= DK * WS, "Qsh alias");
  static_assert(2 * R * DVT <= 2 * DK * WS, "red alias");
  __shared__ __align__(16) float Ksh[R][KP];
  __shared__ __align__(16) float WQ[2 * DK * WS];  // Wt | Qt ; Qsh aliases Wt ; red aliases all
  __shared__ __align__(16) float VU[R][DVT];      // raw v -> U -> V'
  __shared__ float Am[R][R + 1], Tm[R][R + 1], Pm[R][R + 1];
  __shared__ float gam[R], bet[R];
  float* Wt = WQ;
  float* Qt = WQ + DK * WS;
  float* Qsh = WQ;

  const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
  const int kg = w % KG, cgi = w / KG, c = cgi * 32 + lane;
  const int b = blockIdx.z, hv = blockIdx.y, d0 = blockIdx.x * DVT;
  const int grp = Hv / Hk, hk = hv / grp;
  const i64 sb = slot ? (i64)slot[b] : (i64)b;

  float s[RPT];  // S[kg*RPT+m][d0+c]
  if (sb >= 0) {
    const float* sp = state + ((sb * Hv + hv) * (i64)DK + kg * RPT) * DV + d0 + c;
#pragma unroll
    for (int m = 0; m < RPT; ++m) s[m] = sp[(i64)m * DV];
  } else {
#pragma unroll
    for (int m = 0; m < RPT; ++m) s[m] = 0.f;
  }
  const bool need_state = state_out != nullptr;

  for (int c0 = 0; c0 < T; c0 += R) {
    const int C = min(R, T - c0);
    // 1. Issue every global load of the chunk first (no load waits behind another), then
    //    l2norm q, k rows (q also * scale); v tile; g, beta with chunk-local cumsum.
    constexpr int JPW = (2 * R + NW - 1) / NW, E = DK / 32, VPT = (R * DVT + NT - 1) / NT;
    float x[JPW][E];
#pragma unroll
    for (int jj = 0; jj < JPW; ++jj) {
      const int job = w + jj * NW, i = job >> 1;
      const i64 base = ((i64)b * T + c0 + i) * rs_qk + hk * DK + lane * E;
      const void* src = (job & 1) ? q : k;
      if (job < 2 * R && i < C) {
        if (E == 4) {
          const float4 t4 = ld4(src, in_dt, base);
          x[jj][0] = t4.x; x[jj][1 % E] = t4.y; x[jj][2 % E] = t4.z; x[jj][3 % E] = t4.w;
        } else {
#pragma unroll
          for (int e = 0; e < E; ++e) x[jj][e] = ldf(src, in_dt, base + e);
        }
      } else {
#pragma unroll
        for (int e = 0; e < E; ++e) x[jj][e] = 0.f;
      }
    }
    float xv[VPT];
#pragma unroll
    for (int u = 0; u < VPT; ++u) {
      const int e = tid + u * NT, i = e / DVT, cc = e % DVT;
      xv[u] = i < C && e < R * DVT ? ldf(v, in_dt, ((i64)b * T + c0 + i) * rs_v + hv * DV + d0 + cc) : 0.f;
    }
    float gi = 0.f, bi = 0.f;
    if (w == 0 && lane < C) {
      const i64 idx = ((i64)b * T + c0 + lane) * rs_gb + hv;
      gi = ldf(g, gb_dt, idx);
      bi = ldf(beta, gb_dt, idx);
      if (A_log) {  // torch's softplus (threshold 20) and sigmoid, in fp32
        const float x = gi + ldf(dt_bias, p_dt, hv);
        gi = -expf(ldf(A_log, p_dt, hv)) * (x > 20.f ? x : log1pf(expf(x)));
        bi = 1.f / (1.f + expf(-bi));
      }
      if (blockIdx.x == 0 && g_f) {  // fold data: the row's gates as the recurrence reads them
        const i64 fi = ((i64)b * T + c0 + lane) * Hv + hv;
        g_f[fi] = gi;
        b_f[fi] = bi;
      }
    }
#pragma unroll
    for (int jj = 0; jj < JPW; ++jj) {
      const int job = w + jj * NW, i = job >> 1;
      const bool isq = job & 1;
      if (job >= 2 * R) continue;  // warp-uniform
      float ss = 0.f;
#pragma unroll
      for (int e = 0; e < E; ++e) ss += x[jj][e] * x[jj][e];
      ss = warp_sum(ss);
      const float r = rsqrtf(ss + L2EPS) * (isq ? scale : 1.f);
#pragma unroll
      for (int e = 0; e < E; ++e) {
        const int d = lane * E + e;
        if (isq) { Qsh[i * KP + d] = x[jj][e] * r; Qt[d * WS + i] = x[jj][e] * r; }
        else Ksh[i][d] = x[jj][e] * r;
      }
    }
#pragma unroll
    for (int u = 0; u < VPT; ++u) {
      const int e = tid + u * NT, i = e / DVT, cc = e % DVT;
      if (e < R * DVT) VU[i][cc] = xv[u];
      if (v_f && i < C && e < R * DVT) v_f[(((i64)b * T + c0 + i) * Hv + hv) * DV + d0 + cc] = xv[u];  // fold data
    }
    if (w == 0) {
#pragma unroll
      for (int off = 1; off < 32; off <<= 1) {
        const float t = __shfl_up_sync(0xffffffffu, gi, off);
        if (lane >= off) gi += t;
      }
      if (lane < R) { gam[lane] = gi; bet[lane] = bi; }
    }
    __syncthreads();
    // 2. A = beta_i (k_i.k_j) e^{g_i-g_j} (i>j);  P = (q_i.k_j) e^{g_i-g_j} (i>=j).
    for (int p = tid; p < R * R; p += NT) {
      const int i = p / R, j = p % R;
      float a = 0.f, pq = 0.f;
      if (i >= j && i < C) {
        float dkk = 0.f, dqk = 0.f;
#pragma unroll 2
        for (int d = 0; d < DK; d += 4) {
          const float4 kj = *(const float4*)&Ksh[j][d];
          const float4 ki = *(const float4*)&Ksh[i][d];
          const float4 qi = *(const float4*)&Qsh[i * KP + d];
          dkk += ki.x * kj.x + ki.y * kj.y + ki.z * kj.z + ki.w * kj.w;
          dqk += qi.x * kj.x + qi.y * kj.y + qi.z * kj.z + qi.w * kj.w;
        }
        const float e = expf(gam[i] - gam[j]);
        if (i > j) a = bet[i] * dkk * e;
        pq = dqk * e;
      }
      Am[i][j] = a;
      Pm[i][j] = pq;
    }
    __syncthreads();
    // 3. Tinv = (I + A)^-1 by forward substitution, one column per lane.
    if (w == 0 && lane < R) {
      float t[R];
#pragma unroll
      for (int i = 0; i < R; ++i) {
        float acc = (i == lane) ? 1.f : 0.f;
#pragma unroll
        for (int m = 0; m < i; ++m) acc -= Am[i][m] * t[m];
        t[i] = acc;
      }
#pragma unroll
      for (int i = 0; i < R; ++i) Tm[i][lane] = t[i];
    }
    __syncthreads();
    // 4. W = Tinv diag(beta e^g) K (stored transposed); U = Tinv diag(beta) V: DK + DVT independent column jobs
    //    over all the CTA's threads (warp-uniform: DK is a multiple of 32).
    for (int job = tid; job < DK + DVT; job += NT) {
      if (job >= DK) {
        const int cc = job - DK;
        float bv[R];
#pragma unroll
        for (int m = 0; m < R; ++m) bv[m] = bet[m] * VU[m][cc];
#pragma unroll 1
        for (int i = 0; i < R; ++i) {
          float acc = 0.f;
#pragma unroll
          for (int m = 0; m < R; ++m) acc += Tm[i][m] * bv[m];
          VU[i][cc] = acc;
        }
        continue;
      }
      const int kk = job;
      float bk[R];
#pragma unroll
      for (int m = 0; m < R; ++m) bk[m] = bet[m] * expf(gam[m]) * Ksh[m][kk];
      float wv[R];
#pragma unroll
      for (int i = 0; i < R; ++i) wv[i] = 0.f;
#pragma unroll 1
      for (int m = 0; m < R; ++m) {
        const float bm = bk[m];
#pragma unroll
        for (int i = 0; i < R; ++i) wv[i] += Tm[i][m] * bm;  // Tm[i][m] = 0 for m > i
      }
#pragma unroll
      for (int i4 = 0; i4 < R / 4; ++i4)
        *(float4*)&Wt[kk * WS + 4 * i4] = make_float4(wv[4 * i4], wv[4 * i4 + 1], wv[4 * i4 + 2], wv[4 * i4 + 3]);
    }
    if (blockIdx.x == 0 && k_hat && hv % grp == 0)  // fold data: k_hat, one CTA per k-head
      for (int e = tid; e < C * DK; e += NT) {
        const int i = e / DK, d = e % DK;
        k_hat[(((i64)b * T + c0 + i) * Hk + hk) * DK + d] = Ksh[i][d];
      }
    __syncthreads();
    // 5. W.S and Q.S over this warp's RPT state rows.
    float aw[R], aq[R];
#pragma unroll
    for (int i = 0; i < R; ++i) { aw[i] = 0.f; aq[i] = 0.f; }
#pragma unroll
    for (int m = 0; m < RPT; ++m) {
      const int kk = kg * RPT + m;
      const float sv = s[m];
      const float4* wr = (const float4*)&Wt[kk * WS];
      const float4* qr = (const float4*)&Qt[kk * WS];
#pragma unroll
      for (int i4 = 0; i4 < R / 4; ++i4) {
        const float4 a = wr[i4], bq = qr[i4];
        aw[4 * i4] += a.x * sv; aw[4 * i4 + 1] += a.y * sv; aw[4 * i4 + 2] += a.z * sv; aw[4 * i4 + 3] += a.w * sv;
        aq[4 * i4] += bq.x * sv; aq[4 * i4 + 1] += bq.y * sv; aq[4 * i4 + 2] += bq.z * sv; aq[4 * i4 + 3] += bq.w * sv;
      }
    }
    __syncthreads();
    // 6. Cross-warp (kk-group) reduction of W.S and Q.S into [R][DVT] buffers, in a fixed order
    //    (deterministic); then V' = U - W.S and O = e^g Q.S + P V'.
    float* redW = WQ;
    float* redQ = WQ + R * DVT;
#pragma unroll 1
    for (int kq = 0; kq < KG; ++kq) {
      if (kg == kq) {
#pragma unroll
        for (int i = 0; i < R; ++i) {
          redW[i * DVT + c] = (kq ? redW[i * DVT + c] : 0.f) + aw[i];
          redQ[i * DVT + c] = (kq ? redQ[i * DVT + c] : 0.f) + aq[i];
        }
      }
      __syncthreads();
    }
    for (int e = tid; e < R * DVT; e += NT) {
      const int i = e / DVT, cc = e % DVT;
      const float vp = VU[i][cc] - redW[e];
      VU[i][cc] = vp;
    }
    __syncthreads();
    for (int e = tid; e < R * DVT; e += NT) {
      const int i = e / DVT, cc = e % DVT;
      if (i >= C) continue;
      float out = expf(gam[i]) * redQ[e];
      for (int j = 0; j <= i; ++j) out += Pm[i][j] * VU[j][cc];
      stf(o, o_dt, (((i64)b * T + c0 + i) * Hv + hv) * DV + d0 + cc, out);
    }
    // 7. S <- e^{g_C} S + K^T diag(e^{g_C - g}) V'  (only if another chunk follows or state wanted)
    if (need_state || c0 + R < T) {
      const float gC = gam[R - 1];
      float vs[R];
#pragma unroll
      for (int i = 0; i < R; ++i) vs[i] = expf(gC - gam[i]) * VU[i][c];
      const float dec = expf(gC);
#pragma unroll
      for (int m = 0; m < RPT; ++m) {
        const int kk = kg * RPT + m;
        float acc = dec * s[m];
#pragma unroll
        for (int i = 0; i < R; ++i) acc += Ksh[i][kk] * vs[i];
        s[m] = acc;
      }
    }
    __syncthreads();
  }
  if (need_state) {  // the final state (prefill) is indexed by sequence b; the runtime commits it to the slot
    float* sp = state_out + (((i64)b * Hv + hv) * (i64)DK + kg * RPT) * DV + d0 + c;
#pragma unroll
    for (int m = 0; m < RPT; ++m) sp[(i64)m * DV] = s[m];
  }
}

#include "gdn/fold.cuh"  // the commit kernel gdn_fold: its body and GDN_FOLD

// gdn_wy16_dk{DK}_cg{CG}_p{RPT}_r{R}: CTA of 32 * (DK / RPT) * CG threads, MINB of them per SM at least
#define GDN_WY16(DK, CG, RPT, R, MINB)                                                                     \
  extern "C" __global__ void __launch_bounds__(32 * (DK / RPT) * CG, MINB)                                \
      gdn_wy16_dk##DK##_cg##CG##_p##RPT##_r##R(                                                         \
          const void* q, const void* k, const void* v, int in_dt, const void* g, const void* beta,        \
          int gb_dt, const void* A_log, const void* dt_bias, int p_dt, const float* state,                \
          const int* slot, void* o, int o_dt, float* k_hat, float* v_f, float* g_f, float* b_f,           \
          float* state_out, int T, int Hk, int Hv, int DV, float scale, int rs_qk, int rs_v,              \
          int rs_gb) {                                                                                    \
    pdl_wait();                                                                                           \
    gdn_wy16_body<DK, CG, R, RPT>(q, k, v, in_dt, g, beta, gb_dt, A_log, dt_bias, p_dt, state, slot,      \
                                  o, o_dt, k_hat, v_f, g_f, b_f, state_out, T, Hk, Hv, DV, scale,         \
                                  rs_qk, rs_v, rs_gb);                                                    \
  }
// every (DK, CG, RPT) of spec.WY16_FORMS at each chunk-row count of spec.CHUNK_ROWS
#define GDN_WY16_R(DK, CG, RPT, MINB) \
  GDN_WY16(DK, CG, RPT, 4, MINB) GDN_WY16(DK, CG, RPT, 8, MINB) GDN_WY16(DK, CG, RPT, 16, MINB)
GDN_WY16_R(128, 1, 32, 3)
GDN_WY16_R(128, 1, 16, 2)
GDN_WY16_R(128, 1, 8, 1)
GDN_WY16_R(128, 2, 32, 1)
GDN_WY16_R(128, 4, 32, 1)
GDN_WY16_R(64, 1, 32, 6)
GDN_WY16_R(64, 1, 16, 3)
GDN_WY16_R(64, 1, 8, 2)
GDN_WY16_R(64, 2, 32, 3)
GDN_FOLD(128, 1)
GDN_FOLD(128, 2)
GDN_FOLD(64, 1)
GDN_FOLD(64, 2)
