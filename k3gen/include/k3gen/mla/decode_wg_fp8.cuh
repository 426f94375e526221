// mla_decode, wgmma over FP8 E4M3 KV (sm_90a): variant "wgmma", kv fp8. Contract:
// k3gen/ops/mla_decode/spec.py; shared-memory plan: WgKernel in k3gen/ops/mla_decode/variants.py
// (Geo8 mirrors it); lane maps checked on the CPU by tests/nogpu/test_mla_decode_wg8.py (the PV
// product replayed through them on random bytes).
//
// The frame (shared with decode_wg_nvfp4.cuh, helpers in decode_wg.cuh): a cp.async producer
// warpgroup, two consumer warpgroups on alternate tiles (each its own online softmax, merged at the
// end, so one's softmax runs under the other's MMAs), 16 query rows per CTA, the 64 tokens of a tile
// on the wgmma M side. E4M3 wgmma multiplies E4M3 by E4M3 only and reads shared operands K-major
// only, so:
//   - The query enters as hi = e4m3(q 2^E) and lo = e4m3(q 2^E - hi), E putting max |q| in
//     [128, 256): a BF16 value's 8 significant bits split 4 + 4, so hi + lo is the BF16 query
//     exactly wherever lo is a normal E4M3 (|q| >= 2^-10 max |q|). QK: S^T = K_tile [Q_hi; Q_lo]^T,
//     18 m64n32k32 with both operands in shared memory (columns 16.. are the lo halves, added to
//     columns 0..15 in registers), one FP32 accumulator per 128-dim scale group; score =
//     sum_g s[tok][g] acc_g.
//   - PV contracts over tokens, but tile rows are tokens (dims contiguous), and K-major A = V^T
//     would need tokens contiguous. The consumer builds V^T's register fragments itself (4-byte
//     loads of 4 dims x 4 tokens, a 4 x 4 byte transpose by prmt) and issues register-A wgmma
//     against B = P^T, P = p s[tok][g] 2^(8 - F) as E4M3 hi + lo, one 128-byte row per query
//     column (k 0..63 hi, 64..127 lo): O^T += V^T P_hi^T + V^T P_lo^T. F, a power of two >= every
//     latent scale seen so far (it only grows), keeps P inside E4M3's range; the running output is
//     in units of 2^(F - 8) and is rescaled exactly when F grows.
// Index permutations (free where both operands agree):
//   PV's k: k = 16 w + 2 i + e holds token 16 w + i + 8 e, so the two tokens a softmax thread
//     owns (accumulator rows tk0 and tk0 + 8) are one 16-bit store per column;
//   PV's M: block mb, row 16 w + g + 8 h holds dim 128 (mb / 2) + 4 (8 w + g) + 2 (mb % 2) + h, so
//     each block stays inside one scale group (one B per instruction) and a thread's 4 dims of one
//     group and token are one 4-byte load.
#pragma once

#include "k3gen/mla/decode_wg.cuh"

namespace k3gen {
namespace mla {
namespace wg8 {

constexpr int kThreads = 384;
constexpr int kN = 16;                          // query rows per CTA = wgmma N
constexpr int kBlocks = 5;                      // a 576-byte code row = 4.5 SW128 rows of 128 bytes
constexpr int kCodeBytes = kBlocks * wg::kBlk;  // 40960 per stage
constexpr int kScaleBytes = kTok * 5 * 4;       // the page's [64][5] FP32 scales, as stored
constexpr int kPGroups = 4;                     // latent scale groups (PV)
constexpr int kPBytes = kN * 128;               // one group's P tile: [16 cols][hi 64 | lo 64]
constexpr int kRedStride = kN + 4;              // red row: column maxima, then the warp's scale max
using wg::kConsumerRegs;                        // the warp-specialized split of decode_wg.cuh
using wg::kProducerRegs;

template <class C>
struct Geo8 {
  static constexpr int S = C::kStages;
  static constexpr int HT = C::kHeads * C::kTokens;
  static constexpr int kScaleOff = S * kCodeBytes;
  static constexpr int kQOff = (kScaleOff + S * kScaleBytes + 1023) / 1024 * 1024;
  static constexpr int kPOff = kQOff + kBlocks * 2 * kN * 128;   // Q: [hi 16 | lo 16 rows][576]
  static constexpr int kRedOff = kPOff + 2 * kPGroups * kPBytes;
  static constexpr int kStatsOff = kRedOff + 2 * 4 * kRedStride * 4;
  static constexpr int kBarOff = kStatsOff + 2 * 2 * kN * 4;
  static constexpr int kEnd = kBarOff + 2 * S * 8 + 2 * 8;   // + the consumers' two handoffs
  static constexpr int kSmem = kEnd + 1024;
  static_assert(2 * kN * wg::kOStride * 4 <= S * kCodeBytes, "the merge buffer reuses the stages");
};

// hi | lo << 16: E4M3 pairs of (x0, x1) (x0 in the low byte) and of the residuals x - hi.
__device__ __forceinline__ unsigned split2(float x0, float x1) {
  const unsigned h = e4m3x2(x0, x1);
  unsigned hh;
  asm("{\n\t.reg .b16 t;\n\tcvt.u16.u32 t, %1;\n\tcvt.rn.f16x2.e4m3x2 %0, t;\n\t}" : "=r"(hh) : "r"(h));
  const float2 b = __half22float2(*reinterpret_cast<const __half2*>(&hh));
  return h | (e4m3x2(x0 - b.x, x1 - b.y) << 16);
}

// As split2 for probabilities, in f16x2 arithmetic (x <= 256: f16's 11 bits hold hi + lo, whose
// 4 + 4 significant bits are all the E4M3 pair keeps).
__device__ __forceinline__ unsigned split2h(float x0, float x1) {
  const __half2 x = __floats2half2_rn(x0, x1);
  unsigned h, hb, l;
  asm("{\n\t.reg .b16 t;\n\tcvt.rn.satfinite.e4m3x2.f16x2 t, %1;\n\tcvt.u32.u16 %0, t;\n\t}"
      : "=r"(h) : "r"(*reinterpret_cast<const unsigned*>(&x)));
  asm("{\n\t.reg .b16 t;\n\tcvt.u16.u32 t, %1;\n\tcvt.rn.f16x2.e4m3x2 %0, t;\n\t}" : "=r"(hb) : "r"(h));
  const __half2 r = __hsub2(x, *reinterpret_cast<const __half2*>(&hb));
  asm("{\n\t.reg .b16 t;\n\tcvt.rn.satfinite.e4m3x2.f16x2 t, %1;\n\tcvt.u32.u16 %0, t;\n\t}"
      : "=r"(l) : "r"(*reinterpret_cast<const unsigned*>(&r)));
  return h | (l << 16);
}

// Q rows r0 .. r0 + 15 of sequence b as E4M3: hi in rows 0..15, lo in rows 16..31 of one SW128
// K-major [32][576] operand (5 blocks; zero past H*T). scratch: 12 floats. Returns 2^-E. Contains a barrier (all threads call it).
template <class C>
__device__ float stage_q(const Params& p, int b, int r0, unsigned char* sq, float* scratch) {
  constexpr int HT = Geo8<C>::HT;
  const int tid = threadIdx.x;
  const uint4* qg = reinterpret_cast<const uint4*>(p.q) + (static_cast<long long>(b) * HT + r0) * kChunks;
  const float mx = wg::q_amax16<kThreads>(qg, r0, HT, scratch);
  int e = mx > 0.f ? 7 - ((__float_as_int(mx) >> 23) - 127) : 0;
  e = min(max(e, -100), 100);
  const float f = f8::pow2(e);
  for (int i = tid; i < kN * (kRow / 16); i += kThreads) {
    const int r = i / (kRow / 16), c = i - r * (kRow / 16);
    uint4 hi = make_uint4(0, 0, 0, 0), lo = hi;
    if (r0 + r < HT) {
      float x[16];
      bf16x8_to_float(qg[r * kChunks + 2 * c], x);
      bf16x8_to_float(qg[r * kChunks + 2 * c + 1], x + 8);
      unsigned hw[4], lw[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const unsigned a = split2(x[4 * k] * f, x[4 * k + 1] * f), d = split2(x[4 * k + 2] * f, x[4 * k + 3] * f);
        hw[k] = (a & 0xffffu) | (d << 16);
        lw[k] = (a >> 16) | (d & 0xffff0000u);
      }
      hi = make_uint4(hw[0], hw[1], hw[2], hw[3]);
      lo = make_uint4(lw[0], lw[1], lw[2], lw[3]);
    }
    *reinterpret_cast<uint4*>(sq + wg::sw_off(2 * kN, r, c)) = hi;
    *reinterpret_cast<uint4*>(sq + wg::sw_off(2 * kN, kN + r, c)) = lo;
  }
  return f8::pow2(-e);
}

// One tile's codes (SW128 K-major, 5 blocks; rows nv.. zero-filled) and scales (FP32 [64][5] as
// stored; the bytes of rows nv.. zero-filled) into stage buffers. row0: the tile's first row in
// the page pool (a valid page even when the tile's page is missing: nv = 0 then). A thread copies
// latent chunk wt % 32 of rows wt / 32 + 4 k and rope chunk wt % 4 of rows wt / 4 (+ 32): with the
// row steps fixed, every address is a per-thread base plus a constant.
template <class C>
__device__ __forceinline__ void load_tile(const Params& p, long long row0, int nv, unsigned dst, unsigned sdst,
                                          int wt) {
  const unsigned char* codes = static_cast<const unsigned char*>(p.c[0]) + row0 * kRow;
  {
    const int t0 = wt >> 5, c = wt & 31;
    const unsigned char* src = codes + t0 * kRow + c * 16;
    const unsigned d0 = dst + (c >> 3) * wg::kBlk + t0 * 128 + (((c & 7) ^ t0) << 4);
    const unsigned d1 = dst + (c >> 3) * wg::kBlk + (t0 + 4) * 128 + (((c & 7) ^ (t0 + 4)) << 4);
#pragma unroll
    for (int k = 0; k < kTok / 4; ++k) {
      const bool ok = t0 + 4 * k < nv;
      cp_async16(((k & 1) ? d1 : d0) + (k >> 1) * 1024, ok ? src + k * 4 * kRow : src, ok ? 16u : 0u);
    }
  }
  {
    const int t = wt >> 2, c = wt & 3;
    const unsigned char* src = codes + t * kRow + kLat + c * 16;
    const unsigned d = dst + 4 * wg::kBlk + (t >> 3) * 1024 + (t & 7) * 128 + ((c ^ (t & 7)) << 4);
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const bool ok = t + 32 * k < nv;
      cp_async16(d + k * 4096, ok ? src + k * 32 * kRow : src, ok ? 16u : 0u);
    }
  }
  if constexpr (!C::kFp8PerTensor) {
    if (wt < kScaleBytes / 16) {
      const unsigned char* sc = static_cast<const unsigned char*>(p.c[1]) + row0 * 20 + wt * 16;
      const int valid = min(max(nv * 20 - wt * 16, 0), 16);
      cp_async16(sdst + wt * 16, sc, static_cast<unsigned>(valid));
    }
  }
}


template <class C>
__device__ void decode(const Params& p) {
  using G = Geo8<C>;
  constexpr int S = G::S, N = kN, HT = G::HT, NJ = N / 8, NA = N / 2;
  constexpr bool kTensor = C::kFp8PerTensor;
  constexpr int NG = kTensor ? 1 : 5;          // QK accumulators (scale groups)
  using MmaQK = sm90::WgmmaE4m3<2 * N>;   // B = [Q_hi; Q_lo]: columns 16.. are the lo halves
  using MmaPV = sm90::WgmmaE4m3RegA<N>;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  const unsigned base = smem_u32(smem);
  const unsigned aQ = base + G::kQOff;
  float* red = reinterpret_cast<float*>(smem + G::kRedOff);      // [consumer][warp][kRedStride]
  float* stats = reinterpret_cast<float*>(smem + G::kStatsOff);  // [consumer][m, l][N]
  const unsigned bar = base + G::kBarOff;                        // full[S], empty[S], hand[2]
  const unsigned hand = bar + 16 * S;

  const int tid = threadIdx.x, wgi = tid / 128, wt = tid % 128, warp = wt / 32, lane = tid % 32;
  const int split = blockIdx.y, b = blockIdx.z;
  const int r0 = blockIdx.x * N;
  const int len = seq_len<C>(p, b);
  const int ntiles = (len + kTok - 1) / kTok;
  const int per = (ntiles + p.splits - 1) / p.splits;
  const int t_begin = min(ntiles, split * per), t_end = min(ntiles, t_begin + per);
  const int n = t_end - t_begin;

  if (tid == 0) {
    sm90::mbar_init(hand, 256);
    sm90::mbar_init(hand + 8, 256);
    sm90::mbar_init_ring(bar, bar + 8 * S, S, 128, 128);
  }
  const float qmul = stage_q<C>(p, b, r0, smem + G::kQOff, red);
  sm90::fence_proxy_async();   // Q (generic stores) is read by wgmma (async proxy)
  __syncthreads();

  if (wgi == 0) {
    sm90::setmaxnreg_dec<kProducerRegs>();
    wg::produce<C, S>(p, b, t_begin, n, len, bar, [&](int s, int, long long row0, int nv) {
      load_tile<C>(p, row0, nv, base + s * kCodeBytes, base + G::kScaleOff + s * kScaleBytes, wt);
    });
    return;   // the consumers synchronize among themselves (named barriers) from here on
  }

  sm90::setmaxnreg_inc<kConsumerRegs>();
  // The consumer index as a compile-time constant (one instantiation per consumer): the stage, Q
  // and P addresses, hence every wgmma descriptor, then depend only on uniform values and stay in
  // uniform registers (as a thread-derived value each descriptor cost an R2UR before its wgmma).
  auto consumer = [&](auto cc) {
  constexpr int c = decltype(cc)::value;
  const unsigned aP = base + G::kPOff + c * kPGroups * kPBytes;
  unsigned char* sP = smem + G::kPOff + c * kPGroups * kPBytes;
  float o[8][NA];
  float m[NJ][2], l[NJ][2];
  int lim[NJ][2];
  wg::init_state<C, N, NA, HT>(o, m, l, lim, r0, len, lane, [](int x) { return x; });
  const float qk_scale = C::kSoftmaxScale * kLog2e * qmul * (kTensor ? p.scale : 1.f);
  const int g8 = lane >> 2, cq = lane & 3;
  const int tk0 = 16 * warp + g8;
  int fexp = kTensor ? 0 : -126;   // the running output is in units of 2^(fexp - 8)
  float* rd = red + c * 4 * kRedStride;

  for (int it = c; it < n; it += 2) {
    const int s = it % S;
    const int tile = t_begin + it;
    const unsigned aKV = base + s * kCodeBytes;
    const float* ssc = reinterpret_cast<const float*>(smem + G::kScaleOff + s * kScaleBytes);
    sm90::mbar_wait(bar + 8 * s, (it / S) & 1);
    sm90::fence_proxy_async();   // the stage was written by cp.async (generic proxy)

    float acc[NG][2 * NA];
#pragma unroll
    for (int g = 0; g < NG; ++g)
#pragma unroll
      for (int i = 0; i < 2 * NA; ++i) acc[g][i] = 0.f;
    sm90::wgmma_fence();
    const unsigned kv_lo = wg::desc_lo(aKV), q_lo = wg::desc_lo(aQ);
#pragma unroll
    for (int ks = 0; ks < kRow / 32; ++ks) {
      MmaQK::mma(acc[kTensor ? 0 : ks >> 2], wg::desc(kv_lo + ((ks >> 2) * wg::kBlk + (ks & 3) * 32) / 16),
                 wg::desc(q_lo + ((ks >> 2) * 2 * N * 128 + (ks & 3) * 32) / 16), 1);
    }
    sm90::wgmma_commit();
    sm90::wgmma_wait<0>();
#pragma unroll
    for (int g = 0; g < NG; ++g)
#pragma unroll
      for (int i = 0; i < 2 * NA; ++i) sm90::fence_operand(acc[g][i]);

    // Scales of this thread's tokens tk0, tk0 + 8 (zero for missing tokens: zero-filled).
    float s0[NG], s1[NG];
    float smax = 0.f;
    if constexpr (kTensor) {
      s0[0] = s1[0] = 1.f;
    } else {
#pragma unroll
      for (int g = 0; g < NG; ++g) {
        s0[g] = ssc[tk0 * 5 + g];
        s1[g] = ssc[(tk0 + 8) * 5 + g];
        if (g < kPGroups) smax = fmaxf(smax, fmaxf(s0[g], s1[g]));
      }
      smax = fmaxf(smax, __shfl_xor_sync(0xffffffffu, smax, 4));
      smax = fmaxf(smax, __shfl_xor_sync(0xffffffffu, smax, 8));
      smax = fmaxf(smax, __shfl_xor_sync(0xffffffffu, smax, 16));
    }
    float sc[NA];
#pragma unroll
    for (int i = 0; i < NA; ++i) {
      float v = 0.f;
#pragma unroll
      for (int g = 0; g < NG; ++g) v = fmaf(acc[g][i] + acc[g][i + NA], (i & 2) ? s1[g] : s0[g], v);
      sc[i] = v;
    }

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
        mx[j][e] = wg::col_max8(fmaxf(v0, v1));
      }
    // One buffer: every warp reads it before the P barrier below, and rewrites it only after.
    if (lane < 4) {
#pragma unroll
      for (int j = 0; j < NJ; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) rd[warp * kRedStride + 8 * j + 2 * lane + e] = mx[j][e];
    }
    if (lane == 0) rd[warp * kRedStride + N] = smax;
    sm90::barrier_sync_divergent(1 + c, 128);
    float resc = 1.f, winv = 256.f;
    if constexpr (!kTensor) {
      const float tmx = fmaxf(fmaxf(rd[N], rd[kRedStride + N]), fmaxf(rd[2 * kRedStride + N], rd[3 * kRedStride + N]));
      // 2^f >= every latent scale so far; f only grows, so resc <= 1 never overflows.
      const int f = max(fexp, min(((__float_as_int(tmx) + 0x7fffff) >> 23) - 127, 100));
      resc = f8::pow2(max(fexp - f, -126));
      fexp = f;
      winv = f8::pow2(min(8 - f, 126));
    }
    // The probabilities' factors per latent group: s 2^(8 - F), exact (a power of two).
    float sw0[kTensor ? 1 : kPGroups], sw1[kTensor ? 1 : kPGroups];
#pragma unroll
    for (int g = 0; g < (kTensor ? 1 : kPGroups); ++g) {
      sw0[g] = s0[g] * winv;
      sw1[g] = s1[g] * winv;
    }
    float alpha[NJ][2];
    bool moved = resc != 1.f;
#pragma unroll
    for (int j = 0; j < NJ; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int col = 8 * j + 2 * (lane & 3) + e;
        const float tmax = fmaxf(fmaxf(rd[col], rd[kRedStride + col]), fmaxf(rd[2 * kRedStride + col], rd[3 * kRedStride + col]));
        const float m_new = fmaxf(m[j][e], tmax);
        float a = 1.f, p0 = 0.f, p1 = 0.f;
        if (m_new != K3GEN_MLA_NEG_INF) {
          a = exp2f(m[j][e] - m_new);
          p0 = exp2f(sc[4 * j + e] - m_new);
          p1 = exp2f(sc[4 * j + 2 + e] - m_new);
        }
        moved |= m_new != m[j][e];
        m[j][e] = m_new;
        l[j][e] = l[j][e] * a + (p0 + p1);
        alpha[j][e] = a * resc;
        // P_g[col][k]: k = 16 warp + 2 (lane / 4) (+ 64 for lo), SW128 K-major.
        unsigned char* rowp = sP + (col >> 3) * 1024 + (col & 7) * 128 + 2 * g8;
#pragma unroll
        for (int g = 0; g < (kTensor ? 1 : kPGroups); ++g) {
          const unsigned v = split2h(p0 * sw0[g], p1 * sw1[g]);
          *reinterpret_cast<unsigned short*>(rowp + g * kPBytes + ((warp ^ (col & 7)) << 4)) =
              static_cast<unsigned short>(v);
          *reinterpret_cast<unsigned short*>(rowp + g * kPBytes + (((4 + warp) ^ (col & 7)) << 4)) =
              static_cast<unsigned short>(v >> 16);
        }
      }
    // Once the column maxima settle, most tiles leave every alpha at 1: skip the 64 products then.
    if (__any_sync(0xffffffffu, moved)) {
#pragma unroll
      for (int mb = 0; mb < 8; ++mb)
#pragma unroll
        for (int i = 0; i < NA; ++i) o[mb][i] *= alpha[i >> 2][i & 1];
    }
    sm90::fence_proxy_async();   // P (generic stores) is read by wgmma
    sm90::barrier_sync_divergent(1 + c, 128);

    // PV, one k32 step (32 tokens) at a time: V^T fragments from the stage, then 8 blocks x hi/lo.
    const unsigned char* kvs = smem + s * kCodeBytes;
    const unsigned p_lo = wg::desc_lo(aP);
#pragma unroll
    for (int ks = 0; ks < 2; ++ks) {
      unsigned a[8][4];
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int g = 0; g < kPGroups; ++g) {
          unsigned w[4];
#pragma unroll
          for (int q = 0; q < 4; ++q) {
            const int tok = 32 * ks + 16 * h + 2 * cq + (q >> 1) + 8 * (q & 1);
            w[q] = *reinterpret_cast<const unsigned*>(kvs + g * wg::kBlk + (tok >> 3) * 1024 + (tok & 7) * 128 +
                                                       (((2 * warp + (g8 >> 2)) ^ (tok & 7)) << 4) + 4 * (g8 & 3));
          }
          const unsigned t0 = f8::prmt(w[0], w[1], 0x5140u), t1 = f8::prmt(w[0], w[1], 0x7362u);
          const unsigned t2 = f8::prmt(w[2], w[3], 0x5140u), t3 = f8::prmt(w[2], w[3], 0x7362u);
          a[2 * g][2 * h] = f8::prmt(t0, t2, 0x5410u);        // dim +0: block 2g, row g8
          a[2 * g][2 * h + 1] = f8::prmt(t0, t2, 0x7632u);    // dim +1: block 2g, row g8 + 8
          a[2 * g + 1][2 * h] = f8::prmt(t1, t3, 0x5410u);    // dim +2: block 2g + 1, row g8
          a[2 * g + 1][2 * h + 1] = f8::prmt(t1, t3, 0x7632u);
        }
      sm90::wgmma_fence();
#pragma unroll
      for (int mb = 0; mb < 8; ++mb) {
        const unsigned pb = p_lo + ((kTensor ? 0 : (mb >> 1) * kPBytes) + ks * 32) / 16;
        MmaPV::mma(o[mb], a[mb], wg::desc(pb));
        MmaPV::mma(o[mb], a[mb], wg::desc(pb + 64 / 16));
      }
      sm90::wgmma_commit();
    }
    sm90::wgmma_wait<0>();
#pragma unroll
    for (int mb = 0; mb < 8; ++mb)
#pragma unroll
      for (int i = 0; i < NA; ++i) sm90::fence_operand(o[mb][i]);
    sm90::mbar_arrive(bar + 8 * (S + s));   // the stage may be refilled
  }

  // Full denominators: 8 lanes per column, then the 4 warps (through red).
  wg::col_stats<c, N, kRedStride>(m, l, rd, stats, warp, lane);
  // Both consumers past their last wgmma: the stages become the merge buffer [2][N][516] FP32.
  wg::handoff(hand);
  float* buf = reinterpret_cast<float*>(smem);
  const float unit = f8::pow2(max(fexp - 8, -126)) * (kTensor ? p.scale : 1.f);
  // O^T fragment (block mb, register i): dim per the PV M map above.
  float wself[NJ][2];
  const bool lse = c == 0 && warp == 0 && lane < 4 && p.splits > 1;
  wg::merge_out<c, N, NA, HT>(
      p, o, wself, stats, buf, hand + 8, lse, cq, b, split, r0, tid, [=](float w) { return w * unit; },
      [=](int mb, int i) { return 128 * (mb >> 1) + 4 * (8 * warp + g8) + 2 * (mb & 1) + ((i & 3) >> 1); });
  };
  if (wgi == 1) consumer(wg::IntC<0>{});
  else consumer(wg::IntC<1>{});
}

}  // namespace wg8
}  // namespace mla
}  // namespace k3gen
