// mla_decode, wgmma over NVFP4 KV with linear scales (sm_90a): variant "wgmma", kv nvfp4. Contract:
// k3gen/ops/mla_decode/spec.py; shared-memory plan: WgKernel in k3gen/ops/mla_decode/variants.py
// (Geo4 mirrors it); lane maps mirrored on the CPU by tests/nogpu/test_mla_decode_wg4.py.
//
// The frame is mla/decode_wg_fp8.cuh's: a cp.async producer warpgroup, two consumer warpgroups on
// alternate 64-token tiles (each its own online softmax, merged at the end), 16 query rows per CTA,
// the tile's tokens on the wgmma M side. Hopper has no FP4 MMA, and a tile scale changes every 16
// dims and every 16 tokens, so the consumer decodes the codes itself, once per element:
//   - e2m1 x E4M3 scale code x 2^-8 is exact in f16 (<= 6 significant bits, |x| <= 10.5, the small
//     ones subnormal): the decoded value is G 2^-8 times the KV value; 2^8 / G goes into the score
//     scale and the output.
//   - QK: S^T[64 tok x 16] = K_tile * Q^T with A = the decoded codes in registers (register-A
//     m64n16k16 f16, 36 per tile, one 128-dim block of 8 k-steps decoded per commit group, two
//     register sets in flight) and B = Q * 2^E (f16) in shared memory.
//   - The same registers are stored into the consumer's f16 V tile (8 SW128 blocks of [64 tok]
//     [64 dims], the SW128 layout of decode_wg.cuh), so PV is a plain f16 product: O^T +=
//     V^T P^T with A read MN-major from that tile and B = P^T (f16, p <= 1) in shared memory.
//   - The live 16-token tile (positions >= length / 16 * 16, whose codes and tile scale are not
//     final) is masked in the tiles (zero scales keep it finite) and folded in afterwards from the
//     BF16 HP tail ring, staged once per CTA, in FP32 on CUDA cores (live_rows).
// Index permutations (free where both operands agree):
//   QK k: a thread's codes for one token and 128-dim block are one 16-byte load (dims 32 c .. of
//     the block, c = lane % 4), 4 words of 8 nibbles; decode8 pairs nibbles (i, i + 4) of a word
//     (one shift per pair), so fragment element (c, hi, e) of k-step ks holds dim qk_dim(ks, c, hi,
//     e). The query is staged in that order.
//   PV M: V-tile block vb, row m holds dim pv_dim(vb, m): a thread's 8 decoded dims of one word are
//     one 16-byte store, and the 8 stores of a quarter warp hit 8 different bank groups.
#pragma once

#include <cuda_fp16.h>

#include "k3gen/mla/decode_wg.cuh"

namespace k3gen {
namespace mla {
namespace wg4 {

constexpr int kThreads = 384;
constexpr int kN = 16;                        // query rows per CTA = wgmma N
// Stage: latent codes [64][256] (16-byte chunk c of token t at c ^ 4 (t % 2): a quarter warp's
// two tokens fall in different halves of the bank window), rope codes [64][32], the tile's 4 x 32
// latent tile scales, its [64][4] rope scales.
constexpr int kLatB = kLat / 2, kRopeB = (kRow - kLat) / 2;
constexpr int kRopeOff = kTok * kLatB;
constexpr int kTsOff = kRopeOff + kTok * kRopeB;
constexpr int kRsOff = kTsOff + (kTok / 16) * 32;
constexpr int kStageBytes = kRsOff + kTok * 4;    // 18816
constexpr int kRingRows = 16;                     // the live tile (< 16 rows past length / 16 * 16)
constexpr int kVBytes = 8 * wg::kBlk;             // a consumer's decoded [64][512] f16 tile
constexpr int kQBytes = 9 * kN * 128;             // Q: 9 SW128 blocks of [16 rows][64 dims]
constexpr int kPBytes = kN * 128;                 // P^T: [16 cols][64 tok] f16
using wg::kConsumerRegs;                        // the warp-specialized split of decode_wg.cuh
using wg::kProducerRegs;

template <class C>
struct Geo4 {
  static constexpr int S = C::kStages;
  static constexpr int HT = C::kHeads * C::kTokens;
  static constexpr int kRingOff = S * kStageBytes;
  static constexpr int kVOff = (kRingOff + kRingRows * kRow * 2 + 1023) / 1024 * 1024;
  static constexpr int kQOff = kVOff + 2 * kVBytes;
  static constexpr int kPOff = kQOff + kQBytes;
  static constexpr int kRedOff = kPOff + 2 * kPBytes;
  static constexpr int kStatsOff = kRedOff + 2 * 4 * kN * 4;
  static constexpr int kBarOff = kStatsOff + 2 * 2 * kN * 4;
  static constexpr int kEnd = kBarOff + 2 * S * 8 + 2 * 8;   // + the consumers' two handoffs
  static constexpr int kSmem = kEnd + 1024;
  static_assert(2 * kN * wg::kOStride * 4 <= 2 * kVBytes, "the merge buffer reuses the V tiles");
};

// Dim of fragment element (c, hi, e) of k-step ks (see the header): the k-step's thread chunk,
// word iw, pair p = 2 (ks % 2) + hi of that word's nibbles (i, i + 4).
__device__ __forceinline__ int qk_dim(int ks, int c, int hi, int e) {
  const int base = ks < 32 ? 128 * (ks >> 3) + 32 * c + 8 * ((ks & 7) >> 1) : kLat + 16 * c + 8 * ((ks - 32) >> 1);
  return base + 2 * (ks & 1) + hi + 4 * e;
}
// Dim held by row m of V-tile block vb.
__device__ __forceinline__ int pv_dim(int vb, int m) {
  return 128 * (vb >> 1) + 32 * (m >> 4) + 8 * (2 * (vb & 1) + ((m >> 3) & 1)) + ((m & 7) >> 1) + 4 * (m & 1);
}

// Q rows r0 .. r0 + 15 of sequence b as f16 * 2^E (E puts max |q| in [2^14, 2^15): every BF16
// element in f16's normal range converts exactly), in the QK k order, SW128 K-major (zero past
// H*T). scratch: 12 floats. Returns 2^-E. Contains a barrier (all threads call it).
template <class C>
__device__ float stage_q(const Params& p, int b, int r0, unsigned char* sq, float* scratch) {
  constexpr int HT = Geo4<C>::HT;
  const int tid = threadIdx.x;
  const uint4* qg = reinterpret_cast<const uint4*>(p.q) + (static_cast<long long>(b) * HT + r0) * kChunks;
  const float mx = wg::q_amax16<kThreads>(qg, r0, HT, scratch);
  int e = mx > 0.f ? 14 - ((__float_as_int(mx) >> 23) - 127) : 0;
  e = min(max(e, -100), 100);
  const float f = f8::pow2(e);
  for (int i = tid; i < kN * kChunks; i += kThreads) {
    const int r = i / kChunks, ch = i - r * kChunks;   // logical chunk: k-step ch / 2, half ch % 2
    uint4 v = make_uint4(0, 0, 0, 0);
    if (r0 + r < HT) {
      const unsigned short* row = reinterpret_cast<const unsigned short*>(qg + r * kChunks);
      unsigned w[4];
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const unsigned x0 = row[qk_dim(ch >> 1, c, ch & 1, 0)], x1 = row[qk_dim(ch >> 1, c, ch & 1, 1)];
        w[c] = f8::h2(bf16_lo(x0) * f, bf16_lo(x1) * f);
      }
      v = make_uint4(w[0], w[1], w[2], w[3]);
    }
    *reinterpret_cast<uint4*>(sq + wg::sw_off(kN, r, ch)) = v;
  }
  return f8::pow2(-e);
}

// One tile's codes and scales into a stage; rows nv.. (and their scales) zero-filled. row0: the
// tile's first row in the page pool (a valid page even when the tile's page is missing: nv = 0).
template <class C>
__device__ __forceinline__ void load_tile(const Params& p, int pg, long long row0, int nv, unsigned dst, int wt) {
  const unsigned char* codes = static_cast<const unsigned char*>(p.c[0]) + row0 * (kRow / 2);
#pragma unroll
  for (int k = 0; k < kTok * 16 / 128; ++k) {
    const int i = wt + 128 * k, t = i >> 4, ch = i & 15;
    const bool ok = t < nv;
    cp_async16(dst + t * kLatB + ((ch ^ ((t & 1) << 2)) << 4), ok ? codes + t * (kRow / 2) + ch * 16 : codes,
               ok ? 16u : 0u);
  }
  {
    const int t = wt >> 1, ch = wt & 1;
    const bool ok = t < nv;
    cp_async16(dst + kRopeOff + t * kRopeB + ch * 16, ok ? codes + t * (kRow / 2) + kLatB + ch * 16 : codes,
               ok ? 16u : 0u);
  }
  if (wt < 8) {   // latent tile scales [4][32]: chunk wt holds half of token tile wt / 2
    const unsigned char* ts = static_cast<const unsigned char*>(p.c[1]) +
                              (static_cast<long long>(max(pg, 0)) * (C::kPage / 16) + (row0 % C::kPage) / 16) * 32;
    const bool ok = 16 * (wt >> 1) < nv;
    cp_async16(dst + kTsOff + wt * 16, ts + (ok ? wt * 16 : 0), ok ? 16u : 0u);
  } else if (wt < 24) {   // rope scales [64][4]: chunk k holds tokens 4k .. 4k + 3
    const int k = wt - 8;
    const unsigned char* rs = static_cast<const unsigned char*>(p.c[2]) + row0 * 4;
    const int valid = min(max(nv * 4 - k * 16, 0), 16);
    cp_async16(dst + kRsOff + k * 16, rs + (valid ? k * 16 : 0), static_cast<unsigned>(valid));
  }
}

// Eight E2M1 codes (word w, element i in nibble i) -> f16x2 pairs (i, i + 4) in d[i], times the
// f16x2 splat s. A code's magnitude bits go to f16 bits 9-11 (25-27) and its sign to bit 15 (31),
// which is e2m1 * 2^-14 exactly (e2m1 is a tiny float of the same shape); with s = scale code * 64
// the product e2m1 * scale * 2^-8 is exact in f16 (<= 6 significant bits, subnormals included).
__device__ __forceinline__ void decode8(unsigned w, unsigned s, unsigned (&d)[4]) {
  d[0] = nv::hmul2(((w << 9) & 0x0e000e00u) | ((w << 12) & 0x80008000u), s);
  d[1] = nv::hmul2(((w << 5) & 0x0e000e00u) | ((w << 8) & 0x80008000u), s);
  d[2] = nv::hmul2(((w << 1) & 0x0e000e00u) | ((w << 4) & 0x80008000u), s);
  d[3] = nv::hmul2(((w >> 3) & 0x0e000e00u) | (w & 0x80008000u), s);
}
// f16x2 (a * 64, b * 64) of two E4M3 scale codes (exact: <= 448 * 64 < 65504).
__device__ __forceinline__ unsigned scales64(unsigned a, unsigned b) {
  return nv::hmul2(nv::e4m3x2_to_h2(a, b), 0x54005400u);
}
// Pins the register-A fragments before the wgmma fence: the decode's arithmetic is plain asm, so
// the compiler could sink it between the wgmmas, and ptxas would then fence (serialize) every one.
template <int K>
__device__ __forceinline__ void pin(unsigned (&a)[8][4]) {
#pragma unroll
  for (int j = 0; j < K; ++j)
#pragma unroll
    for (int r = 0; r < 4; ++r) asm volatile("" : "+r"(a[j][r]));
}
// Words 0 .. NW - 1 of this thread's two tokens (w[r]: token tk0 + 8 r) decoded with the scale
// splat sc(r, iw) into the register-A k-steps 2 iw, 2 iw + 1 (token r in registers r, 2 + r), then
// pinned. d is the caller's scratch: declared in here, its alloca moves to the kernel's entry and
// the QK accumulators' PTX registers are numbered differently, which changes the SASS.
template <int NW, class Sc>
__device__ __forceinline__ void decode_a(unsigned (&A)[8][4], const unsigned (&w)[2][4], Sc sc,
                                         unsigned (&d)[4]) {
#pragma unroll
  for (int r = 0; r < 2; ++r)
#pragma unroll
    for (int iw = 0; iw < NW; ++iw) {
      decode8(w[r][iw], sc(r, iw), d);
      A[2 * iw][r] = d[0];
      A[2 * iw][2 + r] = d[1];
      A[2 * iw + 1][r] = d[2];
      A[2 * iw + 1][2 + r] = d[3];
    }
  pin<2 * NW>(A);
}
__device__ __forceinline__ unsigned splat_lo(unsigned x) { return f8::prmt(x, x, 0x1010u); }
__device__ __forceinline__ unsigned splat_hi(unsigned x) { return f8::prmt(x, x, 0x3232u); }

}  // namespace wg4
}  // namespace mla
}  // namespace k3gen

#include "k3gen/mla/decode_wg_nvfp4_live.cuh"   // live_rows: the HP-tail rows after the tiles

namespace k3gen {
namespace mla {
namespace wg4 {

template <class C>
__device__ void decode(const Params& p) {
  using G = Geo4<C>;
  constexpr int S = G::S, N = kN, HT = G::HT, NJ = N / 8, NA = N / 2;
  using MmaQK = sm90::WgmmaF16RegA16;
  using MmaPV = sm90::WgmmaF16x16<1>;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  const unsigned base = smem_u32(smem);
  const unsigned aQ = base + G::kQOff;
  float* red = reinterpret_cast<float*>(smem + G::kRedOff);      // [consumer][warp][N]
  float* stats = reinterpret_cast<float*>(smem + G::kStatsOff);  // [consumer][m, l][N]
  const unsigned bar = base + G::kBarOff;                        // full[S], empty[S], hand[2]
  const unsigned hand = bar + 16 * S;
  unsigned char* ringb = smem + G::kRingOff;                     // [16][576] BF16 live rows

  const int tid = threadIdx.x, wgi = tid / 128, wt = tid % 128, warp = wt / 32, lane = tid % 32;
  const int split = blockIdx.y, b = blockIdx.z;
  const int r0 = blockIdx.x * N;
  const int len = seq_len<C>(p, b);
  const int ntiles = (len + kTok - 1) / kTok;
  const int per = (ntiles + p.splits - 1) / p.splits;
  const int t_begin = min(ntiles, split * per), t_end = min(ntiles, t_begin + per);
  const int n = t_end - t_begin;
  const int live = len / 16 * 16;
  const bool has_live = n > 0 && t_end == ntiles && live < len;   // this CTA owns the live rows

  if (tid == 0) {
    sm90::mbar_init(hand, 256);
    sm90::mbar_init(hand + 8, 256);
    sm90::mbar_init_ring(bar, bar + 8 * S, S, 128, 128);
  }
  // The live rows, staged once (rows past the length, or all of them when the sequence's ring slot
  // is out of range, read as zeros).
  if (has_live) {
    const unsigned char* ring = static_cast<const unsigned char*>(p.c[3]);
    const int slot = p.ring_slot[b];
    const bool ring_ok = slot >= 0 && slot < p.num_slots;
    for (int i = tid; i < kRingRows * kChunks; i += kThreads) {
      const int r = i / kChunks, ch = i - r * kChunks;
      const bool ok = ring_ok && live + r < len;
      const unsigned char* src =
          ok ? ring + ((static_cast<long long>(slot) * C::kRing + (live + r) % C::kRing) * kChunks + ch) * 16 : ring;
      cp_async16(smem_u32(ringb) + i * 16, src, ok ? 16u : 0u);
    }
    cp_async_commit();
  }
  const float qmul = stage_q<C>(p, b, r0, smem + G::kQOff, red);
  cp_async_wait<0>();
  sm90::fence_proxy_async();   // Q (generic stores) is read by wgmma (async proxy)
  __syncthreads();

  if (wgi == 0) {
    sm90::setmaxnreg_dec<kProducerRegs>();
    wg::produce<C, S>(p, b, t_begin, n, len, bar, [&](int s, int pg, long long row0, int nv) {
      load_tile<C>(p, pg, row0, nv, base + s * kStageBytes, wt);
    });
    return;   // the consumers synchronize among themselves (named barriers) from here on
  }

  sm90::setmaxnreg_inc<kConsumerRegs>();
  // The consumer index as a compile-time constant: every wgmma descriptor stays uniform.
  auto consumer = [&](auto cc) {
  constexpr int c = decltype(cc)::value;
  const unsigned aP = base + G::kPOff + c * kPBytes;
  const unsigned aV = base + G::kVOff + c * kVBytes;
  unsigned char* sP = smem + G::kPOff + c * kPBytes;
  unsigned char* sV = smem + G::kVOff + c * kVBytes;
  float o[8][NA];
  float m[NJ][2], l[NJ][2];
  int lim[NJ][2];
  // The tiles stop before the live rows (live_rows adds them).
  wg::init_state<C, N, NA, HT>(o, m, l, lim, r0, len, lane, [&](int x) { return min(x, live - 1); });
  // Decoded codes are G 2^-8 times the KV values; the query is 2^E times its own.
  const float qk_scale = __fdiv_rn(C::kSoftmaxScale * kLog2e * qmul * 256.f, p.scale);
  const int g8 = lane >> 2, cq = lane & 3;
  const int tk0 = 16 * warp + g8;   // this thread's tokens tk0, tk0 + 8 (one 16-token scale tile)
  float* rd = red + c * 4 * N;
  // Descriptor low words (moved by adding bytes / 16; shared addresses < 2^18 never carry into
  // the LBO field); the high word (SBO 1024, 128B swizzle) is wg::kDescHi for all three operands.
  const unsigned q_lo = wg::desc_lo(aQ), p_lo = wg::desc_lo(aP);
  const unsigned v_lo = static_cast<unsigned>(sm90::wgmma_desc<1024, 1024, 1>(aV));   // MN-major: LBO 1024
  // V-tile byte offsets of this thread's stores (token tk0 + 8 r, chunk 2 cq + i % 2) in block 0.
  int voff[2][2];
#pragma unroll
  for (int r = 0; r < 2; ++r)
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int tt = tk0 + 8 * r, ch = 2 * cq + i;
      voff[r][i] = (tt >> 3) * 1024 + (tt & 7) * 128 + ((ch ^ (tt & 7)) << 4);
    }

  for (int it = c; it < n; it += 2) {
    const int s = it % S;
    const int tile = t_begin + it;
    const unsigned char* st = smem + s * kStageBytes;
    sm90::mbar_wait(bar + 8 * s, (it / S) & 1);
    // Tokens of the live tile (and past the length) are masked; zero scales keep them finite.
    const unsigned keep = tile * kTok + 16 * warp >= live ? 0u : ~0u;   // warp-uniform; a mask, not a branch

    // QK, one 128-dim block (8 k-steps) per commit group, two register sets; then the rope (4).
    // Each block's codes and scales are loaded while the previous block is decoded.
    float acc[NA];
#pragma unroll
    for (int i = 0; i < NA; ++i) acc[i] = 0.f;
    unsigned a[2][8][4];
    auto load_blk = [&](int blk, unsigned (&w)[2][4], unsigned& scw) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int tt = tk0 + 8 * r;
        if (blk < 4) {
          const uint4 u = *reinterpret_cast<const uint4*>(st + tt * kLatB + (((4 * blk + cq) ^ ((tt & 1) << 2)) << 4));
          w[r][0] = u.x; w[r][1] = u.y; w[r][2] = u.z; w[r][3] = u.w;
        } else {
          const uint2 u = *reinterpret_cast<const uint2*>(st + kRopeOff + tt * kRopeB + cq * 8);
          w[r][0] = u.x; w[r][1] = u.y;
        }
      }
      // Latent: the scale codes of groups 8 blk + 2 cq, + 1 (one tile: both tokens); rope: the
      // codes of group cq for each token.
      scw = blk < 4 ? *reinterpret_cast<const unsigned short*>(st + kTsOff + warp * 32 + 8 * blk + 2 * cq)
                    : st[kRsOff + tk0 * 4 + cq] | (st[kRsOff + (tk0 + 8) * 4 + cq] << 8);
    };
    unsigned wcur[2][4], scur;
    load_blk(0, wcur, scur);
    // Two iterations of two latent blocks (a loop: the unrolled form's code no longer fits the
    // instruction cache beside the other consumer's), then the rope.
    unsigned qd = q_lo;   // the Q descriptor's low word at the iteration's first k-step
#pragma unroll 1
    for (int bp = 0; bp < 2; ++bp) {
#pragma unroll
      for (int h2 = 0; h2 < 2; ++h2) {
        const int blk = 2 * bp + h2;
        unsigned (&A)[8][4] = a[h2];
        unsigned wnxt[2][4], snxt;
        load_blk(blk + 1, wnxt, snxt);   // block 4: the rope
        sm90::wgmma_wait<1>();   // the set's previous commit group is done
        const unsigned sc = scales64(scur & 0xffu, scur >> 8) & keep;
        const unsigned s0 = splat_lo(sc), s1 = splat_hi(sc);
        unsigned d[4];   // words 0, 1: group 2 cq; 2, 3: 2 cq + 1
        decode_a<4>(A, wcur, [=](int, int iw) { return iw < 2 ? s0 : s1; }, d);
        sm90::wgmma_fence();
#pragma unroll
        for (int j = 0; j < 8; ++j) MmaQK::mma(acc, A[j], wg::desc(qd + ((h2 * 2 + (j >> 2)) * N * 128 + (j & 3) * 32) / 16));
        sm90::wgmma_commit();
        // The decoded latent dims into the V tile (PV's A): block 2 blk + iw / 2, chunk 2 cq + iw % 2.
        // (A 16-byte store takes 4 consecutive registers, as each k-step's wgmma does, with the
        // two tokens interleaved: ptxas copies the decoded values into the stores' registers.)
#pragma unroll
        for (int r = 0; r < 2; ++r)
#pragma unroll
          for (int iw = 0; iw < 4; ++iw)
            *reinterpret_cast<uint4*>(sV + (2 * blk + (iw >> 1)) * wg::kBlk + voff[r][iw & 1]) =
                make_uint4(A[2 * iw][r], A[2 * iw][2 + r], A[2 * iw + 1][r], A[2 * iw + 1][2 + r]);
#pragma unroll
        for (int r = 0; r < 2; ++r)
#pragma unroll
          for (int iw = 0; iw < 4; ++iw) wcur[r][iw] = wnxt[r][iw];
        scur = snxt;
      }
      qd += 4 * N * 128 / 16;
    }
    {
      unsigned (&A)[8][4] = a[0];
      sm90::wgmma_wait<1>();
      const unsigned sc = scales64(scur & 0xffu, scur >> 8) & keep;   // token tk0, tk0 + 8
      const unsigned s0 = splat_lo(sc), s1 = splat_hi(sc);
      unsigned d[4];
      decode_a<2>(A, wcur, [=](int r, int) { return r == 0 ? s0 : s1; }, d);
      sm90::wgmma_fence();
#pragma unroll
      for (int j = 0; j < 4; ++j) MmaQK::mma(acc, A[j], wg::desc(q_lo + (8 * N * 128 + j * 32) / 16));
      sm90::wgmma_commit();
    }
    sm90::wgmma_wait<0>();
#pragma unroll
    for (int i = 0; i < NA; ++i) sm90::fence_operand(acc[i]);
    sm90::mbar_arrive(bar + 8 * (S + s));   // the stage was read into registers: it may be refilled

    // Masked scores (log2 domain) and per-column maxima of this thread's two tokens.
    const int pos0 = tile * kTok + tk0;
    float sc[NA], mx[NJ][2];
#pragma unroll
    for (int j = 0; j < NJ; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        sc[4 * j + e] = pos0 <= lim[j][e] ? acc[4 * j + e] * qk_scale : K3GEN_MLA_NEG_INF;
        sc[4 * j + 2 + e] = pos0 + 8 <= lim[j][e] ? acc[4 * j + 2 + e] * qk_scale : K3GEN_MLA_NEG_INF;
        mx[j][e] = wg::col_max8(fmaxf(sc[4 * j + e], sc[4 * j + 2 + e]));
      }
    // One buffer: every warp reads it before the P barrier below, and rewrites it only after.
    if (lane < 4) {
#pragma unroll
      for (int j = 0; j < NJ; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) rd[warp * N + 8 * j + 2 * lane + e] = mx[j][e];
    }
    sm90::barrier_sync_divergent(1 + c, 128);
    bool moved = false;
    float alpha[NJ][2];
#pragma unroll
    for (int j = 0; j < NJ; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int col = 8 * j + 2 * cq + e;
        const float tmax = fmaxf(fmaxf(rd[col], rd[N + col]), fmaxf(rd[2 * N + col], rd[3 * N + col]));
        const float m_new = fmaxf(m[j][e], tmax);
        float a_ = 1.f, p0 = 0.f, p1 = 0.f;
        if (m_new != K3GEN_MLA_NEG_INF) {
          a_ = exp2f(m[j][e] - m_new);
          p0 = exp2f(sc[4 * j + e] - m_new);
          p1 = exp2f(sc[4 * j + 2 + e] - m_new);
        }
        // P in f16 (<= 1); the denominator sums the rounded values, what the MMA sums.
        const __half h0 = __float2half_rn(p0), h1 = __float2half_rn(p1);
        moved |= m_new != m[j][e];
        m[j][e] = m_new;
        l[j][e] = l[j][e] * a_ + (__half2float(h0) + __half2float(h1));
        alpha[j][e] = a_;
        // P[col][token], SW128 K-major: token chunk tk / 8 XOR (col % 8).
        unsigned char* rowp = sP + (col >> 3) * 1024 + (col & 7) * 128 + (tk0 & 7) * 2;
        *reinterpret_cast<__half*>(rowp + (((tk0 >> 3) ^ (col & 7)) << 4)) = h0;
        *reinterpret_cast<__half*>(rowp + ((((tk0 >> 3) + 1) ^ (col & 7)) << 4)) = h1;
      }
    if (__any_sync(0xffffffffu, moved)) {
#pragma unroll
      for (int mb = 0; mb < 8; ++mb)
#pragma unroll
        for (int i = 0; i < NA; ++i) o[mb][i] *= alpha[i >> 2][i & 1];
    }
    sm90::fence_proxy_async();   // P and the V tile (generic stores) are read by wgmma
    sm90::barrier_sync_divergent(1 + c, 128);

    sm90::wgmma_fence();
#pragma unroll
    for (int mb = 0; mb < 8; ++mb)
#pragma unroll
      for (int ks = 0; ks < kTok / 16; ++ks)
        MmaPV::mma(o[mb], wg::desc(v_lo + (mb * wg::kBlk + ks * 2048) / 16), wg::desc(p_lo + ks * 32 / 16));
    sm90::wgmma_commit();
    sm90::wgmma_wait<0>();
#pragma unroll
    for (int mb = 0; mb < 8; ++mb)
#pragma unroll
      for (int i = 0; i < NA; ++i) sm90::fence_operand(o[mb][i]);
  }

  // The live rows: consumer 1 (its P tile and red row as scratch; it may have had no tile at all).
  const float gu = p.scale * (1.f / 256.f);
  if (c == 1 && has_live) {
    sm90::barrier_sync_divergent(1 + c, 128);   // every warp is done with red and P
    live_rows<C>(p, b, r0, len, live, ringb, reinterpret_cast<float*>(sP), rd, 1 + c, o, m, l, gu, wt);
  }

  // Full denominators: 8 lanes per column, then the 4 warps (through red).
  wg::col_stats<c, N, N>(m, l, rd, stats, warp, lane);
  // Both consumers past their last wgmma: the V tiles become the merge buffer [2][N][516] FP32.
  wg::handoff(hand);
  float* buf = reinterpret_cast<float*>(smem + G::kVOff);
  // O^T fragment (block mb, register i): row 16 warp + lane / 4 + 8 ((i % 4) / 2) of block mb holds
  // pv_dim(mb, row).
  float wself[NJ][2];
  const bool lse = c == 0 && warp == 0 && lane < 4 && p.splits > 1;
  wg::merge_out<c, N, NA, HT>(p, o, wself, stats, buf, hand + 8, lse, cq, b, split, r0, tid,
                              [=](float w) { return w / gu; },
                              [=](int mb, int i) { return pv_dim(mb, 16 * warp + g8 + 8 * ((i & 3) >> 1)); });
  };
  if (wgi == 1) consumer(wg::IntC<0>{});
  else consumer(wg::IntC<1>{});
}

}  // namespace wg4
}  // namespace mla
}  // namespace k3gen
