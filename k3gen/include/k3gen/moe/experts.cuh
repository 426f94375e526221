// MoE routed experts on packed FP4 weights: gate_up (+ SiTU / SiLU) and down grouped GEMMs, the
// ordered combine, and a dequantization probe. Contract: k3gen/ops/moe_experts/spec.py; the
// design notes (swap AB, register decode, why not wgmma): k3gen/ops/moe_experts/variants.py.
//
// A warp owns one m-tile (16 weight rows of one expert) and a K range (kKC chunks of 128). Lane
// (g = lane / 4, t = lane % 4) loads, per chunk, the 16 bytes holding K [c*128 + 32t, +32) of its
// two rows (g and g + 8 of the tile) and decodes them into the A fragments of 8 mma.sync k-steps:
// in k-step s it supplies K values 32t + 4s + {0, 1} as MMA columns (2t, 2t+1) and + {2, 3} as
// (2t+8, 2t+9). The activation (B) lane (column g, t) supplies the same K values of its token, so
// the K permutation cancels in the dot product. All of a warp's weight loads are issued before its
// first MMA (up to 8 x 2 x 16 bytes per lane in flight).
#pragma once

#include <cuda_bf16.h>

#include "k3gen/common/faults.cuh"
#include "k3gen/common/pdl.cuh"
#include "k3gen/moe/fp4.cuh"

namespace k3gen {
namespace moe {

struct ExpertArgs {
  const u8* w;      // packed E2M1 [E, rows, K/2]
  const u8* s;      // scale bytes [E, rows, K/group]
  const float* gs;       // NVFP4 globals (gate_up [E, 2], down [E, 1]); unused for MXFP4
  const void* x;         // gate_up: x [T, K] (BF16 or E4M3 codes); down: h [T k, K] BF16, grouped order
  const void* xs;        // gate_up FP8: scales [T, K/128] (FP32 or UE8M0 bytes)
  void* out;             // gate_up: h [T k, I] BF16 (grouped order); down: y [T k, W] FP32 (flat slot order)
  const int* offsets;    // [R + 1]
  const int* perm;       // [T k]
  int num_tokens;
  int nslots;            // T k
  int expert_base;       // first local expert in the router's numbering
  unsigned* err;         // this op's error word (k3gen/runtime/faults.py)
};

struct Item {
  int e, p0, n;          // local expert, first grouped position, positions (1..NB)
};

__device__ __forceinline__ uint4 ldg_stream(const u8* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

__device__ __forceinline__ void mma_bf16(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3,
                                         u32 b0, u32 b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ u32 word(const uint4& v, int j) {
  return j == 0 ? v.x : j == 1 ? v.y : j == 2 ? v.z : v.w;
}

// The work list (expert-major, NB positions per item) the clamped offsets define, scanned once per
// CTA: every thread counts the items of kPer experts, a block scan gives each its first item. A
// persistent CTA then walks items blockIdx.y, + gridDim.y, ... (`pick` publishes one through
// shared memory). Offsets are clamped to [0, nslots] (and each end to >= its start):
// garbage offsets give wrong work, never an out-of-bounds position.
template <int kE, int kThreads, int kNB>
struct ItemList {
  static constexpr int kPer = (kE + kThreads - 1) / kThreads;
  static constexpr int kWarps = kThreads / 32;
  // In shared memory, not registers: the GEMM after the scan needs every register it has.
  int first[kThreads], count[kThreads];   // each thread's first item and item count
  int warp_sum[kWarps];
  int total;                              // the list's length
  Item item, next;                        // the CTA's current item and the one after it (e = -1: none)

  // Expert e's clamped (first position, count).
  static __device__ __forceinline__ int2 range(const int* offsets, int base, int nslots, int e) {
    if (e >= kE) return make_int2(0, 0);
    const int l = min(max(offsets[base + e], 0), nslots);
    return make_int2(l, min(max(offsets[base + e + 1], l), nslots) - l);
  }

  __device__ __forceinline__ void scan(const int* offsets, int base, int nslots, unsigned* err) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    // Offsets the clamp in range() changes are an `offsets` fault (once per CTA, off the GEMM loop).
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int e = tid * kPer + i;
      if (e < kE) {
        const int lo = offsets[base + e], hi = offsets[base + e + 1];
        if (lo < 0 || lo > nslots || hi < lo || hi > nslots) fault::report(err, fault::kOffsets);
      }
    }
    int sum = 0;
#pragma unroll
    for (int i = 0; i < kPer; ++i) sum += (range(offsets, base, nslots, tid * kPer + i).y + kNB - 1) / kNB;
    int inc = sum;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int v = __shfl_up_sync(0xffffffffu, inc, d);
      if (lane >= d) inc += v;
    }
    if (lane == 31) warp_sum[warp] = inc;
    __syncthreads();
    int start = inc - sum, tot = 0;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      start += w < warp ? warp_sum[w] : 0;
      tot += warp_sum[w];
    }
    first[tid] = start;
    count[tid] = sum;
    if (tid == 0) total = tot;
    __syncthreads();
  }

  // Item `it` (< total, CTA-uniform) into `item`, and item `it + stride` (if any) into `next`; their
  // owners re-read their experts' offsets (cached). The first barrier lets the previous item's
  // readers finish, and orders thread 0's reset of `next` (it is also next's only reader) before
  // the owner's write.
  __device__ __forceinline__ void pick(const int* offsets, int base, int nslots, int it, int stride) {
    if (threadIdx.x == 0) next.e = -1;
    __syncthreads();
    const int start = first[threadIdx.x], end = start + count[threadIdx.x];
    const int nx = it + stride;
    if ((it >= start && it < end) || (nx < total && nx >= start && nx < end)) {
      int acc = start;
#pragma unroll
      for (int i = 0; i < kPer; ++i) {
        const int2 r = range(offsets, base, nslots, threadIdx.x * kPer + i);
        const int ni = (r.y + kNB - 1) / kNB;
#pragma unroll
        for (int q = 0; q < 2; ++q) {
          const int want = q == 0 ? it : nx;
          if (want >= acc && want < acc + ni && (q == 0 || nx < total)) {
            const int b = (want - acc) * kNB;
            Item& dst = q == 0 ? item : next;
            dst.e = threadIdx.x * kPer + i;
            dst.p0 = r.x + b;
            dst.n = min(kNB, r.y - b);
          }
        }
        acc += ni;
      }
    }
    __syncthreads();
  }
};

// The CTA's weight rows of expert e (codes and scales) into L2 by bulk prefetch, one thread: the
// next item's bytes stream from DRAM while this item computes (no registers held). Rows [r, r + n)
// of each of `blocks` row blocks `stride` rows apart; nothing when a base is not 16-byte aligned.
template <int kK, int kSBytes>
__device__ __forceinline__ void prefetch_rows(const u8* w, const u8* s, size_t e_rows, int r, int n, int blocks,
                                              int stride) {
  if (((reinterpret_cast<unsigned long long>(w) | reinterpret_cast<unsigned long long>(s)) & 15u) != 0) return;
  for (int b = 0; b < blocks; ++b) {
    const size_t row = e_rows + r + static_cast<size_t>(b) * stride;
    l2_prefetch_bulk(w + row * (kK / 2), static_cast<unsigned>(n * (kK / 2)));
    if ((n * kSBytes) % 16 == 0) l2_prefetch_bulk(s + row * kSBytes, static_cast<unsigned>(n * kSBytes));
  }
}

// Weight-scale BF16 multipliers of one lane row and chunk: MXFP4 one (group 32 = the lane's
// segment), NVFP4 two (values 0-15, 16-31 of the segment).
template <bool kMx>
__device__ __forceinline__ void segment_scales(u32 sbytes, u32& s_lo, u32& s_hi) {
  if (kMx) {
    s_lo = s_hi = ue8m0_bf16x2(sbytes & 0xFFu);
  } else {
    s_lo = e4m3_bf16x2(sbytes & 0xFFu);
    s_hi = e4m3_bf16x2((sbytes >> 8) & 0xFFu);
  }
}

// Word j (values 8j..8j+7) of a lane's 32-value segment -> four scaled bf16x2 (exact products).
__device__ __forceinline__ void decode_word(u32 w, u32 scale, u32 (&q)[4]) {
  e2m1x8_to_bf16(w, q);
#pragma unroll
  for (int i = 0; i < 4; ++i) q[i] = bf16x2_mul(q[i], scale);
}

template <bool kMx, int kK>
__device__ __forceinline__ u32 load_scales(const u8* srow, int kseg) {
  if (kMx) return __ldg(srow + kseg / 32);
  return __ldg(reinterpret_cast<const unsigned short*>(srow + kseg / 16));
}

// The 8 k-steps of one chunk: decode word j of both rows (values 8j..8j+7), two MMAs per word.
// B: 16 bf16x2 words (value pairs), or with kFp8 8 words of raw E4M3 codes (4 values each).
template <bool kFp8>
__device__ __forceinline__ void mma_chunk(float (&d)[4], const uint4& a0, const uint4& a1, u32 lo0, u32 hi0,
                                          u32 lo1, u32 hi1, const u32 (&B)[16], u32 z) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    u32 b[4];
    if (kFp8) {
      e4m3x4_to_bf16(B[2 * j], b[0], b[1]);
      e4m3x4_to_bf16(B[2 * j + 1], b[2], b[3]);
    } else {
      b[0] = B[4 * j]; b[1] = B[4 * j + 1]; b[2] = B[4 * j + 2]; b[3] = B[4 * j + 3];
    }
    u32 q0[4], q1[4];
    decode_word(word(a0, j) ^ z, j < 2 ? lo0 : hi0, q0);
    decode_word(word(a1, j) ^ z, j < 2 ? lo1 : hi1, q1);
    mma_bf16(d, q0[0], q1[0], q0[1], q1[1], b[0], b[1]);
    mma_bf16(d, q0[2], q1[2], q0[3], q1[3], b[2], b[3]);
  }
}

// The gated activations in FP32 (the reference's formulas; ulp-level differences from torch's tanh /
// sigmoid). sigmoid(g) = (1 + tanh(g / 2)) / 2: no division, whose slow-path subroutine calls
// cost the FP8 kernel a stack frame and spills.
template <class C>
__device__ __forceinline__ float glu_act(float g, float u) {
  const float sg = fmaf(0.5f, tanhf(0.5f * g), 0.5f);
  if (!C::kSitu) return g * sg * u;
  constexpr float kInvBeta = 1.f / C::kBeta, kInvLinearBeta = 1.f / C::kLinearBeta;
  return C::kBeta * tanhf(g * kInvBeta) * sg * (C::kLinearBeta * tanhf(u * kInvLinearBeta));
}

// One grouped GEMM. G: the GEMM's geometry (kRows per expert, kK, kWM, kWK, kKC); C: the op's.
// kGateUp: rows [gate | up] (A rows g / g+8 = gate / up of column mt*8 + g), B = x rows by token,
// epilogue act(g, u) -> BF16 h in grouped order. Else (down): rows mt*16 + {g, g+8}, B = h rows by
// grouped position, epilogue FP32 y at the flat slot perm[p].
template <class C, class G, bool kGateUp>
__device__ __forceinline__ void expert_gemm(const ExpertArgs& a) {
  constexpr int kThreads = 32 * G::kWM * G::kWK, kNB = 8 * C::kNTiles, kK = G::kK;
  constexpr bool kMx = C::kMxfp4;
  constexpr bool kFp8 = kGateUp && C::kFp8Act;
  constexpr int kSBytes = kK / (kMx ? 32 : 16);
  // gate_up: the offsets, perm and x come from the kernels before it. down: only h does (gate_up's);
  // gate_up triggers its dependents after its own wait, so by the time down starts everything
  // before gate_up (moe_route's offsets and perm) is complete, and down scans the offsets and
  // issues its first item's weight loads before waiting for h (they overlap gate_up's tail).
  if constexpr (kGateUp) {
    griddep_wait();
    griddep_launch_dependents();   // the next kernel still waits for this one to complete
  }
  __shared__ ItemList<C::kExperts, kThreads, kNB> list;
  list.scan(a.offsets, a.expert_base, a.nslots, a.err);

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int wm = warp % G::kWM, wk = warp / G::kWM;
  const int mt = blockIdx.x * G::kWM + wm;
  const int r0 = kGateUp ? mt * 8 + g : mt * 16 + g;
  const int r1 = kGateUp ? C::kInter + mt * 8 + g : mt * 16 + 8 + g;
  __shared__ float red[G::kWK > 1 ? G::kWK : 1][G::kWM][4][32];
  bool waited = kGateUp;
#pragma unroll 1
  for (int item = blockIdx.y; item < list.total; item += gridDim.y) {
  list.pick(a.offsets, a.expert_base, a.nslots, item, gridDim.y);
  const Item it = list.item;
  if (G::kPersistent && threadIdx.x == 0 && list.next.e >= 0) {
    // gate_up: the CTA's 8 wm gate rows and the up rows I below them; down: its 16 wm rows.
    const size_t nx_rows = static_cast<size_t>(list.next.e) * G::kRows;
    if (kGateUp) {
      prefetch_rows<kK, kSBytes>(a.w, a.s, nx_rows, blockIdx.x * G::kWM * 8, G::kWM * 8, 2, C::kInter);
    } else {
      prefetch_rows<kK, kSBytes>(a.w, a.s, nx_rows, blockIdx.x * G::kWM * 16, G::kWM * 16, 1, 0);
    }
  }
  const size_t e_rows = static_cast<size_t>(it.e) * G::kRows;
  const u8* w0 = a.w + (e_rows + r0) * (kK / 2);
  const u8* w1 = a.w + (e_rows + r1) * (kK / 2);
  const u8* s0 = a.s + (e_rows + r0) * kSBytes;
  const u8* s1 = a.s + (e_rows + r1) * kSBytes;

  // Every weight byte of the warp in flight at once (zeros past K: they meet zero activations).
  uint4 A0[G::kKC], A1[G::kKC];
  u32 S0[G::kKC], S1[G::kKC];
#pragma unroll
  for (int c = 0; c < G::kKC; ++c) {
    const int kseg = (wk * G::kKC + c) * 128 + 32 * t;
    A0[c] = A1[c] = make_uint4(0u, 0u, 0u, 0u);
    S0[c] = S1[c] = 0u;
    if (kseg < kK) {
      A0[c] = ldg_stream(w0 + kseg / 2);
      A1[c] = ldg_stream(w1 + kseg / 2);
      S0[c] = load_scales<kMx, kK>(s0, kseg);
      S1[c] = load_scales<kMx, kK>(s1, kseg);
    }
  }

  if (!waited) {   // down, first item: h is gate_up's
    griddep_wait();
    griddep_launch_dependents();
    waited = true;
  }
  // One 8-token tile at a time (a rolled loop: its trip count is CTA-uniform, and the tile's K-split
  // sum and epilogue run inside it, so only one tile's accumulators are live).
  const int ntiles = (it.n + 7) / 8;
#pragma unroll 1
  for (int nt = 0; nt < ntiles; ++nt) {
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    // An opaque zero, new every tile, XORed into the codes: it keeps the compiler from hoisting the
    // (tile-invariant) decode of all kKC chunks out of the loop, which needs 32 registers a chunk.
    u32 z;
    asm volatile("mov.u32 %0, 0;\n" : "=r"(z));
    // B source row of MMA column g (a padding column repeats the last valid one: discarded).
    const int p = it.p0 + min(nt * 8 + g, it.n - 1);
    const u8* brow;
    int tok_c[2] = {0, 0};   // tokens of accumulator columns 2t, 2t+1 (FP8 scales)
    if (kGateUp) {
      const int f = min(max(a.perm[p], 0), a.nslots - 1);
      const int tok = min(f / C::kTopK, a.num_tokens - 1);
      brow = static_cast<const u8*>(a.x) + static_cast<size_t>(tok) * kK * (kFp8 ? 1 : 2);
      if (kFp8) {
#pragma unroll
        for (int q = 0; q < 2; ++q) {
          const int pc = it.p0 + min(nt * 8 + 2 * t + q, it.n - 1);
          tok_c[q] = min(min(max(a.perm[pc], 0), a.nslots - 1) / C::kTopK, a.num_tokens - 1);
        }
      }
    } else {
      brow = static_cast<const u8*>(a.x) + static_cast<size_t>(p) * kK * 2;
    }
    // The tile's activation segments into L1 up front (no registers): the chunk loop below loads
    // each just before its MMAs. Measured on the H200 it changed nothing at T1 / T64 (the kernel is
    // issue-bound on the decode, ncu); kept because it costs no register.
    {
      const u8* pf = brow + (wk * G::kKC * 128 + 32 * t) * (kFp8 ? 1 : 2);
      const int nc = min(G::kKC, (kK - wk * G::kKC * 128 - 32 * t + 127) / 128);
#pragma unroll 1
      for (int c = 0; c < nc; ++c, pf += 128 * (kFp8 ? 1 : 2)) asm volatile("prefetch.global.L1 [%0];\n" ::"l"(pf));
    }
#pragma unroll
    for (int c = 0; c < G::kKC; ++c) {
      const int chunk = wk * G::kKC + c, kseg = chunk * 128 + 32 * t;
      u32 B[16];
#pragma unroll
      for (int i = 0; i < 16; ++i) B[i] = 0u;
      if (kseg < kK) {
        if (kFp8) {   // raw codes in B[0..7]: decoded word by word in mma_chunk (fewer live registers)
          const uint4* src = reinterpret_cast<const uint4*>(brow + kseg);
#pragma unroll
          for (int v = 0; v < 2; ++v) {
            const uint4 u = src[v];
            B[4 * v] = u.x; B[4 * v + 1] = u.y; B[4 * v + 2] = u.z; B[4 * v + 3] = u.w;
          }
        } else {
          const uint4* src = reinterpret_cast<const uint4*>(brow + kseg * 2);
#pragma unroll
          for (int v = 0; v < 4; ++v) {
            const uint4 u = src[v];
            B[4 * v] = u.x; B[4 * v + 1] = u.y; B[4 * v + 2] = u.z; B[4 * v + 3] = u.w;
          }
        }
      }
      u32 lo0, hi0, lo1, hi1;
      segment_scales<kMx>(S0[c] ^ z, lo0, hi0);   // z: not hoisted either (4 registers a chunk)
      segment_scales<kMx>(S1[c] ^ z, lo1, hi1);
      float part[4] = {0.f, 0.f, 0.f, 0.f};
      if (kFp8) {
        mma_chunk<true>(part, A0[c], A1[c], lo0, hi0, lo1, hi1, B, z);
      } else {
        mma_chunk<false>(acc, A0[c], A1[c], lo0, hi0, lo1, hi1, B, z);
      }
      if (kFp8) {
        float xs[2];
#pragma unroll
        for (int q = 0; q < 2; ++q) {
          const size_t at = static_cast<size_t>(tok_c[q]) * (kK / 128) + min(chunk, kK / 128 - 1);
          xs[q] = C::kUe8m0Act ? ue8m0_value(static_cast<const u8*>(a.xs)[at])
                               : static_cast<const float*>(a.xs)[at];
        }
        acc[0] = fmaf(part[0], xs[0], acc[0]);
        acc[1] = fmaf(part[1], xs[1], acc[1]);
        acc[2] = fmaf(part[2], xs[0], acc[2]);
        acc[3] = fmaf(part[3], xs[1], acc[3]);
      }
    }

    // K split: the partial sums of the kWK warps of an m-tile added in warp order (deterministic).
    if (G::kWK > 1) {
#pragma unroll
      for (int i = 0; i < 4; ++i) red[wk][wm][i][lane] = acc[i];
      __syncthreads();
      if (wk == 0) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          float v = red[0][wm][i][lane];
#pragma unroll
          for (int k = 1; k < G::kWK; ++k) v += red[k][wm][i][lane];
          acc[i] = v;
        }
      }
      __syncthreads();   // red is rewritten by the next tile
      if (wk != 0) continue;
    }
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      const int col = nt * 8 + 2 * t + q;
      if (col >= it.n) continue;
      const int p = it.p0 + col;
      if (kGateUp) {
        float gv = acc[q], uv = acc[2 + q];
        if (!kMx) {
          gv *= a.gs[2 * it.e];
          uv *= a.gs[2 * it.e + 1];
        }
        const float h = glu_act<C>(gv, uv);
        static_cast<__nv_bfloat16*>(a.out)[static_cast<size_t>(p) * C::kInter + mt * 8 + g] = __float2bfloat16_rn(h);
      } else {
        const int f = a.perm[p];
        if (f < 0 || f >= a.nslots) {   // gate_up clamped it; its row is dropped here
          fault::report(a.err, fault::kPerm);
          continue;
        }
        float* y = static_cast<float*>(a.out) + static_cast<size_t>(f) * C::kHidden;
        const float gsc = kMx ? 1.f : a.gs[it.e];
        y[mt * 16 + g] = kMx ? acc[q] : acc[q] * gsc;
        y[mt * 16 + 8 + g] = kMx ? acc[2 + q] : acc[2 + q] * gsc;
      }
    }
  }
    if constexpr (!G::kPersistent) break;   // a CTA per item: grid.y = max_items
  }   // items
  if (!waited) griddep_wait();   // no item: still complete after gate_up (PDL chains are transitive)
}

// out[t, :] = sum_j weights[t, j] * y[t k + j, :] over the slots of local experts, j in order.
template <class C>
__device__ __forceinline__ void combine(const float* y, const int* ids, const float* wts, __nv_bfloat16* out,
                                        float* out32, int base, unsigned* err) {
  griddep_wait();
  griddep_launch_dependents();
  const int t = blockIdx.x;
  const int col = (blockIdx.y * blockDim.x + threadIdx.x) * 4;
  if (col >= C::kHidden) return;
  // All k slot rows in flight at once, then summed in slot order: ptxas interleaves the loads with
  // the FMAs two at a time (32 registers), so L1 prefetches issued first carry the k round trips.
#pragma unroll
  for (int j = 0; j < C::kTopK; ++j)
    asm volatile("prefetch.global.L1 [%0];\n" ::"l"(y + static_cast<size_t>(t * C::kTopK + j) * C::kHidden + col));
  bool ok[C::kTopK];
  bool bad_id = false;
#pragma unroll
  for (int j = 0; j < C::kTopK; ++j) {
    const int id = ids[t * C::kTopK + j], e = id - base;
    ok[j] = e >= 0 && e < C::kExperts;   // another rank's expert (EP), or a bad id: not summed
    bad_id |= id < 0 || id >= C::kRouteExperts;
  }
  // The kernel's one atomic: the fault bit (the sum below is ordered, no atomics).
  if (bad_id && blockIdx.y == 0 && threadIdx.x == 0) fault::report(err, fault::kExpert);
  float w[C::kTopK];
  float4 v[C::kTopK];
#pragma unroll
  for (int j = 0; j < C::kTopK; ++j) {
    const int slot = t * C::kTopK + j;
    w[j] = ok[j] ? wts[slot] : 0.f;
    // Unconditional: every slot row lies inside the workspace, and a foreign slot's bytes are
    // never summed.
    v[j] = __ldg(reinterpret_cast<const float4*>(y + static_cast<size_t>(slot) * C::kHidden + col));
  }
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
  for (int j = 0; j < C::kTopK; ++j) {
    if (!ok[j]) continue;
    acc.x = fmaf(w[j], v[j].x, acc.x);
    acc.y = fmaf(w[j], v[j].y, acc.y);
    acc.z = fmaf(w[j], v[j].z, acc.z);
    acc.w = fmaf(w[j], v[j].w, acc.w);
  }
  const size_t at = static_cast<size_t>(t) * C::kHidden + col;
  const __nv_bfloat162 lo = __floats2bfloat162_rn(acc.x, acc.y), hi = __floats2bfloat162_rn(acc.z, acc.w);
  uint2 packed;
  packed.x = *reinterpret_cast<const u32*>(&lo);
  packed.y = *reinterpret_cast<const u32*>(&hi);
  *reinterpret_cast<uint2*>(out + at) = packed;
  if (out32 != nullptr) *reinterpret_cast<float4*>(out32 + at) = acc;
}

// The dequantized FP32 values of rows [row0, row0 + nrows) of expert e's w13 (which = 0) or w2 (1),
// through exactly the GEMM's decode (E2M1 lookups, BF16 scale product) and its FP32 global multiply
// (NVFP4): the GPU test holds them to numerics.py's decoders bit for bit. One thread per segment.
template <class C>
__device__ __forceinline__ void dequant_probe(const u8* w, const u8* s, const float* gs, float* out,
                                              int which, int e, int row0, int nrows) {
  constexpr bool kMx = C::kMxfp4;
  const int K = which == 0 ? C::kHidden : C::kInter, rows = which == 0 ? 2 * C::kInter : C::kHidden;
  const int segs = K / 32;
  const int idx = blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= nrows * segs) return;
  const int r = row0 + idx / segs, kseg = (idx % segs) * 32;
  if (r >= rows || e < 0 || e >= C::kExperts) return;
  const size_t row = static_cast<size_t>(e) * rows + r;
  const uint4 v = ldg_stream(w + row * (K / 2) + kseg / 2);
  const u8* srow = s + row * (K / (kMx ? 32 : 16));
  const u32 sb = kMx ? srow[kseg / 32] : (srow[kseg / 16] | (srow[kseg / 16 + 1] << 8));
  u32 lo, hi;
  segment_scales<kMx>(sb, lo, hi);
  float g = 1.f;
  if (!kMx) g = which == 0 ? gs[2 * e + (r < C::kInter ? 0 : 1)] : gs[e];
  float* o = out + static_cast<size_t>(idx / segs) * K + kseg;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    u32 q[4];
    decode_word(word(v, j), j < 2 ? lo : hi, q);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float a0 = __uint_as_float(q[i] << 16), a1 = __uint_as_float(q[i] & 0xFFFF0000u);
      o[8 * j + 2 * i] = kMx ? a0 : a0 * g;
      o[8 * j + 2 * i + 1] = kMx ? a1 : a1 * g;
    }
  }
}

}  // namespace moe
}  // namespace k3gen
