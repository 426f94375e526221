// Hopper (sm_90a) asynchronous primitives: mbarriers, TMA tile loads, the wgmma shared-memory
// descriptor for 128B-swizzled K-major tiles, and wgmma.mma_async on E4M3 and BF16 operands
// (BF16 also with a transposed, MN-major A: see WgmmaBf16).
//
// Shared-memory tiles used with these helpers are TMA boxes of 128-byte rows written with
// CU_TENSOR_MAP_SWIZZLE_128B into 1024-byte-aligned buffers: row r sits at r * 128 and its 16-byte
// chunk c at ((c ^ (r % 8)) * 16). That is exactly the PTX canonical K-major SW128 layout
// ((8, m), (16, 8)) : ((128 B, SBO = 1024 B), (1 B, 16 B)) with the 128B swizzle applied to address
// bits [4, 7) ^= [7, 10), so one descriptor per tile serves wgmma, and stepping K by 32 bytes is
// start address + 32 (the swizzle acts on the final address). tests/nogpu/test_fp8_gemm_wgmma.py
// replays this address arithmetic against the PTX definitions.
#pragma once

namespace k3gen {
namespace sm90 {

// Opaque CUtensorMap (128 bytes, 64-byte aligned), passed by value as a __grid_constant__ param.
struct alignas(64) TmaMap {
  unsigned long long v[16];
};

__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// ---- mbarrier ----------------------------------------------------------------------------------
__device__ __forceinline__ void mbar_init(unsigned bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// Makes the initialised barriers visible to the async proxy (TMA) and to the cluster.
__device__ __forceinline__ void fence_mbar_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
// A ring's barriers, one thread: full[s] at full0 + 8 s and empty[s] at empty0 + 8 s for s < S,
// with their expected arrival counts, then the init fence.
__device__ __forceinline__ void mbar_init_ring(unsigned full0, unsigned empty0, int S, unsigned full_count,
                                               unsigned empty_count) {
  for (int s = 0; s < S; ++s) {
    mbar_init(full0 + 8 * s, full_count);
    mbar_init(empty0 + 8 * s, empty_count);
  }
  fence_mbar_init();
}
__device__ __forceinline__ void mbar_arrive(unsigned bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_arrive_expect_tx(unsigned bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ unsigned mbar_try_wait(unsigned bar, unsigned parity) {
  unsigned done;
  asm volatile(
      "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(done)
      : "r"(bar), "r"(parity)
      : "memory");
  return done;
}
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
  while (!mbar_try_wait(bar, parity)) {
  }
}
// The same wait with its poll loop inside one asm block: ptxas sees no data-dependent branch in
// the C++ control flow, so wgmmas may stay in flight across it (a C++ poll loop around
// mbar_try_wait is a divergent path to ptxas, which then serializes every wgmma of the kernel).
__device__ __forceinline__ void mbar_wait_asm(unsigned bar, unsigned parity) {
  asm volatile(
      "{\n.reg .pred p;\nWAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      "@!p bra WAIT_%=;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}
// A phase that never completes (a tx count that does not match the bytes a TMA delivers, a lost
// arrival) would hang the GPU; past ~2^28 polls (seconds, far beyond any legitimate wait) this
// wait traps instead, so the launch fails with an error the caller sees. It costs a register, so
// kernels use it where registers are plentiful (a producer) and the plain wait in MMA loops.
__device__ __forceinline__ void mbar_wait_or_trap(unsigned bar, unsigned parity) {
  for (unsigned polls = 0; !mbar_try_wait(bar, parity);)
    if (++polls > (1u << 28)) __trap();
}

// ---- TMA ---------------------------------------------------------------------------------------
__device__ __forceinline__ void tma_prefetch_map(const TmaMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<unsigned long long>(map)) : "memory");
}
// Box at (c0 = innermost element, c1 = row) into shared `dst`; completes `bytes` of `bar`'s tx count
// (out-of-bounds parts of the box are zero-filled and still counted).
__device__ __forceinline__ void tma_load_2d(unsigned dst, const TmaMap* map, int c0, int c1, unsigned bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(
          dst),
      "l"(reinterpret_cast<unsigned long long>(map)), "r"(c0), "r"(c1), "r"(bar)
      : "memory");
}
// Pulls the box at (c0, c1) into L2 only (no shared memory, no barrier): starts DRAM reads of a
// block the ring has no stage for yet.
// 1-D bulk copy of `bytes` (multiple of 16, 16-byte aligned ends) into this CTA's shared memory,
// completing on mbarrier `bar` as transaction bytes.
__device__ __forceinline__ void bulk_load(unsigned dst, const void* src, unsigned bytes, unsigned bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
      "l"(src), "r"(bytes), "r"(bar)
      : "memory");
}

__device__ __forceinline__ void tma_prefetch_l2_2d(const TmaMap* map, int c0, int c1) {
  asm volatile("cp.async.bulk.prefetch.tensor.2d.L2.global.tile [%0, {%1, %2}];\n" ::"l"(
                   reinterpret_cast<unsigned long long>(map)),
               "r"(c0), "r"(c1)
               : "memory");
}
// Orders this thread's generic-proxy shared accesses with the async proxy (TMA, wgmma).
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// CTA barrier that warps may reach from different code paths (the non-.aligned form; __syncthreads
// is bar.sync.aligned, which requires every thread to execute the same instruction).
__device__ __forceinline__ void barrier_sync_divergent(unsigned id, unsigned threads) {
  asm volatile("barrier.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// Arrives on named barrier `id` without waiting (producer side of a barrier_sync_divergent on the
// same id and thread count).
__device__ __forceinline__ void barrier_arrive(unsigned id, unsigned threads) {
  asm volatile("barrier.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// Warpgroup-wide register budget changes (all 128 threads of the warpgroup execute them).
template <int R>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(R));
}
template <int R>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(R));
}

// ---- wgmma -------------------------------------------------------------------------------------
// Descriptor fields (PTX "matrix descriptor"): start >> 4 in bits 0-13, LBO >> 4 in 16-29, SBO >> 4
// in 32-45, base offset 0 (buffers are 1024-byte aligned), layout type in 62-63 (1 = 128B swizzle).
template <unsigned kLbo, unsigned kSbo, unsigned kLayout>
__host__ __device__ constexpr unsigned long long wgmma_desc(unsigned smem_byte_addr) {
  return static_cast<unsigned long long>((smem_byte_addr & 0x3FFFFu) >> 4) |
         (static_cast<unsigned long long>((kLbo & 0x3FFFFu) >> 4) << 16) |
         (static_cast<unsigned long long>((kSbo & 0x3FFFFu) >> 4) << 32) |
         (static_cast<unsigned long long>(kLayout & 3u) << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Pins accumulator registers at this point of the program: the compiler may not move reads or
// writes of `r` across it (so nothing touches a wgmma accumulator while the MMA is in flight).
__device__ __forceinline__ void fence_operand(float& r) { asm volatile("" : "+f"(r)::"memory"); }

// D[64 x N] (+)= A[64 x 32] * B[N x 32]^T, E4M3 in, FP32 accumulate; A and B K-major in shared
// memory (the only major-ness FP8 wgmma has). acc = 0 overwrites D, 1 accumulates. Thread t of the
// warpgroup holds rows 16 * (t / 32) + (t % 32) / 4 (+ 8) and columns 8 j + 2 (t % 4) (+ 1):
// d[4j + 0 / 1] at the first row, d[4j + 2 / 3] eight rows down.
template <int N>
struct WgmmaE4m3;

template <>
struct WgmmaE4m3<8> {
  __device__ __forceinline__ static void mma(float (&d)[4], unsigned long long da, unsigned long long db, int acc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %6, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 {"
        "%0, %1, %2, %3"
        "}, %4, %5, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "l"(da), "l"(db), "r"(acc));
  }
};

template <>
struct WgmmaE4m3<16> {
  __device__ __forceinline__ static void mma(float (&d)[8], unsigned long long da, unsigned long long db, int acc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3 {"
        "%0, %1, %2, %3, %4, %5, %6, %7"
        "}, %8, %9, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]),
          "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
        : "l"(da), "l"(db), "r"(acc));
  }
};

template <>
struct WgmmaE4m3<32> {
  __device__ __forceinline__ static void mma(float (&d)[16], unsigned long long da, unsigned long long db, int acc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
        "}, %16, %17, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]),
          "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
          "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "l"(da), "l"(db), "r"(acc));
  }
};

template <>
struct WgmmaE4m3<64> {
  __device__ __forceinline__ static void mma(float (&d)[32], unsigned long long da, unsigned long long db, int acc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
        "}, %32, %33, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]),
          "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
          "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]),
          "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
          "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(da), "l"(db), "r"(acc));
  }
};

template <>
struct WgmmaE4m3<128> {
  __device__ __forceinline__ static void mma(float (&d)[64], unsigned long long da, unsigned long long db, int acc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
        "}, %64, %65, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]),
          "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
          "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]),
          "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]),
          "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]),
          "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]),
          "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]),
          "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]),
          "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(da), "l"(db), "r"(acc));
  }
};

// As WgmmaE4m3, A from registers: a[0..3] hold 4 E4M3 each, in the warp's 16 rows the
// mma.sync m16n8k32 A fragment (row (t % 32) / 4 (+ 8 in a[1], a[3]), k 4 (t % 4) .. + 3, +16 in
// a[2], a[3]); warp w of the warpgroup holds rows 16 w ... The registers must stay unchanged until
// the wgmma has completed (wgmma_wait).
template <int N>
struct WgmmaE4m3RegA;

template <>
struct WgmmaE4m3RegA<16> {
  __device__ __forceinline__ static void mma(float (&d)[8], const unsigned (&a)[4], unsigned long long db) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3 {"
        "%0, %1, %2, %3, %4, %5, %6, %7"
        "}, {%8, %9, %10, %11}, %12, 1, 1, 1;\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]),
          "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
  }
};

// ---- cp.async feeding an mbarrier --------------------------------------------------------------
// One arrival on `bar` once every cp.async this thread issued so far has landed. .noinc: the
// arrival is one of the barrier's expected count (init it with the number of copying threads).
__device__ __forceinline__ void cp_async_mbar_arrive_noinc(unsigned bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}

// ---- BF16 wgmma ---------------------------------------------------------------------------------
// D[64 x N] (+)= A[64 x 16] * B[16 x N], BF16 in, FP32 accumulate, both operands from shared
// memory through descriptors. kTransA = 0: A is K-major (the SW128 K-major tile of wgmma_desc,
// one K step of 16 elements = start + 32 bytes). kTransA = 1: A is MN-major: 16-bit types only;
// in the SW128 MN-major canonical layout ((8 x 8 elements, m), (8 rows, k)) one 128-byte row holds
// 64 consecutive M elements of one K index, 8 K rows form a 1024-byte atom, SBO is the stride
// between 8-row K groups and LBO the stride between 64-element M blocks (unused when M = 64 is a
// single atom). B is always K-major here. Accumulator fragment as WgmmaE4m3.
template <int N, int kTransA>
struct WgmmaBf16;

template <int kTransA>
struct WgmmaBf16<16, kTransA> {
  __device__ __forceinline__ static void mma(float (&d)[8], unsigned long long da, unsigned long long db, int acc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7"
        "}, %8, %9, p, 1, 1, %11, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]),
          "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
        : "l"(da), "l"(db), "r"(acc), "n"(kTransA));
  }
};

template <int kTransA>
struct WgmmaBf16<32, kTransA> {
  __device__ __forceinline__ static void mma(float (&d)[16], unsigned long long da, unsigned long long db, int acc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
        "}, %16, %17, p, 1, 1, %19, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]),
          "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
          "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "l"(da), "l"(db), "r"(acc), "n"(kTransA));
  }
};

// BF16 wgmma with both operands in shared memory and both transposes selectable (mla_decode's
// heads-on-M schedule: Q K^T with K-major operands, P V with V read N-major, kTransB = 1).
// Accumulator fragment as WgmmaE4m3; acc = 0 overwrites D.
template <int N, int kTransA, int kTransB>
struct WgmmaBf16SS;

template <int kTransA, int kTransB>
struct WgmmaBf16SS<64, kTransA, kTransB> {
  __device__ __forceinline__ static void mma(float (&d)[32], unsigned long long da, unsigned long long db, int acc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
        "}, %32, %33, p, 1, 1, %35, %36;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(da), "l"(db), "r"(acc), "n"(kTransA), "n"(kTransB));
  }
};

template <int kTransA, int kTransB>
struct WgmmaBf16SS<128, kTransA, kTransB> {
  __device__ __forceinline__ static void mma(float (&d)[64], unsigned long long da, unsigned long long db, int acc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
        "}, %64, %65, p, 1, 1, %67, %68;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(da), "l"(db), "r"(acc), "n"(kTransA), "n"(kTransB));
  }
};

// ---- f16 wgmma, N = 16 (the NVFP4 schedule: E2M1 x E4M3 products are exact in f16) -------------
// As WgmmaBf16<16, kTransA> with f16 operands; always accumulates.
template <int kTransA>
struct WgmmaF16x16 {
  __device__ __forceinline__ static void mma(float (&d)[8], unsigned long long da, unsigned long long db) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7"
        "}, %8, %9, 1, 1, 1, %10, 0;\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]),
          "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
        : "l"(da), "l"(db), "n"(kTransA));
  }
};
// A from registers: a[0..3] = f16x2 of the mma.sync m16n8k16 A fragment in the warp's 16 rows
// (row (t % 32) / 4 (+ 8 in a[1], a[3]), k 2 (t % 4), + 1 (+ 8 in a[2], a[3])); warp w of the
// warpgroup holds rows 16 w ... The registers must stay unchanged until the wgmma has completed.
struct WgmmaF16RegA16 {
  __device__ __forceinline__ static void mma(float (&d)[8], const unsigned (&a)[4], unsigned long long db) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7"
        "}, {%8, %9, %10, %11}, %12, 1, 1, 1, 0;\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]),
          "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
  }
};

}  // namespace sm90
}  // namespace k3gen
