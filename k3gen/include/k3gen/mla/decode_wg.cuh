// mla_decode, wgmma schedule (sm_90a, BF16 KV). Contract: k3gen/ir/ops/mla_decode.py (schedule
// "wgmma"); shared-memory plan: MlaDecodeSpec.wg_smem; address math checked on the CPU by
// tests/nogpu/test_mla_decode_wg.py against the PTX layouts (k3gen/ir/sm90_tiles.py).
//
// Grid (groups, splits, B) as the mma.sync kernel, 384 threads = 3 warpgroups, N = 16 * kMT query
// rows per CTA (row r = t * H + h), one CTA per SM. NC = the query rows (wgmma N) of one consumer.
//   warpgroup 0 (producer): cp.async of the split's 64-token tiles into 2 stages; rows past the
//     sequence end and rows of bad pages are zero-filled; each thread's copies arrive on the
//     stage's `full` mbarrier (cp.async.mbarrier.arrive.noinc, 128 arrivals).
//   warpgroups 1 and 2 (consumers), two ways to share the work (kSplitRows, from kMT):
//   - kMT 1, 2 (N = NC = 16, 32): consumer c takes the tiles it = c, c + 2, ... of the split, so
//     stage it % 2 always belongs to consumer c and each consumer has its own online-softmax state
//     (merged at the end): one consumer's softmax runs while the other's MMAs hold the tensor cores.
//   - kMT 4 (N = 64, NC = 32): both consumers take every tile, consumer c the query rows
//     32 c .. 32 c + 31; a stage is refilled once both released it. Per FLOP this halves the
//     KV re-reads (CTAs per sequence) of the N = 32 plan; the states are disjoint (no merge).
// Per tile, tokens on the wgmma M side (64 = one instruction's M):
//   QK: S^T[64 tok x N] = K_tile[64 x 576] * Q^T, A = the KV tile (K-major), B = Q (K-major),
//       36 x m64nNk16;
//   softmax over the 64 tokens of each column: thread max, shuffles over the 8 lanes sharing a
//       column, 4 warp maxima through shared memory; P rounded to BF16, the denominator sums those
//       BF16 values (what the MMA sums), per-thread partial sums reduced once at the end;
//   PV: O^T[512 x N] += V^T[512 x 64] * P^T[64 x N], A = the same KV tile read MN-major (the
//       instruction's transpose-A flag), B = P stored [N][64 tok] K-major; 8 x 4 x m64nNk16.
// KV tile, Q and P use the SW128 K-major layout of 128-byte rows: a [rows][576] operand is 9
// blocks of [rows][64 elements]; row r of a block at (r / 8) * 1024 + (r % 8) * 128, 16-byte chunk
// c at (c ^ (r % 8)) * 16. Read MN-major, a block of the KV tile is exactly the SW128 MN-major atom
// stack of dims 64 kb .. 64 kb + 63: one 128-byte row per token, 8 tokens per 1024-byte atom.
#pragma once

#include <cuda_bf16.h>

#include "k3gen/mla/decode.cuh"
#include "k3gen/common/sm90_async.cuh"

namespace k3gen {
namespace mla {
namespace wg {

constexpr int kThreads = 384;
constexpr int kStages = 2;
constexpr int kBlk = kTok * 128;             // one [64 tokens][64 dims] SW128 block
constexpr int kKBlocks = kRow / 64;          // 9 (8 latent + 1 rope)
constexpr int kTileBytes = kKBlocks * kBlk;  // 73728
constexpr int kOStride = kLat + 4;           // merge buffer row (FP32)
constexpr int kProducerRegs = 56, kConsumerRegs = 224;
static_assert(128 * kProducerRegs + 256 * kConsumerRegs <= 65536, "register file");

template <class C>
struct WgGeo {
  static constexpr bool kSplitRows = C::kMT == 4;
  static constexpr int N = 16 * C::kMT;
  static constexpr int NC = kSplitRows ? N / 2 : N;
  static constexpr int HT = C::kHeads * C::kTokens;
  static constexpr int kQOff = kStages * kTileBytes;
  static constexpr int kPOff = kQOff + N * kRow * 2;
  static constexpr int kRedOff = kPOff + 2 * NC * 128;
  static constexpr int kStatsOff = kRedOff + 2 * 4 * NC * 4;
  static constexpr int kBarOff = kStatsOff + (kSplitRows ? 0 : 2 * 2 * N * 4);
  static constexpr int kEnd = kBarOff + 4 * 8;
  static constexpr int kSmem = kEnd + 1024;
  static_assert(N * kOStride * 4 <= kStages * kTileBytes, "the merge buffer reuses the stages");
  static_assert(kQOff % 1024 == 0 && kPOff % 1024 == 0 && (NC * 128) % 1024 == 0, "SW128 atoms are 1024-aligned");
};

// Byte offset of 16-byte chunk c (of 72) of row `row` in a [rows][576] BF16 operand (9 SW128 blocks).
__device__ __forceinline__ int sw_off(int rows, int row, int c) {
  return (c >> 3) * rows * 128 + (row >> 3) * 1024 + (row & 7) * 128 + (((c & 7) ^ (row & 7)) << 4);
}
// K-major SW128 operand (LBO unused); MN-major with one 64-element M block: LBO (the M-block
// stride) is never applied, SBO is the 8-token K group stride. Both get 1024 so either reading
// of the two fields gives the same addresses.
__device__ __forceinline__ unsigned long long desc_k(unsigned a) { return sm90::wgmma_desc<16, 1024, 1>(a); }
__device__ __forceinline__ unsigned long long desc_mn(unsigned a) { return sm90::wgmma_desc<1024, 1024, 1>(a); }
// The same descriptors split in their two words (the FP8 and NVFP4 kernels): the high one (SBO
// 1024, layout 128B swizzle) is the same for K-major and MN-major operands, and adding (bytes >> 4)
// to the low word moves the start (shared addresses < 2^18, so it never carries into the LBO field).
constexpr unsigned kDescHi = static_cast<unsigned>(sm90::wgmma_desc<16, 1024, 1>(0u) >> 32);
static_assert(static_cast<unsigned>(sm90::wgmma_desc<1024, 1024, 1>(0u) >> 32) == kDescHi, "one high word");
__device__ __forceinline__ unsigned desc_lo(unsigned addr) {
  return static_cast<unsigned>(sm90::wgmma_desc<16, 1024, 1>(addr));
}
__device__ __forceinline__ unsigned long long desc(unsigned lo) {
  return (static_cast<unsigned long long>(kDescHi) << 32) | lo;
}

// A compile-time consumer index (one instantiation per consumer keeps its descriptors uniform).
template <int V>
struct IntC {
  static constexpr int value = V;
};

// max |q| over the 16 query rows r0 .. of sequence b (rows past ht excluded), all kThreads
// threads of the CTA (a barrier inside; scratch: kThreads / 32 floats).
template <int kThreads>
__device__ __forceinline__ float q_amax16(const uint4* qg, int r0, int ht, float* scratch) {
  const int tid = threadIdx.x;
  float mx = 0.f;
  for (int i = tid; i < 16 * kChunks; i += kThreads) {
    if (r0 + i / kChunks >= ht) break;
    mx = fmaxf(mx, bf16x8_amax(qg[i]));
  }
  return block_max<kThreads>(mx, scratch);
}

// Max / sum over the 8 lanes that hold the same accumulator column (lanes differing in lane / 4).
__device__ __forceinline__ float col_max8(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 4));
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 8));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 16));
}
__device__ __forceinline__ float col_sum8(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 4);
  x += __shfl_xor_sync(0xffffffffu, x, 8);
  return x + __shfl_xor_sync(0xffffffffu, x, 16);
}

// The CTA's n_rows output rows from the FP32 merge buffer ([rows][kOStride]), 4 columns per
// thread over the 256 consumer threads (i0 = tid - 128): BF16 out with one split, FP32 partials
// with several.
__device__ __forceinline__ void rows_out(const Params& p, const float* buf, int n_rows, int b, int split, int r0,
                                         int ht, int i0) {
  for (int i = i0; i < n_rows * (kLat / 4); i += 256) {
    const int row = i / (kLat / 4), col = (i - row * (kLat / 4)) * 4;
    if (r0 + row >= ht) break;
    const float4 v = *reinterpret_cast<const float4*>(buf + row * kOStride + col);
    if (p.splits == 1) {
      *reinterpret_cast<uint2*>(p.out + (static_cast<long long>(b) * ht + r0 + row) * kLat + col) =
          make_uint2(bf16x2(v.x, v.y), bf16x2(v.z, v.w));
    } else {
      *reinterpret_cast<float4*>(p.part_o + ((static_cast<long long>(b) * p.splits + split) * ht + r0 + row) * kLat +
                                 col) = v;
    }
  }
}

template <class C>
__device__ __forceinline__ void load_tile(const Params& p, int b, int len, int tile, unsigned dst, int wt) {
  const int pg = tile_page<C>(p, b, tile);
  const int slot0 = (tile * kTok) % C::kPage;
  const unsigned char* kv = static_cast<const unsigned char*>(p.c[0]);
  for (int i = wt; i < kTok * kChunks; i += 128) {
    const int t = i / kChunks, c = i - t * kChunks;
    const bool ok = pg >= 0 && tile * kTok + t < len;
    const void* src = ok ? kv + ((static_cast<long long>(pg) * C::kPage + slot0 + t) * kRow + c * 8) * 2
                         : static_cast<const void*>(kv);
    cp_async16(dst + sw_off(kTok, t, c), src, ok ? 16u : 0u);
  }
}

template <class C>
__device__ void decode(const Params& p) {
  using G = WgGeo<C>;
  constexpr bool kSplitRows = G::kSplitRows;
  constexpr int N = G::N, NC = G::NC, HT = G::HT, NJ = NC / 8, NA = NC / 2;   // NA: accumulators per m64 block
  using MmaQK = sm90::WgmmaBf16<NC, 0>;
  using MmaPV = sm90::WgmmaBf16<NC, 1>;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  const unsigned base = smem_u32(smem);
  const unsigned aQ = base + G::kQOff;
  float* red = reinterpret_cast<float*>(smem + G::kRedOff);      // [consumer][warp][NC]
  float* stats = reinterpret_cast<float*>(smem + G::kStatsOff);  // [consumer][m, l][N] (alternate tiles)
  const unsigned bar = base + G::kBarOff;                        // full[0..1], empty[0..1]

  const int tid = threadIdx.x, wgi = tid / 128, wt = tid % 128, warp = wt / 32, lane = tid % 32;
  const int g = blockIdx.x, split = blockIdx.y, b = blockIdx.z;
  const int r0 = g * N;
  const int len = max(p.lengths[b], 0);
  const int ntiles = (len + kTok - 1) / kTok;
  const int per = (ntiles + p.splits - 1) / p.splits;
  const int t_begin = min(ntiles, split * per), t_end = min(ntiles, t_begin + per);
  const int n = t_end - t_begin;

  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      sm90::mbar_init(bar + 8 * s, 128);
      sm90::mbar_init(bar + 16 + 8 * s, kSplitRows ? 256 : 128);   // every consumer reading the stage
    }
    sm90::fence_mbar_init();
  }
  {
    const uint4* qg = reinterpret_cast<const uint4*>(p.q) + (static_cast<long long>(b) * HT + r0) * kChunks;
    for (int i = tid; i < N * kChunks; i += kThreads) {
      const int r = i / kChunks, c = i - r * kChunks;
      *reinterpret_cast<uint4*>(smem + G::kQOff + sw_off(N, r, c)) = r0 + r < HT ? qg[i] : make_uint4(0, 0, 0, 0);
    }
  }
  sm90::fence_proxy_async();   // Q (generic stores) is read by wgmma (async proxy)
  __syncthreads();

  if (wgi == 0) {
    sm90::setmaxnreg_dec<kProducerRegs>();
    for (int it = 0; it < n; ++it) {
      const int s = it & 1;
      if (it >= kStages) sm90::mbar_wait_or_trap(bar + 16 + 8 * s, ((it >> 1) - 1) & 1);
      load_tile<C>(p, b, len, t_begin + it, base + s * kTileBytes, wt);
      sm90::cp_async_mbar_arrive_noinc(bar + 8 * s);
    }
    cp_async_wait<0>();
    return;   // the consumers synchronize among themselves (named barriers) from here on
  }

  sm90::setmaxnreg_inc<kConsumerRegs>();
  const int c = wgi - 1;
  const int c0 = kSplitRows ? c * NC : 0;   // this consumer's first query row in the CTA
  const unsigned aP = base + G::kPOff + c * NC * 128;
  unsigned char* sP = smem + G::kPOff + c * NC * 128;
  // This thread's columns (query rows r0 + c0 + col) col(j, e) = 8 j + 2 (lane % 4) + e, tokens
  // 16 warp + lane / 4 (+ 8).
  float o[8][NA];
  float m[NJ][2], l[NJ][2];
  int lim[NJ][2];
#pragma unroll
  for (int mb = 0; mb < 8; ++mb)
#pragma unroll
    for (int i = 0; i < NA; ++i) o[mb][i] = 0.f;
#pragma unroll
  for (int j = 0; j < NJ; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int r = r0 + c0 + 8 * j + 2 * (lane & 3) + e;
      m[j][e] = K3GEN_MLA_NEG_INF;
      l[j][e] = 0.f;
      lim[j][e] = len - C::kTokens + (r < HT ? r / C::kHeads : C::kTokens - 1);
    }
  const float qk_scale = C::kSoftmaxScale * kLog2e;
  const int tk0 = 16 * warp + (lane >> 2);

  // A consumer whose rows are all padding (the last group of H * T % 64 <= 32) only passes the
  // stages on: its arrival must follow the stage's fill so it counts toward that phase.
  const bool idle = kSplitRows && r0 + c0 >= HT;
  for (int it = kSplitRows ? 0 : c; it < n; it += kSplitRows ? 1 : 2) {
    const int s = it & 1;
    const int tile = t_begin + it;
    const unsigned aKV = base + s * kTileBytes;
    sm90::mbar_wait(bar + 8 * s, (it >> 1) & 1);
    if (idle) {
      sm90::mbar_arrive(bar + 16 + 8 * s);
      continue;
    }
    sm90::fence_proxy_async();   // the stage was written by cp.async (generic proxy)

    float sc[NA];
#pragma unroll
    for (int i = 0; i < NA; ++i) sc[i] = 0.f;
    sm90::wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < kRow / 16; ++ks)
      MmaQK::mma(sc, desc_k(aKV + (ks >> 2) * kBlk + (ks & 3) * 32),
                 desc_k(aQ + (ks >> 2) * N * 128 + c0 * 128 + (ks & 3) * 32), ks);
    sm90::wgmma_commit();
    sm90::wgmma_wait<0>();
#pragma unroll
    for (int i = 0; i < NA; ++i) sm90::fence_operand(sc[i]);

    // Masked scores (log2 domain) and per-column maxima of this thread's two tokens.
    const int pos0 = tile * kTok + tk0;
    float mx[NJ][2];
#pragma unroll
    for (int j = 0; j < NJ; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float& v0 = sc[4 * j + e];
        float& v1 = sc[4 * j + 2 + e];
        v0 = pos0 <= lim[j][e] ? v0 * qk_scale : K3GEN_MLA_NEG_INF;
        v1 = pos0 + 8 <= lim[j][e] ? v1 * qk_scale : K3GEN_MLA_NEG_INF;
        mx[j][e] = col_max8(fmaxf(v0, v1));
      }
    // One buffer: every warp reads it before the P barrier below, and rewrites it only after.
    float* rd = red + c * 4 * NC;
    if (lane < 4) {
#pragma unroll
      for (int j = 0; j < NJ; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) rd[warp * NC + 8 * j + 2 * lane + e] = mx[j][e];
    }
    sm90::barrier_sync_divergent(1 + c, 128);
#pragma unroll
    for (int j = 0; j < NJ; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int col = 8 * j + 2 * (lane & 3) + e;
        const float tmax = fmaxf(fmaxf(rd[col], rd[NC + col]), fmaxf(rd[2 * NC + col], rd[3 * NC + col]));
        const float m_new = fmaxf(m[j][e], tmax);
        float alpha = 1.f, p0 = 0.f, p1 = 0.f;
        if (m_new != K3GEN_MLA_NEG_INF) {
          alpha = exp2f(m[j][e] - m_new);
          p0 = exp2f(sc[4 * j + e] - m_new);
          p1 = exp2f(sc[4 * j + 2 + e] - m_new);
        }
        const __nv_bfloat16 b0 = __float2bfloat16_rn(p0), b1 = __float2bfloat16_rn(p1);
        m[j][e] = m_new;
        l[j][e] = l[j][e] * alpha + (__bfloat162float(b0) + __bfloat162float(b1));
#pragma unroll
        for (int mb = 0; mb < 8; ++mb) {
          o[mb][4 * j + e] *= alpha;
          o[mb][4 * j + 2 + e] *= alpha;
        }
        // P[col][token], SW128 K-major: token chunk tk / 8 XOR (col % 8).
        unsigned char* rowp = sP + (col >> 3) * 1024 + (col & 7) * 128 + (tk0 & 7) * 2;
        *reinterpret_cast<__nv_bfloat16*>(rowp + (((tk0 >> 3) ^ (col & 7)) << 4)) = b0;
        *reinterpret_cast<__nv_bfloat16*>(rowp + ((((tk0 >> 3) + 1) ^ (col & 7)) << 4)) = b1;
      }
    sm90::fence_proxy_async();   // P (generic stores) is read by wgmma
    sm90::barrier_sync_divergent(1 + c, 128);

    sm90::wgmma_fence();
#pragma unroll
    for (int mb = 0; mb < 8; ++mb)
#pragma unroll
      for (int ks = 0; ks < kTok / 16; ++ks)
        MmaPV::mma(o[mb], desc_mn(aKV + mb * kBlk + ks * 2048), desc_k(aP + ks * 32), 1);
    sm90::wgmma_commit();
    sm90::wgmma_wait<0>();
#pragma unroll
    for (int mb = 0; mb < 8; ++mb)
#pragma unroll
      for (int i = 0; i < NA; ++i) sm90::fence_operand(o[mb][i]);
    sm90::mbar_arrive(bar + 16 + 8 * s);   // the stage may be refilled
  }

  // Full denominators: 8 lanes per column, then the 4 warps (through red).
  float* rl = red + c * 4 * NC;
  if (!idle) {
    sm90::barrier_sync_divergent(1 + c, 128);   // every warp is done with red
#pragma unroll
    for (int j = 0; j < NJ; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float x = col_sum8(l[j][e]);
        if (lane < 4) rl[warp * NC + 8 * j + 2 * lane + e] = x;
      }
    sm90::barrier_sync_divergent(1 + c, 128);
  }
  float wself[NJ][2];
  float* buf = reinterpret_cast<float*>(smem);
  if constexpr (kSplitRows) {
    // Disjoint rows: each consumer normalizes its own columns.
#pragma unroll
    for (int j = 0; j < NJ; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int col = 8 * j + 2 * (lane & 3) + e;
        const float lt = idle ? 0.f : rl[col] + rl[NC + col] + rl[2 * NC + col] + rl[3 * NC + col];
        wself[j][e] = lt > 0.f ? 1.f / lt : 0.f;
        if (!idle && warp == 0 && lane < 4 && p.splits > 1 && r0 + c0 + col < HT)
          p.part_lse[(static_cast<long long>(b) * p.splits + split) * HT + r0 + c0 + col] =
              lt > 0.f ? m[j][e] + log2f(lt) : K3GEN_MLA_NEG_INF;
      }
    // Both consumers past their last wgmma: the stages become the output buffer [N][516] FP32.
    sm90::barrier_sync_divergent(3, 256);
    if (!idle) {
#pragma unroll
      for (int mb = 0; mb < 8; ++mb)
#pragma unroll
        for (int i = 0; i < NA; ++i) {
          const int dim = 64 * mb + 16 * warp + (lane >> 2) + 8 * ((i & 3) >> 1);
          const int col = c0 + 8 * (i >> 2) + 2 * (lane & 3) + (i & 1);
          buf[col * kOStride + dim] = o[mb][i] * wself[i >> 2][i & 1];
        }
    }
    sm90::barrier_sync_divergent(3, 256);
  } else {
    if (warp == 0 && lane < 4) {
#pragma unroll
      for (int j = 0; j < NJ; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int col = 8 * j + 2 * lane + e;
          stats[(c * 2) * N + col] = m[j][e];
          stats[(c * 2 + 1) * N + col] = rl[col] + rl[NC + col] + rl[2 * NC + col] + rl[3 * NC + col];
        }
    }
    // Both consumers past their last wgmma: the stages become the merge buffer [N][516] FP32.
    sm90::barrier_sync_divergent(3, 256);
#pragma unroll
    for (int j = 0; j < NJ; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int col = 8 * j + 2 * (lane & 3) + e;
        const float m0 = stats[col], l0 = stats[N + col], m1 = stats[2 * N + col], l1 = stats[3 * N + col];
        const float mm = fmaxf(m0, m1);
        const float w0 = m0 == K3GEN_MLA_NEG_INF ? 0.f : exp2f(m0 - mm);
        const float w1 = m1 == K3GEN_MLA_NEG_INF ? 0.f : exp2f(m1 - mm);
        const float lt = l0 * w0 + l1 * w1;
        wself[j][e] = lt > 0.f ? (c == 0 ? w0 : w1) / lt : 0.f;
        if (c == 0 && warp == 0 && lane < 4 && p.splits > 1 && r0 + col < HT)
          p.part_lse[(static_cast<long long>(b) * p.splits + split) * HT + r0 + col] =
              lt > 0.f ? mm + log2f(lt) : K3GEN_MLA_NEG_INF;
      }
    // O^T fragment (m64 block mb, register i): dim 64 mb + 16 warp + lane / 4 + 8 ((i % 4) / 2),
    // column 8 (i / 4) + 2 (lane % 4) + i % 2.
    for (int pass = 1; pass >= 0; --pass) {
      if (c == pass) {
#pragma unroll
        for (int mb = 0; mb < 8; ++mb)
#pragma unroll
          for (int i = 0; i < NA; ++i) {
            const int dim = 64 * mb + 16 * warp + (lane >> 2) + 8 * ((i & 3) >> 1);
            const int col = 8 * (i >> 2) + 2 * (lane & 3) + (i & 1);
            const float v = o[mb][i] * wself[i >> 2][i & 1];
            float& d = buf[col * kOStride + dim];
            d = pass == 1 ? v : d + v;
          }
      }
      sm90::barrier_sync_divergent(3, 256);
    }
  }
  rows_out(p, buf, N, b, split, r0, HT, tid - 128);
}

}  // namespace wg
}  // namespace mla
}  // namespace k3gen
