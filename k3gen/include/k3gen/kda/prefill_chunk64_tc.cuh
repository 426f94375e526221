// kda_prefill `chunk64_tc` (the SM100 family: sm_103a, sm_107a): chunk64 (prefill_chunk64.cuh: the
// algorithm, prep and emit, shared unchanged) with the sequential state pass on tcgen05. Variant
// "chunk64_tc" of k3gen/ops/kda_prefill/variants.py, whose plan mirrors the record and shared-memory
// layouts below; the index math and the arithmetic are replayed on the CPU against chunk64's by
// tests/nogpu/ops/test_kda_prefill_tcgen05.py. Compile + SASS + CPU replay only: never run on a GPU.
//
// Why the state pass: it is the one sequential chain (per (sequence, head), chunk after chunk), and
// S (128 x 128 FP32) fits TMEM exactly (128 lanes x 128 columns), so one CTA keeps S^T there for the
// whole sequence and the MMAs run at M = 128 (all state rows at once) instead of chunk64's 16-row
// mma.sync tiles per warp. Prep (parallel over chunks) keeps its mma.sync code: its MMAs are small
// (K = 128, 16- to 64-row tiles) beside its FP32 solve, and its 220 KB of shared memory leaves no room
// for operand images; it only writes the record in the layout this pass reads (RecTc).
//
// State pass: grid (H, B), 160 threads. S^T [v][k] in TMEM columns [0, 128): v = TMEM lane (M = 128,
// data path layout D: row r in lane r), k = column. Per chunk, with S_b = bf16(S^T) and V_b = bf16(V_new^T)
// in shared memory as SW128 K-major A operands, the record's BF16 tiles as B operands:
//   (1) MMA: D_V  = U^T + S_b (-W)^T          8 x m128n64k16 (the accumulator holds U^T, stored by the warps)
//            D_O  = S_b (e^G Q)^T             8 x m128n64k16 (D_O ping-pong [256, 320) / [320, 384))
//   (2) warps: V_b = bf16(D_V)
//   (3) MMA: D_O += V_b Aqk^T                4 x m128n64k16
//            S^T += V_b (K e^(G_C - G))       4 x m128n128k16 (S^T already times e^(G_C))
//   (4) warps: S_b = bf16(S^T), S^T *= e^(G_C) of the next chunk, its U^T into D_V; then the raw O of
//       this chunk out of D_O (under the next chunk's (1)); after the last chunk S^T to the pool.
// Rounding contract (identical to chunk64's chunk_step, so its tolerances hold): the state is FP32
// throughout and enters each chunk's MMAs as bf16_rn of the FP32 state (loaded state, or the state
// after the previous chunk); V_new is FP32 = U^T + sum(S_b W_b) (U^T the accumulator's start value)
// and enters its MMAs as bf16_rn once; O = sum(S_b Qg_b) + sum(V_b Aqk_b) in one FP32 accumulator;
// S^T <- fl(S^T * e^(G_C)) + sum(V_b Kg_b). FP32 sums inside the MMAs are the tensor core's on both.
// Warps 0-3: thread v = TMEM lane v (tcgen05.ld/st 32x32b; warp w reaches lanes 32 w ..). Warp 4: the
// TMEM allocation; its lane 0 issues the record copies (two buffers) and every MMA.
#pragma once

#include <cuda_bf16.h>

#include "k3gen/kda/prefill_chunk64.cuh"
#include "k3gen/common/sm100_tc.cuh"

#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM100_ALL) && !defined(__CUDA_ARCH_FEAT_SM103_ALL) && \
    !defined(__CUDA_ARCH_FEAT_SM107_ALL) && !defined(__CUDA_ARCH_FAMILY_SPECIFIC__)
#error "kda_prefill chunk64_tc needs an arch-specific sm_10xa target (tcgen05)"
#endif

namespace k3gen {
namespace kda {
namespace c64tc {

using c64::kC;

// ---- the record (spec.py C64TC_*): one chunk of one head, [J][H] in the workspace ------------------
// The MMA operands as the 128B-swizzled K-major images the descriptors read (SW128 blocks of [rows]
// [64 BF16], 8-row groups 1024 bytes apart), then the warps' FP32 parts.
constexpr unsigned kOffW = 0;                        // -W [64 t][128 k]: 2 blocks of [64][64]
constexpr unsigned kOffQg = kOffW + kC * kDim * 2;   // e^G Q [64 t][128 k]: 2 blocks
constexpr unsigned kOffKgt = kOffQg + kC * kDim * 2; // (K e^(G_C - G))^T [128 k][64 t]: 1 block of 128 rows
constexpr unsigned kOffAqk = kOffKgt + kDim * kC * 2;  // Aqk [64 t][64 s], zero above the diagonal: 1 block
constexpr unsigned kTiles = kOffAqk + kC * kC * 2;   // 57344: the MMA part (bulk copy 1)
constexpr unsigned kOffEgl = kTiles;                 // e^(G_C) FP32 [128]
constexpr unsigned kOffUt = kOffEgl + kDim * 4;      // U^T FP32 as float4 [16 t-quads][128 v] (thread v: conflict-free)
constexpr unsigned kRecBytes = kOffUt + kDim * kC * 4;  // 90624
constexpr unsigned kEuBytes = kRecBytes - kTiles;    // e^(G_C) and U^T (bulk copy 2)

// Byte of 16-byte chunk `ch` (8 BF16 along K) of row `row` in an operand of `rows` rows stored as SW128
// blocks of [rows][64]: block ch / 8, the row's 128 bytes in its 8-row group, chunk XOR row % 8.
__host__ __device__ constexpr unsigned sw128(int rows, int row, int ch) {
  return static_cast<unsigned>((ch >> 3) * rows * 128 + (row >> 3) * 1024 + (row & 7) * 128 +
                               (((ch & 7) ^ (row & 7)) << 4));
}
__host__ __device__ constexpr unsigned sw128_el(int rows, int row, int col) {
  return sw128(rows, row, col >> 3) + (col & 7) * 2;
}
// Where k16 step ks of an operand of `rows` rows starts: 4 steps (32 bytes each) per SW128 block.
__host__ __device__ constexpr unsigned kstep(int rows, int ks) { return (ks >> 2) * rows * 128 + (ks & 3) * 32; }
// U^T: the float4 of t = 4 r4 .. 4 r4 + 3 of row v (thread v reads 16 of them, a warp 512 contiguous bytes).
__host__ __device__ constexpr unsigned ut_off(int v, int r4) { return kOffUt + (r4 * kDim + v) * 16; }

// prep's layout policy (c64::RecPad's interface): the same values as chunk64's record, here.
struct RecTc {
  using Ptr = unsigned char*;
  static __device__ __forceinline__ unsigned char* at(const c64::Params& p, long long i) {
    return reinterpret_cast<unsigned char*>(p.rec) + i * kRecBytes;
  }
  static __device__ __forceinline__ void egl(Ptr r, int c, float v) { reinterpret_cast<float*>(r + kOffEgl)[c] = v; }
  static __device__ __forceinline__ void kgt8(Ptr r, int c, int r8, uint4 v) {
    *reinterpret_cast<uint4*>(r + kOffKgt + sw128(kDim, c, r8)) = v;
  }
  static __device__ __forceinline__ void qg(Ptr r, int t, int c, __nv_bfloat16 v) {
    *reinterpret_cast<__nv_bfloat16*>(r + kOffQg + sw128_el(kC, t, c)) = v;
  }
  static __device__ __forceinline__ void w(Ptr r, int t, int c, __nv_bfloat16 v) {
    *reinterpret_cast<__nv_bfloat16*>(r + kOffW + sw128_el(kC, t, c)) = v;
  }
  static __device__ __forceinline__ void ut4(Ptr r, int c, int r4, float4 v) {
    *reinterpret_cast<float4*>(r + ut_off(c, r4)) = v;
  }
  static __device__ __forceinline__ void aqk2(Ptr r, int t, int s, unsigned v) {  // s even: one chunk
    *reinterpret_cast<unsigned*>(r + kOffAqk + sw128_el(kC, t, s)) = v;
  }
};

// ---- shared memory (from the 1024-aligned base) and TMEM plan (variants.py tc_plan) ----------------
constexpr int kMathWarps = 4, kMathThreads = 32 * kMathWarps, kThreads = kMathThreads + 32;
constexpr unsigned kSmSb = 2 * kTiles;               // S_b [128 v][128 k]: 2 blocks of [128][64]
constexpr unsigned kSmVb = kSmSb + kDim * kDim * 2;  // V_b [128 v][64 t]: 1 block
constexpr unsigned kSmEu = kSmVb + kDim * kC * 2;    // e^(G_C) | U^T of buffer 0, then of buffer 1
constexpr unsigned kSmBar = kSmEu + 2 * kEuBytes;    // full[2], vo_full, vn_ready, s_full, s_ready
constexpr unsigned kSmTmem = kSmBar + 6 * 8;         // the allocated TMEM base
constexpr unsigned kSmEnd = kSmTmem + 16;
constexpr unsigned kSmem = kSmEnd + 1024;            // + the slack that aligns the window up to 1024
constexpr int kTmemCols = 512;                       // power of two >= the 384 used
constexpr unsigned kColS = 0, kColV = 128, kColO = 256;
static_assert(kTiles % 1024 == 0 && kSmSb % 1024 == 0 && kSmVb % 1024 == 0 && kSmEu % 16 == 0 && kRecBytes % 16 == 0,
              "SW128 images 1024-aligned, bulk copies 16-aligned");
static_assert(kSmem <= 227 * 1024, "opt-in shared memory per block");

// Row v's 32 values (K index 32 j ..) as BF16 (round to nearest even) into chunks 4 j .. 4 j + 3 of row
// v of a 128-row SW128 operand.
__device__ __forceinline__ void put_row_bf16(unsigned char* op, int v, int j, const float (&x)[32]) {
#pragma unroll
  for (int q = 0; q < 4; ++q)
    *reinterpret_cast<uint4*>(op + sw128(kDim, v, 4 * j + q)) =
        make_uint4(pack_bf16x2(x[8 * q], x[8 * q + 1]), pack_bf16x2(x[8 * q + 2], x[8 * q + 3]),
                   pack_bf16x2(x[8 * q + 4], x[8 * q + 5]), pack_bf16x2(x[8 * q + 6], x[8 * q + 7]));
}

// U^T row v of a buffer into D_V: the accumulator the next V_new MMAs start from.
__device__ __forceinline__ void put_ut(const unsigned char* eu, int v, unsigned lane_addr) {
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    float u[32];
#pragma unroll
    for (int q = 0; q < 8; ++q) {
      const float4 f = *reinterpret_cast<const float4*>(eu + ut_off(v, 8 * hf + q) - kTiles);
      u[4 * q] = f.x, u[4 * q + 1] = f.y, u[4 * q + 2] = f.z, u[4 * q + 3] = f.w;
    }
    sm100::st32(lane_addr + kColV + 32 * hf, u);
  }
}

// S_b = bf16(s) of columns 32 j .., then s * e^(G_C) back into TMEM (the next chunk's start).
__device__ __forceinline__ void rescale(unsigned char* smem, const float* egl, int v, int j, float (&s)[32],
                                        unsigned lane_addr) {
  put_row_bf16(smem + kSmSb, v, j, s);
#pragma unroll
  for (int q = 0; q < 8; ++q) {
    const float4 e = reinterpret_cast<const float4*>(egl)[8 * j + q];
    s[4 * q] *= e.x, s[4 * q + 1] *= e.y, s[4 * q + 2] *= e.z, s[4 * q + 3] *= e.w;
  }
  sm100::st32(lane_addr + kColS + 32 * j, s);
}

// The MMA issuer (one thread): the two steps of every chunk, and the record copies.
template <class Issue>
__device__ __forceinline__ void mma_loop(unsigned base, unsigned tmem, int nc, Issue&& issue) {
  const unsigned bar = base + kSmBar, full0 = bar, vo_full = bar + 16, vn_ready = bar + 24, s_full = bar + 32,
                 s_ready = bar + 40;
  constexpr unsigned kN64 = sm100::idesc<true, false, 128, 64>(), kN128 = sm100::idesc<true, false, 128, 128>();
#pragma unroll 1
  for (int c = 0; c < nc; ++c) {
    const int buf = c & 1;
    const unsigned tb = base + buf * kTiles, d_o = tmem + kColO + 64 * buf;
    sm90::mbar_wait(full0 + 8 * buf, (c >> 1) & 1);  // the record's tiles
    sm90::mbar_wait(s_ready, c & 1);                 // S_b, S^T scaled, U^T in D_V
    sm100::fence_after();
#pragma unroll
    for (int ks = 0; ks < kDim / 16; ++ks) {
      const unsigned long long a = sm100::desc<16, 1024>(base + kSmSb + kstep(kDim, ks));
      sm100::mma(tmem + kColV, a, sm100::desc<16, 1024>(tb + kOffW + kstep(kC, ks)), kN64, 1);
      sm100::mma(d_o, a, sm100::desc<16, 1024>(tb + kOffQg + kstep(kC, ks)), kN64, ks);
    }
    sm100::commit(vo_full);
    sm90::mbar_wait(vn_ready, c & 1);                // V_b
    sm100::fence_after();
#pragma unroll
    for (int ks = 0; ks < kC / 16; ++ks) {
      const unsigned long long a = sm100::desc<16, 1024>(base + kSmVb + kstep(kDim, ks));
      sm100::mma(d_o, a, sm100::desc<16, 1024>(tb + kOffAqk + kstep(kC, ks)), kN64, 1);
      sm100::mma(tmem + kColS, a, sm100::desc<16, 1024>(tb + kOffKgt + kstep(kDim, ks)), kN128, 1);
    }
    sm100::commit(s_full);
    if (c + 2 < nc) {
      // The buffer is free once these MMAs are done and the warps have read its FP32 part (before
      // s_ready of this chunk): refill it with chunk c + 2.
      sm90::mbar_wait(s_full, c & 1);
      sm90::fence_proxy_async();
      issue(buf, c + 2);
    }
  }
}

// The state pass of sequence blockIdx.y, head blockIdx.x (grid (H, B), kThreads threads).
template <class C>
__device__ __forceinline__ void state(const c64::Params& p, unsigned char* smem_raw) {
  constexpr int H = C::kHeads, D = H * kDim;
  const int h = blockIdx.x, b = blockIdx.y, tid = threadIdx.x, warp = tid >> 5;
  const long long tok0 = __ldg(p.cu_seqlens + b);
  const int len = __ldg(p.cu_seqlens + b + 1) - static_cast<int>(tok0);
  const int slot = __ldg(p.slots + b);
  if (slot < 0 || slot >= p.num_slots || len <= 0) return;  // uniform, before any barrier or allocation
  unsigned char* smem = smem_raw + ((1024u - (smem_addr(smem_raw) & 1023u)) & 1023u);
  const unsigned base = smem_addr(smem);
  const unsigned bar = base + kSmBar, full0 = bar, vo_full = bar + 16, vn_ready = bar + 24, s_full = bar + 32,
                 s_ready = bar + 40;
  const unsigned char* recs =
      reinterpret_cast<const unsigned char*>(p.rec) + (c64::item_base(p.cu_seqlens, b) * H + h) * kRecBytes;
  const int nc = (len + kC - 1) / kC;
  const bool resume = __ldg(p.resume + b) != 0;
  auto issue = [&](int buf, int c) {  // chunk c's record: the tiles, then e^(G_C) | U^T
    const unsigned char* r = recs + static_cast<long long>(c) * H * kRecBytes;
    sm90::mbar_arrive_expect_tx(full0 + 8 * buf, kRecBytes);
    sm90::bulk_load(base + buf * kTiles, r, kTiles, full0 + 8 * buf);
    sm90::bulk_load(base + kSmEu + buf * kEuBytes, r + kTiles, kEuBytes, full0 + 8 * buf);
  };
  if (tid == kMathThreads) {
    sm90::mbar_init(full0, 1);
    sm90::mbar_init(full0 + 8, 1);
    sm90::mbar_init(vo_full, 1);
    sm90::mbar_init(vn_ready, kMathThreads);
    sm90::mbar_init(s_full, 1);
    sm90::mbar_init(s_ready, kMathThreads);
    sm90::fence_proxy_async();  // the initialised barriers, to the bulk copies (async proxy)
    for (int c = 0; c < 2 && c < nc; ++c) issue(c, c);
  }
  if (warp == kMathWarps) sm100::tmem_alloc(base + kSmTmem, kTmemCols);
  sm100::fence_before();
  __syncthreads();
  sm100::fence_after();
  const unsigned tmem = *reinterpret_cast<volatile unsigned*>(smem + kSmTmem);
  if (warp == kMathWarps) {
    if (tid == kMathThreads) mma_loop(base, tmem, nc, issue);
  } else {
    const int v = tid;
    const unsigned lane_addr = tmem + (static_cast<unsigned>(32 * warp) << 16);
    constexpr long long kHead = kDim * kDim;
    const long long head = (static_cast<long long>(slot) * H + h) * kHead + static_cast<long long>(v) * kDim;
    // The starting state (the slot's, upcast exactly, or zero) -> S_b and S^T e^(G_C) of chunk 0.
    sm90::mbar_wait(full0, 0);
    const float* egl0 = reinterpret_cast<const float*>(smem + kSmEu);
#pragma unroll 1
    for (int j = 0; j < 4; ++j) {
      float s[32];
#pragma unroll
      for (int q = 0; q < 8; ++q) {
        float4 f = make_float4(0.f, 0.f, 0.f, 0.f);
        if (resume) {
          if constexpr (C::kBf16State) {
            const uint2 u = reinterpret_cast<const uint2*>(static_cast<const __nv_bfloat16*>(p.ssm) + head)[8 * j + q];
            f = make_float4(__uint_as_float(u.x << 16), __uint_as_float(u.x & 0xffff0000u),
                            __uint_as_float(u.y << 16), __uint_as_float(u.y & 0xffff0000u));
          } else {
            f = reinterpret_cast<const float4*>(static_cast<const float*>(p.ssm) + head)[8 * j + q];
          }
        }
        s[4 * q] = f.x, s[4 * q + 1] = f.y, s[4 * q + 2] = f.z, s[4 * q + 3] = f.w;
      }
      rescale(smem, egl0, v, j, s, lane_addr);
    }
    put_ut(smem + kSmEu, v, lane_addr);
    sm90::fence_proxy_async();  // S_b (generic stores) is read by the MMA (async proxy)
    sm100::fence_before();
    sm90::mbar_arrive(s_ready);
#pragma unroll 1
    for (int c = 0; c < nc; ++c) {
      sm90::mbar_wait(vo_full, c & 1);
      sm100::fence_after();
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        float x[32];
        sm100::ld32(lane_addr + kColV + 32 * hf, x);
        put_row_bf16(smem + kSmVb, v, hf, x);
      }
      sm90::fence_proxy_async();
      sm100::fence_before();
      sm90::mbar_arrive(vn_ready);
      sm90::mbar_wait(s_full, c & 1);
      sm100::fence_after();
      if (c + 1 < nc) {
        const int nb = (c + 1) & 1;
        sm90::mbar_wait(full0 + 8 * nb, ((c + 1) >> 1) & 1);
        const float* egl = reinterpret_cast<const float*>(smem + kSmEu + nb * kEuBytes);
#pragma unroll 1
        for (int j = 0; j < 4; ++j) {
          float s[32];
          sm100::ld32(lane_addr + kColS + 32 * j, s);
          rescale(smem, egl, v, j, s, lane_addr);
        }
        put_ut(smem + kSmEu + nb * kEuBytes, v, lane_addr);
        sm90::fence_proxy_async();
        sm100::fence_before();
        sm90::mbar_arrive(s_ready);
      } else {
        // The final state, row v: FP32, or BF16 rounded to nearest even (chunk64's store_state).
#pragma unroll 1
        for (int j = 0; j < 4; ++j) {
          float s[32];
          sm100::ld32(lane_addr + kColS + 32 * j, s);
#pragma unroll
          for (int q = 0; q < 8; ++q) {
            if constexpr (C::kBf16State)
              reinterpret_cast<uint2*>(static_cast<__nv_bfloat16*>(p.ssm) + head)[8 * j + q] =
                  make_uint2(pack_bf16x2(s[4 * q], s[4 * q + 1]), pack_bf16x2(s[4 * q + 2], s[4 * q + 3]));
            else
              reinterpret_cast<float4*>(static_cast<float*>(p.ssm) + head)[8 * j + q] =
                  make_float4(s[4 * q], s[4 * q + 1], s[4 * q + 2], s[4 * q + 3]);
          }
        }
      }
      // Raw O of chunk c (token rows t < n, column v: chunk64's addresses), from its D_O buffer,
      // which the MMAs of chunk c + 2 overwrite only after this thread's next s_ready arrival.
      const int n = len - c * kC < kC ? len - c * kC : kC;
      float* o = p.o + ((tok0 + static_cast<long long>(c) * kC) * H + h) * kDim + v;
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        float x[32];
        sm100::ld32(lane_addr + kColO + 64 * (c & 1) + 32 * hf, x);
#pragma unroll
        for (int i = 0; i < 32; ++i)
          if (32 * hf + i < n) o[static_cast<long long>(32 * hf + i) * H * kDim] = x[i];
      }
    }
    sm100::fence_before();
  }
  __syncthreads();
  if (warp == kMathWarps) {
    sm100::fence_after();
    sm100::tmem_dealloc(tmem, kTmemCols);
  }
  c64::conv_tail<D, kThreads>(p, slot, tok0, len, resume, h);
}

}  // namespace c64tc
}  // namespace kda
}  // namespace k3gen
