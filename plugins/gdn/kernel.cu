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

// rawld_row: the E (2 or 4) elements of a row at element `base` in one vector load (fp32 words in order, or 16-bit
// pairs in the low words; base * element size aligned to that load); row_elem converts one (rawf, common.cuh).
template <int E>
__device__ __forceinline__ uint4 rawld_row(const void* p, int dt, i64 base) {
  uint4 r = make_uint4(0u, 0u, 0u, 0u);
  if (dt == DT_F32) {
    if (E == 4) r = *(const uint4*)((const float*)p + base);
    else { const uint2 t = *(const uint2*)((const float*)p + base); r.x = t.x; r.y = t.y; }
  } else {
    if (E == 4) { const uint2 t = *(const uint2*)((const u16*)p + base); r.x = t.x; r.y = t.y; }
    else r.x = *(const unsigned*)((const u16*)p + base);
  }
  return r;
}
template <int E>
__device__ __forceinline__ float row_elem(const uint4& r, int e, int dt) {
  const unsigned wv[4] = {r.x, r.y, r.z, r.w};
  if (dt == DT_F32) return __uint_as_float(wv[e]);
  return rawf((wv[e >> 1] >> (16 * (e & 1))) & 0xffffu, dt);
}

// c ? a : b as a register select (selp): the compiler must not turn a select of two array elements into a
// dynamic index, which would put the array in local memory.
__device__ __forceinline__ float sel(unsigned c, float a, float b) {
  float r;
  asm("{.reg .pred p; setp.ne.u32 p, %1, 0; selp.f32 %0, %2, %3, p;}" : "=f"(r) : "r"(c), "f"(a), "f"(b));
  return r;
}

// One butterfly stage over pd[0 .. 2H): the lane keeps the half its bit H selects, summed with the partner lane's
// copy of it (lane ^ H), in pd[0 .. H). After stages 16, 8, 4, 2, 1 lane l holds the sum over the warp of pd[l].
template <int H>
__device__ __forceinline__ void fold_half(float* pd, int lane) {
  const unsigned hi = lane & H;
#pragma unroll
  for (int u = 0; u < H; ++u) {
    const float send = sel(hi, pd[u], pd[u + H]), keep = sel(hi, pd[u + H], pd[u]);
    pd[u] = keep + __shfl_xor_sync(0xffffffffu, send, H);
  }
}

// The model's gates from its raw columns a (in g) and b (in beta), in fp32 (reference.gdn_gates): g = -exp(A_log)
// softplus(a + dt_bias) with torch's softplus threshold 20, beta = sigmoid(b). One definition for every kernel that
// computes them, so the fold data and an in-kernel commit see the same bits.
__device__ __forceinline__ void gdn_gates(float& g, float& beta, float A_log, float dt_bias) {
  const float x = g + dt_bias;
  g = -expf(A_log) * (x > 20.f ? x : log1pf(expf(x)));
  beta = 1.f / (1.f + expf(-beta));
}

// l2norm of a row of DK = 32 E values, lane l holding elements l*E..l*E+E-1: the factor rsqrt(sum x^2 + eps) * mul
// every element is multiplied by (q: mul = the scale, k: 1). One definition for every kernel (the same k_hat bits).
template <int E>
__device__ __forceinline__ float l2norm_factor(const float (&x)[E], float mul) {
  float ss = 0.f;
#pragma unroll
  for (int e = 0; e < E; ++e) ss += x[e] * x[e];
  ss = warp_sum(ss);
  return rsqrtf(ss + L2EPS) * mul;
}

// Shared memory beyond the static arrays (spec.wy16_dyn_smem, the launcher passes it): the W.S / Q.S partials
// of every state-row group, [KG][2][R][DVT], summed in one pass (no barrier per group), then U [R][DVT].
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
  static_assert(32 % R == 0, "a dot-product batch of step 2 holds whole rows");
  __shared__ __align__(16) float Ksh[R][KP];
  __shared__ __align__(16) float WQ[2 * DK * WS];  // Wt | Qt ; Qsh aliases Wt
  __shared__ __align__(16) float VU[R][DVT];      // raw v -> V'
  __shared__ float Am[R][R + 1], Pm[R][R + 1];
  __shared__ __align__(16) float Tt[R][R + 4];  // Tinv transposed, rows 16-byte aligned
  __shared__ float gam[R], bet[R], bge[R], eg[R], dcy[R];  // cumulative g, beta, beta e^g, e^g, e^(g_C - g)
  extern __shared__ __align__(16) float dyn[];
  float* red = dyn;                       // [KG][2][R][DVT]: W.S | Q.S partials of state-row group kg
  float (*Ush)[DVT] = (float (*)[DVT])(dyn + KG * 2 * R * DVT);  // U [R][DVT]
  float* Wt = WQ;
  float* Qt = WQ + DK * WS;
  float* Qsh = WQ;

  const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
  const int kg = w % KG, cgi = w / KG, c = cgi * 32 + lane;
  const int b = blockIdx.z, hv = blockIdx.y, d0 = blockIdx.x * DVT;
  const int grp = Hv / Hk, hk = hv / grp;
  const int* slot_p = slot ? slot + b : nullptr;
  const i64 sb0 = slot_p ? (i64)*slot_p : (i64)b;  // first: the state's address waits on it
  const bool need_state = state_out != nullptr;
  float s[RPT];  // S[kg*RPT+m][d0+c], loaded in the first chunk once its rows' loads are in flight

  for (int c0 = 0; c0 < T; c0 += R) {
    const int C = min(R, T - c0);
    // 1. Issue every global load of the chunk first (no load waits behind another), then
    //    l2norm q, k rows (q also * scale); v tile; g, beta with chunk-local cumsum.
    //    Loads keep raw bits (rawld) and are converted once all are issued: a conversion right after its load
    //    would hold the warp for that load's whole latency, one load after another.
    constexpr int JPW = (2 * R + NW - 1) / NW, E = DK / 32, VPT = (R * DVT + NT - 1) / NT;
    uint4 rx[JPW];  // E elements of a q / k row: fp32 words, or 16-bit pairs in the low words
#pragma unroll
    for (int jj = 0; jj < JPW; ++jj) {
      const int job = w + jj * NW, i = job >> 1;
      const i64 base = ((i64)b * T + c0 + i) * rs_qk + hk * DK + lane * E;
      const void* src = (job & 1) ? q : k;
      rx[jj] = make_uint4(0u, 0u, 0u, 0u);
      if (job < 2 * R && i < C) rx[jj] = rawld_row<E>(src, in_dt, base);
    }
    unsigned rv[VPT];
#pragma unroll
    for (int u = 0; u < VPT; ++u) {
      const int e = tid + u * NT, i = e / DVT, cc = e % DVT;
      rv[u] = 0u;
      if (i < C && e < R * DVT) rv[u] = rawld(v, in_dt, ((i64)b * T + c0 + i) * rs_v + hv * DV + d0 + cc);
    }
    unsigned rg = 0u, rb = 0u, ra = 0u, rd = 0u;
    if (w == 0 && lane < C) {
      const i64 idx = ((i64)b * T + c0 + lane) * rs_gb + hv;
      rg = rawld(g, gb_dt, idx);
      rb = rawld(beta, gb_dt, idx);
      if (A_log) { ra = rawld(A_log, p_dt, hv); rd = rawld(dt_bias, p_dt, hv); }
    }
    if (c0 == 0) {
      if (sb0 >= 0) {
        const float* sp = state + ((sb0 * Hv + hv) * (i64)DK + kg * RPT) * DV + d0 + c;
#pragma unroll
        for (int m = 0; m < RPT; ++m) s[m] = sp[(i64)m * DV];
      } else {
#pragma unroll
        for (int m = 0; m < RPT; ++m) s[m] = 0.f;
      }
    }
    float x[JPW][E];
#pragma unroll
    for (int jj = 0; jj < JPW; ++jj)
#pragma unroll
      for (int e = 0; e < E; ++e) x[jj][e] = row_elem<E>(rx[jj], e, in_dt);
    float xv[VPT];
#pragma unroll
    for (int u = 0; u < VPT; ++u) xv[u] = rawf(rv[u], in_dt);
    float gi = 0.f, bi = 0.f;
    if (w == 0 && lane < C) {
      gi = rawf(rg, gb_dt);
      bi = rawf(rb, gb_dt);
      if (A_log) gdn_gates(gi, bi, rawf(ra, p_dt), rawf(rd, p_dt));
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
      const float r = l2norm_factor<E>(x[jj], isq ? scale : 1.f);
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
      const float gC = __shfl_sync(0xffffffffu, gi, R - 1);
      if (lane < R) {  // each exponential once: steps 4, 6 and 7 read them
        const float e = expf(gi);
        gam[lane] = gi; bet[lane] = bi; eg[lane] = e; bge[lane] = bi * e; dcy[lane] = expf(gC - gi);
      }
    }
    __syncthreads();
    // 2. A = beta_i (k_i.k_j) e^{g_i-g_j} (i>j);  P = (q_i.k_j) e^{g_i-g_j} (i>=j). The 2 R^2 dot products in
    //    batches of 32 per warp: lane l sums its E dims of each, then a butterfly over the lanes leaves dot l of
    //    the batch in lane l (one fixed tree per dot, whatever R: a row's sums do not depend on T).
    {
      constexpr int RB = 32 / R, NB = 2 * R / RB;  // rows (of K then Q) per batch, batches
      for (int bt = w; bt < NB; bt += NW) {
        float xr[RB][E];
#pragma unroll
        for (int r = 0; r < RB; ++r) {
          const int vr = bt * RB + r;  // K rows 0..R-1, then Q rows
          const float* row = vr < R ? &Ksh[vr < R ? vr : 0][0] : &Qsh[(vr < R ? 0 : vr - R) * KP];  // one load each
#pragma unroll
          for (int e = 0; e < E; ++e) xr[r][e] = row[lane * E + e];
        }
        float pd[32];
#pragma unroll
        for (int u = 0; u < 32; ++u) {  // dot u: row u / R of the batch with K row u % R
          float acc = 0.f;
#pragma unroll
          for (int e = 0; e < E; ++e) acc += xr[u / R][e] * Ksh[u % R][lane * E + e];
          pd[u] = acc;
        }
        fold_half<16>(pd, lane), fold_half<8>(pd, lane), fold_half<4>(pd, lane), fold_half<2>(pd, lane);
        fold_half<1>(pd, lane);
        const int vr = bt * RB + lane / R, j = lane % R, i = vr % R;
        const bool isp = vr >= R;
        float val = 0.f;
        if (i >= j && i < C) {
          const float e = expf(gam[i] - gam[j]);
          val = isp ? pd[0] * e : (i > j ? bet[i] * pd[0] * e : 0.f);
        }
        if (isp) Pm[i][j] = val; else Am[i][j] = val;
      }
    }
    __syncthreads();
    // 3. Tinv = (I + A)^-1 by forward substitution, one column per lane (stored transposed: Tt[m][i] = Tinv[i][m]).
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
      for (int i = 0; i < R; ++i) Tt[lane][i] = t[i];
    }
    __syncthreads();
    // 4. W = Tinv diag(beta e^g) K (stored transposed); U = Tinv diag(beta) V: DK + DVT columns, each split into S
    //    blocks of R/S rows so every thread of the CTA has a share; warp-uniform (DK and DVT are multiples of 32).
    //    Every row sums m = 0..R-1 in order (Tinv is 0 above the diagonal).
    {
      constexpr int COLS = DK + DVT, S = (NT >= 4 * COLS && R % 16 == 0) ? 4 : (NT >= 2 * COLS && R % 8 == 0) ? 2 : 1;
      constexpr int RS = R / S;  // a multiple of 4: Tt rows read as float4
      for (int job = tid; job < COLS * S; job += NT) {
        const int col = job % COLS, i0 = job / COLS * RS;
        const bool isw = col < DK;
        const float* src = isw ? &Ksh[0][col] : &VU[0][isw ? 0 : col - DK];
        const float* scl = isw ? bge : bet;
        const int stride = isw ? KP : DVT;
        float acc[RS];
#pragma unroll
        for (int r = 0; r < RS; ++r) acc[r] = 0.f;
#pragma unroll 4
        for (int m = 0; m < R; ++m) {
          const float bm = scl[m] * src[m * stride];
#pragma unroll
          for (int r4 = 0; r4 < RS / 4; ++r4) {
            const float4 t4 = *(const float4*)&Tt[m][i0 + 4 * r4];
            acc[4 * r4] += t4.x * bm; acc[4 * r4 + 1] += t4.y * bm; acc[4 * r4 + 2] += t4.z * bm; acc[4 * r4 + 3] += t4.w * bm;
          }
        }
#pragma unroll
        for (int r = 0; r < RS; ++r) {
          if (isw) Wt[col * WS + i0 + r] = acc[r]; else Ush[i0 + r][col - DK] = acc[r];
        }
      }
    }
    if (blockIdx.x == 0 && k_hat && hv % grp == 0)  // fold data: k_hat, one CTA per k-head
      for (int e = tid; e < C * DK; e += NT) {
        const int i = e / DK, d = e % DK;
        k_hat[(((i64)b * T + c0 + i) * Hk + hk) * DK + d] = Ksh[i][d];
      }
    __syncthreads();
    // 5. W.S and Q.S over this warp's RPT state rows, into this group's partials.
    {
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
      float* rw = red + kg * 2 * R * DVT;
#pragma unroll
      for (int i = 0; i < R; ++i) { rw[i * DVT + c] = aw[i]; rw[(R + i) * DVT + c] = aq[i]; }
    }
    __syncthreads();
    // 6. Sum the groups' partials in group order (deterministic; the order of every form with this KG), then
    //    V' = U - W.S; Q.S stays in group 0's slot for step 7.
    for (int e = tid; e < 2 * R * DVT; e += NT) {
      float acc = red[e];
#pragma unroll
      for (int kq = 1; kq < KG; ++kq) acc += red[kq * 2 * R * DVT + e];
      const int i = e / DVT, cc = e % DVT;
      if (i < R) VU[i][cc] = Ush[i][cc] - acc;  // warp-uniform: R * DVT is a multiple of 32
      else red[e] = acc;
    }
    __syncthreads();
    // 7. O = e^g Q.S + P V';  S <- e^{g_C} S + K^T diag(e^{g_C - g}) V' (only if another chunk follows or
    //    state wanted)
    const float* redQ = red + R * DVT;
    for (int e = tid; e < R * DVT; e += NT) {
      const int i = e / DVT, cc = e % DVT;
      if (i >= C) continue;
      float out = eg[i] * redQ[e];
      for (int j = 0; j <= i; ++j) out += Pm[i][j] * VU[j][cc];
      stf(o, o_dt, (((i64)b * T + c0 + i) * Hv + hv) * DV + d0 + cc, out);
    }
    if (need_state || c0 + R < T) {
      float vs[R];
#pragma unroll
      for (int i = 0; i < R; ++i) vs[i] = dcy[i] * VU[i][c];
      const float dec = eg[R - 1];
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
#include "gdn/decode.cuh"  // gdn_decode: a one-row step that commits its state in place (GDN_DECODE)

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
GDN_DECODE(128, 1)
GDN_DECODE(128, 2)
GDN_DECODE(64, 1)
GDN_DECODE(64, 2)
