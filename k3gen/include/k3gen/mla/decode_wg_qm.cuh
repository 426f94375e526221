// mla_decode, query rows on the wgmma M side (sm_90a, BF16 KV): variant "wgmma_qm". Contract:
// k3gen/ops/mla_decode/spec.py; shared-memory plan: QmKernel in k3gen/ops/mla_decode/variants.py
// (QmGeo mirrors it); address math replayed on the CPU by tests/nogpu/test_mla_decode_wgq.py
// against the PTX layouts.
//
// Why query rows on M: with the 64 tokens of a tile on M and the query rows on N (32 per consumer),
// every m64n32k16 reads 3 KB of shared memory for 64 K of MACs and large H * T runs at the
// shared-memory port, not the tensor pipe. Here 64 query rows are M: QK is m64n64k16 (Q and K both
// from shared memory) and PV is m64n128k16 (P and V from shared memory), and the softmax of a row
// stays inside the 4 lanes of a quad (no cross-warp reduction).
//
// Grid (groups, splits, B) as the other schedules, 384 threads, 64 query rows per CTA (row
// r = t * H + h), one CTA per SM:
//   warpgroup 0: the producer, one thread: a 64-token tile (one page, or part of one) is 9 TMA boxes of
//     [64 tok][128 B] into the stage's 9 SW128 blocks (the box is exactly one block; the map's 128B
//     swizzle is the wgmma layout); rows of bad pages come from past the map's end (zero-filled);
//     rows past the sequence end are whatever the page holds, so each consumer zeroes the V rows it
//     multiplies (QK's scores there are replaced by -inf, a select, so no value reaches the output).
//   warpgroup 1 (S): S = Q K^T (36 x m64n64k16), the online softmax, P (BF16, [64 rows][64 tok]
//     SW128 K-major) and the per-row rescale factors into shared memory, then
//     O[:, 0:256] += P V[:, 0:256] (2 x 4 x m64n128k16, V read N-major from the stage);
//   warpgroup 2 (O): O[:, 256:512] += P V[:, 256:512] once P is published.
// Overlap: the O warpgroup's PV of tile i runs under the S warpgroup's QK of tile i + 1, and the
// producer refills a stage while the other one is computed on.
// Hand-offs, on mbarriers (compute-sanitizer racecheck does not see named-barrier arrive / sync
// pairs order these stores and loads; bench/notes/mla_decode.md): pfull (S's 128 threads arrive
// after P and the factors are stored, O waits on the tile's phase), pempty (O's 128 threads arrive
// once its PV of the tile retired, S waits before overwriting P) and end (all 256, once: the stats).
#pragma once

#include <cuda_bf16.h>

#include "k3gen/mla/decode_wg.cuh"

namespace k3gen {
namespace mla {
namespace wgq {

constexpr int kThreads = 384;
constexpr int kRows = 64;                   // query rows per CTA = wgmma M
constexpr unsigned kBarTail = 4;   // kBarTail + consumer: a named barrier per consumer warpgroup
using wg::kBlk;
constexpr int kStages = 2;                  // one 72 KB tile per consumer warpgroup (a third does not fit with Q)
constexpr int kKBlocks = kRow / 64;         // 9 (8 latent + 1 rope)
constexpr int kTileBytes = kKBlocks * kBlk; // 73728

template <class C>
struct QmGeo {
  static constexpr int HT = C::kHeads * C::kTokens;
  static constexpr int kQOff = kStages * kTileBytes;      // Q: 9 SW128 blocks of [64 rows][64 dims]
  static constexpr int kPOff = kQOff + kRows * kRow * 2;  // P: one SW128 block [64 rows][64 tok]
  static constexpr int kAlphaOff = kPOff + kRows * 128;   // per-row rescale factor of the tile
  static constexpr int kStatsOff = kAlphaOff + kRows * 4; // final m, l per row
  static constexpr int kBarOff = kStatsOff + 2 * kRows * 4;
  static constexpr int kEnd = kBarOff + 7 * 8;   // full[2], empty[2], pfull, pempty, end
  static constexpr int kSmem = kEnd + 1024;
  static_assert(kQOff % 1024 == 0 && kPOff % 1024 == 0, "SW128 atoms are 1024-aligned");
};

using MmaS = sm90::WgmmaBf16SS<64, 0, 0>;
using MmaO = sm90::WgmmaBf16SS<128, 0, 1>;

// V as wgmma's N-major B: 128 dims = two 64-dim blocks of the stage (LBO = the block stride), 8-token
// K groups 1024 bytes apart (SBO).
__device__ __forceinline__ unsigned long long desc_v(unsigned a) {
  return sm90::wgmma_desc<kBlk, 1024, 1>(a);
}

// S[64 rows x 64 tok] = Q K^T over the 576 dims.
__device__ __forceinline__ void qk(float (&s)[32], unsigned aQ, unsigned aKV) {
#pragma unroll
  for (int ks = 0; ks < kRow / 16; ++ks)
    MmaS::mma(s, wg::desc_k(aQ + (ks >> 2) * kBlk + (ks & 3) * 32),
              wg::desc_k(aKV + (ks >> 2) * kBlk + (ks & 3) * 32), ks);
}

// O[:, 256 c .. 256 c + 255] += P V over the tile's 64 tokens; o[h] holds dims 256 c + 128 h ...
__device__ __forceinline__ void pv(float (&o)[2][64], unsigned aP, unsigned aKV, int c) {
#pragma unroll
  for (int ks = 0; ks < kTok / 16; ++ks)
#pragma unroll
    for (int h = 0; h < 2; ++h)
      MmaO::mma(o[h], wg::desc_k(aP + ks * 32), desc_v(aKV + (4 * c + 2 * h) * kBlk + ks * 2048), 1);
}

__device__ __forceinline__ void rescale(float (&o)[2][64], float a0, float a1) {
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int i = 0; i < 64; ++i) o[h][i] *= (i & 2) ? a1 : a0;
}

__device__ __forceinline__ void pin(float (&o)[2][64]) {
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int i = 0; i < 64; ++i) sm90::fence_operand(o[h][i]);
}

// Online-softmax state of this thread's two rows (16 w + lane / 4 and + 8); l holds this thread's
// partial sums (its 16 columns per row), reduced over the quad at the end.
struct RowState {
  float m[2], l[2];
  int lim[2];
};

// One tile's softmax on S (log2 domain, masked past each row's causal limit; the select also drops
// whatever the page holds past the sequence end): P rounded to BF16 into pk (tokens 8 j + 2 (lane % 4)
// + {0, 1} of row r in pk[2 j + r]), the rows' rescale factors into a.
__device__ __forceinline__ void softmax(float (&sc)[32], RowState& st, int pos0, float qk_scale, unsigned (&pk)[16],
                                        float (&a)[2]) {
  float mx[2] = {K3GEN_MLA_NEG_INF, K3GEN_MLA_NEG_INF};
#pragma unroll
  for (int i = 0; i < 32; ++i) {
    const int r = (i >> 1) & 1, pos = pos0 + 8 * (i >> 2) + (i & 1);
    sc[i] = pos <= st.lim[r] ? sc[i] * qk_scale : K3GEN_MLA_NEG_INF;
    mx[r] = fmaxf(mx[r], sc[i]);
  }
  float msub[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
    mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
    const float m_new = fmaxf(st.m[r], mx[r]);
    // A row with nothing visible yet (m_new = -inf) keeps its state: factor 1, probabilities 0.
    a[r] = m_new == K3GEN_MLA_NEG_INF ? 1.f : exp2f(st.m[r] - m_new);
    msub[r] = m_new == K3GEN_MLA_NEG_INF ? 0.f : m_new;
    st.m[r] = m_new;
  }
  float sum[2] = {0.f, 0.f};
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const __nv_bfloat162 pb = __floats2bfloat162_rn(exp2f(sc[4 * j + 2 * r] - msub[r]),
                                                      exp2f(sc[4 * j + 2 * r + 1] - msub[r]));
      const float2 pf = __bfloat1622float2(pb);   // the denominator sums what the MMA sums
      sum[r] += pf.x + pf.y;
      pk[2 * j + r] = *reinterpret_cast<const unsigned*>(&pb);
    }
#pragma unroll
  for (int r = 0; r < 2; ++r) st.l[r] = st.l[r] * a[r] + sum[r];
}

// P into the shared [64 rows][64 tok] SW128 K-major tile (row r at (r / 8) * 1024 + (r % 8) * 128,
// token chunk j at (j ^ (r % 8)) * 16), the factors into alpha (one lane per quad).
__device__ __forceinline__ void publish(const unsigned (&pk)[16], const float (&a)[2], unsigned char* sP, float* alpha,
                                        int warp, int lane) {
  const int row0 = 16 * warp + (lane >> 2);
  unsigned char* base = sP + (row0 >> 3) * 1024 + (row0 & 7) * 128 + 4 * (lane & 3);
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int r = 0; r < 2; ++r) *reinterpret_cast<unsigned*>(base + r * 1024 + ((j ^ (row0 & 7)) << 4)) = pk[2 * j + r];
  if ((lane & 3) == 0) {
    alpha[row0] = a[0];
    alpha[row0 + 8] = a[1];
  }
}

// This warpgroup's 256 output columns of the CTA's rows, normalized (w = 1 / l, 0 for an empty row):
// BF16 rows with one split, FP32 partials with several. Staged through shared memory (the stages
// are free once both consumers passed the end handoff; each consumer its own region, rows padded by 16 bytes:
// conflict-free fragment stores) so every row leaves as contiguous 16-byte stores.
template <class T>
__device__ __forceinline__ void store_rows(const Params& p, const float (&o)[2][64], const float (&w)[2], T* dst,
                                           unsigned char* buf, int r0, int ht, int c, int wt) {
  constexpr int kStride = 256 * sizeof(T) + 16;
  const int warp = wt / 32, lane = wt % 32, row0 = 16 * warp + (lane >> 2);
  unsigned char* mine = buf + c * kRows * kStride;
#pragma unroll
  for (int r = 0; r < 2; ++r)
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        const float x = o[h][4 * j + 2 * r] * w[r], y = o[h][4 * j + 2 * r + 1] * w[r];
        unsigned char* at = mine + (row0 + 8 * r) * kStride + (128 * h + 8 * j + 2 * (lane & 3)) * sizeof(T);
        if constexpr (sizeof(T) == 2)
          *reinterpret_cast<unsigned*>(at) = bf16x2(x, y);
        else
          *reinterpret_cast<float2*>(at) = make_float2(x, y);
      }
  sm90::barrier_sync_divergent(kBarTail + c, 128);
  constexpr int kPerRow = 256 * sizeof(T) / 16;
  for (int i = wt; i < kRows * kPerRow; i += 128) {
    const int row = i / kPerRow, q = i - row * kPerRow;
    if (r0 + row >= ht) break;
    *reinterpret_cast<uint4*>(dst + static_cast<long long>(row) * kLat + 256 * c + q * (16 / sizeof(T))) =
        *reinterpret_cast<const uint4*>(mine + row * kStride + q * 16);
  }
}

// Tile `tile` of sequence b into the stage at `dst`: 9 boxes of [64 tok][128 B] (columns 128 kb); a bad
// page id reads from past the map's end (zero-filled); the boxes' bytes complete `full`.
template <class C>
__device__ __forceinline__ void issue_tile(const Params& p, int b, int tile, unsigned dst, unsigned full,
                                           const sm90::TmaMap* kv_map) {
  const int pg = tile_page<C>(p, b, tile);
  const int row = pg < 0 ? p.num_pages * C::kPage : pg * C::kPage + (tile * kTok) % C::kPage;
  sm90::mbar_arrive_expect_tx(full, kTileBytes);
#pragma unroll
  for (int kb = 0; kb < kRow / 64; ++kb) sm90::tma_load_2d(dst + kb * kBlk, kv_map, 128 * kb, row, full);
}

// Zeroes V rows rem .. 63 of this consumer's four 64-dim blocks of the stage at `stage` (rows past
// the sequence end: a zero probability times a NaN there would still be NaN), then makes them
// visible to this warpgroup's wgmma.
__device__ __forceinline__ void zero_tail(unsigned char* stage, int rem, int c, int wt) {
  for (int i = wt; i < (kTok - rem) * 32; i += 128) {
    const int row = rem + (i >> 5), blk = 4 * c + ((i >> 3) & 3), chunk = i & 7;
    *reinterpret_cast<uint4*>(stage + blk * kBlk + row * 128 + chunk * 16) = make_uint4(0, 0, 0, 0);
  }
  sm90::fence_proxy_async();
  sm90::barrier_sync_divergent(kBarTail + c, 128);
}

template <class C>
__device__ void decode(const Params& p, const sm90::TmaMap* kv_map) {
  using G = QmGeo<C>;
  constexpr int HT = G::HT;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  const unsigned base = smem_u32(smem);
  const unsigned aQ = base + G::kQOff, aP = base + G::kPOff;
  unsigned char* sP = smem + G::kPOff;
  float* alpha = reinterpret_cast<float*>(smem + G::kAlphaOff);
  float* stats = reinterpret_cast<float*>(smem + G::kStatsOff);   // [m, l][64 rows]
  const unsigned bar = base + G::kBarOff;                         // full[0..1], empty[0..1]
  const unsigned pfull = bar + 32, pempty = bar + 40, endb = bar + 48;

  const int tid = threadIdx.x, wgi = tid / 128, wt = tid % 128, warp = wt / 32, lane = tid % 32;
  const int g = blockIdx.x, split = blockIdx.y, b = blockIdx.z;
  const int r0 = g * kRows;
  // The split's tiles, recomputed where needed (the prologue's producer thread, then each role after its
  // setmaxnreg): ptxas spills values that live across setmaxnreg (to local memory, reloaded per tile).
  auto tiles = [&](int& len, int& t_begin, int& n) {
    len = seq_len<C>(p, b);
    const int ntiles = (len + kTok - 1) / kTok;
    const int per = (ntiles + p.splits - 1) / p.splits;
    t_begin = min(ntiles, split * per);
    n = min(ntiles, t_begin + per) - t_begin;
  };
  int len, t_begin, n;

  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      sm90::mbar_init(bar + 8 * s, 1);          // the producer's expect_tx; the TMA bytes complete it
      sm90::mbar_init(bar + 16 + 8 * s, 256);   // both consumers read every stage
    }
    sm90::mbar_init(pfull, 128);
    sm90::mbar_init(pempty, 128);
    sm90::mbar_init(endb, 256);
    sm90::fence_mbar_init();
    // The first two tiles stream while the CTA loads Q.
    tiles(len, t_begin, n);
    for (int it = 0; it < min(n, kStages); ++it)
      issue_tile<C>(p, b, t_begin + it, base + it * kTileBytes, bar + 8 * it, kv_map);
  }
  {
    const uint4* qg = reinterpret_cast<const uint4*>(p.q) + (static_cast<long long>(b) * HT + r0) * kChunks;
    for (int i = tid; i < kRows * kChunks; i += kThreads) {
      const int r = i / kChunks, c = i - r * kChunks;
      *reinterpret_cast<uint4*>(smem + G::kQOff + wg::sw_off(kRows, r, c)) =
          r0 + r < HT ? qg[i] : make_uint4(0, 0, 0, 0);
    }
  }
  sm90::fence_proxy_async();   // Q (generic stores) is read by wgmma (async proxy)
  __syncthreads();

  if (wgi == 0) {
    sm90::setmaxnreg_dec<wg::kProducerRegs>();
    if (wt == 0) {
      tiles(len, t_begin, n);
      for (int it = kStages; it < n; ++it) {
        const int s = it & 1;
        sm90::mbar_wait_or_trap(bar + 16 + 8 * s, ((it >> 1) - 1) & 1);
        issue_tile<C>(p, b, t_begin + it, base + s * kTileBytes, bar + 8 * s, kv_map);
      }
    }
    return;
  }
  sm90::setmaxnreg_inc<wg::kConsumerRegs>();
  tiles(len, t_begin, n);
  const int c = wgi - 1;
  const int row0 = 16 * warp + (lane >> 2);   // this thread's rows row0, row0 + 8 of the CTA
  float o[2][64];
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int i = 0; i < 64; ++i) o[h][i] = 0.f;

  if (c == 0) {
    RowState st;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = r0 + row0 + 8 * r;
      st.m[r] = K3GEN_MLA_NEG_INF;
      st.l[r] = 0.f;
      st.lim[r] = len - C::kTokens + (row < HT ? row / C::kHeads : C::kTokens - 1);
    }
    const float qk_scale = C::kSoftmaxScale * kLog2e;
    float sc[32];
    // Per tile: QK, softmax, P published, PV of our half, and that PV retired before the next QK,
    // so the stage is released one whole tile before the producer's refill of it is needed (two
    // 72 KB stages fit beside Q; issuing the next QK under this PV would leave the refill almost
    // no time: H200, H128 B128 L8K 1024-1140 us that way).
    for (int it = 0; it < n; ++it) {
      const int s = it & 1;
      const unsigned aKV = base + s * kTileBytes;
      sm90::mbar_wait_asm(bar + 8 * s, (it >> 1) & 1);
      sm90::wgmma_fence();
      qk(sc, aQ, aKV);
      sm90::wgmma_commit();
      sm90::wgmma_wait<0>();
#pragma unroll
      for (int i = 0; i < 32; ++i) sm90::fence_operand(sc[i]);
      const int rem = len - (t_begin + it) * kTok;
      if (rem < kTok) zero_tail(smem + s * kTileBytes, rem, 0, wt);
      float a[2];
      unsigned pk[16];
      softmax(sc, st, (t_begin + it) * kTok + 2 * (lane & 3), qk_scale, pk, a);
      if (it > 0) sm90::mbar_wait_asm(pempty, (it - 1) & 1);   // the O warpgroup is done with P
      publish(pk, a, sP, alpha, warp, lane);
      sm90::fence_proxy_async();   // P (generic stores) is read by wgmma
      sm90::mbar_arrive(pfull);
      rescale(o, a[0], a[1]);
      pin(o);   // keeps the multiplies above the fence (NVVM sinks register-only arithmetic past asm)
      sm90::wgmma_fence();
      pv(o, aP, aKV, 0);
      sm90::wgmma_commit();
      sm90::wgmma_wait<0>();
      pin(o);
      sm90::mbar_arrive(bar + 16 + 8 * s);
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      st.l[r] += __shfl_xor_sync(0xffffffffu, st.l[r], 1);
      st.l[r] += __shfl_xor_sync(0xffffffffu, st.l[r], 2);
      if ((lane & 3) == 0) {
        stats[row0 + 8 * r] = st.m[r];
        stats[kRows + row0 + 8 * r] = st.l[r];
        const int row = r0 + row0 + 8 * r;
        if (p.splits > 1 && row < HT)
          p.part_lse[(static_cast<long long>(b) * p.splits + split) * HT + row] =
              st.l[r] > 0.f ? st.m[r] + log2f(st.l[r]) : K3GEN_MLA_NEG_INF;
      }
    }
    sm90::mbar_arrive(endb);
    sm90::mbar_wait_asm(endb, 0);
  } else {
    for (int it = 0; it < n; ++it) {
      const int s = it & 1;
      sm90::mbar_wait_asm(pfull, it & 1);
      sm90::mbar_wait_asm(bar + 8 * s, (it >> 1) & 1);
      const int rem = len - (t_begin + it) * kTok;
      if (rem < kTok) zero_tail(smem + s * kTileBytes, rem, 1, wt);
      rescale(o, alpha[row0], alpha[row0 + 8]);
      pin(o);
      sm90::wgmma_fence();
      pv(o, aP, base + s * kTileBytes, 1);
      sm90::wgmma_commit();
      sm90::wgmma_wait<0>();
      pin(o);
      sm90::mbar_arrive(bar + 16 + 8 * s);
      if (it + 1 < n) sm90::mbar_arrive(pempty);
    }
    sm90::mbar_arrive(endb);
    sm90::mbar_wait_asm(endb, 0);
  }
  float w[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float l = stats[kRows + row0 + 8 * r];
    w[r] = l > 0.f ? 1.f / l : 0.f;
  }
  if (p.splits == 1)
    store_rows(p, o, w, p.out + (static_cast<long long>(b) * HT + r0) * kLat, smem, r0, HT, c, wt);
  else
    store_rows(p, o, w, p.part_o + ((static_cast<long long>(b) * p.splits + split) * HT + r0) * kLat, smem, r0, HT,
               c, wt);
}

}  // namespace wgq
}  // namespace mla
}  // namespace k3gen
