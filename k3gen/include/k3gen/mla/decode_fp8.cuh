// mla_decode, FP8 E4M3 KV: the codes go from the raw cp.async stage straight into f16 mma
// fragments (cvt.rn.f16x2.e4m3x2 is exact), with no dequantized tile in shared memory.
// Included by mla/decode.cuh after Params; numerics:
//   QK: f16 mma of the exact codes against Q * 2^E (E per CTA puts max |q| in [2^14, 2^15), so
//       every BF16 query element in f16's normal range converts exactly); one FP32 partial per
//       128-dim scale group, times its per-token scale, then times 2^-E.
//   PV: the scale is per (token, group) and the contraction runs over tokens, so it folds into
//       the probabilities: A = f16(p * s / 2^F) <= 1 with 2^F >= the tile's largest scale of the
//       warp's group (F per tile, a power of two: the running output is rescaled exactly).
// Fragment layouts use permutations of the contraction index (free as long as A and B agree):
//   QK: a thread's 8 consecutive codes of one token feed two k16 steps (one 8-byte load).
//   PV: k index (2c, 2c+1, 2c+8, 2c+9) is token (c, c+4, c+8, c+12) and n8 tile j column n is
//       dim 4n + j of a 32-dim block, so a thread's 4 consecutive codes of one token feed 4 tiles.
// Stage rows are 608 B (576 + 32): both load patterns are bank-conflict free.
#pragma once

namespace k3gen {
namespace mla {
namespace f8 {

constexpr int kRowB = kRow + 32;                          // bytes per code row in a stage
constexpr int kQRowB = kRow * 2 + 64;                     // bytes per f16 query row (76 chunks)
constexpr int kScaleOff = kTok * kRowB;                   // FP32 scales [64][8] after the codes
constexpr int kStageBytes = kScaleOff + kTok * kFp8Scales * 4;
constexpr int kGroups = 5;                                // 4 latent groups of 128 + rope 64

__device__ __forceinline__ void cvt_e4m3x4(unsigned w, unsigned& lo, unsigned& hi) {
  asm("{\n\t.reg .b16 l, h;\n\tmov.b32 {l, h}, %2;\n\t"
      "cvt.rn.f16x2.e4m3x2 %0, l;\n\tcvt.rn.f16x2.e4m3x2 %1, h;\n\t}"
      : "=r"(lo), "=r"(hi) : "r"(w));
}
__device__ __forceinline__ unsigned prmt(unsigned a, unsigned b, unsigned sel) {
  unsigned d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}
__device__ __forceinline__ void mma_f16(float (&d)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                        unsigned b0, unsigned b1) {
  asm(  // pure: may interleave with independent chains
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ unsigned h2(float lo, float hi) {
  const __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const unsigned*>(&v);
}
__device__ __forceinline__ float pow2(int e) { return __int_as_float((127 + e) << 23); }  // |e| <= 126

// Q rows r0 .. r0 + R - 1 of sequence b as f16 * 2^E into sq ([R][kQRowB], natural order; zero
// past H*T). scratch: 8 floats. Returns 2^-E. Contains barriers (all threads call it).
template <class C>
__device__ float stage_q(const Params& p, int b, int r0, unsigned char* sq, float* scratch) {
  constexpr int R = 16 * C::kMT, HT = C::kHeads * C::kTokens;
  const int tid = threadIdx.x;
  const uint4* qg = reinterpret_cast<const uint4*>(p.q) + (static_cast<long long>(b) * HT + r0) * kChunks;
  float mx = 0.f;
  for (int i = tid; i < R * kChunks; i += kThreads) {
    if (r0 + i / kChunks >= HT) break;
    float x[8];
    bf16x8_to_float(qg[i], x);
#pragma unroll
    for (int j = 0; j < 8; ++j) mx = fmaxf(mx, fabsf(x[j]));
  }
#pragma unroll
  for (int off = 16; off >= 1; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
  if (tid % 32 == 0) scratch[tid / 32] = mx;
  __syncthreads();
#pragma unroll
  for (int w = 0; w < kWarps; ++w) mx = fmaxf(mx, scratch[w]);
  int e = mx > 0.f ? 14 - ((__float_as_int(mx) >> 23) - 127) : 0;
  e = min(max(e, -100), 100);
  const float f = pow2(e);
  for (int i = tid; i < R * kChunks; i += kThreads) {
    const int r = i / kChunks, c = i - r * kChunks;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (r0 + r < HT) {
      float x[8];
      bf16x8_to_float(qg[i], x);
      v = make_uint4(h2(x[0] * f, x[1] * f), h2(x[2] * f, x[3] * f), h2(x[4] * f, x[5] * f), h2(x[6] * f, x[7] * f));
    }
    *reinterpret_cast<uint4*>(sq + r * kQRowB + c * 16) = v;
  }
  __syncthreads();
  return pow2(-e);
}

// Zero the code rows nv .. 63 and their scales (rows past the sequence end or of a bad page were
// not copied: 0 * garbage could be NaN in PV).
__device__ __forceinline__ void zero_rows(unsigned char* stage, int nv) {
  for (int i = threadIdx.x; i < (kTok - nv) * 38; i += kThreads) {
    const int t = nv + i / 38, c = i % 38;
    unsigned char* d = c < 36 ? stage + t * kRowB + c * 16 : stage + kScaleOff + t * 32 + (c - 36) * 16;
    *reinterpret_cast<uint4*>(d) = make_uint4(0, 0, 0, 0);
  }
}

// acc = sum over groups of s[token][group] * (q . codes) for tokens 8w + 2c, 8w + 2c + 1 (C layout).
// qh: query fragments in registers when QR > 1 (MT = 1 at one CTA per SM; [K][row g | row g + 8]);
// else read from sq.
template <class C, int QR>
__device__ __forceinline__ void qk(float (&acc)[C::kMT][4], const unsigned char* stage, const uint4 (&qh)[QR][2],
                                   const unsigned char* sq, int warp, int lane) {
  constexpr int MT = C::kMT;
  const int g = lane >> 2, c = lane & 3;
  const unsigned char* krow = stage + (warp * 8 + g) * kRowB + 8 * c;
  const float* sc = reinterpret_cast<const float*>(stage + kScaleOff) + (warp * 8 + 2 * c) * kFp8Scales;
#pragma unroll
  for (int m = 0; m < MT; ++m) acc[m][0] = acc[m][1] = acc[m][2] = acc[m][3] = 0.f;
#pragma unroll
  for (int G = 0; G < kGroups; ++G) {
    float t[MT][4];
#pragma unroll
    for (int m = 0; m < MT; ++m) t[m][0] = t[m][1] = t[m][2] = t[m][3] = 0.f;
#pragma unroll
    for (int K = 4 * G; K < (4 * G + 4 < kRow / 32 ? 4 * G + 4 : kRow / 32); ++K) {
      const uint2 cw = *reinterpret_cast<const uint2*>(krow + 32 * K);
      unsigned b0, b1, b2, b3;
      cvt_e4m3x4(cw.x, b0, b1);
      cvt_e4m3x4(cw.y, b2, b3);
#pragma unroll
      for (int m = 0; m < MT; ++m) {
        uint4 qa, qb;
        if constexpr (QR > 1) {
          qa = qh[K][0];
          qb = qh[K][1];
        } else {
          qa = *reinterpret_cast<const uint4*>(sq + (m * 16 + g) * kQRowB + (4 * K + c) * 16);
          qb = *reinterpret_cast<const uint4*>(sq + (m * 16 + g + 8) * kQRowB + (4 * K + c) * 16);
        }
        mma_f16(t[m], qa.x, qb.x, qa.y, qb.y, b0, b1);
        mma_f16(t[m], qa.z, qb.z, qa.w, qb.w, b2, b3);
      }
    }
    if constexpr (C::kFp8PerTensor) {
#pragma unroll
      for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[m][i] += t[m][i];
    } else {
      const float s0 = sc[G], s1 = sc[kFp8Scales + G];
#pragma unroll
      for (int m = 0; m < MT; ++m) {
        acc[m][0] = fmaf(t[m][0], s0, acc[m][0]);
        acc[m][1] = fmaf(t[m][1], s1, acc[m][1]);
        acc[m][2] = fmaf(t[m][2], s0, acc[m][2]);
        acc[m][3] = fmaf(t[m][3], s1, acc[m][3]);
      }
    }
  }
}

// The running output's rows (m * 16 + g, + 8) times alpha * s before a tile's PV (s = 1 folds away).
template <int MT>
__device__ __forceinline__ void rescale_o(float (&o)[MT][8][4], const float* sAlpha, int g, float s) {
#pragma unroll
  for (int m = 0; m < MT; ++m) {
    const float a0 = sAlpha[m * 16 + g] * s, a1 = sAlpha[m * 16 + g + 8] * s;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      o[m][j][0] *= a0; o[m][j][1] *= a0;
      o[m][j][2] *= a1; o[m][j][3] *= a1;
    }
  }
}
// PV's f16 A fragments of k16 step kk: P (sP [R][kSStride]) at tokens 16 kk + c + 4 i (the PV k
// permutation of the header) times the token weights w[i] (all 1 fold away).
template <int MT>
__device__ __forceinline__ void p_frags(unsigned (&a)[MT][4], const float* sP, int kk, int g, int c,
                                        const float (&w)[4]) {
#pragma unroll
  for (int m = 0; m < MT; ++m) {
    const float* p0 = sP + (m * 16 + g) * kSStride + 16 * kk + c;
    const float* p1 = p0 + 8 * kSStride;
    a[m][0] = h2(p0[0] * w[0], p0[4] * w[1]);
    a[m][1] = h2(p1[0] * w[0], p1[4] * w[1]);
    a[m][2] = h2(p0[8] * w[2], p0[12] * w[3]);
    a[m][3] = h2(p1[8] * w[2], p1[12] * w[3]);
  }
}

// o (permuted columns, see the header) = o * alpha * 2^(F_prev - F) + (p * s / 2^F) . codes over
// the tile. sP: FP32 probabilities [R][kSStride]. F is carried across tiles in `fexp`.
template <class C>
__device__ __forceinline__ void pv(float (&o)[C::kMT][8][4], const unsigned char* stage, const float* sP,
                                   const float* sAlpha, int warp, int lane, int& fexp) {
  constexpr int MT = C::kMT;
  const int g = lane >> 2, c = lane & 3;
  float w[4][4];   // per k16 step kk: the weights of tokens 16 kk + c + 4 i
  int f = 0;
  if constexpr (C::kFp8PerTensor) {
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) w[kk][0] = w[kk][1] = w[kk][2] = w[kk][3] = 1.f;
  } else {
    const float* sc = reinterpret_cast<const float*>(stage + kScaleOff) + (warp >> 1);
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
#pragma unroll
      for (int i = 0; i < 4; ++i) w[kk][i] = sc[(16 * kk + c + 4 * i) * kFp8Scales];
    float mk[4];   // a tree, not a chain of 16 dependent max operations
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) mk[kk] = fmaxf(fmaxf(w[kk][0], w[kk][1]), fmaxf(w[kk][2], w[kk][3]));
    float mx = fmaxf(fmaxf(mk[0], mk[1]), fmaxf(mk[2], mk[3]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    f = ((__float_as_int(mx) + 0x7fffff) >> 23) - 127;   // 2^f >= mx
    f = min(max(f, -60), 60);
    const float inv = pow2(-f);
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
#pragma unroll
      for (int i = 0; i < 4; ++i) w[kk][i] *= inv;
  }
  const float resc = pow2(fexp - f);
  fexp = f;
  rescale_o<MT>(o, sAlpha, g, resc);
  const unsigned char* vb = stage + c * kRowB + 64 * warp + 4 * g;
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    unsigned a[MT][4];
    p_frags<MT>(a, sP, kk, g, c, w[kk]);
#pragma unroll
    for (int bp = 0; bp < 2; ++bp) {
      const unsigned char* vr = vb + 16 * kk * kRowB + 32 * bp;
      const unsigned w0 = *reinterpret_cast<const unsigned*>(vr);
      const unsigned w1 = *reinterpret_cast<const unsigned*>(vr + 4 * kRowB);
      const unsigned w2 = *reinterpret_cast<const unsigned*>(vr + 8 * kRowB);
      const unsigned w3 = *reinterpret_cast<const unsigned*>(vr + 12 * kRowB);
      unsigned b0[4], b1[4];
      cvt_e4m3x4(prmt(w0, w1, 0x5140u), b0[0], b0[1]);
      cvt_e4m3x4(prmt(w0, w1, 0x7362u), b0[2], b0[3]);
      cvt_e4m3x4(prmt(w2, w3, 0x5140u), b1[0], b1[1]);
      cvt_e4m3x4(prmt(w2, w3, 0x7362u), b1[2], b1[3]);
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int m = 0; m < MT; ++m) mma_f16(o[m][4 * bp + j], a[m][0], a[m][1], a[m][2], a[m][3], b0[j], b1[j]);
    }
  }
}

}  // namespace f8
}  // namespace mla
}  // namespace k3gen
