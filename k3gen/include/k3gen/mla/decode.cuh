// mla_decode: absorbed MLA attention over paged latent KV (BF16, FP8 E4M3, NVFP4 + HP tail ring).
// Variant "mma" of k3gen/ops/mla_decode/variants.py. Contract: k3gen/ops/mla_decode/spec.py;
// FP32 twin: k3gen/ops/mla_decode/reference.py.
//
// Grid (groups, splits, B), 256 threads. CTA (g, s, b) owns query rows 16*MT*g .. of sequence b
// (row r = t * H + h) and the s-th run of its 64-token KV tiles. Per tile:
//   cp.async ring (kStages deep) -> [FP8/NVFP4: dequantize to a BF16 tile in shared memory]
//   -> QK: warp w computes the 8 tokens 8w..8w+7 for all rows over 576 dims (mma m16n8k16)
//   -> online softmax in FP32 (log2 domain), P rounded to BF16
//   -> PV: warp w accumulates output columns 64w..64w+63 (MT x 8 n8 tiles of FP32 in registers).
// Rows past the sequence end and rows of bad pages are zero in the BF16 tile (0 * garbage would
// be NaN); their scores are masked by the causal limit.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "k3gen/common/faults.cuh"
#include "k3gen/common/quant.cuh"

namespace k3gen {
namespace mla {

enum class Kv { kBf16, kFp8, kNvfp4 };

constexpr int kRow = 576;
constexpr int kLat = 512;
constexpr int kTok = 64;                 // tokens per tile
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kPad = 8;
constexpr int kChunks = kRow / 8;        // 16-byte chunks per shared KV/Q row (72, unpadded)
constexpr int kSStride = kTok + 4;       // FP32 per score row
constexpr int kPStride = kTok + kPad;    // BF16 per probability row (144 B = 9 chunks)
constexpr int kFp8Scales = 8;            // FP32 slots per token in an FP8 stage (5 used)
constexpr int kNvSwzBytes = 9 * 32 * 8;  // the 64-row half of a page's swizzled scale matrix
constexpr float kLog2e = 1.4426950408889634f;
#define K3GEN_MLA_NEG_INF (__int_as_float(0xff800000u))

template <class C>
struct Geo {
  static constexpr int R = 16 * C::kMT;
  static constexpr int HT = C::kHeads * C::kTokens;
  static constexpr int kTileBytes = kTok * kRow * 2;
  static constexpr int kRaw = C::kKv == Kv::kBf16 ? kTileBytes
                              : C::kKv == Kv::kFp8 ? kTok * (kRow + 32) + kTok * kFp8Scales * 4
                                                   : kTok * (kRow / 2 + 16) + kNvSwzBytes;
  // kQReg (MT = 1 at one CTA per SM): Q lives in registers (144 of them), staged once through the
  // last ring stage. Otherwise Q stays in shared memory (FP8/NVFP4: f16 rows of 1216 B) and is
  // re-read per tile: that is what lets FP8/NVFP4 run two CTAs per SM (C::kCtasPerSm).
  static constexpr bool kQReg = C::kMT == 1 && C::kCtasPerSm == 1;
  static constexpr int kQ = kQReg ? 0 : R * (C::kKv == Kv::kBf16 ? kRow * 2 : kRow * 2 + 64);
  static constexpr int kS = R * kSStride * 4;
  static constexpr int kP = R * kPStride * 2;
  static constexpr int kStats = R * 4 * 4;
  static constexpr int kFixed = kQ + kS + kP + kStats;
  static constexpr int kSmem = kFixed + C::kStages * kRaw;
  static_assert(!kQReg || kRaw >= 16 * (kRow * 2 + 64), "register Q is staged through the last ring stage");
};

// 16-byte chunk index of (row, chunk) in a [rows][576] BF16 shared tile. Rows are 1152 B (a
// multiple of 128), so the chunk is XORed with row & 7 inside its aligned group of 8: the 8 rows an
// ldmatrix phase reads at one logical chunk hit 8 different bank groups. 72 % 8 == 0 keeps the
// result inside the row.
__device__ __forceinline__ int swz(int row, int chunk) { return row * kChunks + (chunk ^ (row & 7)); }

struct Params {
  const __nv_bfloat16* q;        // [B, T*H, 576]
  const int* lengths;            // [B]
  const int* block_table;        // [>= B, bt_cols]
  long long bt_stride;
  int bt_cols, num_pages;
  const int* ring_slot;          // NVFP4: [B]
  int num_slots;
  const void* c[4];              // KvLayout.tensors() in order
  float scale;                   // FP8 per-tensor scale or NVFP4 global scale G
  __nv_bfloat16* out;            // [B, T*H, 512]
  float* part_o;                 // [B, splits, T*H, 512] (splits > 1)
  float* part_lse;               // [B, splits, T*H], log2 domain
  int splits;
  unsigned* err;                 // this op's error word (k3gen/runtime/faults.py)
};

__device__ __forceinline__ unsigned smem_u32(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void cp_async16(unsigned dst, const void* src, unsigned src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async8(unsigned dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

__device__ __forceinline__ void ldsm_x4(unsigned addr, unsigned (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(unsigned addr, unsigned (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
// D += A (16x16 BF16, row) * B (16x8 BF16, col), FP32 accumulate.
// Not volatile: the MMA is pure, so the scheduler may interleave independent accumulator chains.
__device__ __forceinline__ void mma_bf16(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  asm(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ unsigned bf16x2(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // RNE
  return *reinterpret_cast<const unsigned*>(&v);
}

}  // namespace mla
}  // namespace k3gen
#include "k3gen/mla/decode_fp8.cuh"    // the FP8 register path (uses Params and the helpers above)
#include "k3gen/mla/decode_nvfp4.cuh"  // the NVFP4 register path
namespace k3gen {
namespace mla {

// Page id of the tile's tokens, or -1 (fault recorded) when the table entry is missing or out of
// range: its rows read as zeros (BF16: the TMA map's out-of-bounds fill) and are masked.
template <class C>
__device__ __forceinline__ int tile_page(const Params& p, int b, int tile) {
  const int j = tile * kTok / C::kPage;
  const int pg = j < p.bt_cols ? p.block_table[static_cast<long long>(b) * p.bt_stride + j] : -1;
  if (j < p.bt_cols && pg >= 0 && pg < p.num_pages) return pg;
  fault::report(p.err, j < p.bt_cols ? fault::kPage : fault::kTable);
  return -1;
}

// Sequence b's length clamped to [0, bt_cols * page], the positions its table row can name; past
// that or short of T (rows that see no position come out zero): `length`. NVFP4: a ring slot outside
// [0, num_slots) is a `ring` fault (the live rows read as zeros). Only the fault path pays.
template <class C>
__device__ __forceinline__ int seq_len(const Params& p, int b) {
  const int raw = p.lengths[b];
  const long long cap = static_cast<long long>(p.bt_cols) * C::kPage;
  if (raw < C::kTokens || raw > cap) fault::report(p.err, fault::kLength);
  if constexpr (C::kKv == Kv::kNvfp4) {
    const int slot = p.ring_slot[b];
    if (slot < 0 || slot >= p.num_slots) fault::report(p.err, fault::kRing);
  }
  return static_cast<int>(min(static_cast<long long>(max(raw, 0)), cap));
}

// Issue the copies of one tile (page pg from tile_page) into a raw stage (no commit).
template <class C>
__device__ __forceinline__ void load_tile(const Params& p, int b, int len, int tile, int pg, unsigned char* stage) {
  const int tid = threadIdx.x;
  const int slot0 = (tile * kTok) % C::kPage;
  const unsigned dst0 = smem_u32(stage);
  if constexpr (C::kKv == Kv::kBf16) {
    const unsigned char* kv = static_cast<const unsigned char*>(p.c[0]);
    for (int i = tid; i < kTok * (kRow / 8); i += kThreads) {
      const int t = i / (kRow / 8), c = i - t * (kRow / 8);
      const bool ok = pg >= 0 && tile * kTok + t < len;
      const void* src = ok ? kv + ((static_cast<long long>(pg) * C::kPage + slot0 + t) * kRow + c * 8) * 2
                           : static_cast<const void*>(kv);
      cp_async16(dst0 + swz(t, c) * 16, src, ok ? 16u : 0u);
    }
  } else if constexpr (C::kKv == Kv::kFp8) {
    if (pg < 0) return;  // dequantization writes zeros for the whole tile
    const unsigned char* codes = static_cast<const unsigned char*>(p.c[0]) +
                                 (static_cast<long long>(pg) * C::kPage + slot0) * kRow;
    const int n = min(kTok, len - tile * kTok);
    for (int i = tid; i < n * (kRow / 16); i += kThreads) {
      const int t = i / (kRow / 16), c = i - t * (kRow / 16);
      cp_async16(dst0 + t * f8::kRowB + c * 16, codes + i * 16, 16u);
    }
    if constexpr (!C::kFp8PerTensor) {
      // [tokens, 5] FP32 rows are 20 B: copy them 4 B at a time into 8-float slots.
      const float* sc = static_cast<const float*>(p.c[1]) + (static_cast<long long>(pg) * C::kPage + slot0) * 5;
      const unsigned sdst = dst0 + f8::kScaleOff;
      for (int i = tid; i < n * 5; i += kThreads) {
        const int t = i / 5, g = i - t * 5;
        asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(sdst + (t * kFp8Scales + g) * 4),
                     "l"(sc + i) : "memory");
      }
    }
  } else {
    if (pg < 0) return;
    const unsigned char* codes = static_cast<const unsigned char*>(p.c[0]) +
                                 (static_cast<long long>(pg) * C::kPage + slot0) * (kRow / 2);
    const int n = min(kTok, len - tile * kTok);
    for (int i = tid; i < n * (kRow / 32); i += kThreads) {
      const int t = i / (kRow / 32), c = i - t * (kRow / 32);
      cp_async16(dst0 + t * nv::kRowB + c * 16, codes + i * 16, 16u);
    }
    const unsigned sdst = dst0 + nv::kScaleOff;
    if constexpr (C::kSwizzle) {
      // Rows slot0..slot0+63 of the [128, 36] matrix: 8 bytes of every 16-byte chunk.
      const unsigned char* sc = static_cast<const unsigned char*>(p.c[1]) +
                                static_cast<long long>(pg) * (C::kPage * 36) + (slot0 / 64) * 8;
      for (int i = tid; i < 9 * 32; i += kThreads) cp_async8(sdst + i * 8, sc + i * 16);
    } else {
      // Latent tile scales [4 tiles, 32] then rope scales [64 tokens, 4].
      const unsigned char* ts = static_cast<const unsigned char*>(p.c[1]) +
                                (static_cast<long long>(pg) * (C::kPage / 16) + slot0 / 16) * 32;
      const unsigned char* rs = static_cast<const unsigned char*>(p.c[2]) +
                                (static_cast<long long>(pg) * C::kPage + slot0) * 4;
      if (tid < 8) cp_async16(sdst + tid * 16, ts + tid * 16, 16u);
      else if (tid < 24) cp_async16(sdst + 128 + (tid - 8) * 16, rs + (tid - 8) * 16, 16u);
    }
  }
}

template <class C>
__device__ void decode(const Params& p) {
  using G = Geo<C>;
  constexpr int R = G::R, HT = G::HT, MT = C::kMT, S = C::kStages;
  constexpr bool kF8 = C::kKv == Kv::kFp8, kNv = C::kKv == Kv::kNvfp4;
  constexpr bool kF16 = kF8 || kNv;   // f16 fragments from the raw codes; FP32 p in sS; permuted columns
  extern __shared__ __align__(128) unsigned char smem[];
  __nv_bfloat16* sQ = reinterpret_cast<__nv_bfloat16*>(smem);
  float* sS = reinterpret_cast<float*>(smem + G::kQ);
  __nv_bfloat16* sP = reinterpret_cast<__nv_bfloat16*>(smem + G::kQ + G::kS);
  float* sM = reinterpret_cast<float*>(smem + G::kQ + G::kS + G::kP);
  float* sL = sM + R;
  float* sAlpha = sL + R;
  int* sLim = reinterpret_cast<int*>(sAlpha + R);
  unsigned char* sRaw = smem + G::kFixed;

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = blockIdx.x, split = blockIdx.y, b = blockIdx.z;
  const int r0 = g * R;
  const int len = seq_len<C>(p, b);
  const int ntiles = (len + kTok - 1) / kTok;
  const int per = (ntiles + p.splits - 1) / p.splits;
  const int t_begin = min(ntiles, split * per), t_end = min(ntiles, t_begin + per);
  const int live = len / 16 * 16;   // NVFP4: first position of the live (incomplete) 16-token tile

  // Page ids are read one iteration before their tile is issued (a block-table load followed
  // at once by its use stalled every thread on an L2 round trip per tile). bad: bit s marks
  // ring stage s as holding a missing page, so FP8/NVFP4 zero it instead of decoding stale bytes.
  unsigned bad = 0;
  for (int s = 0; s < S - 1; ++s) {
    if (t_begin + s < t_end) {
      const int pg = tile_page<C>(p, b, t_begin + s);
      bad |= static_cast<unsigned>(pg < 0) << s;
      load_tile<C>(p, b, len, t_begin + s, pg, sRaw + s * G::kRaw);
    }
    cp_async_commit();
  }
  int pg_next = t_begin + S - 1 < t_end ? tile_page<C>(p, b, t_begin + S - 1) : -1;

  // Query rows (zero past H*T), stats, causal limits. MT = 1 stages Q in the last ring stage
  // (first written after the barrier of iteration 0) and keeps its A fragments in registers.
  if constexpr (G::kQReg) sQ = reinterpret_cast<__nv_bfloat16*>(sRaw + (S - 1) * G::kRaw);
  float qmul = 1.f;   // FP8/NVFP4: 2^-E of the f16 query
  if constexpr (kF16) {
    qmul = f8::stage_q<C>(p, b, r0, reinterpret_cast<unsigned char*>(sQ), sS);
  } else {
    const uint4* qg = reinterpret_cast<const uint4*>(p.q) + (static_cast<long long>(b) * HT + r0) * kChunks;
    for (int i = tid; i < R * kChunks; i += kThreads) {
      const int r = i / kChunks, c = i - r * kChunks;
      const uint4 v = r0 + r < HT ? qg[i] : make_uint4(0, 0, 0, 0);
      reinterpret_cast<uint4*>(sQ)[swz(r, c)] = v;
    }
  }
  if (tid < R) {
    sM[tid] = K3GEN_MLA_NEG_INF;
    sL[tid] = 0.f;
    const int t = r0 + tid < HT ? (r0 + tid) / C::kHeads : C::kTokens - 1;
    sLim[tid] = len - C::kTokens + t;
  }

  float o[MT][8][4];
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int j = 0; j < 8; ++j) o[m][j][0] = o[m][j][1] = o[m][j][2] = o[m][j][3] = 0.f;

  float qk_scale = C::kSoftmaxScale * kLog2e * qmul;
  if constexpr (kF8 && C::kFp8PerTensor) qk_scale *= p.scale;
  if constexpr (kNv) qk_scale = __fdiv_rn(qk_scale, p.scale);   // codes times scale codes are G * KV
  const unsigned aQ = smem_u32(sQ), aP = smem_u32(sP);
  // Lane constants of the swizzled ldmatrix addresses: a phase's 8 rows are r..r+7 with
  // row & 7 == lane & 7, and logical chunk 2k + j (2k a multiple of 4, j < 4) maps to 2k ^ (j ^ (lane & 7)).
  const int yB = (lane >> 3) ^ (lane & 7);         // QK B: 4 matrices = chunks 2k .. 2k+3
  const int yA = (lane >> 4) ^ (lane & 7);         // A (Q) and PV V: 2 chunks per matrix pair
  unsigned qf[G::kQReg && !kF8 ? kRow / 16 : 1][4];   // BF16: ldmatrix A fragments; NVFP4: f16 per group
  uint4 qh[G::kQReg && kF8 ? kRow / 32 : 1][2];   // FP8: f16 query rows g, g + 8, natural order
  int fexp = 0;                                   // FP8: the running output is in units of 2^fexp
  if constexpr (G::kQReg && kF8) {
    const unsigned char* sq = reinterpret_cast<const unsigned char*>(sQ) + (lane >> 2) * f8::kQRowB + (lane & 3) * 16;
#pragma unroll
    for (int k = 0; k < kRow / 32; ++k) {
      qh[k][0] = *reinterpret_cast<const uint4*>(sq + k * 64);
      qh[k][1] = *reinterpret_cast<const uint4*>(sq + 8 * f8::kQRowB + k * 64);
    }
  } else if constexpr (G::kQReg && kNv) {
    const unsigned char* sq = reinterpret_cast<const unsigned char*>(sQ) + (lane >> 2) * f8::kQRowB + (lane & 3) * 8;
#pragma unroll
    for (int k = 0; k < kRow / 16; ++k) {
      const uint2 qa = *reinterpret_cast<const uint2*>(sq + k * 32);
      const uint2 qb = *reinterpret_cast<const uint2*>(sq + 8 * f8::kQRowB + k * 32);
      qf[k][0] = qa.x; qf[k][1] = qb.x; qf[k][2] = qa.y; qf[k][3] = qb.y;
    }
  } else if constexpr (G::kQReg) {
    __syncthreads();
#pragma unroll
    for (int k = 0; k < kRow / 16; ++k) ldsm_x4(aQ + (lane & 15) * (kRow * 2) + ((2 * k) ^ yA) * 16, qf[k]);
  }
  // Online softmax of the scores in sS: each half-warp owns a row (rows w + 8 (2i + half)) and
  // each of its lanes 4 columns, so a warp reduces two rows in the same 4 shuffle steps (the
  // row-per-warp form spent 20 dependent shuffles on its two rows).
  static_assert(kTok == 64 && R % (2 * kWarps) == 0, "softmax lane map");
  auto softmax = [&]() {
    const int hl = lane & 15;
#pragma unroll
    for (int row = warp + kWarps * (lane >> 4); row < R; row += 2 * kWarps) {
      const float4 s4 = *reinterpret_cast<const float4*>(sS + row * kSStride + 4 * hl);
      float mx = fmaxf(fmaxf(s4.x, s4.y), fmaxf(s4.z, s4.w));
#pragma unroll
      for (int off = 8; off >= 1; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
      const float m_old = sM[row];
      const float m_new = fmaxf(m_old, mx);
      float alpha = 1.f, p0 = 0.f, p1 = 0.f, p2 = 0.f, p3 = 0.f;
      if (m_new != K3GEN_MLA_NEG_INF) {
        alpha = exp2f(m_old - m_new);
        p0 = exp2f(s4.x - m_new);
        p1 = exp2f(s4.y - m_new);
        p2 = exp2f(s4.z - m_new);
        p3 = exp2f(s4.w - m_new);
      }
      const unsigned pb0 = bf16x2(p0, p1), pb1 = bf16x2(p2, p3);
      // The denominator sums what the MMA sums; FP8/NVFP4 keep FP32 p (the PV A fragments are
      // f16 of p, for FP8 times the per-token scales).
      float sum = kF16 ? (p0 + p1) + (p2 + p3)
                       : (bf16_lo(pb0) + bf16_hi(pb0)) + (bf16_lo(pb1) + bf16_hi(pb1));
#pragma unroll
      for (int off = 8; off >= 1; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
      if constexpr (kF16) *reinterpret_cast<float4*>(sS + row * kSStride + 4 * hl) = make_float4(p0, p1, p2, p3);
      else *reinterpret_cast<uint2*>(sP + row * kPStride + 4 * hl) = make_uint2(pb0, pb1);
      __syncwarp();
      if (hl == 0) {
        sL[row] = sL[row] * alpha + sum;
        sM[row] = m_new;
        sAlpha[row] = alpha;
      }
    }
  };

  for (int it = 0; t_begin + it < t_end; ++it) {
    const int tile = t_begin + it;
    cp_async_wait<S - 2>();
    __syncthreads();
    if (tile + S - 1 < t_end) {
      const int slot = (it + S - 1) % S;
      bad = (bad & ~(1u << slot)) | (static_cast<unsigned>(pg_next < 0) << slot);
      load_tile<C>(p, b, len, tile + S - 1, pg_next, sRaw + slot * G::kRaw);
      pg_next = tile + S < t_end ? tile_page<C>(p, b, tile + S) : -1;
    }
    cp_async_commit();
    const unsigned char* stage = sRaw + (it % S) * G::kRaw;
    const __nv_bfloat16* kv = reinterpret_cast<const __nv_bfloat16*>(stage);
    if constexpr (kF16) {
      // Rows not copied (past the end, bad page) or (NVFP4) of the live tile become zeros.
      const int end = kNv ? live : len;
      const int valid = (bad >> (it % S)) & 1u ? 0 : max(0, min(kTok, end - tile * kTok));
      if (valid < kTok) {
        if constexpr (kF8) f8::zero_rows(const_cast<unsigned char*>(stage), valid);
        else nv::zero_rows<C>(const_cast<unsigned char*>(stage), valid);
        __syncthreads();
      }
    }
    const unsigned aKV = smem_u32(kv);

    // QK: warp w -> tokens 8w..8w+7 of every row.
    {
      // Four independent accumulator chains per query tile (k16 steps 4i, 4i+1, 4i+2, 4i+3): one
      // chain of 36 dependent MMAs per tile was the latency floor of the QK phase. Every MT uses
      // the same chains and the same final sum, so a row's score is bitwise the same whatever
      // the query tiling (decode T = 1 and verify T = 1 + M agree exactly).
      float acc[MT][4], acc2[MT][4], acc3[MT][4], acc4[MT][4];
#pragma unroll
      for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[m][i] = acc2[m][i] = acc3[m][i] = acc4[m][i] = 0.f;
      const unsigned bRow = aKV + (warp * 8 + (lane & 7)) * (kRow * 2);
      const unsigned aRow = aQ + (lane & 15) * (kRow * 2);
      if constexpr (kF8) f8::qk<C>(acc, stage, qh, reinterpret_cast<const unsigned char*>(sQ), warp, lane);
      if constexpr (kNv) nv::qk<C>(acc, stage, qf, reinterpret_cast<const unsigned char*>(sQ), warp, lane);
#pragma unroll
      for (int k = 0; k < (kF16 ? 0 : kRow / 16); k += 2) {
        unsigned bf[4];
        ldsm_x4(bRow + ((2 * k) ^ yB) * 16, bf);
#pragma unroll
        for (int m = 0; m < MT; ++m) {
          float (&a0)[4] = (k & 2) ? acc3[m] : acc[m];
          float (&a1)[4] = (k & 2) ? acc4[m] : acc2[m];
          if constexpr (G::kQReg) {
            mma_bf16(a0, qf[k], bf[0], bf[1]);
            mma_bf16(a1, qf[k + 1], bf[2], bf[3]);
          } else {
            unsigned a[4];
            ldsm_x4(aRow + m * 16 * (kRow * 2) + ((2 * k) ^ yA) * 16, a);
            mma_bf16(a0, a, bf[0], bf[1]);
            ldsm_x4(aRow + m * 16 * (kRow * 2) + ((2 * k + 2) ^ yA) * 16, a);
            mma_bf16(a1, a, bf[2], bf[3]);
          }
        }
      }
      if constexpr (!kF16)
#pragma unroll
        for (int m = 0; m < MT; ++m)
#pragma unroll
          for (int i = 0; i < 4; ++i) acc[m][i] = (acc[m][i] + acc2[m][i]) + (acc3[m][i] + acc4[m][i]);
      const int col = warp * 8 + (lane & 3) * 2;
      const int pos = tile * kTok + col;
#pragma unroll
      for (int m = 0; m < MT; ++m) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = m * 16 + (lane >> 2) + 8 * h;
          const int lim = kNv ? min(sLim[row], live - 1) : sLim[row];   // NVFP4: live rows come later
          float2 v;
          v.x = pos <= lim ? acc[m][2 * h] * qk_scale : K3GEN_MLA_NEG_INF;
          v.y = pos + 1 <= lim ? acc[m][2 * h + 1] * qk_scale : K3GEN_MLA_NEG_INF;
          *reinterpret_cast<float2*>(sS + row * kSStride + col) = v;
        }
      }
    }
    __syncthreads();

    softmax();
    __syncthreads();

    // PV: warp w -> output columns 64w..64w+63.
    if constexpr (kF8) {
      f8::pv<C>(o, stage, sS, sAlpha, warp, lane, fexp);
    } else if constexpr (kNv) {
      nv::pv<C>(o, stage, sS, sAlpha, warp, lane);
    } else {
#pragma unroll
      for (int m = 0; m < MT; ++m) {
        const float a0 = sAlpha[m * 16 + (lane >> 2)], a1 = sAlpha[m * 16 + (lane >> 2) + 8];
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          o[m][j][0] *= a0; o[m][j][1] *= a0;
          o[m][j][2] *= a1; o[m][j][3] *= a1;
        }
      }
      const unsigned vRow = aKV + ((lane & 7) + ((lane >> 3) & 1) * 8) * (kRow * 2) + warp * 128;
      const unsigned pRow = aP + ((lane & 15) * kPStride + (lane >> 4) * 8) * 2;
#pragma unroll
      for (int k = 0; k < kTok / 16; ++k) {
        unsigned a[MT][4];
#pragma unroll
        for (int m = 0; m < MT; ++m) ldsm_x4(pRow + (m * 16 * kPStride + k * 16) * 2, a[m]);
#pragma unroll
        for (int jj = 0; jj < 4; ++jj) {
          unsigned bv[4];
          ldsm_x4_t(vRow + k * 16 * (kRow * 2) + ((2 * jj) ^ yA) * 16, bv);
#pragma unroll
          for (int m = 0; m < MT; ++m) {
            mma_bf16(o[m][2 * jj], a[m], bv[0], bv[1]);
            mma_bf16(o[m][2 * jj + 1], a[m], bv[2], bv[3]);
          }
        }
      }
    }
  }
  cp_async_wait<0>();
  __syncthreads();
  if constexpr (kNv) {
    // The live positions, by the CTA of the sequence's last tile (uniform condition).
    if (t_begin < t_end && t_end == ntiles && live < len) {
      nv::live_scores<C>(p, b, len, live, r0, sRaw, sS, sLim, C::kSoftmaxScale * kLog2e);
      __syncthreads();
      softmax();
      __syncthreads();
      nv::live_pv<C>(o, sRaw, len - live, sS, sAlpha, p.scale, warp, lane);
    }
  }

  // Epilogue: normalized rows; one split writes BF16 directly, several write FP32 partials.
#pragma unroll
  for (int m = 0; m < MT; ++m) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = m * 16 + (lane >> 2) + 8 * h;
      if (r0 + row >= HT) continue;
      const float l = sL[row];
      float inv = l > 0.f ? 1.f / l : 0.f;
      const long long orow = static_cast<long long>(b) * HT + r0 + row;
      const long long prow = (static_cast<long long>(b) * p.splits + split) * HT + r0 + row;
      if constexpr (kF16) {
        // Tile 4 bp + j, column 2c + e holds dim 32 bp + 8c + 4e + j of the warp's 64.
        if constexpr (kF8) inv *= f8::pow2(fexp) * (C::kFp8PerTensor ? p.scale : 1.f);
        else inv = __fdiv_rn(inv, p.scale);   // NVFP4: the output is in units of 1/G
#pragma unroll
        for (int bp = 0; bp < 2; ++bp) {
          float x[8];
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            x[j] = o[m][4 * bp + j][2 * h] * inv;
            x[4 + j] = o[m][4 * bp + j][2 * h + 1] * inv;
          }
          const int col = warp * 64 + 32 * bp + 8 * (lane & 3);
          if (p.splits == 1) {
            *reinterpret_cast<uint4*>(p.out + orow * kLat + col) =
                make_uint4(bf16x2(x[0], x[1]), bf16x2(x[2], x[3]), bf16x2(x[4], x[5]), bf16x2(x[6], x[7]));
          } else {
            float4* d = reinterpret_cast<float4*>(p.part_o + prow * kLat + col);
            d[0] = make_float4(x[0], x[1], x[2], x[3]);
            d[1] = make_float4(x[4], x[5], x[6], x[7]);
          }
        }
        continue;
      }
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int col = warp * 64 + j * 8 + (lane & 3) * 2;
        const float x = o[m][j][2 * h] * inv, y = o[m][j][2 * h + 1] * inv;
        if (p.splits == 1) {
          *reinterpret_cast<unsigned*>(p.out + orow * kLat + col) = bf16x2(x, y);
        } else {
          *reinterpret_cast<float2*>(p.part_o + prow * kLat + col) = make_float2(x, y);
        }
      }
    }
  }
  if (p.splits > 1 && tid < R && r0 + tid < HT) {
    const float l = sL[tid];
    p.part_lse[(static_cast<long long>(b) * p.splits + split) * HT + r0 + tid] =
        l > 0.f ? sM[tid] + log2f(l) : K3GEN_MLA_NEG_INF;
  }
}

// Max of x over the kThreads threads of the CTA: every thread calls it (a barrier inside) and gets the
// result; scratch holds kThreads / 32 floats.
template <int kThreads>
__device__ __forceinline__ float block_max(float x, float* scratch) {
#pragma unroll
  for (int off = 16; off >= 1; off >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, off));
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = x;
  __syncthreads();
#pragma unroll
  for (int w = 0; w < kThreads / 32; ++w) x = fmaxf(x, scratch[w]);
  return x;
}

// Log-sum-exp merge of the splits: grid (T*H, B), kCombineThreads = 4 groups x 128 threads x 4
// columns; group g takes splits g, g + 4, ... Small batches take many splits (64 at B = 1, L = 8K)
// over few CTAs (one per row): one thread walking all splits kept only 2-3 partial rows in flight
// and made the combine as long as the split kernel itself.
constexpr int kCombineThreads = 512;
__device__ __forceinline__ void combine(const float* part_o, const float* part_lse, __nv_bfloat16* out, int splits,
                                        int ht) {
  __shared__ float red[kCombineThreads / 32];
  __shared__ float4 part[3][128];
  __shared__ float psum[3][128];
  const int r = blockIdx.x, b = blockIdx.y, tid = threadIdx.x, g = tid / 128, t = tid % 128, col = t * 4;
  const float* lse = part_lse + static_cast<long long>(b) * splits * ht + r;
  float mx = K3GEN_MLA_NEG_INF;
  for (int s = tid; s < splits; s += kCombineThreads) mx = fmaxf(mx, lse[static_cast<long long>(s) * ht]);
  mx = block_max<kCombineThreads>(mx, red);
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  float wsum = 0.f;
  if (mx != K3GEN_MLA_NEG_INF) {
    const float* po = part_o + (static_cast<long long>(b) * splits * ht + r) * kLat + col;
    // w = 0 for a split with no tiles; its partial row is written as zeros, so 0 * v is 0.
#pragma unroll 4
    for (int s = g; s < splits; s += 4) {
      const float w = exp2f(lse[static_cast<long long>(s) * ht] - mx);
      const float4 v = *reinterpret_cast<const float4*>(po + static_cast<long long>(s) * ht * kLat);
      acc.x += w * v.x; acc.y += w * v.y; acc.z += w * v.z; acc.w += w * v.w;
      wsum += w;
    }
  }
  if (g > 0) {
    part[g - 1][t] = acc;
    psum[g - 1][t] = wsum;
  }
  __syncthreads();
  if (g == 0) {
#pragma unroll
    for (int k = 0; k < 3; ++k) {
      const float4 a = part[k][t];
      acc.x += a.x; acc.y += a.y; acc.z += a.z; acc.w += a.w;
      wsum += psum[k][t];
    }
    const float inv = wsum > 0.f ? 1.f / wsum : 0.f;
    uint2 o2 = make_uint2(bf16x2(acc.x * inv, acc.y * inv), bf16x2(acc.z * inv, acc.w * inv));
    *reinterpret_cast<uint2*>(out + (static_cast<long long>(b) * ht + r) * kLat + col) = o2;
  }
}

}  // namespace mla
}  // namespace k3gen
