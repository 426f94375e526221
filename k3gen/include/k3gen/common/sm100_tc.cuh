// The tcgen05 layer of the SM100 family (sm_100a, sm_103a, sm_107a) shared by the NVRTC kernels that
// use it (mla/decode_tc.cuh, mla/decode_tm.cuh, mla/prefill_tc.cuh, kda/prefill_chunk64_tc.cuh, moe/experts_tc.cuh):
// shared-memory and instruction descriptors, the
// kind::f16 MMA with its commit, the thread-sync fences, TMEM allocation and the 32x32b TMEM loads
// and stores. k3gen/arch/sm100.py holds the same encoders in Python; each kernel's template
// static_asserts that both agree.
//
// Nothing here is arch-guarded: only the kernels that call it are compiled for sm_10xa.
#pragma once

#include "k3gen/common/sm90_async.cuh"

namespace k3gen {
namespace sm100 {

// Shared-memory matrix descriptor: the SM90 one (start >> 4, LBO >> 4, SBO >> 4, 128B swizzle at
// bits 62..63 = tcgen05's 3-bit field 61..63 value 2) plus tcgen05's fixed version bits 46..48 = 1.
template <unsigned kLbo, unsigned kSbo>
__host__ __device__ constexpr unsigned long long desc(unsigned addr) {
  return sm90::wgmma_desc<kLbo, kSbo, 1>(addr) | (1ull << 46);
}
// Instruction descriptor of kind::f16: D F32 (bits 4-5 = 1), A/B format (bits 7-9 / 10-12: 0 F16,
// 1 BF16), A / B major (bits 15 / 16: 1 = MN-major), N >> 3 (bits 17-22), M >> 4 (bits 24-28).
template <bool kBf16, bool kBMn, int M, int N, bool kAMn = false>
__host__ __device__ constexpr unsigned idesc() {
  static_assert((M == 64 && N % 8 == 0) || (M == 128 && N % 16 == 0), "kind::f16 cta_group::1 N step");
  static_assert(N >= 8 && N <= 256, "kind::f16 N range");
  return (1u << 4) | (kBf16 ? (1u << 7) | (1u << 10) : 0u) | (kAMn ? 1u << 15 : 0u) | (kBMn ? 1u << 16 : 0u) |
         (static_cast<unsigned>(N >> 3) << 17) | (static_cast<unsigned>(M >> 4) << 24);
}
// D (TMEM) (+)= A B, A and B from shared memory through descriptors; acc = 0 overwrites D.
__device__ __forceinline__ void mma(unsigned d_tmem, unsigned long long a, unsigned long long b, unsigned id,
                                    int acc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %4, 0;\n"
      "tcgen05.mma.cta_group::1.kind::f16 [%0], %1, %2, %3, p;\n}\n" ::"r"(d_tmem),
      "l"(a), "l"(b), "r"(id), "r"(acc)
      : "memory");
}
// Arrives on `bar` once every tcgen05 op this thread issued before it has completed.
__device__ __forceinline__ void commit(unsigned bar) {
  asm volatile("tcgen05.commit.cta_group::1.mbarrier::arrive::one.shared::cluster.b64 [%0];\n" ::"r"(bar)
               : "memory");
}
__device__ __forceinline__ void fence_before() { asm volatile("tcgen05.fence::before_thread_sync;\n" ::: "memory"); }
__device__ __forceinline__ void fence_after() { asm volatile("tcgen05.fence::after_thread_sync;\n" ::: "memory"); }
__device__ __forceinline__ void tmem_alloc(unsigned slot, int cols) {
  asm volatile("tcgen05.alloc.cta_group::1.sync.aligned.shared::cta.b32 [%0], %1;\n" ::"r"(slot), "r"(cols)
               : "memory");
  asm volatile("tcgen05.relinquish_alloc_permit.cta_group::1.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void tmem_dealloc(unsigned taddr, int cols) {
  asm volatile("tcgen05.dealloc.cta_group::1.sync.aligned.b32 %0, %1;\n" ::"r"(taddr), "r"(cols) : "memory");
}
// 32 consecutive FP32 columns of this thread's TMEM lane (warp w of a warpgroup: lanes 32 w ..), not
// waited for: several loads may be in flight before one wait_ld.
__device__ __forceinline__ void ld32_async(unsigned taddr, float (&v)[32]) {
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
}
__device__ __forceinline__ void wait_ld() { asm volatile("tcgen05.wait::ld.sync.aligned;\n" ::: "memory"); }
// A tcgen05.ld's destination registers are defined, for the compiler, at the load, but hold the data
// only after tcgen05.wait::ld: pinning them after the wait keeps every use of them below it (NVVM
// may otherwise hoist register-only arithmetic above an asm statement it does not depend on).
template <int N>
__device__ __forceinline__ void pin(float (&v)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(v[i])::"memory");
}
// 8 consecutive FP32 columns of this thread's TMEM lane, not waited for (wait_ld, then pin).
__device__ __forceinline__ void ld8_async(unsigned taddr, float (&v)[8]) {
  unsigned (&r)[8] = reinterpret_cast<unsigned (&)[8]>(v);
  asm volatile("tcgen05.ld.sync.aligned.32x32b.x8.b32 {%0, %1, %2, %3, %4, %5, %6, %7}, [%8];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]), "=r"(r[4]), "=r"(r[5]), "=r"(r[6]), "=r"(r[7])
               : "r"(taddr)
               : "memory");
}
// 16 consecutive FP32 columns of this thread's TMEM lane, not waited for (wait_ld, then pin).
__device__ __forceinline__ void ld16_async(unsigned taddr, float* v) {
  unsigned* r = reinterpret_cast<unsigned*>(v);
  asm volatile(
      "tcgen05.ld.sync.aligned.32x32b.x16.b32 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, "
      "%15}, [%16];\n"
      : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]), "=r"(r[4]), "=r"(r[5]), "=r"(r[6]), "=r"(r[7]),
        "=r"(r[8]), "=r"(r[9]), "=r"(r[10]), "=r"(r[11]), "=r"(r[12]), "=r"(r[13]), "=r"(r[14]), "=r"(r[15])
      : "r"(taddr)
      : "memory");
}
// 16 FP32 columns of this thread's TMEM lane from registers, waited for.
__device__ __forceinline__ void st16(unsigned taddr, const float* v) {
  const unsigned* r = reinterpret_cast<const unsigned*>(v);
  asm volatile(
      "tcgen05.st.sync.aligned.32x32b.x16.b32 [%0], {%1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, "
      "%15, %16};\n" ::"r"(taddr),
      "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]), "r"(r[4]), "r"(r[5]), "r"(r[6]), "r"(r[7]), "r"(r[8]), "r"(r[9]),
      "r"(r[10]), "r"(r[11]), "r"(r[12]), "r"(r[13]), "r"(r[14]), "r"(r[15])
      : "memory");
  asm volatile("tcgen05.wait::st.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void ld32(unsigned taddr, float (&v)[32]) {
  ld32_async(taddr, v);
  wait_ld();
  pin(v);
}
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

}  // namespace sm100
}  // namespace k3gen
