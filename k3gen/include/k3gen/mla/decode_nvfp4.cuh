// mla_decode, NVFP4 KV: E2M1 codes go from the raw stage straight into f16 mma fragments.
// Included by mla/decode.cuh after mla/decode_fp8.cuh (shares its f16 helpers and stage_q).
// Numerics: e2m1 (<= 2 significant bits, |x| in [0.5, 6]) times its E4M3 scale code (<= 4 bits,
// [2^-9, 448]) is exact in f16 (normal range, <= 6 bits), so B = code * scale_code is formed with
// one exact HMUL2 and the global 1/G is applied in FP32: QK to the scores, PV to the output
// (the running output is in units of 1/G). Q is f16 * 2^E as for FP8; P is f16 (<= 1).
// Decode: a 16-entry E2M1 table is a PRMT over two registers holding the f16 high bytes of the 8
// magnitudes (the low bytes are 0); signs are moved with sign-replicating PRMT selectors.
// Layouts: QK k-step = one 16-dim scale group; lane c holds dims 4c..4c+3 (one 16-bit load);
// PV as FP8 (k index (2c, 2c+1, 2c+8, 2c+9) = token (c, c+4, c+8, c+12), n8 tile j column n =
// dim 4n + j of a 32-dim block). Stage rows are 304 B (288 + 16): both patterns conflict free.
// Positions of the live 16-token tile (>= length // 16 * 16) are masked in the tiles and added
// afterwards from the BF16 HP tail ring by `live_rows` (CUDA cores, fewer than 16 rows).
#pragma once

namespace k3gen {
namespace mla {
namespace nv {

constexpr int kRowB = kRow / 2 + 16;                      // bytes per code row in a stage
constexpr int kScaleOff = kTok * kRowB;                   // scale bytes after the codes
constexpr int kStageBytes = kScaleOff + kNvSwzBytes;
constexpr unsigned kLut0 = 0x3e3c3800u, kLut1 = 0x46444240u;   // f16 high bytes of 0 .. 6

// Four E2M1 codes (u: element 0 in the low nibble) -> f16x2 (e0, e1), (e2, e3).
__device__ __forceinline__ void e2m1x4_to_h2(unsigned u, unsigned& lo, unsigned& hi) {
  const unsigned mag = f8::prmt(kLut0, kLut1, u & 0x7777u);
  const unsigned y = u << 4;
  lo = f8::prmt(mag, 0u, 0x1404u) | (f8::prmt(u, y, 0x88c8u) & 0x80008000u);
  hi = f8::prmt(mag, 0u, 0x3424u) | (f8::prmt(u, y, 0x98d8u) & 0x80008000u);
}
__device__ __forceinline__ unsigned hmul2(unsigned a, unsigned b) {
  unsigned d;
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
// Two E4M3 scale codes -> f16x2 (exact).
__device__ __forceinline__ unsigned e4m3x2_to_h2(unsigned lo, unsigned hi) {
  unsigned d;
  asm("{\n\t.reg .b16 t;\n\tcvt.u16.u32 t, %1;\n\tcvt.rn.f16x2.e4m3x2 %0, t;\n\t}" : "=r"(d) : "r"(lo | (hi << 8)));
  return d;
}

// E4M3 scale code of (token t of the tile, 16-dim group c) in a raw stage.
template <class C>
__device__ __forceinline__ unsigned scale_code(const unsigned char* stage, int t, int c) {
  const unsigned char* sc = stage + kScaleOff;
  if constexpr (C::kSwizzle) return sc[((c >> 2) * 32 + (t & 31)) * 8 + (t >> 5) * 4 + (c & 3)];
  else return c < 32 ? sc[(t >> 4) * 32 + c] : sc[128 + t * 4 + (c - 32)];
}

// Zero the code rows nv .. 63 and their scales (nv: a multiple of 16, or 0). Those rows were not
// copied (past the end, a bad page) or belong to the live tile, whose codes and latent tile scale
// may not be written yet: a zero code times a garbage (NaN) scale code would still be NaN.
template <class C>
__device__ __forceinline__ void zero_rows(unsigned char* stage, int nv) {
  for (int i = threadIdx.x; i < (kTok - nv) * 18; i += kThreads)
    *reinterpret_cast<uint4*>(stage + (nv + i / 18) * kRowB + (i % 18) * 16) = make_uint4(0, 0, 0, 0);
  unsigned char* sc = stage + kScaleOff;
  for (int i = threadIdx.x; i < (kTok - nv) * 36; i += kThreads) {
    const int t = nv + i / 36, c = i % 36;
    if constexpr (C::kSwizzle) sc[((c >> 2) * 32 + (t & 31)) * 8 + (t >> 5) * 4 + (c & 3)] = 0;
    else if (c < 32) sc[(t >> 4) * 32 + c] = 0;   // the 16-token tile of t is wholly >= nv
    else sc[128 + t * 4 + (c - 32)] = 0;
  }
}

// acc = q . (code * scale_code) for tokens 8w + 2c, 8w + 2c + 1 (C layout), all 576 dims.
// qn: query fragments in registers when QR > 1 ([step][a0 | a1 | a2 | a3]); else read from sq (f16 rows).
template <class C, int QR>
__device__ __forceinline__ void qk(float (&acc)[C::kMT][4], const unsigned char* stage, const unsigned (&qn)[QR][4],
                                   const unsigned char* sq, int warp, int lane) {
  constexpr int MT = C::kMT;
  const int g = lane >> 2, c = lane & 3, t = warp * 8 + g;
  const unsigned char* krow = stage + t * kRowB + 2 * c;
  float acc2[MT][4];   // odd groups: two independent MMA chains instead of one of 36
#pragma unroll
  for (int m = 0; m < MT; ++m) {
    acc[m][0] = acc[m][1] = acc[m][2] = acc[m][3] = 0.f;
    acc2[m][0] = acc2[m][1] = acc2[m][2] = acc2[m][3] = 0.f;
  }
#pragma unroll
  for (int G = 0; G < kRow / 16; ++G) {
    float (&d)[MT][4] = (G & 1) ? acc2 : acc;
    const unsigned u = *reinterpret_cast<const unsigned short*>(krow + 8 * G);
    const unsigned s = scale_code<C>(stage, t, G);
    const unsigned s2 = e4m3x2_to_h2(s, s);
    unsigned b0, b1;
    e2m1x4_to_h2(u, b0, b1);
    b0 = hmul2(b0, s2);
    b1 = hmul2(b1, s2);
#pragma unroll
    for (int m = 0; m < MT; ++m) {
      if constexpr (QR > 1) {
        f8::mma_f16(d[m], qn[G][0], qn[G][1], qn[G][2], qn[G][3], b0, b1);
      } else {
        const uint2 qa = *reinterpret_cast<const uint2*>(sq + (m * 16 + g) * f8::kQRowB + G * 32 + c * 8);
        const uint2 qb = *reinterpret_cast<const uint2*>(sq + (m * 16 + g + 8) * f8::kQRowB + G * 32 + c * 8);
        f8::mma_f16(d[m], qa.x, qb.x, qa.y, qb.y, b0, b1);
      }
    }
  }
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[m][i] += acc2[m][i];
}

// o (permuted columns) = o * alpha + f16(p) . (code * scale_code) over the tile.
template <class C>
__device__ __forceinline__ void pv(float (&o)[C::kMT][8][4], const unsigned char* stage, const float* sP,
                                   const float* sAlpha, int warp, int lane) {
  constexpr int MT = C::kMT;
  const int g = lane >> 2, c = lane & 3;
  f8::rescale_o<MT>(o, sAlpha, g, 1.f);
  const unsigned char* vb = stage + c * kRowB + 32 * warp + 2 * g;
  const float ones[4] = {1.f, 1.f, 1.f, 1.f};   // P is not weighted here
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    unsigned a[MT][4];
    f8::p_frags<MT>(a, sP, kk, g, c, ones);
#pragma unroll
    for (int bp = 0; bp < 2; ++bp) {
      const unsigned char* vr = vb + 16 * kk * kRowB + 16 * bp;
      const int grp = 4 * warp + 2 * bp + (g >> 2);
      unsigned u[4], mag[4], sc[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        u[i] = *reinterpret_cast<const unsigned short*>(vr + 4 * i * kRowB);
        mag[i] = f8::prmt(kLut0, kLut1, u[i] & 0x7777u);
        sc[i] = scale_code<C>(stage, 16 * kk + c + 4 * i, grp);
      }
      const unsigned s01 = e4m3x2_to_h2(sc[0], sc[1]), s23 = e4m3x2_to_h2(sc[2], sc[3]);
      const unsigned u01 = f8::prmt(u[0], u[1], 0x5410u), u23 = f8::prmt(u[2], u[3], 0x5410u);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        // [0, v(c), 0, v(c + 4)] of column j: selector 8 replicates the sign of a table byte (0).
        const unsigned sel = 0x0808u | (j << 4) | ((4 + j) << 12);
        const unsigned b0 = hmul2(f8::prmt(mag[0], mag[1], sel) | ((u01 << (12 - 4 * j)) & 0x80008000u), s01);
        const unsigned b1 = hmul2(f8::prmt(mag[2], mag[3], sel) | ((u23 << (12 - 4 * j)) & 0x80008000u), s23);
#pragma unroll
        for (int m = 0; m < MT; ++m) f8::mma_f16(o[m][4 * bp + j], a[m][0], a[m][1], a[m][2], a[m][3], b0, b1);
      }
    }
  }
}

// Positions live .. len - 1 (fewer than 16) from the BF16 HP tail ring, after the tiles. Step 1:
// the rows into buf ([n][576] BF16) and their scores into sS (other columns -inf).
template <class C>
__device__ void live_scores(const Params& p, int b, int len, int live, int r0, unsigned char* buf, float* sS,
                            const int* sLim, float qk_scale) {
  constexpr int R = 16 * C::kMT, HT = C::kHeads * C::kTokens;
  const int tid = threadIdx.x, n = len - live;
  const uint4* ring = static_cast<const uint4*>(p.c[C::kSwizzle ? 2 : 3]);
  const int slot = p.ring_slot[b];
  const bool ring_ok = slot >= 0 && slot < p.num_slots;   // else the live rows read as zeros
  for (int i = tid; i < n * kChunks; i += kThreads) {
    const int r = i / kChunks, c = i - r * kChunks;
    const uint4 v = ring_ok ? ring[(static_cast<long long>(slot) * C::kRing + (live + r) % C::kRing) * kChunks + c]
                            : make_uint4(0, 0, 0, 0);
    *reinterpret_cast<uint4*>(buf + r * (kRow * 2) + c * 16) = v;
  }
  for (int i = tid; i < R * kTok; i += kThreads)
    if (i % kTok >= n) sS[(i / kTok) * kSStride + i % kTok] = K3GEN_MLA_NEG_INF;
  __syncthreads();
  const uint4* qg = reinterpret_cast<const uint4*>(p.q) + (static_cast<long long>(b) * HT + r0) * kChunks;
  for (int i = tid; i < R * n; i += kThreads) {
    const int r = i / n, j = i - r * n;
    float s = K3GEN_MLA_NEG_INF;
    if (r0 + r < HT && live + j <= sLim[r]) {
      const uint4* kr = reinterpret_cast<const uint4*>(buf + j * (kRow * 2));
      float acc = 0.f;
      for (int c = 0; c < kChunks; ++c) {
        float x[8], y[8];
        bf16x8_to_float(qg[r * kChunks + c], x);
        bf16x8_to_float(kr[c], y);
#pragma unroll
        for (int e = 0; e < 8; ++e) acc = fmaf(x[e], y[e], acc);
      }
      s = acc * qk_scale;
    } else if (r0 + r >= HT && live + j <= sLim[r]) {
      s = 0.f;   // padding rows: as the tiles (zero query), never written out
    }
    sS[r * kSStride + j] = s;
  }
}

// Step 2 (after the softmax wrote FP32 p into sS): o = o * alpha + G * p . rows (units of 1/G).
template <class C>
__device__ void live_pv(float (&o)[C::kMT][8][4], const unsigned char* buf, int n, const float* sP,
                        const float* sAlpha, float G, int warp, int lane) {
  const int g = lane >> 2, c = lane & 3;
#pragma unroll
  for (int m = 0; m < C::kMT; ++m)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = m * 16 + g + 8 * h;
      const float al = sAlpha[row];
#pragma unroll
      for (int bp = 0; bp < 2; ++bp)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          // dims 64w + 32bp + 8c + 4e + j, j = 0..3: tile 4bp + j, C element 2h + e
          float acc[4] = {0.f, 0.f, 0.f, 0.f};
          for (int jj = 0; jj < n; ++jj) {
            const float pj = sP[row * kSStride + jj];
            const uint2 v = *reinterpret_cast<const uint2*>(buf + jj * (kRow * 2) +
                                                            (64 * warp + 32 * bp + 8 * c + 4 * e) * 2);
            acc[0] = fmaf(pj, bf16_lo(v.x), acc[0]);
            acc[1] = fmaf(pj, bf16_hi(v.x), acc[1]);
            acc[2] = fmaf(pj, bf16_lo(v.y), acc[2]);
            acc[3] = fmaf(pj, bf16_hi(v.y), acc[3]);
          }
#pragma unroll
          for (int j = 0; j < 4; ++j) o[m][4 * bp + j][2 * h + e] = fmaf(acc[j], G, o[m][4 * bp + j][2 * h + e] * al);
        }
    }
}

}  // namespace nv
}  // namespace mla
}  // namespace k3gen
