// tcgen05 primitives of the SM100 family (sm_100a, sm_103a, sm_107a) for kernels written as NVRTC C++
// with inline PTX: the shared-memory matrix descriptor, the kind::f16 instruction descriptor, MMA
// issue and commit, the thread-sync fences, TMEM allocation and 32x32b loads. The field layouts are
// k3gen/arch/sm100.py's (the CPU tests replay them); the mla_decode tcgen05 kernel keeps its own copy
// (mla/decode_tc.cuh) so that its sources stay as they were built.
#pragma once

#include "k3gen/common/sm90_async.cuh"

#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM100_ALL) && !defined(__CUDA_ARCH_FEAT_SM103_ALL) && \
    !defined(__CUDA_ARCH_FEAT_SM107_ALL) && !defined(__CUDA_ARCH_FAMILY_SPECIFIC__)
#error "tcgen05 needs an arch-specific sm_10xa target"
#endif

namespace k3gen {
namespace tc05 {

// Shared-memory matrix descriptor: SM90's (start >> 4, LBO >> 4, SBO >> 4, 128B swizzle) plus the
// fixed version field (bits 46..48 = 1) tcgen05 requires.
template <unsigned kLbo, unsigned kSbo>
__host__ __device__ constexpr unsigned long long desc_sw128(unsigned addr) {
  return sm90::wgmma_desc<kLbo, kSbo, 1>(addr) | (1ull << 46);
}

// kind::f16 instruction descriptor, F32 accumulator (bits 4-5 = 1), A and B BF16 (bits 7-9, 10-12 =
// 1) or F16 (0), both K-major, N >> 3 at bits 17-22, M >> 4 at bits 24-28.
template <bool kBf16, int M, int N>
__host__ __device__ constexpr unsigned idesc_f16() {
  static_assert((M == 64 && N % 8 == 0) || (M == 128 && N % 16 == 0), "kind::f16 cta_group::1 N step");
  static_assert(N >= 8 && N <= 256, "kind::f16 N range");
  return (1u << 4) | (kBf16 ? (1u << 7) | (1u << 10) : 0u) | (static_cast<unsigned>(N >> 3) << 17) |
         (static_cast<unsigned>(M >> 4) << 24);
}

// D[tmem] (+)= A[desc a] x B[desc b]^T; acc = 0 overwrites D (the first K step of a tile).
__device__ __forceinline__ void mma_f16(unsigned d_tmem, unsigned long long a, unsigned long long b, unsigned id,
                                        int acc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %4, 0;\n"
      "tcgen05.mma.cta_group::1.kind::f16 [%0], %1, %2, %3, p;\n}\n" ::"r"(d_tmem),
      "l"(a), "l"(b), "r"(id), "r"(acc)
      : "memory");
}

// Arrives once on `bar` when every tcgen05 operation this thread issued before it has completed.
__device__ __forceinline__ void commit(unsigned bar) {
  asm volatile("tcgen05.commit.cta_group::1.mbarrier::arrive::one.shared::cluster.b64 [%0];\n" ::"r"(bar)
               : "memory");
}
__device__ __forceinline__ void fence_before() { asm volatile("tcgen05.fence::before_thread_sync;\n" ::: "memory"); }
__device__ __forceinline__ void fence_after() { asm volatile("tcgen05.fence::after_thread_sync;\n" ::: "memory"); }

// Whole warp: `cols` TMEM columns (a power of two >= 32), base address written to shared `slot`.
__device__ __forceinline__ void alloc(unsigned slot, int cols) {
  asm volatile("tcgen05.alloc.cta_group::1.sync.aligned.shared::cta.b32 [%0], %1;\n" ::"r"(slot), "r"(cols)
               : "memory");
  asm volatile("tcgen05.relinquish_alloc_permit.cta_group::1.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void dealloc(unsigned taddr, int cols) {
  asm volatile("tcgen05.dealloc.cta_group::1.sync.aligned.b32 %0, %1;\n" ::"r"(taddr), "r"(cols) : "memory");
}

// Whole warp: 8 consecutive FP32 columns of this thread's TMEM lane (warp w % 4 reads lanes 32 (w % 4)
// .. + 31), not yet waited for (wait_ld before use).
__device__ __forceinline__ void ld8(unsigned taddr, float (&v)[8]) {
  unsigned (&r)[8] = reinterpret_cast<unsigned (&)[8]>(v);
  asm volatile("tcgen05.ld.sync.aligned.32x32b.x8.b32 {%0, %1, %2, %3, %4, %5, %6, %7}, [%8];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]), "=r"(r[4]), "=r"(r[5]), "=r"(r[6]), "=r"(r[7])
               : "r"(taddr)
               : "memory");
}
__device__ __forceinline__ void wait_ld() { asm volatile("tcgen05.wait::ld.sync.aligned;\n" ::: "memory"); }

}  // namespace tc05
}  // namespace k3gen
