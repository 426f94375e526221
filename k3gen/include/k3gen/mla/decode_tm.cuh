// mla_decode on tcgen05 with the KV tokens on the MMA M side: variant "tcgen05_tm" of
// k3gen/ops/mla_decode/variants.py (TmKernel; TmGeo mirrors its plan). Contract:
// k3gen/ops/mla_decode/spec.py; index math, reduction order and an emulation of the tile loop are
// replayed on the CPU by tests/nogpu/ops/test_mla_decode_tcgen05_tm*.py; the design and its B300
// projection: docs/mla_decode_tcgen05.md, bench/cases/mla_decode_b300.py.
//
// Why not decode_tc.cuh's schedule: it puts 64 query rows on M, so at K3's H * T (12 .. 64 rows per
// CTA) most of M is padding, an M = 64 MMA is priced as an M = 128 one, and S is computed (and a
// FP8 / NVFP4 tile decoded) by both CTAs of a pair. Here one CTA owns R = 16 m_tiles <= 64 query rows
// and all 512 output dims: S^T and O^T are N = R wide, so O^T (4 R columns) fits TMEM beside S^T.
// Shared with the other kernels: Params, the page walk (tile_page), seq_len, the split schedule and
// the combine (decode.cuh); the TMA boxes, bulk copies, decoders (hardware E2M1, the HP-tail rows)
// and the Q staging rule (decode_tc.cuh); the tcgen05 layer (common/sm100_tc.cuh).
//
// Geometry: grid (groups, splits, B); CTA g owns query rows r0 = R g .. r0 + R - 1 of sequence b
// (row r = t * H + h; rows past H * T are padding: scores computed, never stored).
//   QK: S^T [64 tok][R] = K Q^T, M = 64 tokens (A: the operand tile, K-major, as TMA / the
//       decoders write it), N = R (B: Q K-major [R][576]), 36 x k16. TMEM layout F: token t in lane
//       32 (t / 16) + t % 16; ping-pong at columns [0, R) and [R, 2R).
//   PV: O^T [512][R] += V^T P^T, 4 blocks of M = 128 dims (A: V^T, the same tile read MN-major,
//       LBO = the 64-dim block stride), N = R, K = 64 tokens (4 x k16; B: P^T K-major [R][64 tok]
//       SW128). TMEM layout D: dim 128 mb + d in lane d, columns 2R + R mb .. 2R + R mb + R - 1.
// Warps: 0-3 softmax (lane t < 16 of warp w owns token 16 w + t with every query row as a column;
//   all 32 lanes own O^T lane 32 w + lane); 4 TMA / bulk producer (lane 0) and the TMEM allocator;
//   5 MMA issuer (lane 0); 6-9 decoders (FP8 / NVFP4, decode_tc.cuh's decode_tile, into a ring of
//   kOpStages operand tiles).
// Softmax, per tile (the rules of decode.cuh / decode_tc.cuh: log2 domain, P rounded once to the
//   operand type, the denominator sums the rounded values, a row with nothing visible keeps factor
//   1): per 16 columns, the column (query row) maxima over the tile's 64 tokens by a butterfly over
//   lanes xor 8, 4, 2, 1 that keeps half the columns per step (lane t ends with column 16 c + t),
//   then over the 4 warps in shared memory; thread j < R updates column j's m and alpha; the scores
//   are read from TMEM again for P (16 registers at a time: R = 64 would not fit twice). The
//   denominator is a partial per token slot and column (lp = lp alpha + p, kept in TMEM columns
//   [6R, 7R)) summed once at the end by the same butterfly, then warps ((0 + 1) + 2) + 3. O^T is
//   rescaled in TMEM only when some column's max moved. BF16 rows past the sequence end (the TMA box
//   copies them as stored) are zeroed by their owners before PV reads them.
#pragma once

#include "k3gen/mla/decode_tc.cuh"

namespace k3gen {
namespace mla {
namespace tm {

using tc::kBlk;
using tc::kTileBytes;
constexpr int kSoftmaxThreads = 128, kDecThreads = 128;
constexpr unsigned kSoftmaxBar = 1;   // named barrier of the 4 softmax warps (0 is __syncthreads)

__host__ __device__ constexpr int tmem_cols(int used) {
  return used <= 32 ? 32 : used <= 64 ? 64 : used <= 128 ? 128 : used <= 256 ? 256 : 512;
}

template <class C>
struct TmGeo {
  using Raw = tc::RawGeo<C>;
  static constexpr int kR = 16 * C::kMT;            // query rows per CTA = the MMAs' N
  static constexpr bool kDecode = Raw::kDecode;
  static constexpr int kThreads = kDecode ? 320 : 192;
  static constexpr int kOpStages = C::kOpStages;   // operand tiles the MMA reads (BF16: the TMA ring)
  static constexpr int kRawStages = kDecode ? C::kStages : 0;
  static constexpr int kRingStages = kDecode ? kRawStages : kOpStages;   // what the producer fills
  static constexpr int kQOff = kOpStages * kTileBytes;
  static constexpr int kPOff = kQOff + kR * kRow * 2;
  static constexpr int kRawOff = kPOff + kR * kTok * 2;
  static constexpr int kBarOff = kRawOff + kRawStages * Raw::kRawBytes;
  // full[ring], empty[ring], (decoded:) op_full[op], op_empty[op], s_full[2], p_full, o_done
  static constexpr int kNumBars = 2 * kRingStages + (kDecode ? 2 * kOpStages : 0) + 4;
  static constexpr int kTmemOff = kBarOff + 8 * kNumBars;
  static constexpr int kRedOff = kTmemOff + 16;      // [4 warps][kR] column maxima / sums
  static constexpr int kColOff = kRedOff + 4 * kR * 4;   // per column: m, then alpha (the epilogue: 1 / l)
  static constexpr int kEnd = kColOff + 2 * kR * 4;
  static constexpr int kSmem = kEnd + 1024;
  // TMEM columns: S^T ping-pong [0, 2R), O^T [2R, 6R), the denominator partials [6R, 7R) (per token
  // slot: in registers they would not fit beside the scores at R = 64 with 320 threads).
  static constexpr int kSCol = 0, kOCol = 2 * kR, kLCol = 6 * kR;
  static constexpr int kTmemCols = tmem_cols(7 * kR);
  static_assert(kR % 16 == 0 && kR >= 16 && kR <= 64, "N = R: the M = 128 step, O^T and S^T within 512 columns");
  static_assert(kDecode || kOpStages == C::kStages, "BF16: the TMA stages are the operand tiles");
  static_assert(kQOff % 1024 == 0 && kPOff % 1024 == 0 && kRawOff % 16 == 0, "SW128 atoms 1024-aligned");
};

using sm100::commit;
using sm100::desc;
using sm100::fence_after;
using sm100::fence_before;
using sm100::idesc;
using sm100::mma;

// S^T[64 tok][R] = K Q^T over the 576 dims: A = the tile's tokens, B = Q rows, both K-major.
template <bool kBf16, int R>
__device__ __forceinline__ void qk(unsigned d, unsigned aKV, unsigned aQ) {
  constexpr unsigned id = idesc<kBf16, false, kTok, R>();
#pragma unroll
  for (int ks = 0; ks < kRow / 16; ++ks)
    mma(d, desc<16, 1024>(aKV + (ks >> 2) * kBlk + (ks & 3) * 32),
        desc<16, 1024>(aQ + (ks >> 2) * R * 128 + (ks & 3) * 32), id, ks);
}
// O^T[512][R] += V^T P^T: block mb = dims 128 mb .. (tile blocks 2 mb, 2 mb + 1 read MN-major), 16-token
// K steps 2048 bytes apart; P^T K-major. acc0: the split's first tile (no partial sums in TMEM).
template <bool kBf16, int R>
__device__ __forceinline__ void pv(unsigned d, unsigned aKV, unsigned aP, bool acc0) {
  constexpr unsigned id = idesc<kBf16, false, 128, R, true>();
#pragma unroll
  for (int mb = 0; mb < kLat / 128; ++mb)
#pragma unroll
    for (int ks = 0; ks < kTok / 16; ++ks)
      mma(d + R * mb, desc<kBlk, 1024>(aKV + 2 * mb * kBlk + ks * 2048), desc<16, 1024>(aP + ks * 32), id,
          ks > 0 || !acc0);
}

// Butterfly over lanes xor 8, 4, 2, 1 (inside each 16-lane half) keeping half the columns per step:
// lane t of a half ends with op over the half's 16 lanes of column t of the 16 in v[0] (each step:
// own value op partner's). The CPU replays this order.
template <class Op>
__device__ __forceinline__ float half_reduce16(float (&v)[16], int lane, Op op) {
#pragma unroll
  for (int step = 0; step < 4; ++step) {
    const int o = 8 >> step, h = 8 >> step;
    const bool upper = (lane & o) != 0;
#pragma unroll
    for (int j = 0; j < h; ++j) {
      const float send = upper ? v[j] : v[h + j];
      const float keep = upper ? v[h + j] : v[j];
      v[j] = op(keep, __shfl_xor_sync(0xffffffffu, send, o));
    }
  }
  return v[0];
}

// 16 of this thread's scores (waited for and pinned by the caller), masked and scaled: token `pos` is
// visible to query row rb + j when pos <= len - T + t(rb + j), i.e. t >= d = pos - (len - T),
// t(r) = r / H (rows past H * T count as t = T - 1).
template <class C>
__device__ __forceinline__ void mask_scores(float (&x)[16], bool mine, int d, int rb, float qk_scale) {
  constexpr int HT = C::kHeads * C::kTokens;
  if (mine && d <= 0) {   // every query token sees pos (all but the split's last tile)
#pragma unroll
    for (int j = 0; j < 16; ++j) x[j] *= qk_scale;
  } else {
    // t(r) = min(r, HT - 1) / H, so t(rb + j) >= d  <=>  min(j, HT - 1 - rb) >= d H - rb (d > 0): no
    // per-column constant for the compiler to keep live across the tile loop.
    const int need = d * C::kHeads - rb, last = HT - 1 - rb;
#pragma unroll
    for (int j = 0; j < 16; ++j) x[j] = mine && min(j, last) >= need ? x[j] * qk_scale : K3GEN_MLA_NEG_INF;
  }
}

template <class C>
__device__ void decode(const Params& p, const sm90::TmaMap* kv_map) {
  using G = TmGeo<C>;
  using Raw = typename G::Raw;
  constexpr int R = G::kR, HT = C::kHeads * C::kTokens, RS = G::kRingStages, OS = G::kOpStages;
  constexpr bool kBf16 = C::kKv == Kv::kBf16, kF16 = !kBf16, kDecode = G::kDecode;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  const unsigned base = smem_u32(smem);
  const unsigned aQ = base + G::kQOff, aP = base + G::kPOff;
  const unsigned full0 = base + G::kBarOff, empty0 = full0 + 8 * RS, op_full0 = empty0 + 8 * RS,
                 op_empty0 = op_full0 + (kDecode ? 8 * OS : 0), s_full0 = op_empty0 + (kDecode ? 8 * OS : 0),
                 p_full = s_full0 + 16, o_done = p_full + 8;
  float* red = reinterpret_cast<float*>(smem + G::kRedOff);   // [4 warps][R]
  float* col_m = reinterpret_cast<float*>(smem + G::kColOff);
  float* col_a = col_m + R;    // this tile's alpha per column; after the last tile, the output factor
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = blockIdx.x, split = blockIdx.y, b = blockIdx.z;
  const int r0 = g * R;
  const int len = seq_len<C>(p, b);
  const int ntiles = (len + kTok - 1) / kTok;
  const int per = (ntiles + p.splits - 1) / p.splits;
  const int t_begin = min(ntiles, split * per), n = min(ntiles, t_begin + per) - t_begin;

  if (tid == 0) {
    for (int s = 0; s < RS; ++s) {
      sm90::mbar_init(full0 + 8 * s, 1);
      sm90::mbar_init(empty0 + 8 * s, kDecode ? kDecThreads : 1);
    }
    if constexpr (kDecode) {
      for (int s = 0; s < OS; ++s) {
        sm90::mbar_init(op_full0 + 8 * s, kDecThreads);
        sm90::mbar_init(op_empty0 + 8 * s, 1);
      }
    }
    sm90::mbar_init(s_full0, 1);
    sm90::mbar_init(s_full0 + 8, 1);
    sm90::mbar_init(p_full, kSoftmaxThreads);
    sm90::mbar_init(o_done, 1);
    sm90::fence_mbar_init();
  }
  if (warp == 4) sm100::tmem_alloc(base + G::kTmemOff, G::kTmemCols);
  const float qmul = tc::stage_q<C, G::kThreads, R>(p, b, r0, smem + G::kQOff, red);
  if (tid < R) col_m[tid] = K3GEN_MLA_NEG_INF;
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
        if constexpr (kBf16) tc::issue_bf16<C>(p, b, t_begin + it, base + s * kTileBytes, full0 + 8 * s, kv_map);
        else tc::issue_raw<C>(p, b, t_begin + it, base + G::kRawOff + s * Raw::kRawBytes, full0 + 8 * s);
      }
    }
  } else if (warp == 5) {
    if (lane == 0) {
      auto issue_qk = [&](int it) {
        const int s = it % OS;
        sm90::mbar_wait_asm((kBf16 ? full0 : op_full0) + 8 * s, (it / OS) & 1);
        fence_after();
        qk<kBf16, R>(tmem + G::kSCol + R * (it & 1), base + s * kTileBytes, aQ);
        commit(s_full0 + 8 * (it & 1));
      };
      // Two or more operand tiles: QK of the next tile runs under this tile's softmax.
      constexpr bool kAhead = OS >= 2;
      if (kAhead && n > 0) issue_qk(0);
      for (int it = 0; it < n; ++it) {
        if (kAhead) {
          if (it + 1 < n) issue_qk(it + 1);
        } else {
          issue_qk(it);
        }
        sm90::mbar_wait_asm(p_full, it & 1);
        fence_after();
        pv<kBf16, R>(tmem + G::kOCol, base + (it % OS) * kTileBytes, aP, it == 0);
        commit(o_done);
        commit((kBf16 ? empty0 : op_empty0) + 8 * (it % OS));
      }
    }
  } else if (warp >= 6) {
    const int dt = tid - 192;
    for (int it = 0; it < n; ++it) {
      const int s = it % RS, os = it % OS;
      sm90::mbar_wait_asm(full0 + 8 * s, (it / RS) & 1);
      if (it >= OS) sm90::mbar_wait_asm(op_empty0 + 8 * os, (it / OS - 1) & 1);
      tc::decode_tile<C>(p, b, t_begin + it, len, smem + G::kRawOff + s * Raw::kRawBytes, smem + os * kTileBytes, dt);
      sm90::fence_proxy_async();   // generic stores read by the MMA
      sm90::mbar_arrive(empty0 + 8 * s);
      sm90::mbar_arrive(op_full0 + 8 * os);
    }
  } else {
    const bool mine = lane < 16;
    const int tok = 16 * warp + (lane & 15);   // the tile token this lane's scores belong to
    float qk_scale = C::kSoftmaxScale * kLog2e * qmul;
    if constexpr (C::kKv == Kv::kFp8 && C::kFp8PerTensor) qk_scale *= p.scale;
    if constexpr (C::kKv == Kv::kNvfp4) qk_scale = __fdiv_rn(qk_scale, p.scale);
    const unsigned lane_addr = tmem + (static_cast<unsigned>(32 * warp) << 16);
    // P^T row j (query row r0 + j), this token's 2 bytes: SW128 K-major [R][64 tok].
    unsigned char* pcol = smem + G::kPOff + (tok & 7) * 2;
    auto max_op = [](float a, float c) { return fmaxf(a, c); };
    auto add_op = [](float a, float c) { return a + c; };
    for (int it = 0; it < n; ++it) {
      const int d = (t_begin + it) * kTok + tok - (len - C::kTokens);
      const unsigned sbuf = lane_addr + G::kSCol + R * (it & 1);
      sm90::mbar_wait_asm(s_full0 + 8 * (it & 1), (it >> 1) & 1);
      fence_after();
      // Column maxima, 16 columns at a time (the butterfly consumes the scores: read again below).
#pragma unroll
      for (int c = 0; c < R / 16; ++c) {
        __syncwarp();   // the lanes that stored P / red rejoin before the aligned TMEM load
        float x[16];
        sm100::ld16_async(sbuf + 16 * c, x);
        sm100::wait_ld();
        sm100::pin(x);   // every use of the scores stays below the wait
        mask_scores<C>(x, mine, d, r0 + 16 * c, qk_scale);
        const float mx = half_reduce16(x, lane, max_op);
        if (mine) red[warp * R + 16 * c + lane] = mx;
      }
      sm90::barrier_sync_divergent(kSoftmaxBar, kSoftmaxThreads);
      if (tid < R) {
        const float tmax = fmaxf(fmaxf(red[tid], red[R + tid]), fmaxf(red[2 * R + tid], red[3 * R + tid]));
        const float m_old = col_m[tid], m_new = fmaxf(m_old, tmax);
        col_a[tid] = m_new == K3GEN_MLA_NEG_INF ? 1.f : exp2f(m_old - m_new);
        col_m[tid] = m_new;
      }
      sm90::barrier_sync_divergent(kSoftmaxBar, kSoftmaxThreads);
      bool moved = false;   // uniform: every thread reads the same alphas
#pragma unroll
      for (int j = 0; j < R; ++j) moved |= col_a[j] != 1.f;
      if (it > 0) {
        sm90::mbar_wait_asm(o_done, (it - 1) & 1);   // PV of the previous tile retired: O and P are free
        fence_after();
        if (moved) {
          __syncwarp();
          // 16 columns' alphas at a time, over the 4 dim blocks (all R alphas live would cost R registers).
#pragma unroll 1
          for (int c = 0; c < R / 16; ++c) {
            float a[16];
#pragma unroll
            for (int j = 0; j < 16; ++j) a[j] = col_a[16 * c + j];
#pragma unroll
            for (int mb = 0; mb < kLat / 128; ++mb) {
              float o[16];
              const unsigned ta = lane_addr + G::kOCol + R * mb + 16 * c;
              sm100::ld16_async(ta, o);
              sm100::wait_ld();
              sm100::pin(o);
#pragma unroll
              for (int j = 0; j < 16; ++j) o[j] *= a[j];
              sm100::st16(ta, o);
            }
          }
        }
      }
      // P^T (rounded once) and this token slot's denominator partials lp (TMEM), 16 columns at a time.
#pragma unroll
      for (int c = 0; c < R / 16; ++c) {
        __syncwarp();
        float x[16], lp[16];
        sm100::ld16_async(sbuf + 16 * c, x);
        sm100::ld16_async(lane_addr + G::kLCol + 16 * c, lp);   // unused at it = 0 (nothing stored yet)
        sm100::wait_ld();
        sm100::pin(x);   // every use of the scores and partials stays below the wait
        sm100::pin(lp);
        mask_scores<C>(x, mine, d, r0 + 16 * c, qk_scale);
#pragma unroll
        for (int j = 0; j < 16; ++j) {
          const int col = 16 * c + j;
          const float m = col_m[col];
          const float msub = m == K3GEN_MLA_NEG_INF ? 0.f : m;   // a column with nothing visible: p = 0
          const unsigned w = tc::pack2(exp2f(x[j] - msub), 0.f, kF16);
          const float pr = tc::unpack2(w, kF16).x;   // the denominator sums what the MMA sums
          lp[j] = it > 0 ? lp[j] * col_a[col] + pr : pr;
          if (mine)
            *reinterpret_cast<unsigned short*>(pcol + (col >> 3) * 1024 + (col & 7) * 128 +
                                               (((tok >> 3) ^ (col & 7)) << 4)) = static_cast<unsigned short>(w);
        }
        __syncwarp();   // after the owners' P stores: tcgen05.st is aligned
        sm100::st16(lane_addr + G::kLCol + 16 * c, lp);
      }
      if constexpr (kBf16) {
        // The TMA box copies the page rows past the sequence end as they are (stale, maybe NaN):
        // 0 * NaN would poison O, so the owner of such a token zeroes its V row before PV reads
        // it (QK of this tile has completed; the decoders write zeros for FP8 / NVFP4).
        if (mine && d > C::kTokens - 1) {
          unsigned char* op = smem + (it % OS) * kTileBytes;
#pragma unroll 4
          for (int c = 0; c < kLat / 8; ++c)
            *reinterpret_cast<uint4*>(op + tc::sw_off(tok, c)) = make_uint4(0, 0, 0, 0);
        }
      }
      sm90::fence_proxy_async();   // P and zeroed rows (generic stores) are read by the MMA
      fence_before();
      sm90::mbar_arrive(p_full);
    }
    // Epilogue: l per column, then O^T / l (0 for a column with nothing visible); one split writes
    // BF16 rows, several FP32 partials and the log-sum-exp.
    sm90::barrier_sync_divergent(kSoftmaxBar, kSoftmaxThreads);   // every thread past its last red / col read
#pragma unroll
    for (int c = 0; c < R / 16; ++c) {
      float v[16];
      __syncwarp();
      if (n > 0) {
        sm100::ld16_async(lane_addr + G::kLCol + 16 * c, v);
        sm100::wait_ld();
        sm100::pin(v);
      } else {
#pragma unroll
        for (int j = 0; j < 16; ++j) v[j] = 0.f;
      }
      const float sum = half_reduce16(v, lane, add_op);
      if (mine) red[warp * R + 16 * c + lane] = sum;
    }
    sm90::barrier_sync_divergent(kSoftmaxBar, kSoftmaxThreads);
    if (tid < R) {
      const float l = ((red[tid] + red[R + tid]) + red[2 * R + tid]) + red[3 * R + tid];
      float w = l > 0.f ? 1.f / l : 0.f;
      if constexpr (C::kKv == Kv::kFp8 && C::kFp8PerTensor) w *= p.scale;
      if constexpr (C::kKv == Kv::kNvfp4) w = __fdiv_rn(w, p.scale);   // the output is in units of 1/G
      col_a[tid] = w;
      if (p.splits > 1 && r0 + tid < HT)
        p.part_lse[(static_cast<long long>(b) * p.splits + split) * HT + r0 + tid] =
            l > 0.f ? col_m[tid] + log2f(l) : K3GEN_MLA_NEG_INF;
    }
    sm90::barrier_sync_divergent(kSoftmaxBar, kSoftmaxThreads);
    if (n > 0) {
      sm90::mbar_wait_asm(o_done, (n - 1) & 1);
      fence_after();
    }
    const long long row0 = p.splits == 1 ? static_cast<long long>(b) * HT + r0
                                         : (static_cast<long long>(b) * p.splits + split) * HT + r0;
    const int rows = min(R, HT - r0);   // this CTA's real query rows
#pragma unroll 1
    for (int mb = 0; mb < kLat / 128; ++mb) {
      const int dim = 128 * mb + 32 * warp + lane;   // O^T lane 32 w + lane of block mb
#pragma unroll 1
      for (int c = 0; c < R / 16; ++c) {
        float o[16];
        __syncwarp();
        if (n > 0) {
          sm100::ld16_async(lane_addr + G::kOCol + R * mb + 16 * c, o);
          sm100::wait_ld();
          sm100::pin(o);
        }
        __nv_bfloat16* ob = p.out + (row0 + 16 * c) * kLat + dim;
        float* pb = p.part_o + (row0 + 16 * c) * kLat + dim;
#pragma unroll
        for (int j = 0; j < 16; ++j) {
          if (16 * c + j >= rows) break;
          const float v = n > 0 ? o[j] * col_a[16 * c + j] : 0.f;
          if (p.splits == 1) ob[j * kLat] = __float2bfloat16_rn(v);
          else pb[j * kLat] = v;
        }
      }
    }
    fence_before();
  }
  // Lane 0 of the producer / MMA warps ran its loop alone: every lane rejoins its warp before the
  // aligned barrier (and before warp 4's aligned dealloc).
  __syncwarp();
  __syncthreads();
  if (warp == 4) {
    fence_after();
    sm100::tmem_dealloc(tmem, G::kTmemCols);
  }
}

}  // namespace tm
}  // namespace mla
}  // namespace k3gen
