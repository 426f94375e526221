// Device quantizers shared by k3gen kernels. Bit-exact with k3gen/numerics.py: any change
// here must be mirrored there (and tests/nogpu/test_quant.py pins the reference to ml_dtypes).
#pragma once

#include <cuda_bf16.h>

namespace k3gen {

// ---- BF16 unpacking: a 32-bit word holds element 0 in its low half (little endian). ----------
__device__ __forceinline__ float bf16_lo(unsigned w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_hi(unsigned w) { return __uint_as_float(w & 0xffff0000u); }
// Two floats -> one BF16 pair, each rounded to nearest even (lo in the low half).
__device__ __forceinline__ unsigned pack_bf16x2(float lo, float hi) {
  const __nv_bfloat162 p = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const unsigned*>(&p);
}

// 8 BF16 in a uint4 -> 8 floats (exact).
__device__ __forceinline__ void bf16x8_to_float(const uint4& v, float* out) {
  out[0] = bf16_lo(v.x); out[1] = bf16_hi(v.x);
  out[2] = bf16_lo(v.y); out[3] = bf16_hi(v.y);
  out[4] = bf16_lo(v.z); out[5] = bf16_hi(v.z);
  out[6] = bf16_lo(v.w); out[7] = bf16_hi(v.w);
}

// max |x| over 8 BF16. fmaxf drops NaN where torch.amax keeps it: NaN input is unspecified.
__device__ __forceinline__ float bf16x8_amax(const uint4& v) {
  float m = 0.f;
  const unsigned w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    m = fmaxf(m, fabsf(bf16_lo(w[i])));
    m = fmaxf(m, fabsf(bf16_hi(w[i])));
  }
  return m;
}

// ---- E4M3 (sm_89+) -----------------------------------------------------------------------------
// cvt puts its FIRST source in the HIGH byte; this wrapper takes memory order (lo, hi).
__device__ __forceinline__ unsigned e4m3x2(float lo, float hi) {
  unsigned short r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  return r;
}

__device__ __forceinline__ unsigned e4m3(float x) { return e4m3x2(x, 0.f) & 0xffu; }

// 4 floats -> 4 E4M3 bytes, v[0] in the lowest byte.
__device__ __forceinline__ unsigned e4m3x4(const float* v) {
  return e4m3x2(v[0], v[1]) | (e4m3x2(v[2], v[3]) << 16);
}

// Exact decode; 0x7F/0xFF are NaN.
__device__ __forceinline__ float e4m3_to_float(unsigned code) {
  const unsigned e = (code >> 3) & 15u, m = code & 7u;
  float mag = e == 0u ? static_cast<float>(m) * 0.001953125f                 // m * 2^-9
                      : __uint_as_float(((e + 120u) << 23) | (m << 20));      // (1+m/8) 2^(e-7)
  if ((code & 0x7fu) == 0x7fu) mag = __uint_as_float(0x7fc00000u);
  return (code & 0x80u) ? -mag : mag;
}

// ---- E2M1 --------------------------------------------------------------------------------------
// Software RNE on the grid 0,.5,1,1.5,2,3,4,6, saturating at 6. At a tie the even code wins:
// ties at .25, 1.25, 2.5, 5 round down (strict >), ties at .75, 1.75, 3.5 round up (>=).
// Bit 3 is the input's sign bit, as the hardware cvt does (-0.1 -> 0x8).
__device__ __forceinline__ unsigned e2m1_sw(float x) {
  const float a = fabsf(x);
  const unsigned c = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) +
                     (a >= 3.5f) + (a > 5.0f);
  return c | ((__float_as_uint(x) >> 28) & 8u);
}

// 8 floats -> 8 E2M1 nibbles in 32 bits, v[0] in the lowest nibble.
template <bool kHw>
__device__ __forceinline__ unsigned e2m1x8(const float* v) {
  if constexpr (kHw) {
    // sm_100a family: cvt puts its FIRST source in the HIGH nibble, so odd elements go first.
    unsigned r;
    asm("{\n\t.reg .b8 b0, b1, b2, b3;\n\t"
        "cvt.rn.satfinite.e2m1x2.f32 b0, %2, %1;\n\t"
        "cvt.rn.satfinite.e2m1x2.f32 b1, %4, %3;\n\t"
        "cvt.rn.satfinite.e2m1x2.f32 b2, %6, %5;\n\t"
        "cvt.rn.satfinite.e2m1x2.f32 b3, %8, %7;\n\t"
        "mov.b32 %0, {b0, b1, b2, b3};\n\t}"
        : "=r"(r)
        : "f"(v[0]), "f"(v[1]), "f"(v[2]), "f"(v[3]), "f"(v[4]), "f"(v[5]), "f"(v[6]), "f"(v[7]));
    return r;
  } else {
    unsigned r = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) r |= e2m1_sw(v[i]) << (4 * i);
    return r;
  }
}

// ---- NVFP4 block scale -------------------------------------------------------------------------
// Stored scale E4M3_satfinite((amax / 6) * G): two separately rounded FP32 ops (the explicit
// intrinsics keep the compiler from contracting or using a reciprocal).
__device__ __forceinline__ unsigned nvfp4_scale_code(float amax, float G) {
  return e4m3(__fmul_rn(__fdiv_rn(amax, 6.0f), G));
}

// Dequant step the codes are computed with: the STORED scale over G.
__device__ __forceinline__ float nvfp4_step(unsigned scale_code, float G) {
  return __fdiv_rn(e4m3_to_float(scale_code), G);
}

// Code-domain value x / d with IEEE division; 0 where d == 0 (an all-zero block).
__device__ __forceinline__ float div_or_zero(float x, float d) {
  return d == 0.f ? 0.f : __fdiv_rn(x, d);
}

}  // namespace k3gen
