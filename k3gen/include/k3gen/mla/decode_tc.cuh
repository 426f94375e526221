// mla_decode on tcgen05 (sm_100a family: sm_103a, sm_107a): variant "tcgen05" of
// k3gen/ops/mla_decode/variants.py (TcKernel; TcGeo mirrors its shared-memory plan). Contract:
// k3gen/ops/mla_decode/spec.py; index math replayed on the CPU by
// tests/nogpu/ops/test_mla_decode_tcgen05.py against the SM90 kernels' (same inputs).
//
// NVRTC C++ with inline tcgen05 PTX, not CuTe DSL: the page walk (tile_page), the split schedule,
// Params, the BF16 TMA box plan of "wgmma_qm" and the combine entry are the SM90 kernels' own C++
// (mla/decode.cuh); only the MMA/TMEM layer (common/sm100_tc.cuh, shared with mla_prefill's tcgen05
// kernel) and the copy engine calls are new here. A CuTe DSL kernel would have to re-implement all
// of those in Python and could not share them.
//
// Geometry: grid (2 * groups, splits, B); CTA x = 2 g + half owns query rows 64 g .. 64 g + 63 of
// sequence b (row r = t * H + h, zero past H * T) and output dims 256 half .. + 255 of the split's
// tiles. Both halves compute the same S (bitwise: same operands, same MMAs); the 64 x 512 FP32
// output does not fit beside S in one CTA's 512 TMEM columns (a 2-CTA multicast pair is the next
// step; here the second read of a tile is an L2 hit of its twin, adjacent in blockIdx.x).
//   M = 64 query rows (tcgen05 data path layout F: row r in TMEM lane 32 (r / 16) + r % 16).
//   TMEM columns: S ping-pong [0, 64) and [64, 128) (FP32), O [128, 384) (FP32 256 dims).
// Warps:
//   0-3  softmax: lane t < 16 of warp w owns row 16 w + t (tcgen05.ld 32x32b: one row per thread,
//        no shuffles); online softmax in FP32 (log2 domain) exactly as the SM90 kernels (P rounded
//        to BF16/F16 once, the denominator sums the rounded values, a row with nothing visible
//        keeps factor 1); O rescaled in TMEM (ld / mul / st) only when a row's max moved; P into
//        shared memory as a K-major SW128 [64 rows][64 tok] operand; the epilogue.
//   4    TMA producer (lane 0) and the TMEM allocator (whole warp).
//   5    MMA issuer (lane 0): S = Q K^T (36 x m64n64k16), O += P V (4 x m64n256k16, V MN-major).
//   6-9  FP8 / NVFP4 only: decoders, raw stage -> f16 K-major SW128 operand tile (the BF16 TMA
//        tile's layout, so one MMA layer serves every KV dtype).
// Copies: BF16 tiles are 9 TMA boxes [64 tok][128 B] of the wgmma_qm map (128B swizzle = the UMMA
// K-major / MN-major SW128 layout); FP8 and NVFP4 stages are bulk copies (cp.async.bulk) of the
// tile's contiguous codes and scales.
// Numerics: BF16 KV: kind::f16 with BF16 operands (Q, K, V, P as the SM90 kernels). FP8 KV: codes
// to f16 by cvt.rn.f16x2.e4m3x2, times the token's FP32 group scale, rounded once to f16 (per-tensor:
// the codes exactly, the scale on the scores and the output). NVFP4 KV: cvt.rn.f16x2.e2m1x2 (the
// hardware conversion) times the E4M3 scale code is exact in f16; 1/G on the scores and the output;
// the live 16-token tile's positions (>= length // 16 * 16) come from the BF16 HP tail ring times G,
// rounded once to f16, into the same operand tile. Q is f16 * 2^E for FP8/NVFP4 (stage_q's rule).
// Why not kind::f8f6f4 for FP8: the per-token FP32 group scales change every 128 dims, so S would
// need 5 TMEM partials (with O and the ping-pong S past 512 columns) and Q and P as E4M3 hi + lo
// pairs (twice the MMAs) for BF16-level accuracy.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "k3gen/mla/decode.cuh"
#include "k3gen/common/sm90_async.cuh"
#include "k3gen/common/sm100_tc.cuh"

#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM100_ALL) && !defined(__CUDA_ARCH_FEAT_SM103_ALL) && \
    !defined(__CUDA_ARCH_FEAT_SM107_ALL) && !defined(__CUDA_ARCH_FAMILY_SPECIFIC__)
#error "the tcgen05 kernel of mla_decode needs an arch-specific sm_10xa target"
#endif

namespace k3gen {
namespace mla {
namespace tc {

constexpr int kRows = 64;                    // query rows per CTA = MMA M
constexpr int kHalf = 256;                   // output dims per CTA
constexpr int kBlk = kTok * 128;             // one [64][64] 16-bit SW128 block
constexpr int kTileBytes = (kRow / 64) * kBlk;   // 73728: a [64 tok][576] 16-bit operand tile
constexpr int kTmemCols = 512;
constexpr int kSCol = 0, kOCol = 128;        // S ping-pong at 0 / 64, O at 128
constexpr int kSoftmaxThreads = 128, kDecThreads = 128;

// One FP8 / NVFP4 raw stage as the bulk copies land it (shared with decode_tm.cuh).
template <class C>
struct RawGeo {
  static constexpr bool kDecode = C::kKv != Kv::kBf16;
  static constexpr int kScaleBytes = C::kKv == Kv::kFp8 ? (C::kFp8PerTensor ? 0 : kTok * 5 * 4)
                                                        : (C::kKv == Kv::kNvfp4 ? 128 * 36 : 0);
  static constexpr int kCodeBytes = C::kKv == Kv::kFp8 ? kTok * kRow : kTok * kRow / 2;
  static constexpr int kRawBytes = kDecode ? kCodeBytes + kScaleBytes : 0;
};

template <class C>
struct TcGeo : RawGeo<C> {
  using RawGeo<C>::kDecode;
  using RawGeo<C>::kRawBytes;
  static constexpr int kThreads = kDecode ? 320 : 192;
  static constexpr int kOpStages = kDecode ? 1 : C::kStages;   // operand tiles the MMA reads
  static constexpr int kRawStages = kDecode ? C::kStages : 0;  // FP8/NVFP4 raw ring
  static constexpr int kQOff = kOpStages * kTileBytes;
  static constexpr int kPOff = kQOff + kRows * kRow * 2;
  static constexpr int kRawOff = kPOff + kRows * kTok * 2;
  static constexpr int kBarOff = kRawOff + kRawStages * kRawBytes;
  // full[S], empty[S], dec_full, dec_empty, s_full[2], p_full, o_done
  static constexpr int kNumBars = 2 * (kDecode ? kRawStages : kOpStages) + 6;
  static constexpr int kTmemOff = kBarOff + 8 * kNumBars;
  static constexpr int kRedOff = kTmemOff + 16;
  static constexpr int kEnd = kRedOff + 16 * 4;
  static constexpr int kSmem = kEnd + 1024;
  static_assert(kQOff % 1024 == 0 && kPOff % 1024 == 0 && kRawOff % 16 == 0, "SW128 atoms 1024-aligned");
};

// ---- tcgen05 layer: common/sm100_tc.cuh (shared with mla/prefill_tc.cuh) ----------------------------
using sm100::commit;
using sm100::desc;
using sm100::fence_after;
using sm100::fence_before;
using sm100::idesc;
using sm100::ld32;
using sm100::mma;
using sm100::st32;
using sm100::tmem_alloc;
using sm100::tmem_dealloc;

// ---- operand layout (the SM90 kernels' SW128 K-major rows) ------------------------------------------
// Byte offset of 16-byte chunk c (of 72) of row `row` in a [kR][576] 16-bit operand (9 SW128 blocks
// of [kR][64], kR a multiple of 8); sw_off: the [64][576] tiles.
template <int kR>
__host__ __device__ constexpr int sw_rows(int row, int c) {
  return (c >> 3) * kR * 128 + (row >> 3) * 1024 + (row & 7) * 128 + (((c & 7) ^ (row & 7)) << 4);
}
__host__ __device__ constexpr int sw_off(int row, int c) { return sw_rows<kTok>(row, c); }

// S[64 rows x 64 tok] = Q K^T over the 576 dims (K-major A and B, k16 = 32 bytes inside a block).
template <bool kBf16>
__device__ __forceinline__ void qk(unsigned d, unsigned aQ, unsigned aKV) {
  constexpr unsigned id = idesc<kBf16, false, kRows, kTok>();
#pragma unroll
  for (int ks = 0; ks < kRow / 16; ++ks)
    mma(d, desc<16, 1024>(aQ + (ks >> 2) * kBlk + (ks & 3) * 32),
        desc<16, 1024>(aKV + (ks >> 2) * kBlk + (ks & 3) * 32), id, ks);
}
// O[:, 256 half ..] += P V: V MN-major over the half's 4 dim blocks (LBO = block stride), 16-token
// K steps 2048 bytes apart. acc0: the tile is the split's first (TMEM holds no partial sums yet).
template <bool kBf16>
__device__ __forceinline__ void pv(unsigned d, unsigned aP, unsigned aKV, int half, bool acc0) {
  constexpr unsigned id = idesc<kBf16, true, kRows, kHalf>();
#pragma unroll
  for (int ks = 0; ks < kTok / 16; ++ks)
    mma(d, desc<16, 1024>(aP + ks * 32), desc<kBlk, 1024>(aKV + 4 * half * kBlk + ks * 2048), id,
        ks > 0 || !acc0);
}

// ---- copies ------------------------------------------------------------------------------------------
// BF16: the wgmma_qm box plan (a bad page reads past the map's end: zero-filled).
template <class C>
__device__ __forceinline__ void issue_bf16(const Params& p, int b, int tile, unsigned dst, unsigned full,
                                           const sm90::TmaMap* kv_map) {
  const int pg = tile_page<C>(p, b, tile);
  const int row = pg < 0 ? p.num_pages * C::kPage : pg * C::kPage + (tile * kTok) % C::kPage;
  sm90::mbar_arrive_expect_tx(full, kTileBytes);
#pragma unroll
  for (int kb = 0; kb < kRow / 64; ++kb) sm90::tma_load_2d(dst + kb * kBlk, kv_map, 128 * kb, row, full);
}
// FP8 / NVFP4: the tile's codes (contiguous rows of its page) and scales; a bad page copies nothing
// (the decoders write zeros).
template <class C>
__device__ __forceinline__ void issue_raw(const Params& p, int b, int tile, unsigned dst, unsigned full) {
  using G = RawGeo<C>;
  const int pg = tile_page<C>(p, b, tile);
  if (pg < 0) {
    sm90::mbar_arrive(full);
    return;
  }
  const int slot0 = (tile * kTok) % C::kPage;
  const long long row = static_cast<long long>(pg) * C::kPage + slot0;
  sm90::mbar_arrive_expect_tx(full, G::kRawBytes);
  const unsigned char* codes = static_cast<const unsigned char*>(p.c[0]);
  sm90::bulk_load(dst, codes + row * (G::kCodeBytes / kTok), G::kCodeBytes, full);
  if constexpr (C::kKv == Kv::kFp8) {
    if constexpr (G::kScaleBytes > 0)
      sm90::bulk_load(dst + G::kCodeBytes, static_cast<const float*>(p.c[1]) + row * 5, G::kScaleBytes, full);
  } else {
    // The page's whole [128, 36] swizzled scale matrix (the 64-row half is 8 of every 16 bytes).
    sm90::bulk_load(dst + G::kCodeBytes, static_cast<const unsigned char*>(p.c[1]) + static_cast<long long>(pg) *
                    G::kScaleBytes, G::kScaleBytes, full);
  }
}

__device__ __forceinline__ unsigned h2_of_f32(float lo, float hi) {
  const __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const unsigned*>(&v);
}
// Two E2M1 codes (low nibble first) -> f16x2 by the hardware conversion.
__device__ __forceinline__ void e2m1x8_to_h2x4(unsigned u, unsigned (&h)[4]) {
  asm("{\n.reg .b8 b0, b1, b2, b3;\nmov.b32 {b0, b1, b2, b3}, %4;\n"
      "cvt.rn.f16x2.e2m1x2 %0, b0;\ncvt.rn.f16x2.e2m1x2 %1, b1;\n"
      "cvt.rn.f16x2.e2m1x2 %2, b2;\ncvt.rn.f16x2.e2m1x2 %3, b3;\n}\n"
      : "=r"(h[0]), "=r"(h[1]), "=r"(h[2]), "=r"(h[3])
      : "r"(u));
}
__device__ __forceinline__ unsigned e4m3x2_to_h2(unsigned v16) {
  unsigned d;
  asm("{\n.reg .b16 t;\ncvt.u16.u32 t, %1;\ncvt.rn.f16x2.e4m3x2 %0, t;\n}" : "=r"(d) : "r"(v16));
  return d;
}
__device__ __forceinline__ unsigned hmul2(unsigned a, unsigned b) {
  unsigned d;
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

// Byte of scale (page row pr, 16-dim group c) in a page's [128, 36] 128x4-swizzled scale matrix
// (k3gen.ir.layouts.swizzle_128x4_offset with cols 36).
__host__ __device__ constexpr int swz_scale(int pr, int c) {
  return (c & 3) + (c >> 2) * 512 + (pr & 31) * 16 + ((pr & 127) >> 5) * 4;
}

// The raw stage of tile `tile` into the f16 operand tile (each decoder thread: 16-dim groups of
// tokens; FP8: 36 groups of 16 codes per token). Rows past the end and rows of a bad page are zero;
// NVFP4 rows of the live tile come from the ring times G.
template <class C>
__device__ __forceinline__ void decode_tile(const Params& p, int b, int tile, int len, const unsigned char* raw,
                                            unsigned char* op, int dt) {
  using G = RawGeo<C>;
  const bool bad = tile_page<C>(p, b, tile) < 0;
  const int slot0 = (tile * kTok) % C::kPage;
  const int live = C::kKv == Kv::kNvfp4 ? len / 16 * 16 : len;
  const uint4* ring = static_cast<const uint4*>(p.c[C::kKv == Kv::kNvfp4 ? 2 : 0]);
  const int slot = C::kKv == Kv::kNvfp4 ? p.ring_slot[b] : 0;
  const bool ring_ok = slot >= 0 && slot < p.num_slots;
  for (int i = dt; i < kTok * (kRow / 16); i += kDecThreads) {
    const int t = i % kTok, g = i / kTok, pos = tile * kTok + t;
    uint4 w0 = make_uint4(0, 0, 0, 0), w1 = w0;   // the group's 16 dims as 8 f16x2
    if (!bad && pos < live) {
      unsigned h[8];
      if constexpr (C::kKv == Kv::kNvfp4) {
        const uint2 u = *reinterpret_cast<const uint2*>(raw + t * (kRow / 2) + g * 8);
        const unsigned sc = raw[G::kCodeBytes + swz_scale(slot0 + t, g)];
        const unsigned s2 = e4m3x2_to_h2(sc | (sc << 8));
        unsigned a[4], c4[4];
        e2m1x8_to_h2x4(u.x, a);
        e2m1x8_to_h2x4(u.y, c4);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          h[j] = hmul2(a[j], s2);       // e2m1 x E4M3 is exact in f16
          h[4 + j] = hmul2(c4[j], s2);
        }
      } else {
        const uint4 u = *reinterpret_cast<const uint4*>(raw + t * kRow + g * 16);
        const unsigned uw[4] = {u.x, u.y, u.z, u.w};
        float s = 1.f;
        if constexpr (!C::kFp8PerTensor) s = reinterpret_cast<const float*>(raw + G::kCodeBytes)[t * 5 + g / 8];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const unsigned lo = e4m3x2_to_h2(uw[j] & 0xffffu), hi = e4m3x2_to_h2(uw[j] >> 16);
          if constexpr (C::kFp8PerTensor) {
            h[2 * j] = lo;              // codes exactly; the scale goes on the scores and the output
            h[2 * j + 1] = hi;
          } else {
            const float2 a = __half22float2(*reinterpret_cast<const __half2*>(&lo));
            const float2 c2 = __half22float2(*reinterpret_cast<const __half2*>(&hi));
            h[2 * j] = h2_of_f32(a.x * s, a.y * s);   // one rounding to f16
            h[2 * j + 1] = h2_of_f32(c2.x * s, c2.y * s);
          }
        }
      }
      w0 = make_uint4(h[0], h[1], h[2], h[3]);
      w1 = make_uint4(h[4], h[5], h[6], h[7]);
    } else if (C::kKv == Kv::kNvfp4 && pos < len && ring_ok) {
      const uint4* r = ring + (static_cast<long long>(slot) * C::kRing + pos % C::kRing) * kChunks + 2 * g;
      uint4 v[2] = {r[0], r[1]};
      unsigned h[8];
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        const unsigned vw[4] = {v[k].x, v[k].y, v[k].z, v[k].w};
#pragma unroll
        for (int j = 0; j < 4; ++j) h[4 * k + j] = h2_of_f32(bf16_lo(vw[j]) * p.scale, bf16_hi(vw[j]) * p.scale);
      }
      w0 = make_uint4(h[0], h[1], h[2], h[3]);
      w1 = make_uint4(h[4], h[5], h[6], h[7]);
    }
    *reinterpret_cast<uint4*>(op + sw_off(t, 2 * g)) = w0;
    *reinterpret_cast<uint4*>(op + sw_off(t, 2 * g + 1)) = w1;
  }
}

// Q rows r0 .. r0 + kR - 1 of sequence b into the K-major SW128 operand [kR][576] (zero past ht):
// BF16 as is, or f16 times 2^E (E from the rows' max, stage_q's rule: the max lands in
// [2^14, 2^15)). Returns 2^-E.
template <class C, int kThreads, int kR = kRows>
__device__ __forceinline__ float stage_q(const Params& p, int b, int r0, unsigned char* sq, float* scratch) {
  constexpr int HT = C::kHeads * C::kTokens;
  const uint4* qg = reinterpret_cast<const uint4*>(p.q) + (static_cast<long long>(b) * HT + r0) * kChunks;
  const int tid = threadIdx.x;
  float f = 1.f, inv = 1.f;
  if constexpr (C::kKv != Kv::kBf16) {
    float mx = 0.f;
    for (int i = tid; i < kR * kChunks; i += kThreads) {
      if (r0 + i / kChunks >= HT) break;
      mx = fmaxf(mx, bf16x8_amax(qg[i]));
    }
    mx = block_max<kThreads>(mx, scratch);
    int e = mx > 0.f ? 14 - ((__float_as_int(mx) >> 23) - 127) : 0;
    e = min(max(e, -100), 100);
    f = f8::pow2(e);
    inv = f8::pow2(-e);
  }
  for (int i = tid; i < kR * kChunks; i += kThreads) {
    const int r = i / kChunks, c = i - r * kChunks;
    uint4 v = r0 + r < HT ? qg[i] : make_uint4(0, 0, 0, 0);
    if constexpr (C::kKv != Kv::kBf16) {
      float x[8];
      bf16x8_to_float(v, x);
      v = make_uint4(h2_of_f32(x[0] * f, x[1] * f), h2_of_f32(x[2] * f, x[3] * f), h2_of_f32(x[4] * f, x[5] * f),
                     h2_of_f32(x[6] * f, x[7] * f));
    }
    *reinterpret_cast<uint4*>(sq + sw_rows<kR>(r, c)) = v;
  }
  return inv;
}

__device__ __forceinline__ unsigned pack2(float a, float b, bool f16) {
  return f16 ? h2_of_f32(a, b) : bf16x2(a, b);
}
__device__ __forceinline__ float2 unpack2(unsigned w, bool f16) {
  if (f16) return __half22float2(*reinterpret_cast<const __half2*>(&w));
  return make_float2(bf16_lo(w), bf16_hi(w));
}

template <class C>
__device__ void decode(const Params& p, const sm90::TmaMap* kv_map) {
  using G = TcGeo<C>;
  constexpr int HT = C::kHeads * C::kTokens, RS = G::kDecode ? G::kRawStages : G::kOpStages;
  constexpr bool kBf16 = C::kKv == Kv::kBf16, kF16 = !kBf16;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  const unsigned base = smem_u32(smem);
  const unsigned aQ = base + G::kQOff, aP = base + G::kPOff;
  const unsigned bar = base + G::kBarOff;
  const unsigned full0 = bar, empty0 = bar + 8 * RS, dec_full = bar + 16 * RS, dec_empty = dec_full + 8,
                 s_full0 = dec_full + 16, p_full = dec_full + 32, o_done = dec_full + 40;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = blockIdx.x >> 1, half = blockIdx.x & 1, split = blockIdx.y, b = blockIdx.z;
  const int r0 = g * kRows;
  const int len = seq_len<C>(p, b);
  const int ntiles = (len + kTok - 1) / kTok;
  const int per = (ntiles + p.splits - 1) / p.splits;
  const int t_begin = min(ntiles, split * per), n = min(ntiles, t_begin + per) - t_begin;

  if (tid == 0) {
    for (int s = 0; s < RS; ++s) {
      sm90::mbar_init(full0 + 8 * s, 1);
      sm90::mbar_init(empty0 + 8 * s, G::kDecode ? kDecThreads : 1);
    }
    sm90::mbar_init(dec_full, kDecThreads);
    sm90::mbar_init(dec_empty, 1);
    sm90::mbar_init(s_full0, 1);
    sm90::mbar_init(s_full0 + 8, 1);
    sm90::mbar_init(p_full, kSoftmaxThreads);
    sm90::mbar_init(o_done, 1);
    sm90::fence_mbar_init();
  }
  if (warp == 4) tmem_alloc(base + G::kTmemOff, kTmemCols);
  const float qmul = stage_q<C, G::kThreads>(p, b, r0, smem + G::kQOff, reinterpret_cast<float*>(smem + G::kRedOff));
  sm90::fence_proxy_async();   // Q (generic stores) is read by the MMA (async proxy)
  fence_before();
  __syncthreads();
  fence_after();
  const unsigned tmem = *reinterpret_cast<volatile unsigned*>(smem + G::kTmemOff);

  if (warp == 4) {
    if (lane == 0) {
      for (int it = 0; it < n; ++it) {
        const int s = it % RS;
        if (it >= RS) sm90::mbar_wait_or_trap(empty0 + 8 * s, (it / RS - 1) & 1);
        if constexpr (kBf16) issue_bf16<C>(p, b, t_begin + it, base + s * kTileBytes, full0 + 8 * s, kv_map);
        else issue_raw<C>(p, b, t_begin + it, base + G::kRawOff + s * G::kRawBytes, full0 + 8 * s);
      }
    }
  } else if (warp == 5) {
    if (lane == 0) {
      // The operand tile of `it`: the TMA stage (BF16) or the one decoded tile.
      auto operand = [&](int it) -> unsigned {
        if constexpr (kBf16) {
          sm90::mbar_wait_asm(full0 + 8 * (it % RS), (it / RS) & 1);
          return base + (it % RS) * kTileBytes;
        } else {
          sm90::mbar_wait_asm(dec_full, it & 1);
          return base;
        }
      };
      auto issue_qk = [&](int it) {
        const unsigned a = operand(it);
        fence_after();
        qk<kBf16>(tmem + kSCol + 64 * (it & 1), aQ, a);
        commit(s_full0 + 8 * (it & 1));
      };
      // Two or more operand stages: QK of the next tile runs under this tile's softmax.
      constexpr bool kAhead = G::kOpStages >= 2;
      if (kAhead && n > 0) issue_qk(0);
      for (int it = 0; it < n; ++it) {
        if (kAhead) {
          if (it + 1 < n) issue_qk(it + 1);
        } else {
          issue_qk(it);
        }
        sm90::mbar_wait_asm(p_full, it & 1);
        fence_after();
        pv<kBf16>(tmem + kOCol, aP, kBf16 ? base + (it % RS) * kTileBytes : base, half, it == 0);
        commit(o_done);
        commit(kBf16 ? empty0 + 8 * (it % RS) : dec_empty);
      }
    }
  } else if (warp >= 6) {
    const int dt = tid - 192;
    for (int it = 0; it < n; ++it) {
      const int s = it % RS;
      sm90::mbar_wait_asm(full0 + 8 * s, (it / RS) & 1);
      if (it > 0) sm90::mbar_wait_asm(dec_empty, (it - 1) & 1);
      decode_tile<C>(p, b, t_begin + it, len, smem + G::kRawOff + s * G::kRawBytes, smem, dt);
      sm90::fence_proxy_async();   // generic stores read by the MMA
      sm90::mbar_arrive(empty0 + 8 * s);
      sm90::mbar_arrive(dec_full);
    }
  } else {
    // Softmax warps: lane < 16 of warp w owns CTA row 16 w + lane (TMEM lane 32 w + lane).
    const int row = 16 * warp + lane;
    const bool mine = lane < 16;
    const int rr = r0 + row;
    const int lim = len - C::kTokens + (rr < HT ? rr / C::kHeads : C::kTokens - 1);
    float m = K3GEN_MLA_NEG_INF, l = 0.f;
    float qk_scale = C::kSoftmaxScale * kLog2e * qmul;
    if constexpr (C::kKv == Kv::kFp8 && C::kFp8PerTensor) qk_scale *= p.scale;
    if constexpr (C::kKv == Kv::kNvfp4) qk_scale = __fdiv_rn(qk_scale, p.scale);
    const unsigned lane_addr = tmem + (static_cast<unsigned>(32 * warp) << 16);
    unsigned char* prow = smem + G::kPOff + (row >> 3) * 1024 + (row & 7) * 128;
    for (int it = 0; it < n; ++it) {
      const int pos0 = (t_begin + it) * kTok;
      sm90::mbar_wait_asm(s_full0 + 8 * (it & 1), (it >> 1) & 1);
      fence_after();
      // tcgen05.ld is .sync.aligned: the lanes that stored P (mine) last tile rejoin the others first.
      __syncwarp();
      float s[2][32];
      sm100::ld32_async(lane_addr + kSCol + 64 * (it & 1), s[0]);
      sm100::ld32_async(lane_addr + kSCol + 64 * (it & 1) + 32, s[1]);
      sm100::wait_ld();
      sm100::pin(s[0]);   // every use of the scores stays below the wait (sm100::pin)
      sm100::pin(s[1]);
      float mx = K3GEN_MLA_NEG_INF;
#pragma unroll
      for (int j = 0; j < 64; ++j) {
        float& x = s[j >> 5][j & 31];
        x = pos0 + j <= lim ? x * qk_scale : K3GEN_MLA_NEG_INF;
        mx = fmaxf(mx, x);
      }
      const float m_new = fmaxf(m, mx);
      const float alpha = (!mine || m_new == K3GEN_MLA_NEG_INF) ? 1.f : exp2f(m - m_new);
      const float msub = m_new == K3GEN_MLA_NEG_INF ? 0.f : m_new;
      m = m_new;
      unsigned pk[32];
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < 32; ++j) {
        pk[j] = pack2(exp2f(s[j >> 4][(2 * j) & 31] - msub), exp2f(s[j >> 4][(2 * j + 1) & 31] - msub), kF16);
        const float2 pf = unpack2(pk[j], kF16);   // the denominator sums what the MMA sums
        sum += pf.x + pf.y;
      }
      l = l * alpha + sum;
      if (it > 0) {
        sm90::mbar_wait_asm(o_done, (it - 1) & 1);   // PV of the previous tile retired: O and P are free
        fence_after();
        if (__any_sync(0xffffffffu, mine && alpha != 1.f)) {
#pragma unroll 1
          for (int c = 0; c < kHalf / 32; ++c) {
            float o[32];
            ld32(lane_addr + kOCol + 32 * c, o);
#pragma unroll
            for (int j = 0; j < 32; ++j) o[j] *= alpha;
            st32(lane_addr + kOCol + 32 * c, o);
          }
        }
      }
      if (mine) {
#pragma unroll
        for (int ch = 0; ch < 8; ++ch)
          *reinterpret_cast<uint4*>(prow + ((ch ^ (row & 7)) << 4)) =
              make_uint4(pk[4 * ch], pk[4 * ch + 1], pk[4 * ch + 2], pk[4 * ch + 3]);
      }
      if constexpr (kBf16) {
        // The sequence's last tile: the TMA box copied the page's rows past the end as stored (stale,
        // maybe NaN, and 0 * NaN would poison O): zero this half's V of those rows before PV reads
        // them (QK of this tile has completed; the decoders write zeros for FP8 / NVFP4).
        const int valid = len - pos0;
        if (valid < kTok) {
          unsigned char* op = smem + (it % RS) * kTileBytes;
          for (int i = tid; i < (kTok - valid) * (kHalf / 8); i += kSoftmaxThreads)
            *reinterpret_cast<uint4*>(op + sw_off(valid + i / (kHalf / 8), kHalf / 8 * half + i % (kHalf / 8))) =
                make_uint4(0, 0, 0, 0);
        }
      }
      sm90::fence_proxy_async();   // P and zeroed rows (generic stores) are read by the MMA
      fence_before();
      sm90::mbar_arrive(p_full);
    }
    // Epilogue: O / l (0 for an empty row); one split writes BF16 rows, several FP32 partials.
    float w = l > 0.f ? 1.f / l : 0.f;
    if constexpr (C::kKv == Kv::kFp8 && C::kFp8PerTensor) w *= p.scale;
    if constexpr (C::kKv == Kv::kNvfp4) w = __fdiv_rn(w, p.scale);   // the output is in units of 1/G
    if (n > 0) {
      sm90::mbar_wait_asm(o_done, (n - 1) & 1);
      fence_after();
    }
    const long long orow = static_cast<long long>(b) * HT + rr;
    const long long prow_g = (static_cast<long long>(b) * p.splits + split) * HT + rr;
#pragma unroll 1
    for (int c = 0; c < kHalf / 32; ++c) {
      float o[32];
      __syncwarp();   // the lanes that skipped the last chunk's store rejoin before the aligned load
      if (n > 0) ld32(lane_addr + kOCol + 32 * c, o);   // waited and pinned (sm100::ld32)
      const int col = kHalf * half + 32 * c;
      if (!mine || rr >= HT) continue;
#pragma unroll
      for (int j = 0; j < 32; ++j) o[j] = n > 0 ? o[j] * w : 0.f;
      if (p.splits == 1) {
        uint4* d = reinterpret_cast<uint4*>(p.out + orow * kLat + col);
#pragma unroll
        for (int q = 0; q < 4; ++q)
          d[q] = make_uint4(bf16x2(o[8 * q], o[8 * q + 1]), bf16x2(o[8 * q + 2], o[8 * q + 3]),
                            bf16x2(o[8 * q + 4], o[8 * q + 5]), bf16x2(o[8 * q + 6], o[8 * q + 7]));
      } else {
        float4* d = reinterpret_cast<float4*>(p.part_o + prow_g * kLat + col);
#pragma unroll
        for (int q = 0; q < 8; ++q) d[q] = make_float4(o[4 * q], o[4 * q + 1], o[4 * q + 2], o[4 * q + 3]);
      }
    }
    if (p.splits > 1 && half == 0 && mine && rr < HT)
      p.part_lse[prow_g] = l > 0.f ? m + log2f(l) : K3GEN_MLA_NEG_INF;
    fence_before();
  }
  // Lane 0 of the producer / MMA warps ran its loop alone: every lane rejoins its warp before the
  // aligned barrier (and before warp 4's aligned dealloc).
  __syncwarp();
  __syncthreads();
  if (warp == 4) {
    fence_after();
    tmem_dealloc(tmem, kTmemCols);
  }
}

}  // namespace tc
}  // namespace mla
}  // namespace k3gen
