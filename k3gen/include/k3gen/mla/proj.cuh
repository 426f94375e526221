// The small per-head projections around MLA decode attention (CUDA cores, FP32 math):
//   norm_quant   RMSNorm of q_a, rounded to BF16, then per-token per-128 E4M3 quantization in
//                either scale recipe (the act_quant_fp8 rules; feeds the FP8 Q-B GEMM)
//   absorb       q_lat = q_nope @ W_UK[h] (128 -> 512) plus the q_pe copy -> [B, H, 576]
//   vb_gate      y = (o_lat @ W_UV[h]^T) * sigmoid(gate_h) -> [B, H, 128]
// Contracts: k3gen/ops/mla_q_absorb/spec.py, k3gen/ops/mla_vb_gate/spec.py. The per-head weights are
// 128 KB of BF16 each; a CTA serves 8 tokens of one head so every weight element read feeds 8
// FMAs, and each weight row is read by consecutive threads (coalesced) from its [128, 512] layout.
#pragma once

#include <cuda_bf16.h>

#include "k3gen/common/quant.cuh"

namespace k3gen {
namespace mla {

constexpr int kQLora = 1536, kNope = 128, kRope = 64, kLatent = 512, kV = 128;
constexpr int kQkHead = kNope + kRope, kOutHead = kLatent + kRope;
constexpr int kBatchTile = 8;

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float bf16_round(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }

// UE8M0 byte of 2^ceil(log2 t) for t >= 0, exactly as reference.quant.ue8m0_encode: 0 for t == 0
// (2^-127), clamped to [0, 254], 255 for NaN; the ceiling is exact for subnormal t too.
__device__ __forceinline__ unsigned ue8m0_ceil(float t) {
  if (t != t) return 255u;
  const unsigned bits = __float_as_uint(fmaxf(t, 0.f));
  const int biased = static_cast<int>(bits >> 23), mant = static_cast<int>(bits & 0x7fffffu);
  int k = biased == 0 ? (mant > (1 << 22) ? -126 : -127) : biased - 127 + (mant != 0);
  k += 127;
  return static_cast<unsigned>(k < 0 ? 0 : (k > 254 ? 254 : k));
}

__device__ __forceinline__ float ue8m0_value(unsigned b) {
  return b == 0u ? __uint_as_float(0x00400000u) : (b == 255u ? __uint_as_float(0x7fc00000u) : __uint_as_float(b << 23));
}

// ---- RMSNorm + FP8 quantization: one CTA per token, 192 threads x 8 columns ---------------------
constexpr int kNormThreads = kQLora / 8;

template <bool kUe8m0>
__device__ __forceinline__ void norm_quant(const __nv_bfloat16* qa, long long qa_stride, const __nv_bfloat16* w,
                                           unsigned char* codes, void* scales, float eps) {
  __shared__ float ssq[kNormThreads / 32];
  const int b = blockIdx.x, tid = threadIdx.x, lane = tid & 31;
  float x[8], wv[8];
  bf16x8_to_float(*reinterpret_cast<const uint4*>(qa + b * qa_stride + 8 * tid), x);
  bf16x8_to_float(*reinterpret_cast<const uint4*>(w + 8 * tid), wv);
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < 8; ++i) s = fmaf(x[i], x[i], s);
  s = warp_sum(s);
  if (lane == 0) ssq[tid >> 5] = s;
  __syncthreads();
  float tot = 0.f;
#pragma unroll
  for (int i = 0; i < kNormThreads / 32; ++i) tot += ssq[i];
  const float rstd = rsqrtf(tot / kQLora + eps);
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    x[i] = bf16_round(__fmul_rn(__fmul_rn(x[i], rstd), wv[i]));
    amax = fmaxf(amax, fabsf(x[i]));
  }
  // 16 threads own one 128-column group; the xor distances stay inside the half-warp.
#pragma unroll
  for (int o = 8; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  const float t = __fdiv_rn(amax, 448.f);
  float step;
  const int grp = tid >> 4, groups = kQLora / 128;
  if constexpr (kUe8m0) {
    const unsigned byte = ue8m0_ceil(t);
    step = ue8m0_value(byte);
    if ((tid & 15) == 0) static_cast<unsigned char*>(scales)[b * groups + grp] = static_cast<unsigned char>(byte);
  } else {
    step = t;
    if ((tid & 15) == 0) static_cast<float*>(scales)[b * groups + grp] = t;
  }
  float q[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) q[i] = step == 0.f ? 0.f : __fdiv_rn(x[i], step);   // FP32: +0 codes for s = 0
  uint2 o;
  o.x = e4m3x4(q);
  o.y = e4m3x4(q + 4);
  *reinterpret_cast<uint2*>(codes + static_cast<long long>(b) * kQLora + 8 * tid) = o;
}

// ---- absorption: grid (H, ceil(B/8)), 256 threads, thread = 2 latent columns ---------------------
constexpr int kAbsorbThreads = kLatent / 2;

__device__ __forceinline__ void absorb(const __nv_bfloat16* q, const __nv_bfloat16* w_uk, long long head_stride,
                                       __nv_bfloat16* out, int heads, int batch) {
  __shared__ float qs[kBatchTile][kNope];
  const int h = blockIdx.x, b0 = blockIdx.y * kBatchTile, tid = threadIdx.x;
  const int nb = min(kBatchTile, batch - b0);
  const long long qrow = static_cast<long long>(heads) * kQkHead, orow = static_cast<long long>(heads) * kOutHead;
  for (int i = tid; i < kBatchTile * kNope; i += kAbsorbThreads) {
    const int bb = i / kNope, d = i % kNope;
    qs[bb][d] = bb < nb ? __bfloat162float(q[(b0 + bb) * qrow + h * kQkHead + d]) : 0.f;
  }
  for (int i = tid; i < nb * kRope; i += kAbsorbThreads) {   // rope part: copied, never rotated
    const int bb = i / kRope, d = i % kRope;
    out[(b0 + bb) * orow + h * kOutHead + kLatent + d] = q[(b0 + bb) * qrow + h * kQkHead + kNope + d];
  }
  __syncthreads();
  const __nv_bfloat162* wp = reinterpret_cast<const __nv_bfloat162*>(w_uk + h * head_stride) + tid;
  float acc[kBatchTile][2] = {};
#pragma unroll 4
  for (int d = 0; d < kNope; ++d) {
    const float2 wv = __bfloat1622float2(wp[d * (kLatent / 2)]);
#pragma unroll
    for (int bb = 0; bb < kBatchTile; ++bb) {
      acc[bb][0] = fmaf(qs[bb][d], wv.x, acc[bb][0]);
      acc[bb][1] = fmaf(qs[bb][d], wv.y, acc[bb][1]);
    }
  }
#pragma unroll
  for (int bb = 0; bb < kBatchTile; ++bb) {
    if (bb < nb) {
      *reinterpret_cast<__nv_bfloat162*>(out + (b0 + bb) * orow + h * kOutHead + 2 * tid) =
          __floats2bfloat162_rn(acc[bb][0], acc[bb][1]);
    }
  }
}

// ---- V-B + gate: grid (H, ceil(B/8)), 256 threads, warp = 16 output dims -------------------------
constexpr int kVbThreads = 256;

__device__ __forceinline__ void vb_gate(const __nv_bfloat16* o_lat, const __nv_bfloat16* w_uv, long long head_stride,
                                        const __nv_bfloat16* gate, long long gate_stride, __nv_bfloat16* out,
                                        int heads, int batch) {
  __shared__ __align__(16) float ol[kBatchTile][kLatent];
  const int h = blockIdx.x, b0 = blockIdx.y * kBatchTile, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int nb = min(kBatchTile, batch - b0);
  for (int i = tid; i < kBatchTile * kLatent / 8; i += kVbThreads) {
    const int bb = i / (kLatent / 8), c = (i % (kLatent / 8)) * 8;
    float v[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    if (bb < nb) {
      bf16x8_to_float(*reinterpret_cast<const uint4*>(
                          o_lat + (static_cast<long long>(b0 + bb) * heads + h) * kLatent + c), v);
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) ol[bb][c + j] = v[j];
  }
  __syncthreads();
  constexpr int kDimsPerWarp = kV / (kVbThreads / 32);
  for (int dd = 0; dd < kDimsPerWarp; ++dd) {
    const int d = warp * kDimsPerWarp + dd;
    const __nv_bfloat16* row = w_uv + h * head_stride + static_cast<long long>(d) * kLatent;
    float w0[8], w1[8];
    bf16x8_to_float(*reinterpret_cast<const uint4*>(row + 8 * lane), w0);
    bf16x8_to_float(*reinterpret_cast<const uint4*>(row + kLatent / 2 + 8 * lane), w1);
    float mine = 0.f;   // lane bb ends up holding token bb's dot product
#pragma unroll
    for (int bb = 0; bb < kBatchTile; ++bb) {
      const float4* a = reinterpret_cast<const float4*>(&ol[bb][8 * lane]);
      const float4* c = reinterpret_cast<const float4*>(&ol[bb][kLatent / 2 + 8 * lane]);
      const float4 a0 = a[0], a1 = a[1], c0 = c[0], c1 = c[1];
      float s = w0[0] * a0.x + w0[1] * a0.y + w0[2] * a0.z + w0[3] * a0.w;
      s += w0[4] * a1.x + w0[5] * a1.y + w0[6] * a1.z + w0[7] * a1.w;
      s += w1[0] * c0.x + w1[1] * c0.y + w1[2] * c0.z + w1[3] * c0.w;
      s += w1[4] * c1.x + w1[5] * c1.y + w1[6] * c1.z + w1[7] * c1.w;
      s = warp_sum(s);
      if (lane == bb) mine = s;
    }
    if (lane < nb) {
      const float g = __bfloat162float(gate[(b0 + lane) * gate_stride + h * kV + d]);
      const float y = mine * (1.f / (1.f + __expf(-g)));
      out[(static_cast<long long>(b0 + lane) * heads + h) * kV + d] = __float2bfloat16_rn(y);
    }
  }
}

}  // namespace mla
}  // namespace k3gen
