// FP8 block-scaled GEMM for small M: out[M, N] = x[M, K] @ w[N, K]^T, BF16 out.
// Contract: k3gen/ir/ops/fp8_block_gemm.py. Config (from the template):
//   kN, kK          static sizes (N % 8 == 0, K % 16 == 0)
//   kBm             tokens per CTA (16, 32, 64)
//   kStages         cp.async pipeline depth in 128-column K blocks
//   kUe8m0          scales are UE8M0 bytes (else FP32 values)
//
// Small M is weight-bandwidth-bound, so the kernel is shaped around streaming W once:
// - The weight tile sits on the m16 side of mma.m16n8k32 and tokens on the n8 side, so M = 1
//   wastes MMA lanes, never weight bytes. Each of the 4 warps owns 16 weight rows (BN = 64) and
//   all tokens of the CTA; n8 tiles past M are skipped (warp-uniform branch).
// - 128x128-byte K blocks stream through a kStages-deep cp.async ring (16-byte copies, XOR
//   swizzle so ldmatrix is conflict-free). Rows past N/M and columns past K are zero-filled or
//   skipped, so N and K need not be multiples of the tile.
// - Per K block the MMA sums go to a fresh partial accumulator that is then scaled by
//   x_scale * w_scale (one product per token, precomputed in shared memory) into the FP32 total:
//   block scales never enter the FP8 operands.
// - Split-K over a thread-block cluster fills the GPU when N / 64 tiles are too few: the CTAs
//   of a cluster take disjoint runs of K blocks and reduce through distributed shared memory in
//   rank order (deterministic; no workspace, no atomics, graph-safe).
// Sm_90a and the sm_100 family have no native FP8 mma.sync: ptxas lowers the e4m3 form to F2FP
// (E4M3 -> F16, exact) + HMMA.16816.F32 and repeats the conversions for every MMA. So the kernel
// converts itself, once: the weight fragment per k32 step in registers, the token tile per stage
// in shared memory (both exact), then F16 MMAs with FP32 accumulation: the same numbers as an
// FP8 MMA accumulating in FP32.
#pragma once

#include <cuda_bf16.h>

namespace k3gen {
namespace fp8gemm {

constexpr int kBlock = 128;   // scale block along N and K; also the K extent of a pipeline stage
constexpr int kBn = 64;       // weight rows per CTA
constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kRedPad = 4;    // floats of padding per token row of the reduction buffer

__device__ __forceinline__ unsigned smem_u32(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// 16-byte async copy; src_bytes = 0 zero-fills the destination (cp.async's ignore-src form).
__device__ __forceinline__ void cp_async16(unsigned dst, const void* src, unsigned src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

__device__ __forceinline__ void ldmatrix_x4(unsigned addr, unsigned (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// D += A(16x16 f16, row) * B(16x8 f16, col), FP32 accumulate.
__device__ __forceinline__ void mma_f16(float (&d)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                        unsigned b0, unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// 4 E4M3 bytes -> two f16x2 (exact: every E4M3 value is an F16 value). `lo` holds bytes 0-1, `hi`
// bytes 2-3. Both operands go through this one helper, so whatever order cvt gives the halves,
// A and B see the same permutation of k and the dot products are unchanged.
__device__ __forceinline__ void e4m3x4_to_f16(unsigned w, unsigned& lo, unsigned& hi) {
  asm("{\n\t.reg .b16 l, h;\n\tmov.b32 {l, h}, %2;\n\t"
      "cvt.rn.f16x2.e4m3x2 %0, l;\n\tcvt.rn.f16x2.e4m3x2 %1, h;\n\t}"
      : "=r"(lo), "=r"(hi)
      : "r"(w));
}

// Byte offset of 16-byte chunk `c` of tile row `r` (rows of 128 bytes): XOR swizzle over the 8
// chunks so the 8 rows one ldmatrix phase reads land in 8 different bank groups.
__device__ __forceinline__ unsigned swz(int r, int c) { return r * kBlock + ((c ^ (r & 7)) << 4); }
// The same for the F16 token tile (rows of 256 bytes, 16 chunks; the XOR stays within a half).
__device__ __forceinline__ unsigned swzh(int r, int c) { return r * 2 * kBlock + ((c ^ (r & 7)) << 4); }

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

struct Params {
  const unsigned char* x;   // [M, K] E4M3
  const void* xs;           // [M, KB] scales
  const unsigned char* w;   // [N, K] E4M3
  const void* ws;           // [NB, KB] scales
  __nv_bfloat16* out;       // [M, N]
  int m;
};

template <class C>
__device__ __forceinline__ void gemm(const Params& p) {
  constexpr int N = C::kN, K = C::kK, BM = C::kBm, S = C::kStages;
  constexpr int KB = (K + kBlock - 1) / kBlock;
  constexpr int NT = BM / 8;                        // n8 token tiles per warp
  constexpr int kStageBytes = (kBn + BM) * kBlock;
  static_assert(N % 8 == 0 && K % 16 == 0, "16-byte rows");
  static_assert(BM % 16 == 0 && BM <= 64, "token tile");
  static_assert(kBlock % kBn == 0, "a CTA's weight rows share one scale row");
  static_assert((kBn * 8) % kThreads == 0 && (BM * 8) % kThreads == 0, "whole 16-byte chunks per thread");
  static_assert(BM * (kBn + kRedPad) * 4 <= S * kStageBytes, "reduction buffer fits in the pipeline");

  extern __shared__ __align__(128) unsigned char smem[];
  unsigned char* xh = smem + S * kStageBytes;                         // [BM][128] F16 tokens
  float* sc = reinterpret_cast<float*>(xh + BM * kBlock * 2);         // [nk][BM] x_scale * w_scale

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int split = gridDim.x, rank = blockIdx.x;
  const int m0 = blockIdx.y * BM, n0 = blockIdx.z * kBn;
  const int mrem = p.m - m0;                        // tokens of this tile, >= 1
  const int kb0 = rank * KB / split, nk = (rank + 1) * KB / split - kb0;

  // Combined scales of this CTA's K blocks; the first pipeline barrier publishes them.
  for (int i = tid; i < nk * BM; i += kThreads) {
    const int kb = kb0 + i / BM, mm = i % BM;
    const float sw = scale_value<C::kUe8m0>(p.ws, static_cast<long long>(n0 / kBlock) * KB + kb);
    const float sx = mm < mrem ? scale_value<C::kUe8m0>(p.xs, static_cast<long long>(m0 + mm) * KB + kb) : 0.f;
    sc[i] = sx * sw;
  }

  const unsigned sbase = smem_u32(smem), xhs = smem_u32(xh);
  auto load_stage = [&](int kb, int slot) {
    const unsigned ws_ = sbase + slot * kStageBytes, xs_ = ws_ + kBn * kBlock;
#pragma unroll
    for (int i = 0; i < kBn * 8 / kThreads; ++i) {
      const int c = tid + i * kThreads, r = c >> 3, col = c & 7;
      const int gk = kb * kBlock + col * 16, gn = n0 + r;
      const bool ok = gn < N && gk < K;
      const unsigned char* src = ok ? p.w + static_cast<long long>(gn) * K + gk : p.w;
      cp_async16(ws_ + swz(r, col), src, ok ? 16u : 0u);
    }
#pragma unroll
    for (int i = 0; i < BM * 8 / kThreads; ++i) {
      const int c = tid + i * kThreads, r = c >> 3, col = c & 7;
      if (r < mrem) {   // rows past M stay stale: they only feed unused output columns
        const int gk = kb * kBlock + col * 16;
        const bool ok = gk < K;
        const unsigned char* src = ok ? p.x + static_cast<long long>(m0 + r) * K + gk : p.x;
        cp_async16(xs_ + swz(r, col), src, ok ? 16u : 0u);
      }
    }
  };

#pragma unroll
  for (int s = 0; s < S - 1; ++s) {
    if (s < nk) load_stage(kb0 + s, s);
    cp_async_commit();   // empty groups keep the wait count uniform
  }

  float acc[NT][4];
#pragma unroll
  for (int j = 0; j < NT; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;

  const int g = lane >> 2, t = lane & 3;
  const int lrow = lane & 7, lmat = lane >> 3;      // ldmatrix: row within a matrix, matrix index
  const int arow = warp * 16 + (lmat & 1) * 8 + lrow;

  for (int i = 0; i < nk; ++i) {
    cp_async_wait<S - 2>();
    __syncthreads();   // stage i landed; every warp is done with the slot refilled next and with xh
    if (i + S - 1 < nk) load_stage(kb0 + i + S - 1, (i + S - 1) % S);
    cp_async_commit();

    const int slot = i % S;
    const unsigned wsm = sbase + slot * kStageBytes;
    // Tokens to F16 once per stage for all 4 warps (instead of once per warp and weight tile).
    // Word q of a 16-byte chunk c goes to pair q of F16 chunk 2c (bytes 0-1) and of 2c+1 (bytes
    // 2-3): the same k order as the weights' in-register conversion below.
#pragma unroll
    for (int it = 0; it < BM * 8 / kThreads; ++it) {
      const int c = tid + it * kThreads, r = c >> 3, col = c & 7;
      if (r < mrem) {
        const uint4 v = *reinterpret_cast<const uint4*>(smem + slot * kStageBytes + kBn * kBlock + swz(r, col));
        uint4 lo, hi;
        e4m3x4_to_f16(v.x, lo.x, hi.x);
        e4m3x4_to_f16(v.y, lo.y, hi.y);
        e4m3x4_to_f16(v.z, lo.z, hi.z);
        e4m3x4_to_f16(v.w, lo.w, hi.w);
        *reinterpret_cast<uint4*>(xh + swzh(r, 2 * col)) = lo;
        *reinterpret_cast<uint4*>(xh + swzh(r, 2 * col + 1)) = hi;
      }
    }
    __syncthreads();

    float part[NT][4];
#pragma unroll
    for (int j = 0; j < NT; ++j) part[j][0] = part[j][1] = part[j][2] = part[j][3] = 0.f;
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {                 // k32 steps of the 128-column block
      unsigned a[4], al[4], ah[4];
      ldmatrix_x4(wsm + swz(arow, ks * 2 + (lmat >> 1)), a);
#pragma unroll
      for (int q = 0; q < 4; ++q) e4m3x4_to_f16(a[q], al[q], ah[q]);
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        if (j * 8 < mrem) {
          unsigned b[4];
          ldmatrix_x4(xhs + swzh(j * 8 + lrow, ks * 4 + lmat), b);
          mma_f16(part[j], al[0], al[1], ah[0], ah[1], b[0], b[1]);   // k 32ks .. +15
          mma_f16(part[j], al[2], al[3], ah[2], ah[3], b[2], b[3]);   // k 32ks+16 .. +31
        }
      }
    }
    const float* s = sc + i * BM;
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      const float s0 = s[j * 8 + 2 * t], s1 = s[j * 8 + 2 * t + 1];
      acc[j][0] = fmaf(part[j][0], s0, acc[j][0]);
      acc[j][1] = fmaf(part[j][1], s1, acc[j][1]);
      acc[j][2] = fmaf(part[j][2], s0, acc[j][2]);
      acc[j][3] = fmaf(part[j][3], s1, acc[j][3]);
    }
  }
  cp_async_wait<0>();
  __syncthreads();   // the pipeline buffers become the reduction buffer

  // Token-major partial tile: red[m][n], so the output rows are written 16 bytes at a time.
  float* red = reinterpret_cast<float*>(smem);
  constexpr int RS = kBn + kRedPad;
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    const int mm = j * 8 + 2 * t, nn = warp * 16 + g;
    red[mm * RS + nn] = acc[j][0];
    red[(mm + 1) * RS + nn] = acc[j][1];
    red[mm * RS + nn + 8] = acc[j][2];
    red[(mm + 1) * RS + nn + 8] = acc[j][3];
  }
  // Every CTA's partial tile complete. Without a cluster launch (split == 1) a CTA barrier and
  // plain shared loads do, so the kernel never relies on an implicit 1-CTA cluster.
  if (split == 1) __syncthreads(); else cluster_sync();

  const int mt = mrem < BM ? mrem : BM;
  const unsigned rbase = smem_u32(red);
  for (int it = rank * kThreads + tid; it < mt * (kBn / 8); it += split * kThreads) {
    const int mm = it / (kBn / 8), c8 = it % (kBn / 8);
    const int gn = n0 + c8 * 8;
    if (gn >= N) continue;
    const unsigned off = rbase + (mm * RS + c8 * 8) * 4;
    float v[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int q = 0; q < split; ++q) {   // rank order: the same sum on every run
      float4 lo, hi;
      if (split == 1) {
        lo = *reinterpret_cast<const float4*>(red + mm * RS + c8 * 8);
        hi = *reinterpret_cast<const float4*>(red + mm * RS + c8 * 8 + 4);
      } else {
        lo = ld_cluster_f4(map_rank(off, q));
        hi = ld_cluster_f4(map_rank(off + 16, q));
      }
      v[0] += lo.x; v[1] += lo.y; v[2] += lo.z; v[3] += lo.w;
      v[4] += hi.x; v[5] += hi.y; v[6] += hi.z; v[7] += hi.w;
    }
    uint4 o;
    o.x = pack_bf16x2(v[0], v[1]);
    o.y = pack_bf16x2(v[2], v[3]);
    o.z = pack_bf16x2(v[4], v[5]);
    o.w = pack_bf16x2(v[6], v[7]);
    *reinterpret_cast<uint4*>(p.out + static_cast<long long>(m0 + mm) * N + gn) = o;
  }
  if (split > 1) cluster_sync();   // no CTA leaves while a peer may still read its shared memory
}

}  // namespace fp8gemm
}  // namespace k3gen
