// FP8 block-scaled GEMM for small M on Hopper wgmma (sm_90a): out[M, N] = x[M, K] @ w[N, K]^T.
// Contract: k3gen/ops/fp8_block_gemm/spec.py (the "wgmma" variant). Config (from the template):
//   kN, kK                  static sizes (N % 8 == 0, K % 16 == 0)
//   kUe8m0                  scales are UE8M0 bytes (else FP32 values)
//   kRingBytes, kMaxStages  shared-memory budget and depth cap of the TMA ring
//   kDescLbo/Sbo/Layout     wgmma descriptor fields of a 128B-swizzled K-major tile
//
// Small M is weight-bandwidth-bound ("swap AB"): the 128 weight rows of a CTA are the wgmma M side
// (two consumer warpgroups of 64 rows) and the tokens the wgmma N side (NT = 8..128), so M = 1 pads
// the tensor-core work to 8 columns and never costs weight bytes.
// - One producer warp streams 128 x 128-byte weight tiles and NT x 128-byte token tiles with TMA
//   (128B swizzle, zero fill past N, M and K) into a ring of 1024-byte-aligned stages guarded by
//   full (tx-count) and empty (8 consumer warps) mbarriers.
// - Per 128-column K block each consumer warpgroup issues four m64nNTk32 wgmmas into a fresh
//   accumulator (scale-d = 0 on the first), waits, releases the stage, then promotes:
//   total += part * (x_scale[token] * w_scale[tile]). Block scales never touch the FP8 operands;
//   the next block's token scales are loaded while the MMAs run.
// - NT is a runtime argument (one kernel holds the five variants; the launcher picks the smallest
//   that covers min(M, 128)), and the ring depth follows from NT and the shared-memory budget.
// - Split-K over a thread-block cluster (gridDim.x CTAs share a tile's K range in whole 128-column
//   blocks) reduces through distributed shared memory in rank order: deterministic, no workspace,
//   graph-safe (the split is planned on the host from M and the SM count).
// - Streaming mode (a workspace is passed; gemm_stream below): one persistent CTA per SM walks a
//   contiguous, balanced range of the (token tile, weight tile, K block) list with one ring that
//   runs on across tiles, and split tiles are reduced from FP32 partials in L2 in CTA order. The
//   host uses it only when asked (Plan.ctas): on the H200 it ran 5-15% behind a one-wave cluster split.
#pragma once

#include <cuda_bf16.h>

#include "k3gen/gemm/fp8_common.cuh"
#include "k3gen/common/pdl.cuh"
#include "k3gen/common/sm90_async.cuh"

namespace k3gen {
namespace fp8gemm90 {

constexpr int kBlock = 128;                  // scale block along N and K; K bytes per stage
constexpr int kBn = 128;                     // weight rows per CTA: one scale tile
constexpr int kConsumerWarps = 8;            // two warpgroups of 64 weight rows
// Plus a producer warpgroup: ptxas budgets registers per 128-thread warpgroup, so a lone producer
// warp would cost the same; instead the producer gives registers back (setmaxnreg) and the
// consumers take them (64 accumulator + 64 partial + 32 scale registers at nt = 128).
constexpr int kThreads = (kConsumerWarps + 4) * 32;
constexpr int kProducerRegs = 40, kConsumerRegs = 232;
static_assert(kProducerRegs * 128 + kConsumerRegs * 256 <= 65536, "register file");
constexpr int kWTile = kBn * kBlock;         // bytes of one weight stage
constexpr int kRedPad = 4;                   // floats of padding per token row of the reduction tile
constexpr int kAlign = 1024;                 // SW128 atoms repeat every 8 rows of 128 bytes

__host__ __device__ constexpr int stage_bytes(int nt) { return kWTile + nt * kBlock; }
__host__ __device__ constexpr int ring_stages(int nt, int ring_bytes, int max_stages) {
  return ring_bytes / stage_bytes(nt) < max_stages ? ring_bytes / stage_bytes(nt) : max_stages;
}
// Dynamic shared memory of variant nt: alignment slack, the ring, full/empty barriers, then one
// slot of nt combined scales (x_scale[token] * w_scale[tile], FP32) per stage.
__host__ __device__ constexpr int smem_bytes(int nt, int ring_bytes, int max_stages) {
  return kAlign + ring_stages(nt, ring_bytes, max_stages) * (stage_bytes(nt) + 2 * 8 + 4 * nt);
}
// The full barrier of a stage completes on the TMA lane's arrival (+ tx bytes) and the 32 arrivals
// of the scale warp, which writes the stage's combined scales into shared memory.
constexpr int kScaleWarp = kConsumerWarps + 1;
constexpr unsigned kFullArrivals = 1 + 32;

struct Params {
  const void* xs;          // [M, KB] scales
  const void* ws;          // [NB, KB] scales
  __nv_bfloat16* out;      // [M, N]
  int m;
  float* part;             // streaming mode: [2 * gridDim.x][NT][kBn] FP32 partial tiles (else null)
  int* cnt;                // streaming mode: [gridDim.x] arrival counters, zero between launches
  int pf;                  // L2 prefetch distance of the weight stream in K blocks (0: off)
  const unsigned char* w_tiles;  // cluster mode: W as [NB][KB] contiguous pre-swizzled 16 KB tiles
                                 // (Fp8BlockGemm.tile_weights), one bulk copy each; null: TMA boxes
};

// Scale warp: the nt combined scales of K block kb into a stage's slot (0 past the token tile, as
// the register path had). One FP32 product per (token, block), as before: results are unchanged.
template <class C, int NT>
__device__ __forceinline__ void stage_scales(const Params& p, float* slot, long long ws_row, int kb, int m0, int mrem,
                                             int lane) {
  constexpr int KB = (C::kK + kBlock - 1) / kBlock;
  const float ws = fp8gemm::scale_value<C::kUe8m0>(p.ws, ws_row + kb);
#pragma unroll
  for (int t = lane; t < NT; t += 32)
    slot[t] = t < mrem ? fp8gemm::scale_value<C::kUe8m0>(p.xs, static_cast<long long>(m0 + t) * KB + kb) * ws : 0.f;
}

// Four m64nNTk32 wgmmas of one K block into `acc` (scale-d = 0 on the first: a fresh partial),
// committed as one group.
template <class C, int NT>
__device__ __forceinline__ void issue_block(unsigned st, int wg, float (&acc)[NT / 2]) {
  using Mma = sm90::WgmmaE4m3<NT>;
  const unsigned long long da =
      sm90::wgmma_desc<C::kDescLbo, C::kDescSbo, C::kDescLayout>(st + wg * 64 * kBlock);
  const unsigned long long db = sm90::wgmma_desc<C::kDescLbo, C::kDescSbo, C::kDescLayout>(st + kWTile);
#pragma unroll
  for (int q = 0; q < NT / 2; ++q) sm90::fence_operand(acc[q]);
  sm90::wgmma_fence();
#pragma unroll
  for (int ks = 0; ks < kBlock / 32; ++ks)   // 32 bytes of K per wgmma: start address + 32 (>> 4 = 2)
    Mma::mma(acc, da + 2 * ks, db + 2 * ks, ks > 0 ? 1 : 0);
  sm90::wgmma_commit();
}

// total += acc * (x_scale[token] * w_scale[tile]) with the stage's combined scales: d[4j + e] and
// d[4j + 2 + e] are token 8j + 2 (lane % 4) + e, so one 8-byte shared load serves four values.
template <int NT>
__device__ __forceinline__ void promote(const float* slot, int t4, float (&acc)[NT / 2], float (&total)[NT / 2]) {
#pragma unroll
  for (int q = 0; q < NT / 2; ++q) sm90::fence_operand(acc[q]);
#pragma unroll
  for (int j = 0; j < NT / 8; ++j) {
    const float2 sc = *reinterpret_cast<const float2*>(slot + 8 * j + 2 * t4);
    total[4 * j + 0] = fmaf(acc[4 * j + 0], sc.x, total[4 * j + 0]);
    total[4 * j + 1] = fmaf(acc[4 * j + 1], sc.y, total[4 * j + 1]);
    total[4 * j + 2] = fmaf(acc[4 * j + 2], sc.x, total[4 * j + 2]);
    total[4 * j + 3] = fmaf(acc[4 * j + 3], sc.y, total[4 * j + 3]);
  }
}

// Ring positions i0 .. i0 + nk - 1 of one consumer warpgroup into `total`. A stage is released
// after its promotion (its scale slot is read there).
// kOverlap = false: wait, four wgmmas, wait for them, promote: the tensor pipe idles during the
//   promotion and the wgmma latency.
// kOverlap = true: two partial accumulators; block i + 1's wgmmas are issued before block i is
//   promoted (wgmma.wait_group 1 retires only block i), so the promotion runs under the next
//   block's MMAs. 3 x NT / 2 accumulator registers (192 at NT = 128: the scales live in shared
//   memory for this). The sum and its order are the same as without overlap.
template <class C, int NT, bool kOverlap>
__device__ __forceinline__ void consume_range(unsigned base, unsigned full0, unsigned empty0, const float* scl,
                                              int i0, int nk, int wg, int lane, float (&pa)[NT / 2],
                                              float (&pb)[NT / 2], float (&total)[NT / 2]) {
  constexpr int S = ring_stages(NT, C::kRingBytes, C::kMaxStages);
  constexpr int kStage = stage_bytes(NT);
  const int t4 = lane & 3;
  auto ready = [&](int i) {   // waits for ring position i, returns its stage base
    const int s = i % S;
    sm90::mbar_wait_asm(full0 + 8 * s, (i / S) & 1);
    return base + s * kStage;
  };
  auto release = [&](int i) {
    __syncwarp();
    if (lane == 0) sm90::mbar_arrive(empty0 + 8 * (i % S));   // this warp no longer reads the stage
  };
  if constexpr (!kOverlap) {
    for (int j = 0; j < nk; ++j) {
      const int i = i0 + j;
      issue_block<C, NT>(ready(i), wg, pa);
      sm90::wgmma_wait<0>();
      promote<NT>(scl + (i % S) * NT, t4, pa, total);
      release(i);
    }
  } else {
    // Every path leaves one known accumulator in flight (pa at the loop head) or none, so ptxas
    // can track the wgmma groups without serializing them (the last block is drained after the
    // loop by an unconditional wait).
    if (nk <= 0) return;
    issue_block<C, NT>(ready(i0), wg, pa);
    int j = 0;
    for (; j + 1 < nk; j += 2) {
      issue_block<C, NT>(ready(i0 + j + 1), wg, pb);
      sm90::wgmma_wait<1>();
      promote<NT>(scl + ((i0 + j) % S) * NT, t4, pa, total);
      release(i0 + j);
      if (j + 2 >= nk) {
        sm90::wgmma_wait<0>();
        promote<NT>(scl + ((i0 + j + 1) % S) * NT, t4, pb, total);
        release(i0 + j + 1);
        j += 2;
        break;
      }
      issue_block<C, NT>(ready(i0 + j + 2), wg, pa);
      sm90::wgmma_wait<1>();
      promote<NT>(scl + ((i0 + j + 1) % S) * NT, t4, pb, total);
      release(i0 + j + 1);
    }
    sm90::wgmma_wait<0>();
    if (j < nk) {   // nk odd: block nk - 1 is in pa
      promote<NT>(scl + ((i0 + j) % S) * NT, t4, pa, total);
      release(i0 + j);
    }
  }
}

template <class C, int NT, bool kOverlap>
__device__ __forceinline__ void gemm(const sm90::TmaMap* wmap, const sm90::TmaMap* xmap, const Params& p) {
  constexpr int N = C::kN, K = C::kK;
  constexpr int KB = (K + kBlock - 1) / kBlock;
  constexpr int S = ring_stages(NT, C::kRingBytes, C::kMaxStages);
  constexpr int kStage = stage_bytes(NT);
  constexpr int NA = NT / 2;                  // accumulator floats per thread
  constexpr int RS = kBn + kRedPad;
  static_assert(S >= 2, "double buffering at least");
  static_assert(NT % 8 == 0 && NT <= 128, "wgmma N");
  static_assert(NT * RS * 4 <= S * kStage, "the reduction tile fits in the ring");
  static_assert(kStage % kAlign == 0, "every tile of every stage stays 1024-byte aligned");

  extern __shared__ unsigned char smem_raw[];
  const unsigned raw = sm90::smem_addr(smem_raw);
  const unsigned base = (raw + kAlign - 1) & ~static_cast<unsigned>(kAlign - 1);
  unsigned char* smem = smem_raw + (base - raw);
  const unsigned full0 = base + S * kStage, empty0 = full0 + 8 * S;
  float* scl = reinterpret_cast<float*>(smem_raw + (base - raw) + S * (kStage + 16));   // [S][NT] scale slots

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int split = gridDim.x, rank = blockIdx.x;
  const int m0 = blockIdx.y * NT, n0 = blockIdx.z * kBn;
  const int mrem = p.m - m0;                  // tokens of this tile, >= 1
  const int kb0 = rank * KB / split, nk = (rank + 1) * KB / split - kb0;

  if (tid == 0) sm90::mbar_init_ring(full0, empty0, S, kFullArrivals, kConsumerWarps);
  __syncthreads();
  griddep_launch_dependents();   // under PDL the next kernel's weight-only prologue may start

  float* red = reinterpret_cast<float*>(smem);   // after the main loop: red[token][row]
  if (warp >= kConsumerWarps) {
    // Producer: one lane keeps S stages of TMA loads in flight.
    sm90::setmaxnreg_dec<kProducerRegs>();
    // Boxes never exceed the tensor (the launcher clamps them): with N < 128 or M < nt the rows
    // past the box keep stale bytes, which only reach output rows/columns that are never stored.
    constexpr int kWRows = N < kBn ? N : kBn;
    const int xrows = p.m < NT ? p.m : NT;
    if (warp == kConsumerWarps && lane == 0) {
      sm90::tma_prefetch_map(wmap);
      sm90::tma_prefetch_map(xmap);
      // Weights first: the first S stages' weight tiles are requested before griddepcontrol.wait
      // (no kernel writes weights), so under PDL they stream while the previous kernel (the
      // activation quantizer) finishes; the token tiles follow the wait.
      // Pre-tiled W (p.w_tiles): the 128 x 128 tile arrives by one 16 KB bulk copy instead of a
      // TMA box of 128 row requests of 128 bytes.
      const int wrows = p.w_tiles ? kBn : kWRows;
      const unsigned char* wt = p.w_tiles + (static_cast<long long>(n0 / kBn) * KB) * (kBn * kBlock);
      auto load_w = [&](unsigned st, int kb, unsigned bar) {
        if (p.w_tiles)
          sm90::bulk_load(st, wt + static_cast<long long>(kb) * (kBn * kBlock), kBn * kBlock, bar);
        else
          sm90::tma_load_2d(st, wmap, kb * kBlock, n0, bar);
      };
      const int pre = nk < S ? nk : S;
      for (int i = 0; i < pre; ++i) {
        const unsigned st = base + i * kStage, bar = full0 + 8 * i;
        sm90::mbar_arrive_expect_tx(bar, (wrows + xrows) * kBlock);
        load_w(st, kb0 + i, bar);
      }
      griddep_wait();
      for (int i = 0; i < nk; ++i) {
        const int s = i % S;
        const unsigned st = base + s * kStage, bar = full0 + 8 * s;
        if (i >= S) {
          sm90::mbar_wait_or_trap(empty0 + 8 * s, ((i / S) - 1) & 1);
          sm90::mbar_arrive_expect_tx(bar, (wrows + xrows) * kBlock);
          load_w(st, kb0 + i, bar);
        }
        sm90::tma_load_2d(st + kWTile, xmap, (kb0 + i) * kBlock, m0, bar);
        if (p.pf > 0 && i + p.pf < nk) sm90::tma_prefetch_l2_2d(wmap, (kb0 + i + p.pf) * kBlock, n0);
      }
      // The last stage's phase stays complete once reached (nothing re-arms it): waiting for it
      // here turns a hang of the consumers' (watchdog-free) waits into a trap.
      if (nk > 0) sm90::mbar_wait_or_trap(full0 + 8 * ((nk - 1) % S), ((nk - 1) / S) & 1);
    } else if (warp == kScaleWarp) {
      const long long ws_row = static_cast<long long>(n0 / kBlock) * KB;
      griddep_wait();   // the token scales come from the previous kernel
      for (int i = 0; i < nk; ++i) {
        const int s = i % S;
        if (i >= S) sm90::mbar_wait(empty0 + 8 * s, ((i / S) - 1) & 1);
        stage_scales<C, NT>(p, scl + s * NT, ws_row, kb0 + i, m0, mrem, lane);
        sm90::mbar_arrive(full0 + 8 * s);
      }
    }
    __syncwarp();
    // Every TMA write has been waited for and every wgmma has completed past this barrier (the
    // consumers' side of it): the ring becomes the token-major partial tile red[token][row], so
    // output rows leave 16 bytes at a time.
    sm90::fence_proxy_async();
    sm90::barrier_sync_divergent(1, kThreads);
  } else {
    // Consumer warpgroup wg: weight rows 64 wg .. 64 wg + 63 of the tile.
    sm90::setmaxnreg_inc<kConsumerRegs>();
    const int wg = warp >> 2;
    float total[NA];
#pragma unroll
    for (int i = 0; i < NA; ++i) total[i] = 0.f;
    const int t4 = lane & 3;
    float pa[NA], pb[NA];
#pragma unroll
    for (int i = 0; i < NA; ++i) pa[i] = pb[i] = 0.f;
    consume_range<C, NT, kOverlap>(base, full0, empty0, scl, 0, nk, wg, lane, pa, pb, total);

    sm90::fence_proxy_async();
    sm90::barrier_sync_divergent(1, kThreads);   // pairs with the producer's: the ring is free
    const int g = lane >> 2, r = wg * 64 + (warp & 3) * 16 + g;
#pragma unroll
    for (int j = 0; j < NA / 4; ++j) {
      const int c = 8 * j + 2 * t4;
      red[c * RS + r] = total[4 * j + 0];
      red[(c + 1) * RS + r] = total[4 * j + 1];
      red[c * RS + r + 8] = total[4 * j + 2];
      red[(c + 1) * RS + r + 8] = total[4 * j + 3];
    }
  }
  // Without a cluster launch (split == 1) a CTA barrier and plain shared loads do.
  if (split == 1) __syncthreads(); else fp8gemm::cluster_sync();

  const int mt = mrem < NT ? mrem : NT;
  const unsigned rbase = sm90::smem_addr(red);
  for (int it = rank * kThreads + tid; it < mt * (kBn / 8); it += split * kThreads) {
    const int mm = it / (kBn / 8), c8 = it % (kBn / 8);
    const int gn = n0 + c8 * 8;
    if (gn >= N) continue;
    const unsigned off = rbase + (mm * RS + c8 * 8) * 4;
    float v[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int q = 0; q < split; ++q) {   // rank order: the same sum on every run
      float4 lo, hi;
      if (split == 1) {
        lo = *reinterpret_cast<const float4*>(red + mm * RS + c8 * 8);
        hi = *reinterpret_cast<const float4*>(red + mm * RS + c8 * 8 + 4);
      } else {
        lo = fp8gemm::ld_cluster_f4(fp8gemm::map_rank(off, q));
        hi = fp8gemm::ld_cluster_f4(fp8gemm::map_rank(off + 16, q));
      }
      v[0] += lo.x; v[1] += lo.y; v[2] += lo.z; v[3] += lo.w;
      v[4] += hi.x; v[5] += hi.y; v[6] += hi.z; v[7] += hi.w;
    }
    uint4 o;
    o.x = fp8gemm::pack_bf16x2(v[0], v[1]);
    o.y = fp8gemm::pack_bf16x2(v[2], v[3]);
    o.z = fp8gemm::pack_bf16x2(v[4], v[5]);
    o.w = fp8gemm::pack_bf16x2(v[6], v[7]);
    *reinterpret_cast<uint4*>(p.out + static_cast<long long>(m0 + mm) * N + gn) = o;
  }
  if (split > 1) fp8gemm::cluster_sync();   // no CTA leaves while a peer may still read its shared memory
}

// Streaming (persistent) mode. The work is the list of (token tile, weight tile, K block) triples,
// K block fastest; CTA c of G owns the contiguous range [c L / G, (c + 1) L / G) of it, so every
// CTA streams the same number of weight blocks (+-1) through ONE ring that runs on across tile
// boundaries: the producer loads the next segment while the consumers finish the current one, and
// an SM ramps its pipeline up once per launch instead of once per tile.
// A segment (the part of one tile inside one CTA's range) that covers all K blocks stores BF16 from
// registers. A split tile's segments write FP32 partials to workspace slot 2c (the CTA's first
// segment) or 2c + 1 (its last); the CTA that arrives last on the tile's counter (indexed by the
// tile's first CTA, which owns no other split tile's start) sums the slots in CTA order, so the
// result does not depend on arrival order, and resets the counter for the next launch.
__device__ __forceinline__ int owner_of(int x, int g, int l) {   // the CTA whose range holds item x
  return static_cast<int>((static_cast<long long>(x + 1) * g + l - 1) / l) - 1;
}
__device__ __forceinline__ int range_start(int c, int g, int l) {
  return static_cast<int>(static_cast<long long>(c) * l / g);
}

template <class C, int NT, bool kOverlap>
__device__ __forceinline__ void gemm_stream(const sm90::TmaMap* wmap, const sm90::TmaMap* xmap, const Params& p) {
  constexpr int N = C::kN, K = C::kK;
  constexpr int KB = (K + kBlock - 1) / kBlock;
  constexpr int NTILES = (N + kBn - 1) / kBn;
  constexpr int S = ring_stages(NT, C::kRingBytes, C::kMaxStages);
  constexpr int kStage = stage_bytes(NT);
  constexpr int NA = NT / 2;
  static_assert(S >= 2 && NT % 8 == 0 && NT <= 128, "ring depth, wgmma N");
  static_assert(kStage % kAlign == 0, "every tile of every stage stays 1024-byte aligned");

  extern __shared__ unsigned char smem_raw[];
  __shared__ int last_flag;
  const unsigned raw = sm90::smem_addr(smem_raw);
  const unsigned base = (raw + kAlign - 1) & ~static_cast<unsigned>(kAlign - 1);
  const unsigned full0 = base + S * kStage, empty0 = full0 + 8 * S;
  float* scl = reinterpret_cast<float*>(smem_raw + (base - raw) + S * (kStage + 16));   // [S][NT] scale slots

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = gridDim.x, c = blockIdx.x;
  const int l = ((p.m + NT - 1) / NT) * NTILES * KB;   // the launcher keeps this < 2^31
  const int x0 = range_start(c, g, l), x1 = range_start(c + 1, g, l);

  if (tid == 0) sm90::mbar_init_ring(full0, empty0, S, kFullArrivals, kConsumerWarps);
  __syncthreads();
  griddep_launch_dependents();   // under PDL the next kernel's weight-only prologue may start

  if (warp >= kConsumerWarps) {
    sm90::setmaxnreg_dec<kProducerRegs>();
    constexpr int kWRows = N < kBn ? N : kBn;
    const int xrows = p.m < NT ? p.m : NT;
    if (warp == kConsumerWarps && lane == 0) {
      sm90::tma_prefetch_map(wmap);
      sm90::tma_prefetch_map(xmap);
      griddep_wait();   // no weight prefetch ahead of it here: a PDL launch only waits correctly
      for (int x = x0, i = 0; x < x1; ++x, ++i) {
        const int tile = x / KB, kb = x - tile * KB;
        const int s = i % S;
        if (i >= S) sm90::mbar_wait_or_trap(empty0 + 8 * s, ((i / S) - 1) & 1);
        const unsigned st = base + s * kStage, bar = full0 + 8 * s;
        sm90::mbar_arrive_expect_tx(bar, (kWRows + xrows) * kBlock);
        sm90::tma_load_2d(st, wmap, kb * kBlock, (tile % NTILES) * kBn, bar);
        sm90::tma_load_2d(st + kWTile, xmap, kb * kBlock, (tile / NTILES) * NT, bar);
        if (p.pf > 0 && x + p.pf < x1) {
          const int tq = (x + p.pf) / KB;
          sm90::tma_prefetch_l2_2d(wmap, (x + p.pf - tq * KB) * kBlock, (tq % NTILES) * kBn);
        }
      }
      const int n = x1 - x0;   // see gemm(): turns a consumer hang into a trap
      if (n > 0) sm90::mbar_wait_or_trap(full0 + 8 * ((n - 1) % S), ((n - 1) / S) & 1);
    } else if (warp == kScaleWarp) {
      griddep_wait();
      for (int x = x0, i = 0; x < x1; ++x, ++i) {
        const int tile = x / KB, kb = x - tile * KB;
        const int s = i % S;
        if (i >= S) sm90::mbar_wait(empty0 + 8 * s, ((i / S) - 1) & 1);
        const int m0 = (tile / NTILES) * NT, n0 = (tile % NTILES) * kBn;
        stage_scales<C, NT>(p, scl + s * NT, static_cast<long long>(n0 / kBlock) * KB, kb, m0, p.m - m0, lane);
        sm90::mbar_arrive(full0 + 8 * s);
      }
    }
    return;   // no CTA-wide barrier follows: the consumers synchronise among themselves (id 2)
  }

  sm90::setmaxnreg_inc<kConsumerRegs>();
  const int wg = warp >> 2, t4 = lane & 3;
  const int r = wg * 64 + (warp & 3) * 16 + (lane >> 2);   // fragment row (and row + 8)
  float total[NA], pa[NA], pb[NA];
#pragma unroll
  for (int q = 0; q < NA; ++q) pa[q] = pb[q] = 0.f;
  int i = 0;   // ring position, continuous across segments
  for (int x = x0; x < x1;) {
    const int tile = x / KB, kb0 = x - tile * KB;
    const int nk = (KB - kb0) < (x1 - x) ? (KB - kb0) : (x1 - x);
    const int m0 = (tile / NTILES) * NT, n0 = (tile % NTILES) * kBn;
    const int mrem = p.m - m0;
#pragma unroll
    for (int q = 0; q < NA; ++q) total[q] = 0.f;
    consume_range<C, NT, kOverlap>(base, full0, empty0, scl, i, nk, wg, lane, pa, pb, total);
    i += nk;

    if (nk == KB) {   // the whole tile: BF16 straight from the fragments
#pragma unroll
      for (int j = 0; j < NA / 4; ++j) {
        const int col = 8 * j + 2 * t4;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int tok = col + (e & 1), row = n0 + r + 8 * (e >> 1);
          if (tok < mrem && row < N)
            p.out[static_cast<long long>(m0 + tok) * N + row] = __float2bfloat16_rn(total[4 * j + e]);
        }
      }
    } else {
      // Partial tile: FP32 partial [token][row] into this segment's slot, then the arrival count.
      float* dst = p.part + static_cast<long long>(2 * c + (x == x0 ? 0 : 1)) * (NT * kBn);
#pragma unroll
      for (int j = 0; j < NA / 4; ++j) {
        const int col = 8 * j + 2 * t4;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int tok = col + (e & 1);
          if (tok < mrem) dst[tok * kBn + r + 8 * (e >> 1)] = total[4 * j + e];
        }
      }
      const int first = owner_of(tile * KB, g, l), nseg = owner_of(tile * KB + KB - 1, g, l) - first + 1;
      __threadfence();   // release: the partial is visible GPU-wide before the arrival
      sm90::barrier_sync_divergent(2, kConsumerWarps * 32);
      if (tid == 0) last_flag = atomicAdd(p.cnt + first, 1) == nseg - 1;
      sm90::barrier_sync_divergent(2, kConsumerWarps * 32);
      if (last_flag) {
        __threadfence();   // acquire: the other segments' partials
        // This usually runs at the end of the CTA's range (the tile's first CTA arrives last), so
        // it is the kernel's tail: every thread keeps all its output chunks in registers and loads
        // them slot by slot, so each slot costs one L2 round trip, not one per chunk.
        constexpr int kChunks = (NT * (kBn / 8) + kConsumerWarps * 32 - 1) / (kConsumerWarps * 32);
        const int mt = mrem < NT ? mrem : NT;
        float v[kChunks][8];
#pragma unroll
        for (int u = 0; u < kChunks; ++u)
#pragma unroll
          for (int e = 0; e < 8; ++e) v[u][e] = 0.f;
        for (int q = first; q < first + nseg; ++q) {   // CTA order: the same sum on every run
          const int slot = 2 * q + (range_start(q, g, l) >= tile * KB ? 0 : 1);
          const float* src = p.part + static_cast<long long>(slot) * (NT * kBn);
#pragma unroll
          for (int u = 0; u < kChunks; ++u) {
            const int it = tid + u * kConsumerWarps * 32, mm = it / (kBn / 8), c8 = it % (kBn / 8);
            if (mm < mt && n0 + c8 * 8 < N) {
              const float4* f = reinterpret_cast<const float4*>(src + mm * kBn + c8 * 8);
              const float4 lo = __ldcg(f), hi = __ldcg(f + 1);
              v[u][0] += lo.x; v[u][1] += lo.y; v[u][2] += lo.z; v[u][3] += lo.w;
              v[u][4] += hi.x; v[u][5] += hi.y; v[u][6] += hi.z; v[u][7] += hi.w;
            }
          }
        }
#pragma unroll
        for (int u = 0; u < kChunks; ++u) {
          const int it = tid + u * kConsumerWarps * 32, mm = it / (kBn / 8), c8 = it % (kBn / 8), gn = n0 + c8 * 8;
          if (mm < mt && gn < N) {
            uint4 o;
            o.x = fp8gemm::pack_bf16x2(v[u][0], v[u][1]);
            o.y = fp8gemm::pack_bf16x2(v[u][2], v[u][3]);
            o.z = fp8gemm::pack_bf16x2(v[u][4], v[u][5]);
            o.w = fp8gemm::pack_bf16x2(v[u][6], v[u][7]);
            *reinterpret_cast<uint4*>(p.out + static_cast<long long>(m0 + mm) * N + gn) = o;
          }
        }
        if (tid == 0) p.cnt[first] = 0;   // every segment of this tile has arrived: none reads it again
      }
    }
    x += nk;
  }
}

// One kernel, five token-tile variants; nt is uniform over the grid. A workspace selects the streaming mode, none the cluster split-K mode.
template <class C, bool kOverlap>
__device__ __forceinline__ void gemm_dispatch_nt(const sm90::TmaMap* wmap, const sm90::TmaMap* xmap, const Params& p,
                                                 int nt) {
  if (p.part != nullptr) {
    switch (nt) {
      case 8: gemm_stream<C, 8, kOverlap>(wmap, xmap, p); return;
      case 16: gemm_stream<C, 16, kOverlap>(wmap, xmap, p); return;
      case 32: gemm_stream<C, 32, kOverlap>(wmap, xmap, p); return;
      case 64: gemm_stream<C, 64, kOverlap>(wmap, xmap, p); return;
      default: gemm_stream<C, 128, kOverlap>(wmap, xmap, p); return;
    }
  }
  switch (nt) {
    case 8: gemm<C, 8, kOverlap>(wmap, xmap, p); break;
    case 16: gemm<C, 16, kOverlap>(wmap, xmap, p); break;
    case 32: gemm<C, 32, kOverlap>(wmap, xmap, p); break;
    case 64: gemm<C, 64, kOverlap>(wmap, xmap, p); break;
    default: gemm<C, 128, kOverlap>(wmap, xmap, p); break;
  }
}

// kOverlap = true is not instantiated: ptxas 12.x serializes every wgmma of the kernel with it
// (C7514, "non wgmma instructions reading accumulator registers ... between start and end of the
// pipeline stage") and spills, even at NT <= 64; see the report of branch gemm128.
template <class C>
__device__ __forceinline__ void gemm_dispatch(const sm90::TmaMap* wmap, const sm90::TmaMap* xmap, const Params& p,
                                              int nt) {
  gemm_dispatch_nt<C, false>(wmap, xmap, p, nt);
}

}  // namespace fp8gemm90
}  // namespace k3gen
