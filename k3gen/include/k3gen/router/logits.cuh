// router_logits: FP32 logits of BF16 rows against the BF16 router weight (contract:
// k3gen/ops/router_logits/spec.py). A warp per expert, 8 rows per CTA: lane l takes the 16-byte chunks
// l, l + 32, ... of the expert's weight row and of each row, FMAs the 8 products in K order into that
// row's accumulator, then the lanes meet in an XOR butterfly. The order is the contract (reference.py
// replays it), and it does not depend on M: a row's logits are the same in any batch.
#pragma once

#include <cuda_bf16.h>

#include "k3gen/common/pdl.cuh"
#include "k3gen/common/quant.cuh"   // bf16_lo / bf16_hi / pack_bf16x2

namespace k3gen {
namespace router {

constexpr int kWarps = 4;
constexpr int kRows = 8;

// acc += the 8 products of one chunk, in K order (BF16 x BF16 is exact in FP32: one rounding each).
__device__ __forceinline__ float dot8(const uint4& a, const uint4& b, float acc) {
  acc = fmaf(bf16_lo(a.x), bf16_lo(b.x), acc);
  acc = fmaf(bf16_hi(a.x), bf16_hi(b.x), acc);
  acc = fmaf(bf16_lo(a.y), bf16_lo(b.y), acc);
  acc = fmaf(bf16_hi(a.y), bf16_hi(b.y), acc);
  acc = fmaf(bf16_lo(a.z), bf16_lo(b.z), acc);
  acc = fmaf(bf16_hi(a.z), bf16_hi(b.z), acc);
  acc = fmaf(bf16_lo(a.w), bf16_lo(b.w), acc);
  return fmaf(bf16_hi(a.w), bf16_hi(b.w), acc);
}

// Chunk i of the weight row as 8 BF16 values: loaded as they are, or (FP32 weights) two 16-byte loads
// rounded to BF16 to nearest even (exact for K3's router, whose FP32 values are BF16 values).
template <class C>
__device__ __forceinline__ uint4 weight_chunk(const void* w, size_t chunk) {
  if constexpr (!C::kWeightF32) {
    return __ldg(static_cast<const uint4*>(w) + chunk);
  } else {
    const float4 a = __ldg(static_cast<const float4*>(w) + 2 * chunk);
    const float4 b = __ldg(static_cast<const float4*>(w) + 2 * chunk + 1);
    return make_uint4(pack_bf16x2(a.x, a.y), pack_bf16x2(a.z, a.w), pack_bf16x2(b.x, b.y),
                      pack_bf16x2(b.z, b.w));
  }
}

template <class C>
__device__ __forceinline__ void logits(const __nv_bfloat16* x, const void* w, float* out, int rows) {
  constexpr int kChunks = C::kHidden / 8;            // 16-byte chunks of a row
  constexpr int kPerLane = kChunks / 32;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int e = blockIdx.x * kWarps + warp;
  const int m0 = blockIdx.y * kRows;
  const int n = min(kRows, rows - m0);
  if (e >= C::kExperts || n <= 0) {
    griddep_wait();
    griddep_launch_dependents();
    return;
  }
  const size_t wr = static_cast<size_t>(e) * kChunks + lane;   // chunk index of the lane's first chunk
  const uint4* xr = reinterpret_cast<const uint4*>(x) + static_cast<size_t>(m0) * kChunks + lane;
  // The weight is a constant of the model: its first chunk loads before the wait on x's producer.
  uint4 wc = weight_chunk<C>(w, wr);
  griddep_wait();
  griddep_launch_dependents();
  float acc[kRows];
#pragma unroll
  for (int t = 0; t < kRows; ++t) acc[t] = 0.f;
#pragma unroll C::kWeightF32 ? 2 : 4
  for (int i = 0; i < kPerLane; ++i) {
    const uint4 wn = i + 1 < kPerLane ? weight_chunk<C>(w, wr + (i + 1) * 32) : wc;
#pragma unroll
    for (int t = 0; t < kRows; ++t)
      if (t < n) acc[t] = dot8(__ldg(xr + static_cast<size_t>(t) * kChunks + i * 32), wc, acc[t]);
    wc = wn;
  }
#pragma unroll
  for (int t = 0; t < kRows; ++t) {
    float v = acc[t];
#pragma unroll
    for (int d = 16; d >= 1; d >>= 1) v += __shfl_xor_sync(0xffffffffu, v, d);
    if (lane == 0 && t < n) out[static_cast<size_t>(m0 + t) * C::kExperts + e] = v;
  }
}

}  // namespace router
}  // namespace k3gen
