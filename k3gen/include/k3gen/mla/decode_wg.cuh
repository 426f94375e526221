// mla_decode on sm_90a: what the warp-specialized wgmma kernels share (decode_wg_fp8.cuh,
// decode_wg_nvfp4.cuh, decode_wg_qm.cuh; variants "wgmma" and "wgmma_qm" of
// k3gen/ops/mla_decode/variants.py). 384 threads = a producer warpgroup and two consumer warpgroups,
// one CTA per SM: register split, the SW128 K-major operand layout and its descriptors, the
// accumulator column reductions, the FP32 output rows. Address math is replayed on the CPU by
// tests/nogpu/test_mla_decode_wg*.py against the PTX layouts (k3gen/arch/sm90.py).
//
// Operands use the SW128 K-major layout of 128-byte rows: a [rows][576] BF16 operand is 9 blocks
// of [rows][64 elements]; row r of a block at (r / 8) * 1024 + (r % 8) * 128, 16-byte chunk c at
// (c ^ (r % 8)) * 16. Read MN-major, a [64 tokens][64 dims] block is exactly the SW128 MN-major
// atom stack of those 64 dims: one 128-byte row per token, 8 tokens per 1024-byte atom.
#pragma once

#include <cuda_bf16.h>

#include "k3gen/mla/decode.cuh"
#include "k3gen/common/sm90_async.cuh"

#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#error "the wgmma kernels of mla_decode need sm_90a"
#endif

namespace k3gen {
namespace mla {
namespace wg {

constexpr int kBlk = kTok * 128;             // one [64 tokens][64 dims] SW128 block
constexpr int kOStride = kLat + 4;           // merge buffer row (FP32)
constexpr int kProducerRegs = 56, kConsumerRegs = 224;
static_assert(128 * kProducerRegs + 256 * kConsumerRegs <= 65536, "register file");

// Byte offset of 16-byte chunk c (of 72) of row `row` in a [rows][576] BF16 operand (9 SW128 blocks).
__device__ __forceinline__ int sw_off(int rows, int row, int c) {
  return (c >> 3) * rows * 128 + (row >> 3) * 1024 + (row & 7) * 128 + (((c & 7) ^ (row & 7)) << 4);
}
// K-major SW128 operand (LBO unused), SBO = the 8-row group stride.
__device__ __forceinline__ unsigned long long desc_k(unsigned a) { return sm90::wgmma_desc<16, 1024, 1>(a); }
// The same descriptor split in its two words (the FP8 and NVFP4 kernels): the high one (SBO 1024,
// layout 128B swizzle) also serves MN-major operands of one 64-element M block (whose LBO, the
// M-block stride, is never applied), and adding (bytes >> 4) to the low word moves the start
// (shared addresses < 2^18, so it never carries into the LBO field).
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

// The CTA's n_rows output rows, the sum of the two consumers' FP32 halves ([2][rows][kOStride]), 4
// columns per thread over the 256 consumer threads (i0 = tid - 128): BF16 out with one split, FP32
// partials with several.
__device__ __forceinline__ void rows_out(const Params& p, const float* buf, int n_rows, int b, int split, int r0,
                                         int ht, int i0) {
  for (int i = i0; i < n_rows * (kLat / 4); i += 256) {
    const int row = i / (kLat / 4), col = (i - row * (kLat / 4)) * 4;
    if (r0 + row >= ht) break;
    const float4 v0 = *reinterpret_cast<const float4*>(buf + row * kOStride + col);
    const float4 v1 = *reinterpret_cast<const float4*>(buf + (n_rows + row) * kOStride + col);
    const float4 v = make_float4(v0.x + v1.x, v0.y + v1.y, v0.z + v1.z, v0.w + v1.w);
    if (p.splits == 1) {
      *reinterpret_cast<uint2*>(p.out + (static_cast<long long>(b) * ht + r0 + row) * kLat + col) =
          make_uint2(bf16x2(v.x, v.y), bf16x2(v.z, v.w));
    } else {
      *reinterpret_cast<float4*>(p.part_o + ((static_cast<long long>(b) * p.splits + split) * ht + r0 + row) * kLat +
                                 col) = v;
    }
  }
}

// ---- the two-consumer frame of decode_wg_fp8.cuh and decode_wg_nvfp4.cuh ----------------------
// A producer warpgroup copies the split's tiles (cp.async) into an S-stage ring: full[s] at
// bar + 8 s, empty[s] at bar + 8 (S + s); consumer c of two takes tiles c, c + 2, .. with its own
// online softmax over N query columns, merged at the end.

// The producer's loop over the split's n tiles from t_begin: tile it into stage it % S once the
// consumers released it, then one cp.async arrival per thread on full[s]. load(s, pg, row0, nv)
// issues the tile's copies (row0 its first row in the page pool, nv its valid rows; pg < 0 and
// nv = 0 for a missing page). The page id is read a tile ahead (its load would otherwise stall
// every tile's copies).
template <class C, int S, class Load>
__device__ __forceinline__ void produce(const Params& p, int b, int t_begin, int n, int len, unsigned bar, Load load) {
  int pg = n > 0 ? tile_page<C>(p, b, t_begin) : -1;
  for (int it = 0; it < n; ++it) {
    const int s = it % S;
    const int tile = t_begin + it;
    const int pg_next = it + 1 < n ? tile_page<C>(p, b, tile + 1) : -1;
    const int nv = pg < 0 ? 0 : min(kTok, len - tile * kTok);
    const long long row0 = static_cast<long long>(max(pg, 0)) * C::kPage + (tile * kTok) % C::kPage;
    if (it >= S) sm90::mbar_wait_or_trap(bar + 8 * (S + s), (it / S - 1) & 1);
    load(s, pg, row0, nv);
    sm90::cp_async_mbar_arrive_noinc(bar + 8 * s);
    pg = pg_next;
  }
  cp_async_wait<0>();
}

// A consumer's state before its first tile: O^T zero, column maxima -inf, sums 0, and lim[j][e]
// = cap(the last key position query row r0 + 8 j + 2 (lane % 4) + e may see).
template <class C, int N, int NA, int HT, class Cap>
__device__ __forceinline__ void init_state(float (&o)[8][NA], float (&m)[N / 8][2], float (&l)[N / 8][2],
                                           int (&lim)[N / 8][2], int r0, int len, int lane, Cap cap) {
#pragma unroll
  for (int mb = 0; mb < 8; ++mb)
#pragma unroll
    for (int i = 0; i < NA; ++i) o[mb][i] = 0.f;
#pragma unroll
  for (int j = 0; j < N / 8; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int r = r0 + 8 * j + 2 * (lane & 3) + e;
      m[j][e] = K3GEN_MLA_NEG_INF;
      l[j][e] = 0.f;
      lim[j][e] = cap(len - C::kTokens + (r < HT ? r / C::kHeads : C::kTokens - 1));
    }
}

// Consumer c's full denominators: 8 lanes per column, then its 4 warps through red (rd: its
// [4][RS] rows); its column maxima and sums into stats ([consumer][m, l][N]).
template <int c, int N, int RS>
__device__ __forceinline__ void col_stats(const float (&m)[N / 8][2], const float (&l)[N / 8][2], float* rd,
                                          float* stats, int warp, int lane) {
  sm90::barrier_sync_divergent(1 + c, 128);   // every warp is done with red
#pragma unroll
  for (int j = 0; j < N / 8; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const float x = col_sum8(l[j][e]);
      if (lane < 4) rd[warp * RS + 8 * j + 2 * lane + e] = x;
    }
  sm90::barrier_sync_divergent(1 + c, 128);
  if (warp == 0 && lane < 4) {
#pragma unroll
    for (int j = 0; j < N / 8; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int col = 8 * j + 2 * lane + e;
        stats[(c * 2) * N + col] = m[j][e];
        stats[(c * 2 + 1) * N + col] = rd[col] + rd[RS + col] + rd[2 * RS + col] + rd[3 * RS + col];
      }
  }
}

// The two consumer warpgroups' handoff of shared-memory data (stats, then the merge halves): each
// of their 256 threads arrives on an mbarrier of 256 arrivals used once (phase 0), then waits for
// the phase (release / acquire). Named barrier 3 ordered the same accesses, but compute-sanitizer
// racecheck flagged them in CTAs of split sequences (bench/notes/mla_decode.md, 2026-12-07); with
// the mbarriers it reports none, at the same speed.
__device__ __forceinline__ void handoff(unsigned hand) {
  sm90::mbar_arrive(hand);
  sm90::mbar_wait(hand, 0);
}

// After col_stats and both consumers' last wgmma: consumer c's merge weights (scale(w / l_total)
// is the factor of its O^T fragment), the split's LSE, both O^T halves into buf ([2][N]
// [kOStride] FP32; dim(mb, i): the dim of register i of block mb, column 8 (i / 4) + 2 (lane % 4)
// + i % 2), then the output rows (their sum). lse: this thread stores the split's LSE (c == 0,
// warp 0, lane < 4, splits > 1). The caller declares wself and evaluates lse, and the functors
// capture by value: declared here (its alloca then comes first) or with reference captures, the
// kernels' PTX orders and numbers registers differently and ptxas allocates them differently.
template <int c, int N, int NA, int HT, class Scale, class Dim>
__device__ __forceinline__ void merge_out(const Params& p, const float (&o)[8][NA], float (&wself)[N / 8][2],
                                          const float* stats, float* buf, unsigned hand, bool lse, int cq, int b,
                                          int split, int r0, int tid, Scale scale, Dim dim) {
#pragma unroll
  for (int j = 0; j < N / 8; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int col = 8 * j + 2 * cq + e;
      const float m0 = stats[col], l0 = stats[N + col], m1 = stats[2 * N + col], l1 = stats[3 * N + col];
      const float mm = fmaxf(m0, m1);
      const float w0 = m0 == K3GEN_MLA_NEG_INF ? 0.f : exp2f(m0 - mm);
      const float w1 = m1 == K3GEN_MLA_NEG_INF ? 0.f : exp2f(m1 - mm);
      const float lt = l0 * w0 + l1 * w1;
      wself[j][e] = lt > 0.f ? scale((c == 0 ? w0 : w1) / lt) : 0.f;
      if (lse && r0 + col < HT)
        p.part_lse[(static_cast<long long>(b) * p.splits + split) * HT + r0 + col] =
            lt > 0.f ? mm + log2f(lt) : K3GEN_MLA_NEG_INF;
    }
  // Each consumer stores its own half ([2][N][kOStride]), one handoff, and rows_out adds the two:
  // no shared byte is written by one consumer and then rewritten by the other (one handoff fewer
  // than a shared accumulator). Written as this descending loop with the store under c == pass:
  // the straight form, or an ascending loop, kept a register on an 8-byte stack in the NVFP4 kernel.
  for (int pass = 1; pass >= 0; --pass) {
    if (c == pass) {
      float* half = buf + pass * N * kOStride;
#pragma unroll
      for (int mb = 0; mb < 8; ++mb)
#pragma unroll
        for (int i = 0; i < NA; ++i) {
          const int col = 8 * (i >> 2) + 2 * cq + (i & 1);
          half[col * kOStride + dim(mb, i)] = o[mb][i] * wself[i >> 2][i & 1];
        }
    }
  }
  handoff(hand);
  rows_out(p, buf, N, b, split, r0, HT, tid - 128);
}

}  // namespace wg
}  // namespace mla
}  // namespace k3gen
