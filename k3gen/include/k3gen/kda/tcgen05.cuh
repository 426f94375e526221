// The few tcgen05 (SM100 family) primitives KDA's chunk64_tc state pass issues. Local to kda/ on
// purpose: mla/decode_tc.cuh has its own copies inside the MLA namespace and may be refactored
// into a common header; these do not depend on it. Encodings are the ones k3gen/arch/sm100.py
// models (idesc_f16, umma_desc); the kda_prefill template's static_asserts compare them.
#pragma once

#include "k3gen/common/sm90_async.cuh"

namespace k3gen {
namespace kda {
namespace tc5 {

// Shared-memory matrix descriptor of a 128B-swizzled K-major operand: SM90's wgmma fields (start
// >> 4; LBO 16, unused by swizzled K-major layouts; SBO 1024 between 8-row groups; the 128B swizzle
// at bits 62-63, which is tcgen05's 3-bit field 61-63 holding 2) plus tcgen05's fixed version bits
// 46-48 = 1.
__host__ __device__ constexpr unsigned long long desc_sw128(unsigned addr) {
  return sm90::wgmma_desc<16, 1024, 1>(addr) | (1ull << 46);
}

// kind::f16 instruction descriptor: F32 accumulator (bits 4-5 = 1), BF16 A and B (bits 7-9 and
// 10-12 = 1), both K-major (bits 15, 16 = 0), N >> 3 at bits 17-22, M >> 4 at bits 24-28.
template <int M, int N>
__host__ __device__ constexpr unsigned idesc_bf16() {
  static_assert(M == 128 && N % 16 == 0 && N >= 16 && N <= 256, "cta_group::1 M = 128 shapes only");
  return (1u << 4) | (1u << 7) | (1u << 10) | (static_cast<unsigned>(N >> 3) << 17) |
         (static_cast<unsigned>(M >> 4) << 24);
}

// D (TMEM) = A B^T (+ D when acc != 0), A and B from shared memory; one thread issues.
__device__ __forceinline__ void mma(unsigned d_tmem, unsigned long long a, unsigned long long b, unsigned id,
                                    int acc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %4, 0;\n"
      "tcgen05.mma.cta_group::1.kind::f16 [%0], %1, %2, %3, p;\n}\n" ::"r"(d_tmem),
      "l"(a), "l"(b), "r"(id), "r"(acc)
      : "memory");
}
// Arrives once on mbarrier `bar` when every tcgen05 operation this thread issued so far has
// completed (their shared-memory reads included).
__device__ __forceinline__ void commit(unsigned bar) {
  asm volatile("tcgen05.commit.cta_group::1.mbarrier::arrive::one.shared::cluster.b64 [%0];\n" ::"r"(bar)
               : "memory");
}
// Order tcgen05 operations around a thread synchronisation (an mbarrier or bar.sync).
__device__ __forceinline__ void fence_before() { asm volatile("tcgen05.fence::before_thread_sync;\n" ::: "memory"); }
__device__ __forceinline__ void fence_after() { asm volatile("tcgen05.fence::after_thread_sync;\n" ::: "memory"); }

// Whole warp: `cols` TMEM columns, the base address written to shared `slot`.
__device__ __forceinline__ void tmem_alloc(unsigned slot, int cols) {
  asm volatile("tcgen05.alloc.cta_group::1.sync.aligned.shared::cta.b32 [%0], %1;\n" ::"r"(slot), "r"(cols)
               : "memory");
  asm volatile("tcgen05.relinquish_alloc_permit.cta_group::1.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void tmem_dealloc(unsigned taddr, int cols) {
  asm volatile("tcgen05.dealloc.cta_group::1.sync.aligned.b32 %0, %1;\n" ::"r"(taddr), "r"(cols) : "memory");
}

// 32 consecutive FP32 columns of this thread's TMEM lane (warp w % 4 reaches lanes 32 (w % 4) ..).
// The wait takes the registers as in/out operands, so no use of them can be scheduled above it.
__device__ __forceinline__ void ld32(unsigned taddr, float (&v)[32]) {
  unsigned (&r)[32] = reinterpret_cast<unsigned (&)[32]>(v);
  asm volatile(
      "tcgen05.ld.sync.aligned.32x32b.x32.b32 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, "
      "%15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, [%32];\n"
      : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]), "=r"(r[4]), "=r"(r[5]), "=r"(r[6]), "=r"(r[7]),
        "=r"(r[8]), "=r"(r[9]), "=r"(r[10]), "=r"(r[11]), "=r"(r[12]), "=r"(r[13]), "=r"(r[14]), "=r"(r[15]),
        "=r"(r[16]), "=r"(r[17]), "=r"(r[18]), "=r"(r[19]), "=r"(r[20]), "=r"(r[21]), "=r"(r[22]), "=r"(r[23]),
        "=r"(r[24]), "=r"(r[25]), "=r"(r[26]), "=r"(r[27]), "=r"(r[28]), "=r"(r[29]), "=r"(r[30]), "=r"(r[31])
      : "r"(taddr)
      : "memory");
  asm volatile("tcgen05.wait::ld.sync.aligned;\n"
               : "+r"(r[0]), "+r"(r[1]), "+r"(r[2]), "+r"(r[3]), "+r"(r[4]), "+r"(r[5]), "+r"(r[6]), "+r"(r[7]),
                 "+r"(r[8]), "+r"(r[9]), "+r"(r[10]), "+r"(r[11]), "+r"(r[12]), "+r"(r[13]), "+r"(r[14]),
                 "+r"(r[15]), "+r"(r[16]), "+r"(r[17]), "+r"(r[18]), "+r"(r[19]), "+r"(r[20]), "+r"(r[21]),
                 "+r"(r[22]), "+r"(r[23]), "+r"(r[24]), "+r"(r[25]), "+r"(r[26]), "+r"(r[27]), "+r"(r[28]),
                 "+r"(r[29]), "+r"(r[30]), "+r"(r[31])
               :
               : "memory");
}
// The store twin; waits until the columns are written (before a fence and an arrive hand them to
// the MMA).
__device__ __forceinline__ void st32(unsigned taddr, const float (&v)[32]) {
  const unsigned (&r)[32] = reinterpret_cast<const unsigned (&)[32]>(v);
  asm volatile(
      "tcgen05.st.sync.aligned.32x32b.x32.b32 [%0], {%1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, "
      "%15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32};\n" ::"r"(taddr),
      "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]), "r"(r[4]), "r"(r[5]), "r"(r[6]), "r"(r[7]), "r"(r[8]), "r"(r[9]),
      "r"(r[10]), "r"(r[11]), "r"(r[12]), "r"(r[13]), "r"(r[14]), "r"(r[15]), "r"(r[16]), "r"(r[17]), "r"(r[18]),
      "r"(r[19]), "r"(r[20]), "r"(r[21]), "r"(r[22]), "r"(r[23]), "r"(r[24]), "r"(r[25]), "r"(r[26]), "r"(r[27]),
      "r"(r[28]), "r"(r[29]), "r"(r[30]), "r"(r[31])
      : "memory");
  asm volatile("tcgen05.wait::st.sync.aligned;\n" ::: "memory");
}

}  // namespace tc5
}  // namespace kda
}  // namespace k3gen
