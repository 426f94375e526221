// mla_decode, NVFP4 wgmma variant (mla/decode_wg_nvfp4.cuh, which includes this after its helpers):
// the live rows of the HP tail ring, folded into one consumer's online softmax after the tiles.
#pragma once

namespace k3gen {
namespace mla {
namespace wg4 {

// The live rows live .. len - 1 (nl < 16, staged BF16 in ring) folded into one consumer's online
// softmax state, in FP32 on CUDA cores (the tiles masked them): scores of the exact rows, then
// m, l and the O^T fragments (units of gu = G 2^-8 per KV unit). sS: 1 KB scratch, rd: 48 floats;
// every thread of the consumer warpgroup calls it (named barrier bar_id).
template <class C>
__device__ void live_rows(const Params& p, int b, int r0, int len, int live, const unsigned char* ring, float* sS,
                          float* rd, unsigned bar_id, float (&o)[8][8], float (&m)[2][2], float (&l)[2][2],
                          float gu, int wt) {
  constexpr int HT = Geo4<C>::HT;
  const int nl = len - live, warp = wt / 32, lane = wt % 32, g8 = lane >> 2, cq = lane & 3;
  {
    // 8 threads per query row, 9 chunks of 8 dims each.
    const int col = wt >> 3, part = wt & 7, r = r0 + col;
    const uint4* qrow = reinterpret_cast<const uint4*>(p.q) + (static_cast<long long>(b) * HT + min(r, HT - 1)) * kChunks;
    float acc[kRingRows];
#pragma unroll
    for (int j = 0; j < kRingRows; ++j) acc[j] = 0.f;
#pragma unroll 1
    for (int k = 0; k < 9; ++k) {
      const int ch = 9 * part + k;
      float x[8];
      bf16x8_to_float(r < HT ? qrow[ch] : make_uint4(0, 0, 0, 0), x);
#pragma unroll
      for (int j = 0; j < kRingRows; ++j) {
        if (j < nl) {
          float y[8];
          bf16x8_to_float(*reinterpret_cast<const uint4*>(ring + j * (kRow * 2) + ch * 16), y);
#pragma unroll
          for (int e = 0; e < 8; ++e) acc[j] = fmaf(x[e], y[e], acc[j]);
        }
      }
    }
    const int lim = len - C::kTokens + (r < HT ? r / C::kHeads : C::kTokens - 1);
#pragma unroll
    for (int j = 0; j < kRingRows; ++j) {
      float v = acc[j];
      v += __shfl_xor_sync(0xffffffffu, v, 1);
      v += __shfl_xor_sync(0xffffffffu, v, 2);
      v += __shfl_xor_sync(0xffffffffu, v, 4);
      if (part == 0) sS[col * kRingRows + j] = j < nl && live + j <= lim ? v * (C::kSoftmaxScale * kLog2e) : K3GEN_MLA_NEG_INF;
    }
  }
  sm90::barrier_sync_divergent(bar_id, 128);
  // One thread per column (warp 0, lanes 4 g8 = 0): new maximum, rescale factor, probabilities
  // (times gu, the tiles' unit) in place of the scores, and its denominator partial.
  if (warp == 0 && g8 == 0) {
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int col = 8 * j + 2 * cq + e;
        float* srow = sS + col * kRingRows;
        float tmax = K3GEN_MLA_NEG_INF;
        for (int t = 0; t < nl; ++t) tmax = fmaxf(tmax, srow[t]);
        const float m_new = fmaxf(m[j][e], tmax);
        float a = 1.f, sum = 0.f;
        if (m_new != K3GEN_MLA_NEG_INF) {
          a = exp2f(m[j][e] - m_new);
          for (int t = 0; t < nl; ++t) {
            const float pt = exp2f(srow[t] - m_new);
            sum += pt;
            srow[t] = pt * gu;
          }
        } else {
          for (int t = 0; t < nl; ++t) srow[t] = 0.f;
        }
        rd[col] = a;
        rd[16 + col] = m_new;
        rd[32 + col] = sum;
      }
  }
  sm90::barrier_sync_divergent(bar_id, 128);
  float al[2][2];
#pragma unroll
  for (int j = 0; j < 2; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int col = 8 * j + 2 * cq + e;
      al[j][e] = rd[col];
      m[j][e] = rd[16 + col];
      l[j][e] = l[j][e] * al[j][e] + (warp == 0 && g8 == 0 ? rd[32 + col] : 0.f);
    }
#pragma unroll
  for (int mb = 0; mb < 8; ++mb)
#pragma unroll
    for (int i = 0; i < 8; ++i) o[mb][i] *= al[i >> 2][i & 1];
#pragma unroll 1
  for (int t = 0; t < nl; ++t) {
    float pc[2][2];
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) pc[j][e] = sS[(8 * j + 2 * cq + e) * kRingRows + t];
    const unsigned short* vrow = reinterpret_cast<const unsigned short*>(ring + t * (kRow * 2));
#pragma unroll
    for (int mb = 0; mb < 8; ++mb)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float v = bf16_lo(vrow[pv_dim(mb, 16 * warp + g8 + 8 * h)]);
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
          for (int e = 0; e < 2; ++e) o[mb][4 * j + 2 * h + e] = fmaf(pc[j][e], v, o[mb][4 * j + 2 * h + e]);
      }
  }
}

}  // namespace wg4
}  // namespace mla
}  // namespace k3gen
