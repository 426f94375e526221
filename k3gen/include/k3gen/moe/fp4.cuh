// E2M1 (FP4) codes to exact BF16 in registers, and the weight-scale / FP8 decoders of the MoE expert
// GEMM. The values are the ones k3gen/numerics.py decodes (e2m1_decode, ue8m0_decode, e4m3_decode):
// the CPU test replays every step below bit for bit, the GPU test compares the probe kernel's output.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace k3gen {
namespace moe {

using u8 = unsigned char;
using u32 = unsigned int;

// prmt in its generic mode: selector nibble bits 0-2 pick one of the 8 bytes {b, a}, bit 3
// replicates that byte's sign bit over the result byte (__byte_perm has no sign mode).
__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) {
  u32 d;
  asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}

// BF16 bits of the E2M1 magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6 (codes 0..7), split into their low
// and high bytes as two 8-byte prmt pools: {0000, 3F00, 3F80, 3FC0, 4000, 4040, 4080, 40C0}.
constexpr u32 kE2m1Lo0 = 0xC0800000u, kE2m1Lo1 = 0xC0804000u;
constexpr u32 kE2m1Hi0 = 0x3F3F3F00u, kE2m1Hi1 = 0x40404040u;

// Eight E2M1 codes (code i in bits 4i..4i+3, i.e. a little-endian word of the packed checkpoint
// bytes: even element in the low nibble) -> four bf16x2, pair q = codes (2q, 2q+1) with the lower K
// in the low half. Two table lookups per four codes give the low and high bytes, two more
// interleave them, and the sign (code bit 3) is the sign-replicated byte of w << 4 (even codes) or
// w (odd codes) masked to bit 15 / 31: 19 integer ops per 8 values, no shared memory, exact.
__device__ __forceinline__ void e2m1x8_to_bf16(u32 w, u32 (&q)[4]) {
  const u32 m = w & 0x77777777u, mh = m >> 16, w4 = w << 4;
  const u32 lo_a = prmt(kE2m1Lo0, kE2m1Lo1, m), hi_a = prmt(kE2m1Hi0, kE2m1Hi1, m);
  const u32 lo_b = prmt(kE2m1Lo0, kE2m1Lo1, mh), hi_b = prmt(kE2m1Hi0, kE2m1Hi1, mh);
  q[0] = prmt(lo_a, hi_a, 0x5140u) | (prmt(w4, w, 0xCC88u) & 0x80008000u);
  q[1] = prmt(lo_a, hi_a, 0x7362u) | (prmt(w4, w, 0xDD99u) & 0x80008000u);
  q[2] = prmt(lo_b, hi_b, 0x5140u) | (prmt(w4, w, 0xEEAAu) & 0x80008000u);
  q[3] = prmt(lo_b, hi_b, 0x7362u) | (prmt(w4, w, 0xFFBBu) & 0x80008000u);
}

__device__ __forceinline__ u32 bf16x2_mul(u32 a, u32 b) {
  u32 d;
  asm("mul.rn.bf16x2 %0, %1, %2;\n" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

// UE8M0 byte -> BF16 bits of 2^(b - 127), both halves (b = 0: 2^-127, a BF16 subnormal; 255: NaN).
__device__ __forceinline__ u32 ue8m0_bf16x2(u32 b) {
  const u32 h = b == 0u ? 0x0040u : (b == 255u ? 0x7FC0u : (b << 7));
  return h | (h << 16);
}

// E4M3 byte -> its FP32 value (exact; 0x7F / 0xFF are NaN), as numerics.e4m3_decode.
__device__ __forceinline__ float e4m3_value(u32 c) {
  const u32 e = (c >> 3) & 15u, m = c & 7u;
  float mag = e == 0u ? static_cast<float>(m) * 0.001953125f : __uint_as_float(((e + 120u) << 23) | (m << 20));
  if ((c & 0x7Fu) == 0x7Fu) mag = __uint_as_float(0x7FC00000u);
  return (c & 0x80u) ? -mag : mag;
}

// E4M3 byte -> BF16 bits, both halves (every E4M3 value is a BF16 value: the FP32 bits' top half).
__device__ __forceinline__ u32 e4m3_bf16x2(u32 c) {
  const u32 h = __float_as_uint(e4m3_value(c)) >> 16;
  return h | (h << 16);
}

// UE8M0 byte -> FP32 2^(b - 127), as numerics.ue8m0_decode.
__device__ __forceinline__ float ue8m0_value(u32 b) {
  return b == 0u ? __uint_as_float(0x00400000u) : (b == 255u ? __uint_as_float(0x7FC00000u) : __uint_as_float(b << 23));
}

// Four E4M3 activation codes (little-endian word, value i in byte i) -> two bf16x2 (0,1), (2,3),
// exact (E4M3 -> F16 by the hardware conversion, F16 -> F32 -> BF16 without rounding).
__device__ __forceinline__ void e4m3x4_to_bf16(u32 w, u32& p01, u32& p23) {
  u32 h01, h23;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(h01) : "h"(static_cast<unsigned short>(w & 0xFFFFu)));
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(h23) : "h"(static_cast<unsigned short>(w >> 16)));
  const float2 f01 = __half22float2(*reinterpret_cast<const __half2*>(&h01));
  const float2 f23 = __half22float2(*reinterpret_cast<const __half2*>(&h23));
  const __nv_bfloat162 b01 = __floats2bfloat162_rn(f01.x, f01.y), b23 = __floats2bfloat162_rn(f23.x, f23.y);
  p01 = *reinterpret_cast<const u32*>(&b01);
  p23 = *reinterpret_cast<const u32*>(&b23);
}

}  // namespace moe
}  // namespace k3gen
