// Device helpers of the FP8 block-scaled GEMMs: stored-scale decoding, the distributed shared
// memory reduction of a thread-block cluster, and BF16 output packing.
#pragma once

#include <cuda_bf16.h>

namespace k3gen {
namespace fp8gemm {

// Value of one stored scale. UE8M0 byte b is 2^(b-127): 0 is the subnormal 2^-127, 255 is NaN.
template <bool kUe8m0>
__device__ __forceinline__ float scale_value(const void* base, long long i) {
  if constexpr (kUe8m0) {
    const unsigned b = static_cast<const unsigned char*>(base)[i];
    if (b == 0u) return __uint_as_float(0x00400000u);
    if (b == 255u) return __uint_as_float(0x7fc00000u);
    return __uint_as_float(b << 23);
  } else {
    return static_cast<const float*>(base)[i];
  }
}

// ---- cluster helpers (distributed shared memory) ------------------------------------------------
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
__device__ __forceinline__ unsigned map_rank(unsigned addr, unsigned rank) {
  unsigned r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(addr), "r"(rank));
  return r;
}
__device__ __forceinline__ float4 ld_cluster_f4(unsigned addr) {
  float4 v;
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];\n"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(addr));
  return v;
}

__device__ __forceinline__ unsigned pack_bf16x2(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const unsigned*>(&v);
}

}  // namespace fp8gemm
}  // namespace k3gen
