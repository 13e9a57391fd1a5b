// The projection kernels with their weight stream through shared memory (sm_90 and newer): one producer warp copies
// each pass of a tile's 16 rows of w into a ring of stages with bulk asynchronous copies (cp.async.bulk, the bytes
// counted on an mbarrier), and the W consumer warps read their chunks from shared memory into the stream's registers
// (a[u], b[u]: MmaW16 of mma.cuh, MmaW8 of gemv_fp8/mma_fp8.cuh) and run its products.
//
// Why: the register stream (mma_body) keeps U slots of loads in flight per lane, about 32 KB per SM, and a lane's
// next loads wait for its products (FP8: the conversions too), so the loads in flight, not the bytes, bound it. Here
// the copies in flight are the ring's other stages whatever the consumers do (64 KB and more per SM), and they run
// ahead across tiles (the epilogue does not pause them).
//
// The sums are mma_body's: a chunk is 64 bytes of a row in both streams (32 16-bit or 64 fp8 columns), warp j takes
// the same chunks (pass p: chunks (p W + j) U .. + U - 1) in the same order, its slots past the row read as zeros
// (mma_body skips a pass with none; adding zeros changes no value), and the epilogue adds the warps' partials in warp
// order. So a row's result is bit for bit the register kernel's and depends only on (N, K).
//
// Shared memory: a stage holds rows 0..15 of the tile (SWIGLU: 8 gate rows, then their up rows) at a stride of the
// pass's bytes + 64: lanes g and g + 1 of a quarter warp then read opposite halves of the 32 banks. Each stage has
// two barriers: full (the producer's expect_tx; the copies' bytes complete it) and empty (one arrival per consumer
// warp once it has read the stage).
#pragma once
#include "common.cuh"
#include "gemv/mma.cuh"

#ifndef BULK_RING_BYTES
#error "BULK_RING_BYTES (shared memory of the weight ring) comes from gemv/spec.py through NVRTC -D options"
#endif

// A kernel entry's launch bounds and body call for the register stream (mma_body) and for this one, from the entry's
// names: its stream s, weights w, y, M, N, y_f32 (gemv/kernel.cu, gemv_fp8/kernel.cu).
#define REGS_BOUNDS(W) __launch_bounds__(W * 32)
#define REGS_RUN(NT, F16, U, W, SWIGLU) mma_body<NT, F16, U, W, SWIGLU>(s, y, M, N, y_f32)
#define BULK_BOUNDS(W) __launch_bounds__((W + 1) * 32, 1)
#define BULK_RUN(NT, F16, U, W, SWIGLU) bulk_body<NT, F16, U, W, SWIGLU>(s, w, y, M, N, y_f32)

#if __CUDA_ARCH__ >= 900
__device__ __forceinline__ unsigned smem_u32(const void* p) {
  unsigned r;
  asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(r) : "l"(p));
  return r;
}
__device__ __forceinline__ void mbar_init(unsigned bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(unsigned bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
// Returns once the phase of `parity` has completed (right away for the phase before the current one).
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
  asm volatile(
      "{\n .reg .pred done;\n WAIT:\n"
      " mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      " @!done bra WAIT;\n}" ::"r"(bar), "r"(parity) : "memory");
}
__device__ __forceinline__ void bulk_copy(unsigned dst, const void* src, unsigned bytes, unsigned bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
}
__device__ __forceinline__ void consumers_sync(int threads) {  // named barrier 1: the consumer warps only
  asm volatile("bar.sync 1, %0;" ::"r"(threads) : "memory");
}

// The ring of a kernel of W consumer warps and U chunks (64 bytes of a row each) a pass: as many stages of one pass
// as BULK_RING_BYTES holds, 2 to 8; its dynamic shared memory BYTES (spec.bulk_smem says the same).
template <int W, int U>
struct BulkRing {
  static constexpr int PASS = W * U * 64;     // bytes of a row per pass
  static constexpr int STRIDE = PASS + 64;    // bytes between rows of a stage
  static constexpr int STAGE = 16 * STRIDE;
  static constexpr int FIT = BULK_RING_BYTES / STAGE;
  static constexpr int STAGES = FIT < 2 ? 2 : FIT > 8 ? 8 : FIT;
  static constexpr int BYTES = STAGES * STAGE + 2 * STAGES * 8;
};

// The producer warp: for each tile of this CTA and each pass, wait until the stage is free, then lanes 0..15 copy
// their row's columns of the pass (rows past N re-read the last row, as mma_rows clamps them).
template <int W, int U, bool SWIGLU>
__device__ __forceinline__ void bulk_produce(const unsigned char* w, unsigned ring, unsigned full, unsigned empty,
                                             int N, int row_bytes, int tiles) {
  using R = BulkRing<W, U>;
  const int lane = threadIdx.x & 31;
  constexpr int TR = SWIGLU ? 8 : 16;
  const int passes = (row_bytes + R::PASS - 1) / R::PASS;
  int it = 0;
  for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const int n0 = tile * TR;
    int row;
    if constexpr (SWIGLU)
      row = lane < 8 ? min(n0 + lane, N / 2 - 1) : N / 2 + min(n0 + lane - 8, N / 2 - 1);
    else
      row = min(n0 + lane, N - 1);
    const unsigned char* src = w + (i64)row * row_bytes;
    for (int p = 0; p < passes; ++p, ++it) {
      const int s = it % R::STAGES;
      mbar_wait(empty + 8 * s, ((it / R::STAGES) & 1) ^ 1);
      const int c0 = p * R::PASS, bytes = min(R::PASS, row_bytes - c0);
      if (lane == 0) mbar_expect_tx(full + 8 * s, 16 * bytes);
      __syncwarp();
      if (lane < 16) bulk_copy(ring + s * R::STAGE + lane * R::STRIDE, src + c0, bytes, full + 8 * s);
    }
  }
}

// A consumer lane's slot u of stage `st`: its 16 bytes of rows g and g + 8 at chunk `ch` (the warp's u-th of the pass;
// its index in the pass: cp), zeros past the row.
template <int W, int U, class S>
__device__ __forceinline__ void bulk_read(S& s, const unsigned char* stage, int u, int ch, int cp) {
  using R = BulkRing<W, U>;
  const int g = (threadIdx.x & 31) >> 2, c = threadIdx.x & 3;
  const bool ok = ch * 4 + c < s.nv;
  const unsigned char* p = stage + g * R::STRIDE + cp * 64 + 16 * c;
  s.a[u] = ok ? *(const uint4*)p : make_uint4(0, 0, 0, 0);
  s.b[u] = ok ? *(const uint4*)(p + 8 * R::STRIDE) : make_uint4(0, 0, 0, 0);
}

// s: the stream (its loads of x, scales and products; its rows of w are s.nv 16-byte vectors); w: its weight bytes.
template <int NT, bool F16, int U, int W, bool SWIGLU, class S>
__device__ __forceinline__ void bulk_body(S& s, const void* w, void* y, int M, int N, int y_f32) {
  using R = BulkRing<W, U>;
  extern __shared__ __align__(128) unsigned char ring[];
  __shared__ float part[W][NT * 8][17];  // [warp][row of x][row of w], as mma_body's
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  constexpr int TR = SWIGLU ? 8 : 16;
  const int tiles = SWIGLU ? (N / 2 + TR - 1) / TR : (N + TR - 1) / TR;
  const int row_bytes = s.nv * 16, passes = (row_bytes + R::PASS - 1) / R::PASS;
  const unsigned base = smem_u32(ring), full = base + R::STAGES * R::STAGE, empty = full + 8 * R::STAGES;
  if (tid == 0) {
    for (int i = 0; i < R::STAGES; ++i) {
      mbar_init(full + 8 * i, 1);
      mbar_init(empty + 8 * i, W);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (warp == W) {  // weights are never written by a step's kernels: the copies need no PDL wait
    bulk_produce<W, U, SWIGLU>((const unsigned char*)w, base, full, empty, N, row_bytes, tiles);
    return;
  }
  int tile = blockIdx.x, it = 0;
  s.scale_rows(tile * TR);
  s.load_scales(warp * U, 0, U);
  pdl_wait();  // x is an earlier kernel's output
  s.load_x(warp * U, 0, U);
  for (;;) {
    float acc[NT][4];
#pragma unroll
    for (int t = 0; t < NT; ++t) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.f;
    for (int p = 0; p < passes; ++p, ++it) {
      const int st = it % R::STAGES, ch0 = (p * W + warp) * U;
      const bool more = p + 1 < passes;
      mbar_wait(full + 8 * st, (it / R::STAGES) & 1);
      const unsigned char* stage = ring + st * R::STAGE;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        bulk_read<W, U>(s, stage, u, ch0 + u, warp * U + u);
        s.mma(u, acc);
        if (more) {  // slot u of the next pass: its x (and scales) load while this pass goes on
          s.load_x(ch0 + W * U, u, u + 1);
          s.load_scales(ch0 + W * U, u, u + 1);
        }
      }
      __syncwarp();
      if (lane == 0) mbar_arrive(empty + 8 * st);
    }
    const int n0 = tile * TR;
    tile += gridDim.x;
    if (tile < tiles) {  // the next tile's first x and scales load during this tile's epilogue
      s.scale_rows(tile * TR);
      s.load_scales(warp * U, 0, U);
      s.load_x(warp * U, 0, U);
    }
    mma_store_part<NT, W>(part, acc);
    consumers_sync(W * 32);
    if (tile >= tiles) pdl_trigger();  // every copy of this CTA landed and was read (mma_body says why here)
    mma_epilogue<NT, F16, W, SWIGLU>(part, y, n0, M, N, y_f32);
    if (tile >= tiles) break;
    consumers_sync(W * 32);  // part is rewritten by the next tile
  }
}
#endif
