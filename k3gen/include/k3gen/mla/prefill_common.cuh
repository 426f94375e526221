// What mla_prefill's kernels share, whatever their MMA (sm_90a wgmma: mla/prefill.cuh; SM100-family
// tcgen05: mla/prefill_tc.cuh): the kernel parameters, the work item of a CTA (head, q-block, the
// sequence's clamped rows, its prefix, its key tiles: work_of), the per-sequence fault report, the
// TMA maps and boxes of K/V, the zero-filling copy of a tile's V past the sequence end, the SW128
// address of a 16-byte chunk. One copy of this C++ serves both, so the varlen, prefix and error-word
// semantics cannot drift apart (tests/nogpu/ops/test_mla_prefill_tcgen05.py replays both kernels').
#pragma once

#include <cuda_bf16.h>

#include "k3gen/common/faults.cuh"
#include "k3gen/common/sm90_async.cuh"

namespace k3gen {
namespace mla {
namespace prefill {

constexpr int kBM = 128;                  // query rows per CTA
constexpr int kBN = 128;                  // keys per tile
constexpr int kDqk = 192, kDnope = 128, kDpe = 64, kDv = 128;
constexpr int kKBlk = kBN * 128;          // one [128 keys][64 dims] SW128 block of K or V (one TMA box)
constexpr int kKBytes = 3 * kKBlk;        // 49152: k_nope 0-63, 64-127, k_pe
constexpr int kVBytes = 2 * kKBlk;        // 32768: v 0-63, 64-127
constexpr float kLog2e = 1.4426950408889634f;
#define K3GEN_PF_NEG_INF (__int_as_float(0xff800000u))

struct Params {
  const __nv_bfloat16* q;        // [nq, H, 192] rows q_row apart, heads q_head apart
  const __nv_bfloat16* k_nope;   // [nk, H, 128]
  const __nv_bfloat16* k_pe;     // [nk, 64]
  const __nv_bfloat16* v;        // [nk, H, 128]
  const int* cu_q;               // [B + 1]
  const int* cu_k;               // [B + 1]
  void* out;                     // [nq, H, 128] contiguous, BF16 or FP32
  long long q_row, q_head, kn_row, kn_head, kpe_row, v_row, v_head;
  int nq, nk, q_blocks, heads_fast;
  unsigned* err;                 // mla_prefill's error word (k3gen/runtime/faults.py)
  int batch;                     // B (the persistent kernel's work items: heads x q_blocks x B)
  int* sched;                    // the persistent kernel's 2 counters (zero between launches), else unused
};

__device__ __forceinline__ unsigned smem_u32(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void cp_async16(unsigned dst, const void* src, unsigned src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

// 2^x by MUFU.EX2 alone. exp2f without fast-math wraps every call in a denormal-range fix-up (FSETP
// and two predicated FMULs: 3 of the ~10 instructions a score costs in the softmax); here a result
// below 2^-126 is flushed to 0. Every exponent is x - (the running row max) <= 0 and the row's
// denominator holds the max's exp2(0) = 1, so a flushed term is < 2^-126 of it.
__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Byte offset of 16-byte chunk c (8 per 128-byte row) of row r in an SW128 block.
__host__ __device__ constexpr unsigned sw128(int r, int c) {
  return static_cast<unsigned>((r >> 3) * 1024 + (r & 7) * 128 + ((c ^ (r & 7)) << 4));
}

// The sequence's rows, clamped to the tensors: q rows q0 .. q0 + lq - 1, keys k0 .. k0 + lk - 1.
struct Seq {
  int q0, lq, k0, lk;
};
__device__ __forceinline__ Seq seq_of(const Params& p, int b) {
  Seq s;
  s.q0 = min(max(p.cu_q[b], 0), p.nq);
  s.lq = min(max(p.cu_q[b + 1], s.q0), p.nq) - s.q0;
  s.k0 = min(max(p.cu_k[b], 0), p.nk);
  s.lk = min(max(p.cu_k[b + 1], s.k0), p.nk) - s.k0;
  return s;
}

// V of keys kv0 .. kv0 + 127 of head h into the stage's two V blocks (keys past the sequence
// zero-filled), kN producer threads (SM90: its producer warpgroup; tcgen05: the V producer warp).
template <int kN = 128>
__device__ __forceinline__ void load_v(const Params& p, const Seq& s, int h, int kv0, unsigned aV, int t) {
#pragma unroll 2
  for (int i = t; i < kBN * 16; i += kN) {
    const int key = i >> 4, c = i & 15;
    const bool ok = kv0 + key < s.lk;
    const __nv_bfloat16* src = p.v + (s.k0 + kv0 + key) * p.v_row + h * p.v_head + c * 8;
    cp_async16(aV + (c >> 3) * kKBlk + sw128(key, c & 7), ok ? src : p.k_pe, ok ? 16u : 0u);
  }
}

// 3-D TMA box at (c0 = byte in the row, c1 = head, c2 = row) into shared `dst`, completing on `bar`.
__device__ __forceinline__ void tma_load_3d(unsigned dst, const sm90::TmaMap* map, int c0, int c1, int c2,
                                            unsigned bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n" ::
          "r"(dst),
      "l"(reinterpret_cast<unsigned long long>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
      : "memory");
}

// The TMA maps of the launcher (uint8, 128B swizzle, zero fill past the tensors): k_nope and v as
// [rows][heads][256 bytes] with boxes [128 rows][1][128 bytes], k_pe as [rows][128 bytes] with box
// [128 rows][128 bytes]; one box is one SW128 block of a stage.
struct Maps {
  const sm90::TmaMap* kn;
  const sm90::TmaMap* kpe;
  const sm90::TmaMap* v;
  const sm90::TmaMap* q;   // the persistent kernel's Q: [rows][heads][384 bytes], box [64 rows][1][128 bytes]
};

// K of keys row .. row + 127 of head h into the 3 blocks at `dst` (3 boxes: k_nope 0-63, 64-127, k_pe),
// and V into the 2 blocks at `dst` (v 0-63, 64-127), each completing its bytes on `bar`; one thread.
__device__ __forceinline__ void tma_k(unsigned dst, unsigned bar, const Maps& maps, int h, int row) {
  sm90::mbar_arrive_expect_tx(bar, kKBytes);
  tma_load_3d(dst, maps.kn, 0, h, row, bar);
  tma_load_3d(dst + kKBlk, maps.kn, 128, h, row, bar);
  sm90::tma_load_2d(dst + 2 * kKBlk, maps.kpe, 0, row, bar);
}
__device__ __forceinline__ void tma_v(unsigned dst, unsigned bar, const Maps& maps, int h, int row) {
  sm90::mbar_arrive_expect_tx(bar, kVBytes);
  tma_load_3d(dst, maps.v, 0, h, row, bar);
  tma_load_3d(dst + kKBlk, maps.v, 128, h, row, bar);
}

// A CTA's work: head h, sequence rows s, q-block rows i0 .., prefix pre, n key tiles. Recomputed after
// each setmaxnreg (values live across it are spilled to local memory by ptxas).
struct Work {
  Seq s;
  int h, i0, pre, n;
};
// The work item of grid position (x, y, z): the CTA's own, or the persistent kernel's item t laid out as
// that grid (work_item).
__device__ __forceinline__ Work work_at(const Params& p, int x, int y, int z) {
  Work w;
  w.h = p.heads_fast ? x : y;
  const int qb = p.q_blocks - 1 - (p.heads_fast ? y : x);
  w.i0 = qb * kBM;
  w.s = seq_of(p, z);
  w.pre = w.s.lk - w.s.lq;
  // Keys up to pre + (last row of the block), clipped to the sequence.
  const int kend = max(0, min(w.s.lk, w.pre + min(w.i0 + kBM, w.s.lq)));
  w.n = (kend + kBN - 1) / kBN;
  return w;
}
__device__ __forceinline__ Work work_of(const Params& p) {
  return work_at(p, blockIdx.x, blockIdx.y, blockIdx.z);
}
// Item t of heads x q_blocks x B in the order the non-persistent grid's CTAs are numbered (x fastest).
__device__ __forceinline__ void item_xyz(const Params& p, int heads, int t, int& x, int& y, int& z) {
  const int gx = p.heads_fast ? heads : p.q_blocks, gy = p.heads_fast ? p.q_blocks : heads;
  x = t % gx;
  y = (t / gx) % gy;
  z = t / (gx * gy);
}

// One thread per sequence reports what seq_of clamped (the raw offsets outside the tensors or
// decreasing, or more query rows than the grid covers: rows past it are left unwritten) and a
// sequence with fewer keys than queries (its first rows see no key and are written as zeros).
template <class C>
__device__ __forceinline__ void report_seq_of(const Params& p, int b) {
  const int a0 = p.cu_q[b], a1 = p.cu_q[b + 1], c0 = p.cu_k[b], c1 = p.cu_k[b + 1];
  if (a0 < 0 || a1 < a0 || a1 > p.nq || c0 < 0 || c1 < c0 || c1 > p.nk || a1 - a0 > p.q_blocks * kBM)
    fault::report<C>(p.err, fault::kRows);
  else if (c1 - c0 < a1 - a0)
    fault::report<C>(p.err, fault::kLength);
}
template <class C>
__device__ __forceinline__ void report_seq(const Params& p) {
  if (threadIdx.x == 0 && blockIdx.x == 0 && blockIdx.y == 0) report_seq_of<C>(p, blockIdx.z);
}

}  // namespace prefill
}  // namespace mla
}  // namespace k3gen
