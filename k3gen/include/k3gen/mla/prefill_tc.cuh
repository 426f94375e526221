// mla_prefill on tcgen05 (the SM100 family: sm_103a, sm_107a): variant "tcgen05" of
// k3gen/ops/mla_prefill/variants.py (its plan mirrors the offsets below; the template static_asserts
// both agree). Contract: k3gen/ops/mla_prefill/spec.py, the same as the sm_90a kernel's
// (mla/prefill.cuh): causal flash attention of the unabsorbed MLA form, varlen with a cached prefix,
// FP32 or BF16 out. Index math replayed on the CPU against the SM90 kernel's by
// tests/nogpu/ops/test_mla_prefill_tcgen05.py. Compiled and checked only: no Blackwell GPU has run it.
//
// Shared with the SM90 kernel, as the same C++ (mla/prefill_common.cuh): Params, the work item of a
// CTA (work_of: head, q-block order, the clamped sequence rows, the prefix, the key tiles), the
// per-sequence fault report, the TMA maps and boxes of K and V, the zero-filling copy of the V of a
// tile that runs past the sequence end. The MMA/TMEM layer is common/sm100_tc.cuh (mla_decode's).
//
// Geometry: the SM90 grid (H, q_blocks, B) or (q_blocks, H, B), 224 threads, one CTA per SM.
//   M = 128 query rows per CTA (a q-block; tcgen05 data path layout D: row r in TMEM lane r),
//   N = 128 keys per tile. TMEM (512 columns allocated): S ping-pong [0, 128) / [128, 256) FP32,
//   O [256, 384) FP32.
//   S = Q K^T: 12 x kind::f16 M128 N128 K16, BF16 Q and K from shared memory (K-major SW128: the
//   boxes TMA writes), K = 192 as three 64-dim blocks (k_nope 0-63, 64-127, the shared k_pe).
//   O += P V: 8 x M128 N128 K16, P K-major from shared memory, V MN-major (the boxes as TMA wrote them).
// Warps:
//   0-3  softmax: thread t owns query row t (tcgen05.ld 32x32b, TMEM lane t; no shuffles). Exactly
//        the SM90 kernel's rules: raw scores masked past each row's limit (a tile the warp's first
//        row sees whole is not masked), with s = scale x log2(e): m_new = max(m, s x row max),
//        a = exp2(m - m_new) (1 for a row with nothing visible yet), P = exp2(fma(x, s, -m_new))
//        (MUFU.EX2, results below 2^-126 flushed) rounded to BF16 once, l = l a + the
//        sum of the rounded values; O rescaled in TMEM (ld / mul / st) when a row's factor is not 1;
//        P into shared memory; the epilogue O / l (0 for an empty row) from TMEM to FP32 / BF16 rows.
//   4    K producer (lane 0): TMA boxes of each tile's K into a 2-stage ring (K-full / K-empty).
//   5    V producer: TMA boxes of V (lane 0), or, for the tile that runs past the sequence end, the
//        zero-filling cp.async copy of all 32 lanes (SM90's load_v): a NaN in another sequence's rows
//        must not reach this one's output through 0 x NaN.
//   6    MMA issuer (lane 0) and the TMEM allocator (whole warp). Order: QK(0), then per tile QK(it + 1)
//        (into the other S buffer, so the softmax of it + 1 can start while PV(it) runs) before PV(it).
// Shared memory (213 KB + alignment): Q 48 KB, K 2 x 48 KB, V 32 KB, P 32 KB, barriers, TMEM slot.
// Why one V stage: with P in shared memory, a second V stage (32 KB) does not fit beside the K ring;
// K (needed first, by QK of the next tile) keeps two. P in TMEM as the A operand (FA4's TS MMA) would
// free 32 KB for it, but that TMEM operand layout cannot be checked against anything here, while
// P's shared-memory layout is the descriptor layout the SM90 kernels and mla_decode's tcgen05 kernel
// share (k3gen/arch/sm90.py models it).
// Barriers: K-full/K-empty per K stage (TMA tx / the QK commit), V-full/V-empty (TMA tx or the tail
// copy's arrival / the PV commit), S-full per S buffer (QK commit), P-full (128 softmax arrivals),
// O-done (PV commit: O and P free again).
#pragma once

#include <cuda_bf16.h>

#include "k3gen/common/faults.cuh"
#include "k3gen/common/sm90_async.cuh"
#include "k3gen/common/sm100_tc.cuh"
#include "k3gen/mla/prefill_common.cuh"

#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM100_ALL) && !defined(__CUDA_ARCH_FEAT_SM103_ALL) && \
    !defined(__CUDA_ARCH_FEAT_SM107_ALL) && !defined(__CUDA_ARCH_FAMILY_SPECIFIC__)
#error "the tcgen05 kernel of mla_prefill needs an arch-specific sm_10xa target"
#endif

namespace k3gen {
namespace mla {
namespace prefill {
namespace tc {

using prefill::kBM;
using sm100::commit;
using sm100::desc;
using sm100::fence_after;
using sm100::fence_before;

constexpr int kThreads = 224;
constexpr int kSoftmaxThreads = 128;           // warps 0-3: one query row per thread
constexpr int kWarpK = 4, kWarpV = 5, kWarpMma = 6;
constexpr int kKStages = 2;
constexpr int kBlk = kBM * 128;                // one [128 rows][64 16-bit] SW128 block (== kKBlk)
static_assert(kBlk == kKBlk && kBM == kBN, "Q, K, V and P blocks are all [128][64] BF16");
// Shared memory from the 1024-aligned base (variants.py tc_smem).
constexpr int kQOff = 0;                       // Q: 3 blocks [128 rows][64 dims] (dims 0-63, 64-127, rope)
constexpr int kKOff = kQOff + 3 * kBlk;        // K ring: kKStages x 3 blocks [128 keys][64 dims]
constexpr int kVOff = kKOff + kKStages * kKBytes;   // V: 2 blocks [128 keys][64 dims]
constexpr int kPOff = kVOff + kVBytes;         // P: 2 blocks [128 rows][64 keys]
constexpr int kBarOff = kPOff + 2 * kBlk;
constexpr int kNumBars = 10;                   // K-full x 2, K-empty x 2, V-full, V-empty, S-full x 2, P-full, O-done
constexpr int kTmemOff = kBarOff + 8 * kNumBars;
constexpr int kEnd = kTmemOff + 16;
constexpr int kSmem = kEnd + 1024;             // + slack to align the base to 1024
static_assert(kKOff % 1024 == 0 && kVOff % 1024 == 0 && kPOff % 1024 == 0, "SW128 atoms 1024-aligned");
static_assert(kSmem <= 232448, "one CTA per SM");
constexpr int kTmemCols = 512;
constexpr int kSCol = 0, kOCol = 2 * kBN;      // S buffers at 0 / 128, O at 256

// ---- index math (constexpr: the template's probes compare it with the Python model) ---------------
// Q loader: 16-byte chunk c (of 24) of CTA row r. Softmax: chunk ch (8 keys, of 16) of P row r.
__host__ __device__ constexpr unsigned q_off(int r, int c) { return kQOff + (c >> 3) * kBlk + sw128(r, c & 7); }
__host__ __device__ constexpr unsigned p_off(int r, int ch) { return kPOff + (ch >> 3) * kBlk + sw128(r, ch & 7); }
// Start addresses of each K16 step's descriptors (K-major: 32 bytes per step inside a 64-dim block).
__host__ __device__ constexpr unsigned qk_a(int ks) { return kQOff + (ks >> 2) * kBlk + (ks & 3) * 32; }
__host__ __device__ constexpr unsigned qk_b(int st, int ks) {
  return kKOff + st * kKBytes + (ks >> 2) * kBlk + (ks & 3) * 32;
}
__host__ __device__ constexpr unsigned pv_a(int ks) { return kPOff + (ks >> 2) * kBlk + (ks & 3) * 32; }
// V MN-major: 16 keys = 16 rows of 128 bytes per step; the two 64-dim blocks kBlk apart (LBO).
__host__ __device__ constexpr unsigned pv_b(int ks) { return kVOff + ks * 2048; }
// A polynomial hash of a function over its whole domain: the template static_asserts the one
// variants.py computes from its Python model, so the model the CPU tests replay is this C++.
template <class F>
__host__ __device__ constexpr unsigned fingerprint(F f, int n0, int n1) {
  unsigned h = 0;
  for (int i = 0; i < n0; ++i)
    for (int j = 0; j < n1; ++j) h = h * 31u + f(i, j);
  return h;
}
struct QOff { __host__ __device__ constexpr unsigned operator()(int r, int c) const { return q_off(r, c); } };
struct POff { __host__ __device__ constexpr unsigned operator()(int r, int c) const { return p_off(r, c); } };
struct QkA { __host__ __device__ constexpr unsigned operator()(int, int ks) const { return qk_a(ks); } };
struct QkB { __host__ __device__ constexpr unsigned operator()(int st, int ks) const { return qk_b(st, ks); } };
struct PvA { __host__ __device__ constexpr unsigned operator()(int, int ks) const { return pv_a(ks); } };
struct PvB { __host__ __device__ constexpr unsigned operator()(int, int ks) const { return pv_b(ks); } };

struct Bars {
  unsigned base;
  __device__ unsigned kfull(int s) const { return base + 8 * s; }
  __device__ unsigned kempty(int s) const { return base + 16 + 8 * s; }
  __device__ unsigned vfull() const { return base + 32; }
  __device__ unsigned vempty() const { return base + 40; }
  __device__ unsigned sfull(int b) const { return base + 48 + 8 * b; }
  __device__ unsigned pfull() const { return base + 64; }
  __device__ unsigned odone() const { return base + 72; }
};

// Q rows i0 .. i0 + 127 of head h (rows past the sequence zero-filled), all threads.
__device__ __forceinline__ void load_q(const Params& p, const Seq& s, int h, int i0, unsigned base) {
  for (int i = threadIdx.x; i < kBM * (kDqk / 8); i += kThreads) {
    const int r = i / (kDqk / 8), c = i - r * (kDqk / 8);
    const bool ok = i0 + r < s.lq;
    const __nv_bfloat16* src =
        ok ? p.q + static_cast<long long>(s.q0 + i0 + r) * p.q_row + h * p.q_head + c * 8 : p.q;
    cp_async16(base + q_off(r, c), src, ok ? 16u : 0u);
  }
}

// S[128 rows x 128 keys] = Q K^T over the 192 dims.
__device__ __forceinline__ void qk(unsigned d, unsigned base, int st) {
  constexpr unsigned id = sm100::idesc<true, false, kBM, kBN>();
#pragma unroll
  for (int ks = 0; ks < kDqk / 16; ++ks)
    sm100::mma(d, desc<16, 1024>(base + qk_a(ks)), desc<16, 1024>(base + qk_b(st, ks)), id, ks);
}
// O[128 rows x 128 dims] (+)= P V over the tile's 128 keys; acc0: O holds no partial sums yet.
__device__ __forceinline__ void pv(unsigned d, unsigned base, bool acc0) {
  constexpr unsigned id = sm100::idesc<true, true, kBM, kDv>();
#pragma unroll
  for (int ks = 0; ks < kBN / 16; ++ks)
    sm100::mma(d, desc<16, 1024>(base + pv_a(ks)), desc<kBlk, 1024>(base + pv_b(ks)), id, ks > 0 || !acc0);
}

// The V producer warp: each tile's V once the previous PV released the stage (tile 0's full-tile V
// was issued by run()); the tile past the sequence end by the zero-filling copy of the 32 lanes.
__device__ __forceinline__ void produce_v(const Params& p, const Seq& s, int h, int n, unsigned base,
                                          const Bars& bars, const Maps& maps, int lane) {
  for (int it = 0; it < n; ++it) {
    const int kv0 = it * kBN;
    if (it > 0) sm90::mbar_wait_or_trap(bars.vempty(), (it - 1) & 1);
    if (kv0 + kBN <= s.lk) {
      if (lane == 0 && it > 0) tma_v(base + kVOff, bars.vfull(), maps, h, s.k0 + kv0);
    } else {
      load_v<32>(p, s, h, kv0, base + kVOff, lane);
      cp_async_commit();
      cp_async_wait<0>();
      sm90::fence_proxy_async();   // generic-proxy copies read by the MMA (async proxy)
      __syncwarp();
      if (lane == 0) sm90::mbar_arrive(bars.vfull());
    }
  }
}

// One tile's scores of this thread's row (in place): masked past `lim` when kMask (column col0 + j),
// the raw row max (scaled by the caller: exact, scale > 0).
template <bool kMask>
__device__ __forceinline__ float mask_max(float (&x)[kBN / 32][32], int col0, int lim) {
  float mx = K3GEN_PF_NEG_INF;
#pragma unroll
  for (int j = 0; j < kBN; ++j) {
    if (kMask) x[j >> 5][j & 31] = col0 + j <= lim ? x[j >> 5][j & 31] : K3GEN_PF_NEG_INF;
    mx = fmaxf(mx, x[j >> 5][j & 31]);
  }
  return mx;
}

template <class C>
__device__ void run(const Params& p, const Maps& maps) {
  report_seq<C>(p);
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  const unsigned base = smem_u32(smem);
  const Bars bars{base + kBarOff};
  const Work w = work_of(p);
  if (w.i0 >= w.s.lq) return;   // CTA-uniform: this sequence has fewer q-blocks
  const Seq& s = w.s;
  const int n = w.n, h = w.h;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;

  if (tid == 0) {
    for (int st = 0; st < kKStages; ++st) {
      sm90::mbar_init(bars.kfull(st), 1);
      sm90::mbar_init(bars.kempty(st), 1);
      sm90::mbar_init(bars.sfull(st), 1);
    }
    sm90::mbar_init(bars.vfull(), 1);
    sm90::mbar_init(bars.vempty(), 1);
    sm90::mbar_init(bars.pfull(), kSoftmaxThreads);
    sm90::mbar_init(bars.odone(), 1);
    sm90::fence_mbar_init();
    // The first K tiles and the first full V stream while the CTA copies Q.
    for (int it = 0; it < min(n, kKStages); ++it)
      tma_k(base + kKOff + it * kKBytes, bars.kfull(it), maps, h, s.k0 + it * kBN);
    if (n > 0 && kBN <= s.lk) tma_v(base + kVOff, bars.vfull(), maps, h, s.k0);
  }
  if (warp == kWarpMma) sm100::tmem_alloc(base + kTmemOff, kTmemCols);
  load_q(p, s, h, w.i0, base);
  cp_async_commit();
  cp_async_wait<0>();
  sm90::fence_proxy_async();   // Q (cp.async, generic proxy) is read by the MMA (async proxy)
  fence_before();
  __syncthreads();
  fence_after();
  const unsigned tmem = *reinterpret_cast<volatile unsigned*>(smem + kTmemOff);

  if (warp == kWarpK) {
    if (lane == 0)
      for (int it = kKStages; it < n; ++it) {
        const int st = it & 1;
        sm90::mbar_wait_or_trap(bars.kempty(st), ((it >> 1) - 1) & 1);
        tma_k(base + kKOff + st * kKBytes, bars.kfull(st), maps, h, s.k0 + it * kBN);
      }
  } else if (warp == kWarpV) {
    produce_v(p, s, h, n, base, bars, maps, lane);
  } else if (warp == kWarpMma) {
    if (lane == 0 && n > 0) {
      auto issue_qk = [&](int it) {
        const int st = it & 1;
        sm90::mbar_wait_or_trap(bars.kfull(st), (it >> 1) & 1);
        fence_after();
        qk(tmem + kSCol + kBN * st, base, st);
        commit(bars.sfull(st));    // S of tile it is in TMEM
        commit(bars.kempty(st));   // and its K stage may be refilled
      };
      issue_qk(0);
      for (int it = 0; it < n; ++it) {
        // S buffer (it + 1) & 1 was last read by the softmax of tile it - 1, whose P-full came first.
        if (it + 1 < n) issue_qk(it + 1);
        sm90::mbar_wait_or_trap(bars.pfull(), it & 1);
        sm90::mbar_wait_or_trap(bars.vfull(), it & 1);
        fence_after();
        pv(tmem + kOCol, base, it == 0);
        commit(bars.odone());    // O final for this tile, P free
        commit(bars.vempty());   // V stage free
      }
    }
  } else {
    // Softmax warps: thread `tid` owns row i0 + tid of the q-block, TMEM lane tid.
    const int i = w.i0 + tid;
    const int lim = i < s.lq ? min(w.pre + i, s.lk - 1) : -1;
    // Tiles wholly at or below this warp's first row's limit need no mask (rows past the sequence
    // are then unmasked too, as in the SM90 kernel: they are never written).
    const int free_end = w.pre + w.i0 + 32 * warp;
    const float scale = C::kSoftmaxScale * kLog2e;
    const unsigned lane_addr = tmem + (static_cast<unsigned>(32 * warp) << 16);
    float m = K3GEN_PF_NEG_INF, l = 0.f;
    for (int it = 0; it < n; ++it) {
      const int st = it & 1;
      sm90::mbar_wait_or_trap(bars.sfull(st), (it >> 1) & 1);
      fence_after();
      float x[kBN / 32][32];
#pragma unroll
      for (int c = 0; c < kBN / 32; ++c) sm100::ld32_async(lane_addr + kSCol + kBN * st + 32 * c, x[c]);
      sm100::wait_ld();
#pragma unroll
      for (int c = 0; c < kBN / 32; ++c) sm100::pin(x[c]);
      const float mx = scale * (it * kBN + kBN - 1 <= free_end ? mask_max<false>(x, it * kBN, lim)
                                                               : mask_max<true>(x, it * kBN, lim));
      const float m_new = fmaxf(m, mx);
      // A row with nothing visible yet keeps its state: factor 1, probabilities 0.
      const float a = m_new == K3GEN_PF_NEG_INF ? 1.f : ex2(m - m_new);
      const float msub = m_new == K3GEN_PF_NEG_INF ? 0.f : m_new;
      m = m_new;
      unsigned pk[kBN / 2];
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < kBN / 2; ++j) {
        const __nv_bfloat162 pb =
            __floats2bfloat162_rn(ex2(fmaf(x[j >> 4][(2 * j) & 31], scale, -msub)),
                                ex2(fmaf(x[j >> 4][(2 * j + 1) & 31], scale, -msub)));
        const float2 pf = __bfloat1622float2(pb);
        sum += pf.x + pf.y;   // the denominator sums what the MMA sums (the rounded values)
        pk[j] = *reinterpret_cast<const unsigned*>(&pb);
      }
      l = l * a + sum;
      if (it > 0) {
        sm90::mbar_wait_or_trap(bars.odone(), (it - 1) & 1);   // PV of the previous tile retired: O and P free
        fence_after();
        if (__any_sync(0xffffffffu, a != 1.f)) {
#pragma unroll 1
          for (int c = 0; c < kDv / 32; ++c) {
            float o[32];
            sm100::ld32(lane_addr + kOCol + 32 * c, o);
            sm100::pin(o);
#pragma unroll
            for (int j = 0; j < 32; ++j) o[j] *= a;
            sm100::st32(lane_addr + kOCol + 32 * c, o);
          }
        }
      }
#pragma unroll
      for (int ch = 0; ch < kBN / 8; ++ch)
        *reinterpret_cast<uint4*>(smem + p_off(tid, ch)) =
            make_uint4(pk[4 * ch], pk[4 * ch + 1], pk[4 * ch + 2], pk[4 * ch + 3]);
      sm90::fence_proxy_async();   // P (generic stores) is read by the MMA
      fence_before();
      sm90::mbar_arrive(bars.pfull());
    }
    // Epilogue: O / l (0 for a row that saw no key, as the SM90 kernel writes it).
    const float inv = l > 0.f ? __fdividef(1.f, l) : 0.f;   // l <= the key count: far from __fdividef's limit
    if (n > 0) {
      sm90::mbar_wait_or_trap(bars.odone(), (n - 1) & 1);
      fence_after();
    }
    const long long off = (static_cast<long long>(s.q0 + i) * C::kHeads + h) * kDv;
#pragma unroll 1
    for (int c = 0; c < kDv / 32; ++c) {
      float o[32];
      if (n > 0) {
        sm100::ld32(lane_addr + kOCol + 32 * c, o);
        sm100::pin(o);
      } else {
#pragma unroll
        for (int j = 0; j < 32; ++j) o[j] = 0.f;
      }
      if (i < s.lq) {
        if constexpr (C::kOutF32) {
          float4* d = reinterpret_cast<float4*>(static_cast<float*>(p.out) + off + 32 * c);
#pragma unroll
          for (int q = 0; q < 8; ++q)
            d[q] = make_float4(o[4 * q] * inv, o[4 * q + 1] * inv, o[4 * q + 2] * inv, o[4 * q + 3] * inv);
        } else {
          uint4* d = reinterpret_cast<uint4*>(static_cast<__nv_bfloat16*>(p.out) + off + 32 * c);
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            unsigned u[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const __nv_bfloat162 v = __floats2bfloat162_rn(o[8 * q + 2 * e] * inv, o[8 * q + 2 * e + 1] * inv);
              u[e] = *reinterpret_cast<const unsigned*>(&v);
            }
            d[q] = make_uint4(u[0], u[1], u[2], u[3]);
          }
        }
      }
    }
    fence_before();
  }
  __syncwarp();   // lane 0 of the producer / MMA warps rejoins its warp before the aligned barrier
  __syncthreads();
  if (warp == kWarpMma) {
    fence_after();
    sm100::tmem_dealloc(tmem, kTmemCols);
  }
}

}  // namespace tc
}  // namespace prefill
}  // namespace mla
}  // namespace k3gen
