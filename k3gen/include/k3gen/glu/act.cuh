// glu_act: the gated activation of a [gate | up] BF16 row, rounded to BF16 and quantized to E4M3
// per 128 columns (contract: k3gen/ops/glu_act/spec.py). One warp per (row, group), 4 columns per
// lane: one 8-byte load of gate and one of up, one 4-byte store of codes.
#pragma once

#include <cuda_bf16.h>

#include "k3gen/common/pdl.cuh"
#include "k3gen/common/quant.cuh"
#include "k3gen/mla/proj.cuh"     // ue8m0_ceil: the act_quant_fp8 rule

namespace k3gen {
namespace glu {

constexpr int kWarps = 4;
constexpr unsigned kFull = 0xffffffffu;

// FP64 throughout, each operation rounded once (the __d*_rn intrinsics keep the compiler from
// contracting into FMAs), then FP32, then BF16: what the reference computes with torch float64.
template <class C>
__device__ __forceinline__ float act(float gf, float uf) {
  const double g = gf, u = uf;
  const double s = __ddiv_rn(1.0, __dadd_rn(1.0, exp(-g)));
  double h;
  if constexpr (C::kSitu) {
    const double a = __dmul_rn(C::kBeta, tanh(__ddiv_rn(g, C::kBeta)));
    const double b = __dmul_rn(C::kLinearBeta, tanh(__ddiv_rn(u, C::kLinearBeta)));
    h = __dmul_rn(__dmul_rn(a, s), b);
  } else {
    h = __dmul_rn(__dmul_rn(g, s), u);
  }
  return mla::bf16_round(__double2float_rn(h));
}

template <class C>
__device__ __forceinline__ void glu_act(const __nv_bfloat16* gu, unsigned char* codes, void* scales, int rows) {
  constexpr int kGroups = C::kInter / 128;
  griddep_launch_dependents();
  const int lane = threadIdx.x & 31;
  const long long g = static_cast<long long>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  if (g >= static_cast<long long>(rows) * kGroups) return;
  const long long row = g / kGroups;
  const int col = static_cast<int>(g % kGroups) * 128 + lane * 4;
  griddep_wait();
  const __nv_bfloat16* r = gu + row * (2LL * C::kInter);
  const uint2 gv = *reinterpret_cast<const uint2*>(r + col);
  const uint2 uv = *reinterpret_cast<const uint2*>(r + C::kInter + col);
  float y[4] = {act<C>(bf16_lo(gv.x), bf16_lo(uv.x)), act<C>(bf16_hi(gv.x), bf16_hi(uv.x)),
                act<C>(bf16_lo(gv.y), bf16_lo(uv.y)), act<C>(bf16_hi(gv.y), bf16_hi(uv.y))};
  float amax = fmaxf(fmaxf(fabsf(y[0]), fabsf(y[1])), fmaxf(fabsf(y[2]), fabsf(y[3])));
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(kFull, amax, o));
  const float t = __fdiv_rn(amax, 448.f);
  float q[4];
  if constexpr (C::kUe8m0) {
    // y / 2^(b - 127) is exact as y * 2^(127 - b) (b <= 254 for finite rows; b == 0: 2^127).
    const unsigned b = mla::ue8m0_ceil(t);
    const float inv = b == 254u ? __uint_as_float(0x00400000u) : __uint_as_float((254u - b) << 23);
#pragma unroll
    for (int i = 0; i < 4; ++i) q[i] = __fmul_rn(y[i], inv);
    if (lane == 0) static_cast<unsigned char*>(scales)[g] = static_cast<unsigned char>(b);
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) q[i] = t == 0.f ? 0.f : __fdiv_rn(y[i], t);   // +0 codes for an all-zero group
    if (lane == 0) static_cast<float*>(scales)[g] = t;
  }
  *reinterpret_cast<unsigned*>(codes + row * C::kInter + col) = e4m3x4(q);
}

}  // namespace glu
}  // namespace k3gen
