// mla_prefill on sm_90a: causal flash attention for the unabsorbed MLA form (variant "wgmma" of
// k3gen/ops/mla_prefill/variants.py; contract: k3gen/ops/mla_prefill/spec.py).
//
// Per head h: s = [q_nope | q_pe] . [k_nope_h | k_pe] * scale (k_pe: one rope key for all heads),
// causal with a prefix (query row i of a sequence with prefix p = len_k - len_q sees keys <= p + i),
// online softmax in FP32, o = P V_h accumulated in FP32.
//
// Grid (H, q_blocks, B) or (q_blocks, H, B) (Params::heads_fast), 384 threads, one CTA per SM
// (213 KB of shared memory):
//   warpgroup 0, the producer: TMA boxes of each 128-key tile (K = 3 SW128 blocks of [128 keys][64
//     dims]: k_nope 0-63, 64-127, k_pe; V = 2 blocks) into a 2-stage ring, on the stage's K-full and
//     V-full barriers; the V of a tile that runs past the sequence end by zero-filling cp.async.
//   warpgroups 1, 2, the consumers: 64 query rows each (a 128-row q-block per CTA): S = Q K^T
//     (12 x m64n128k16, Q and K from shared memory), the masked online softmax in registers, P (BF16)
//     stays in registers as the A operand of O += P V (8 x m64n128k16, V read N-major); K and V of a
//     stage are released separately (K-empty / V-empty, 256 arrivals), so the next K lands while V
//     is still read. kOverlap (variant wgmma_ov) issues QK of tile i before PV of tile i - 1 and runs
//     the softmax of tile i while that PV is in flight (FA3's intra-warpgroup pipelining).
// Q is copied once per CTA by cp.async (rows past the sequence zero-filled). H200, H12 T4096: K/V by
// cp.async from the producer warpgroup (one tile in flight) ran at ~5.5 us per tile whatever the
// consumer schedule; TMA keeps both stages in flight from one thread.
// Long first: blockIdx.y = 0 is the last (largest causal) q-block; heads vary fastest, so the
// heaviest CTAs of every head are dispatched in the first wave.
// cu_seqlens are clamped on the device to [0, nq] / [0, nk] (never an out-of-bounds row).
// Params, the work item (work_of), the fault report, the TMA boxes and the tail tile's V copy are
// mla/prefill_common.cuh, shared with the tcgen05 kernel of the SM100 family (mla/prefill_tc.cuh).
#pragma once

#include <cuda_bf16.h>

#include "k3gen/common/faults.cuh"
#include "k3gen/common/sm90_async.cuh"
#include "k3gen/mla/prefill_common.cuh"

#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#error "mla_prefill's wgmma kernel needs sm_90a"
#endif

namespace k3gen {
namespace mla {
namespace prefill {

// kBM, kBN, the head dims, kKBlk / kKBytes / kVBytes, kLog2e: mla/prefill_common.cuh.
constexpr int kThreads = 384;
constexpr int kStages = 2;
constexpr int kQBlk = 64 * 128;           // one [64 rows][64 dims] SW128 block of a consumer's Q
constexpr int kQBytes = 2 * 3 * kQBlk;    // 49152
constexpr int kStageBytes = kKBytes + kVBytes;
constexpr int kStageOff = kQBytes;
constexpr int kBarOff = kStageOff + kStages * kStageBytes;
constexpr int kOnesOff = kBarOff + 128;          // 512 bytes of BF16 1.0: B of the row-sum wgmmas
constexpr int kSmem = kOnesOff + 512 + 1024;     // + slack to align the base to 1024
constexpr int kProducerRegs = 56, kConsumerRegs = 224;
static_assert(128 * kProducerRegs + 256 * kConsumerRegs <= 65536, "register file");
static_assert(kSmem <= 232448, "one CTA per SM");
constexpr unsigned kBarProducer = 1;   // named barrier of the producer warpgroup (tail-tile copies)
constexpr unsigned kBarTurn = 2;       // 2, 3: the consumers' turns at issuing wgmmas (kPingpong)

// K-major SW128 operand (LBO unused), SBO = the 8-row group stride.
__device__ __forceinline__ unsigned long long desc_k(unsigned a) { return sm90::wgmma_desc<16, 1024, 1>(a); }
// V as the N-major B operand: 8-key groups 1024 bytes apart (SBO), the two 64-dim blocks kKBlk apart (LBO).
__device__ __forceinline__ unsigned long long desc_v(unsigned a) { return sm90::wgmma_desc<kKBlk, 1024, 1>(a); }

using MmaS = sm90::WgmmaBf16SS<128, 0, 0>;

// O[64 x 128] += P[64 x 16] V[16 x 128]: P from registers (the mma.sync m16n8k16 A fragment of the
// warp's 16 rows), V N-major from shared memory. The registers stay unchanged until the wgmma retired.
__device__ __forceinline__ void mma_pv(float (&d)[64], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                       unsigned long long db) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
      "}, {%64, %65, %66, %67}, %68, 1, 1, 1, 1;\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(db));
}

// l[r] += P[64 x 16] 1[16 x 8] (m64n8k16, B: the ones block): the rows' sums of the BF16
// probabilities, added by the tensor core as P V adds them (every column of l holds its row's sum).
// Replaces ~100 instructions per warp per tile of BF16 -> FP32 round trips and FADDs in the softmax.
__device__ __forceinline__ void mma_l(float (&d)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                      unsigned long long db) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%0, %1, %2, %3}, {%4, %5, %6, %7}, %8, 1, 1, 1, 0;\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(db));
}

// The consumers' stage wait: the poll loop inside one asm block (no data-dependent C++ branch next to
// the wgmmas, as sm90::mbar_wait_asm), trapping after ~2^26 polls (seconds: far beyond any legitimate
// wait), so a phase that never completes fails the launch instead of hanging the GPU.
__device__ __forceinline__ void wait_stage(unsigned bar, unsigned parity) {
  asm volatile(
      "{\n.reg .pred p;\n.reg .u32 n;\nmov.u32 n, 0;\nWAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      "@p bra DONE_%=;\nadd.u32 n, n, 1;\nsetp.gt.u32 p, n, 67108864;\n@p trap;\nbra WAIT_%=;\nDONE_%=:\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}

template <int N>
__device__ __forceinline__ void pin(float (&x)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) sm90::fence_operand(x[i]);
}

// The same for PV's A registers: live (unchanged, not reused) until the wgmma that reads them retired.
__device__ __forceinline__ void pin(unsigned (&x)[32]) {
#pragma unroll
  for (int i = 0; i < 32; ++i) asm volatile("" : "+r"(x[i])::"memory");
}

// Q rows i0 .. i0 + 127 of head h into consumer blocks (rows past the sequence zero-filled), all threads.
__device__ __forceinline__ void load_q(const Params& p, const Seq& s, int h, int i0, unsigned aQ) {
  for (int i = threadIdx.x; i < kBM * (kDqk / 8); i += kThreads) {
    const int r = i / (kDqk / 8), c = i - r * (kDqk / 8);
    const bool ok = i0 + r < s.lq;
    const __nv_bfloat16* src =
        ok ? p.q + static_cast<long long>(s.q0 + i0 + r) * p.q_row + h * p.q_head + c * 8 : p.q;
    const int rr = r & 63;
    cp_async16(aQ + (r >> 6) * 3 * kQBlk + (c >> 3) * kQBlk + sw128(rr, c & 7), src, ok ? 16u : 0u);
  }
}

// K of keys kv0 .. kv0 + 127 of head h into the stage's K blocks (k_nope 0-63, 64-127, k_pe), 128
// producer threads; keys past the sequence zero-filled (variant wgmma_cp).
__device__ __forceinline__ void load_k(const Params& p, const Seq& s, int h, int kv0, unsigned aK, int t) {
#pragma unroll 2
  for (int i = t; i < kBN * 24; i += 128) {
    const int key = i / 24, c = i - key * 24;
    const bool ok = kv0 + key < s.lk;
    const long long row = s.k0 + kv0 + key;
    const __nv_bfloat16* src = c < 16 ? p.k_nope + row * p.kn_row + h * p.kn_head + c * 8
                                      : p.k_pe + row * p.kpe_row + (c - 16) * 8;
    cp_async16(aK + (c >> 3) * kKBlk + sw128(key, c & 7), ok ? src : p.k_pe, ok ? 16u : 0u);
  }
}

// One tile's softmax on S, in place: masked past each row's limit when kMask, the probabilities
// exp2(s scale - m_new) into sc (scale includes log2(e); one FFMA per score: the max is taken on the
// raw scores, exact since scale > 0 and rounding is monotone), the running max m (scaled) updated,
// the rows' rescale factors into a. The row max runs in 4 independent partial maxima per row (the
// H100 profile of one serial fmaxf chain: ~11% of a consumer warp's time in FMNMX latency); the max
// is exact in any order.
template <bool kMask>
__device__ __forceinline__ void softmax(float (&sc)[64], float (&m)[2], const int (&lim)[2], int col0, float scale,
                                        float (&a)[2]) {
  float mx[2][4];
#pragma unroll
  for (int r = 0; r < 2; ++r)
#pragma unroll
    for (int k = 0; k < 4; ++k) mx[r][k] = K3GEN_PF_NEG_INF;
#pragma unroll
  for (int i = 0; i < 64; ++i) {
    const int r = (i >> 1) & 1, k = ((i >> 2) & 1) * 2 + (i & 1);
    if (kMask) sc[i] = col0 + 8 * (i >> 2) + (i & 1) <= lim[r] ? sc[i] : K3GEN_PF_NEG_INF;
    mx[r][k] = fmaxf(mx[r][k], sc[i]);
  }
  float msub[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float x = fmaxf(fmaxf(mx[r][0], mx[r][1]), fmaxf(mx[r][2], mx[r][3]));
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
    const float m_new = fmaxf(m[r], x * scale);
    // A row with nothing visible yet keeps its state: factor 1, probabilities 0.
    a[r] = m_new == K3GEN_PF_NEG_INF ? 1.f : ex2(m[r] - m_new);
    msub[r] = m_new == K3GEN_PF_NEG_INF ? 0.f : m_new;
    m[r] = m_new;
  }
#pragma unroll
  for (int i = 0; i < 64; ++i) sc[i] = ex2(fmaf(sc[i], scale, -msub[(i >> 1) & 1]));
}

// P rounded to BF16 into pk (keys 8 j + 2 (lane % 4) + {0, 1} of row half r in pk[2 j + r]: the A
// fragments of PV and of the row sums' wgmmas).
__device__ __forceinline__ void pack(const float (&sc)[64], unsigned (&pk)[32]) {
#pragma unroll
  for (int j = 0; j < 16; ++j)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const __nv_bfloat162 pb = __floats2bfloat162_rn(sc[4 * j + 2 * r], sc[4 * j + 2 * r + 1]);
      pk[2 * j + r] = *reinterpret_cast<const unsigned*>(&pb);
    }
}

// Barriers (8 bytes each): K full / V full (one arrival: the TMA thread's expect_tx, or after the
// producer's copies of a tail tile landed), K empty / V empty (256 consumer arrivals), two stages each.
struct Bars {
  unsigned base;
  __device__ unsigned kfull(int s) const { return base + 8 * s; }
  __device__ unsigned vfull(int s) const { return base + 16 + 8 * s; }
  __device__ unsigned kempty(int s) const { return base + 32 + 8 * s; }
  __device__ unsigned vempty(int s) const { return base + 48 + 8 * s; }
};

__device__ __forceinline__ void qk(float (&sc)[64], unsigned aQ, unsigned aK) {
#pragma unroll
  for (int ks = 0; ks < kDqk / 16; ++ks)
    MmaS::mma(sc, desc_k(aQ + (ks >> 2) * kQBlk + (ks & 3) * 32), desc_k(aK + (ks >> 2) * kKBlk + (ks & 3) * 32), ks);
}
// O += P V and l += P 1 (the row sums; `ones`: the ones block's descriptor), one commit group.
__device__ __forceinline__ void pv(float (&o)[64], float (&l)[4], const unsigned (&pk)[32], unsigned aV,
                                   unsigned long long ones) {
#pragma unroll
  for (int kk = 0; kk < kBN / 16; ++kk)
    mma_pv(o, pk[4 * kk], pk[4 * kk + 1], pk[4 * kk + 2], pk[4 * kk + 3], desc_v(aV + kk * 2048));
#pragma unroll
  for (int kk = 0; kk < kBN / 16; ++kk) mma_l(l, pk[4 * kk], pk[4 * kk + 1], pk[4 * kk + 2], pk[4 * kk + 3], ones);
}
// O and l *= a per row, skipped when no row of the warp changed its max (a == 1 exactly: the same bits);
// past the first tiles a row's max rarely moves.
__device__ __forceinline__ void rescale(float (&o)[64], float (&l)[4], const float (&a)[2]) {
  if (!__any_sync(0xffffffffu, a[0] != 1.f || a[1] != 1.f)) return;
#pragma unroll
  for (int i = 0; i < 64; ++i) o[i] *= (i & 2) ? a[1] : a[0];
#pragma unroll
  for (int i = 0; i < 4; ++i) l[i] *= (i & 2) ? a[1] : a[0];
}

// K of tile `it` (3 TMA boxes: k_nope 0-63, 64-127, k_pe) into the stage of the CTA's tile count g
// (it + the tiles of its earlier work items), on K-full; one thread.
__device__ __forceinline__ void issue_k(const Seq& s, int h, int it, int g, unsigned base, const Bars& bars,
                                        const Maps& maps) {
  const int st = g & 1;
  tma_k(base + kStageOff + st * kStageBytes, bars.kfull(st), maps, h, s.k0 + it * kBN);
}

// V of tile `it` (2 TMA boxes) into the stage of tile count g, on V-full; one thread.
__device__ __forceinline__ void issue_v(const Seq& s, int h, int it, int g, unsigned base, const Bars& bars,
                                        const Maps& maps) {
  const int st = g & 1;
  tma_v(base + kStageOff + st * kStageBytes + kKBytes, bars.vfull(st), maps, h, s.k0 + it * kBN);
}

// Keys tile `it` into its stage, K and V each once its own buffer is released. One thread issues the
// TMA boxes (K: k_nope 0-63, 64-127, k_pe; V: 2 boxes). K rows past the sequence are whatever the
// tensor holds there (zeros past its end): every score there is replaced by -inf, a select. V rows
// there would be multiplied by a zero probability, so the tile that runs past the sequence end gets
// its V by zero-filling cp.async copies of all 128 producer threads instead (a NaN or Inf in another
// sequence's rows must not reach this one's output).
// g0: the CTA's tiles before this work item (the persistent kernel's running stage count); the first
// `issued` tiles were issued by the caller (run(): tiles 0 and 1 before the Q copies, V too unless a
// tail tile).
__device__ __forceinline__ void produce(const Params& p, const Seq& s, int h, int n, unsigned base, const Bars& bars,
                                        const Maps& maps, int wt, int g0 = 0, int issued = kStages) {
  for (int it = 0; it < n; ++it) {
    const int g = g0 + it, st = g & 1, ph = ((g >> 1) - 1) & 1, kv0 = it * kBN;
    const unsigned aV = base + kStageOff + st * kStageBytes + kKBytes;
    if (g >= kStages) sm90::mbar_wait_or_trap(bars.kempty(st), ph);
    if (wt == 0 && it >= issued) issue_k(s, h, it, g, base, bars, maps);
    if (g >= kStages) sm90::mbar_wait_or_trap(bars.vempty(st), ph);
    if (kv0 + kBN <= s.lk) {
      if (wt == 0 && it >= issued) issue_v(s, h, it, g, base, bars, maps);
    } else {
      load_v(p, s, h, kv0, aV, wt);
      cp_async_commit();
      cp_async_wait<0>();
      sm90::fence_proxy_async();
      sm90::barrier_sync_divergent(kBarProducer, 128);
      if (wt == 0) sm90::mbar_arrive(bars.vfull(st));
    }
  }
}

// The cp.async producer (variant wgmma_cp, H200-measured at ~5.5 us per tile: one tile in flight):
// every producer thread copies its share of K, then V, waits for its copies, fences them to the async
// proxy and arrives on K-full, then V-full (128 arrivals each).
__device__ __forceinline__ void produce_cp(const Params& p, const Seq& s, int h, int n, unsigned base,
                                           const Bars& bars, int wt) {
  for (int it = 0; it < n; ++it) {
    const int st = it & 1, ph = ((it >> 1) - 1) & 1;
    const unsigned aK = base + kStageOff + st * kStageBytes;
    if (it >= kStages) sm90::mbar_wait_or_trap(bars.kempty(st), ph);
    load_k(p, s, h, it * kBN, aK, wt);
    cp_async_commit();
    if (it >= kStages) sm90::mbar_wait_or_trap(bars.vempty(st), ph);
    load_v(p, s, h, it * kBN, aK + kKBytes, wt);
    cp_async_commit();
    cp_async_wait<1>();
    sm90::fence_proxy_async();
    sm90::mbar_arrive(bars.kfull(st));
    cp_async_wait<0>();
    sm90::fence_proxy_async();
    sm90::mbar_arrive(bars.vfull(st));
  }
}

// This thread's two rows of the work item's output (o / l; rows past the sequence are not written).
template <class C>
__device__ __forceinline__ void store_rows(const Params& p, const Work& w, const float (&o)[64], const float (&l)[4],
                                           int rloc, int lane) {
  float inv[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    inv[r] = l[2 * r] > 0.f ? __fdividef(1.f, l[2 * r]) : 0.f;   // l <= the key count: far from __fdividef's 2^126 limit
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int i = w.i0 + rloc + 8 * r;
    if (i >= w.s.lq) continue;
    const long long off = (static_cast<long long>(w.s.q0 + i) * C::kHeads + w.h) * kDv + 2 * (lane & 3);
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const float x = o[4 * j + 2 * r] * inv[r], y = o[4 * j + 2 * r + 1] * inv[r];
      if constexpr (C::kOutF32) {
        *reinterpret_cast<float2*>(static_cast<float*>(p.out) + off + 8 * j) = make_float2(x, y);
      } else {
        const __nv_bfloat162 v = __floats2bfloat162_rn(x, y);
        *reinterpret_cast<__nv_bfloat162*>(static_cast<__nv_bfloat16*>(p.out) + off + 8 * j) = v;
      }
    }
  }
}

// The overlapped consumers' two steps (wgmma_ov / wgmma_pp, and the persistent kernels' loops in
// mla/prefill_ps.cuh). `take` / `pass`: the pingpong turn; `qk_done`: run once this step's QK retired
// (the persistent kernels' Q-empty arrival on an item's last tile); `soft(sc, it, a)`: the item's softmax.
// An item's first tile (index 0, the CTA's stage count g): its QK alone, then the softmax and P.
template <class Take, class Pass, class QkDone, class Soft>
__device__ __forceinline__ void first_step(float (&sc)[64], unsigned (&pk)[32], float (&a)[2], unsigned aQ,
                                           unsigned base, const Bars& bars, int g, Take take, Pass pass,
                                           QkDone qk_done, Soft soft) {
  wait_stage(bars.kfull(g & 1), (g >> 1) & 1);
  take();
  sm90::wgmma_fence();
  qk(sc, aQ, base + kStageOff + (g & 1) * kStageBytes);
  sm90::wgmma_commit();
  pass();
  sm90::wgmma_wait<0>();
  pin(sc);
  qk_done();
  sm90::mbar_arrive(bars.kempty(g & 1));
  soft(sc, 0, a);
  pack(sc, pk);
}
// Tile `it` of an item (stage count g): its QK with PV of the tile before (P in pk) in one turn, the
// softmax under that PV, then P of tile `it` packed.
template <class Take, class Pass, class QkDone, class Soft>
__device__ __forceinline__ void step(float (&o)[64], float (&l)[4], float (&sc)[64], unsigned (&pk)[32],
                                     float (&a)[2], unsigned aQ, unsigned base, const Bars& bars, int g, int it,
                                     unsigned long long ones, Take take, Pass pass, QkDone qk_done, Soft soft) {
  const int st = g & 1, sp = st ^ 1;
  wait_stage(bars.kfull(st), (g >> 1) & 1);
  wait_stage(bars.vfull(sp), ((g - 1) >> 1) & 1);
  take();
  sm90::wgmma_fence();
  qk(sc, aQ, base + kStageOff + st * kStageBytes);
  sm90::wgmma_commit();
  rescale(o, l, a);
  pin(o);
  pin(l);
  sm90::wgmma_fence();
  pv(o, l, pk, base + kStageOff + sp * kStageBytes + kKBytes, ones);
  sm90::wgmma_commit();
  pass();
  sm90::wgmma_wait<1>();
  pin(sc);
  qk_done();
  sm90::mbar_arrive(bars.kempty(st));
  soft(sc, it, a);
  sm90::wgmma_wait<0>();
  pin(o);
  pin(l);
  pin(pk);
  sm90::mbar_arrive(bars.vempty(sp));
  pack(sc, pk);
}

// One work item of a consumer warpgroup (c = 0, 1: rows 64 c .. 64 c + 63 of the q-block): its tiles'
// QK, softmax and PV on the stages of tile counts g0 .. g0 + n - 1, then its rows of out. q_empty
// (the persistent kernel's Q-empty barrier, else 0): arrived on once this warpgroup's last QK
// retired, so the next item's Q may land while the last softmax, PV and stores run.
template <class C>
__device__ __forceinline__ void consume(const Params& p, const Work& w, unsigned base, int g0, unsigned q_empty) {
  const Bars bars{base + kBarOff};
  const Seq& s = w.s;
  const int i0 = w.i0, pre = w.pre, n = w.n;
  const int wt = threadIdx.x % 128, warp = wt / 32, lane = threadIdx.x % 32;
  const int c = threadIdx.x / 128 - 1;
  const unsigned aQ = base + c * 3 * kQBlk;
  const int rloc = 64 * c + 16 * warp + (lane >> 2);   // this thread's rows rloc, rloc + 8 of the block
  int lim[2];
  float m[2], l[4] = {0.f, 0.f, 0.f, 0.f};   // l: the row sums' accumulator fragment (columns alike)
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int i = i0 + rloc + 8 * r;
    lim[r] = i < s.lq ? min(pre + i, s.lk - 1) : -1;
    m[r] = K3GEN_PF_NEG_INF;
  }
  // Tiles wholly at or below this warpgroup's first row's limit need no mask.
  const int free_end = pre + i0 + 64 * c;
  const float scale = C::kSoftmaxScale * kLog2e;
  // The ones block as the row sums' B operand: any layout reads ones, the box stays inside 512 bytes.
  const unsigned long long ones = sm90::wgmma_desc<128, 256, 0>(base + kOnesOff);
  const int col = 2 * (lane & 3);
  auto stage_k = [&](int it) { return base + kStageOff + ((g0 + it) & 1) * kStageBytes; };
  auto q_done = [&](int it) {   // this warpgroup's QK of tile `it` retired
    if (q_empty != 0u && it == n - 1) sm90::mbar_arrive(q_empty);
  };
  if (q_empty != 0u && n == 0) sm90::mbar_arrive(q_empty);
  auto soft = [&](float (&sc)[64], int it, float (&a)[2]) {
    if (it * kBN + kBN - 1 <= free_end)
      softmax<false>(sc, m, lim, it * kBN + col, scale, a);
    else
      softmax<true>(sc, m, lim, it * kBN + col, scale, a);
  };
  float o[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) o[i] = 0.f;
  float sc[64];
  unsigned pk[32];
  float a[2];
  if constexpr (!C::kOverlap) {
    // Per tile: QK, softmax, PV, each waited for before the next step.
    for (int it = 0; it < n; ++it) {
      const int g = g0 + it, st = g & 1;
      wait_stage(bars.kfull(st), (g >> 1) & 1);
      sm90::wgmma_fence();
      qk(sc, aQ, stage_k(it));
      sm90::wgmma_commit();
      sm90::wgmma_wait<0>();
      pin(sc);
      q_done(it);
      sm90::mbar_arrive(bars.kempty(st));
      soft(sc, it, a);
      pack(sc, pk);
      rescale(o, l, a);
      pin(o);   // keeps the multiplies above the fence (NVVM sinks register-only arithmetic past asm)
      pin(l);
      wait_stage(bars.vfull(st), (g >> 1) & 1);
      sm90::wgmma_fence();
      pv(o, l, pk, stage_k(it) + kKBytes, ones);
      sm90::wgmma_commit();
      sm90::wgmma_wait<0>();
      pin(o);
      pin(l);
      pin(pk);
      sm90::mbar_arrive(bars.vempty(st));
    }
  } else if (n > 0) {
    // FA3's intra-warpgroup overlap: QK of tile it runs on the tensor cores while PV of tile it - 1
    // follows it, and the softmax of tile it runs while that PV is in flight (P of tile it - 1 stays
    // in pk until the PV retired; the probabilities of tile it wait in sc as FP32).
    // kPingpong (variant wgmma_pp): the two consumers take turns at issuing their wgmmas (named
    // barriers kBarTurn + c), so one's softmax runs while the other's GEMMs occupy the tensor cores;
    // every wait on a stage happens before taking the turn. The persistent kernel keeps the turns
    // going from one work item to the next (its caller makes the first arrival and takes the last).
    auto take = [&] {
      if constexpr (C::kPingpong) sm90::barrier_sync_divergent(kBarTurn + c, 256);
    };
    auto pass = [&](bool last) {
      if constexpr (C::kPingpong)
        if (!(last && c == 1 && !C::kPersistent)) sm90::barrier_arrive(kBarTurn + (c ^ 1), 256);   // none left dangling
    };
    if constexpr (C::kPingpong && !C::kPersistent)
      if (c == 1) sm90::barrier_arrive(kBarTurn, 256);   // consumer 0 goes first
    auto turn = [&] { pass(false); };
    first_step(sc, pk, a, aQ, base, bars, g0, take, turn, [&] { q_done(0); }, soft);
    for (int it = 1; it < n; ++it)
      step(o, l, sc, pk, a, aQ, base, bars, g0 + it, it, ones, take, turn, [&] { q_done(it); }, soft);
    const int gl = g0 + n - 1, sl = gl & 1;
    rescale(o, l, a);
    pin(o);
    pin(l);
    wait_stage(bars.vfull(sl), (gl >> 1) & 1);
    take();
    sm90::wgmma_fence();
    pv(o, l, pk, stage_k(n - 1) + kKBytes, ones);
    sm90::wgmma_commit();
    pass(true);
    sm90::wgmma_wait<0>();
    pin(o);
    pin(l);
    pin(pk);
    sm90::mbar_arrive(bars.vempty(sl));
  }
  store_rows<C>(p, w, o, l, rloc, lane);
}

__device__ __forceinline__ void reload_barrier() { asm volatile("" ::: "memory"); }

template <class C>
__device__ void run(const Params& p, const Maps& maps) {
  report_seq<C>(p);
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  const unsigned base = smem_u32(smem);
  const Bars bars{base + kBarOff};
  // heads_fast: grid (H, q_blocks, B), every head's largest q-block in the first wave (few heads, K/V
  // of all heads in L2); else grid (q_blocks, H, B): a head's q-blocks run together, so its K/V is
  // read from DRAM about once (many heads, K/V of all heads larger than L2). Largest q-block first.
  Work w = work_of(p);
  if (w.i0 >= w.s.lq) return;   // CTA-uniform: this sequence has fewer q-blocks

  const int tid = threadIdx.x, wgi = tid / 128;
  if (tid == 0) {
    for (int st = 0; st < kStages; ++st) {
      // TMA: the issuing thread's expect_tx (or one arrival after a tail tile's copies); cp.async: all.
      sm90::mbar_init(bars.kfull(st), C::kTma ? 1 : 128);
      sm90::mbar_init(bars.vfull(st), C::kTma ? 1 : 128);
      sm90::mbar_init(bars.kempty(st), 256);
      sm90::mbar_init(bars.vempty(st), 256);
    }
    sm90::fence_mbar_init();
    // The first two tiles stream while the CTA copies Q (a tail tile's V is copied by produce()).
    if constexpr (C::kTma)
      for (int it = 0; it < min(w.n, kStages); ++it) {
        issue_k(w.s, w.h, it, it, base, bars, maps);
        if ((it + 1) * kBN <= w.s.lk) issue_v(w.s, w.h, it, it, base, bars, maps);
      }
  }
  load_q(p, w.s, w.h, w.i0, base);
  if (tid < 32)   // BF16 1.0 pairs; made visible to the async proxy by the fence below
    *reinterpret_cast<uint4*>(smem + kOnesOff + 16 * tid) = make_uint4(0x3f803f80u, 0x3f803f80u, 0x3f803f80u, 0x3f803f80u);
  cp_async_commit();
  cp_async_wait<0>();
  sm90::fence_proxy_async();   // Q (cp.async, generic proxy) is read by wgmma (async proxy)
  __syncthreads();

  if (wgi == 0) {
    sm90::setmaxnreg_dec<kProducerRegs>();
    reload_barrier();
    w = work_of(p);
    const int wt = threadIdx.x % 128;
    if constexpr (C::kTma) {
      if (wt == 0) {
        sm90::tma_prefetch_map(maps.kn);
        sm90::tma_prefetch_map(maps.kpe);
        sm90::tma_prefetch_map(maps.v);
      }
      produce(p, w.s, w.h, w.n, base, bars, maps, wt);
    } else {
      produce_cp(p, w.s, w.h, w.n, base, bars, wt);
    }
    return;
  }
  sm90::setmaxnreg_inc<kConsumerRegs>();
  reload_barrier();
  consume<C>(p, work_of(p), base, 0, 0u);
}


}  // namespace prefill
}  // namespace mla
}  // namespace k3gen
