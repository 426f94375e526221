// Attention Residuals mix for decode / verify rows, fused with the RMSNorm after it and the FP8
// per-token-128 quantization of the next GEMM. Contract: k3gen/ops/attn_res/spec.py; the FP32 twin
// (same operations in the same order) is k3gen/ops/attn_res/reference.py.
//
// A row's hidden width is cut into kSlices fixed slices, one CTA each, the CTAs of a row forming a
// thread-block cluster; a thread owns 4 consecutive columns of every source, held in registers
// from the first load to the last use, so the sources are read from memory once. The three
// row-wide sums (each source's sum of squares, each source's pseudo-query dot, the mixed row's sum
// of squares) are reduced in one fixed order that depends on the hidden width alone: within a
// thread ((y0 + y1) + y2) + y3, a warp xor-butterfly 16..1, the warps of the CTA in order, the
// slices in order. Every CTA of the row sums the slices' partials itself, so all hold the same
// totals; nothing depends on the row count or the row's position (the reason this op exists).
// The partials travel by st.async into every peer's shared memory, completing on the peer's
// mbarrier (no cluster barrier per exchange, and no release fence on the stores in flight). The
// first two sums of a source travel together (score_i = r_i * S(V_i q)), so a row needs two
// exchanges, not three.
#pragma once

#include <cuda_bf16.h>

#include "k3gen/common/pdl.cuh"
#include "k3gen/common/quant.cuh"
#include "k3gen/kda/common.cuh"   // cluster helpers: cluster_map, mbarriers, st_async
#include "k3gen/mla/proj.cuh"     // ue8m0_ceil / ue8m0_value, the act_quant_fp8 rules

namespace k3gen {
namespace attnres {

constexpr unsigned kFull = 0xffffffffu;
enum class Delta { kNone, kBf16, kFp32 };

struct Params {
  const float* src;          // [n_max][rows][hidden] FP32: completed blocks, then the partial sum
  long long src_stride;      // elements between sources
  long long row_stride;      // elements between rows of a source
  int n;                     // valid sources (the last one is the running partial sum)
  const float* query;        // [hidden] FP32: res_norm weight * res_proj
  const __nv_bfloat16* norm_w;  // [hidden] BF16: the RMSNorm after the mix
  const void* delta;         // [rows][hidden] (kDelta != kNone): the last layer output
  int seal;                  // 1: source n-1 starts as delta (a new block); 0: it accumulates delta
  __nv_bfloat16* out;        // [rows][hidden]
  unsigned char* codes;      // [rows][hidden] E4M3 (kFp8)
  void* scales;              // [rows][hidden / 128] FP32 or UE8M0 bytes (kFp8)
  float* mixed;              // [rows][hidden] FP32, or null
};

template <class C>
struct Shared {
  static constexpr int kWarps = C::kThreads / 32;
  alignas(8) float wpart0[kWarps][C::kSources][2];   // each warp's (sum of squares, q-dot) per source
  float wpart1[kWarps];                               // each warp's partial of the mixed row's
  // Every slice's totals (summed over its warps in order), as exchanged: exchange 0 per source,
  // exchange 1 the mixed row.
  alignas(8) float recv0[C::kSlices][C::kSources][2];
  float recv1[C::kSlices];
  unsigned long long bar[2];
};

__device__ __forceinline__ float sum4(float a, float b, float c, float d) {
  return __fadd_rn(__fadd_rn(__fadd_rn(a, b), c), d);
}
__device__ __forceinline__ float sq4(const float4& v) {
  return sum4(__fmul_rn(v.x, v.x), __fmul_rn(v.y, v.y), __fmul_rn(v.z, v.z), __fmul_rn(v.w, v.w));
}
__device__ __forceinline__ float dot4(const float4& v, const float4& q) {
  return sum4(__fmul_rn(v.x, q.x), __fmul_rn(v.y, q.y), __fmul_rn(v.z, q.z), __fmul_rn(v.w, q.w));
}
// 1 / sqrt(ss / cols + eps), each operation rounded once (IEEE sqrt and divisions).
__device__ __forceinline__ float rstd(float ss, float cols, float eps) {
  return __fdiv_rn(1.f, __fsqrt_rn(__fadd_rn(__fdiv_rn(ss, cols), eps)));
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = __fadd_rn(v, __shfl_xor_sync(kFull, v, o));
  return v;   // the same value in every lane (a + b == b + a exactly)
}

__device__ __forceinline__ void st_async2(unsigned remote_addr, float a, float b, unsigned remote_bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.b32 [%0], {%1, %2}, [%3];\n"
               ::"r"(remote_addr), "r"(__float_as_uint(a)), "r"(__float_as_uint(b)), "r"(remote_bar)
               : "memory");
}

// A slice's totals to every CTA of the row: lane 0 of each warp leaves the warp's totals in shared
// memory, thread i < n sums source i's over the warps in order and stores the pair straight into
// every CTA's table (st.async, completing on that CTA's mbarrier; without a cluster the table is
// local and a barrier publishes it). Every CTA then reads the same table and sums the slices in
// order, so all hold the same totals.
template <class C>
__device__ __forceinline__ void publish0(const float (&ss)[C::kSources], const float (&dt)[C::kSources], int n,
                                         Shared<C>& sh, unsigned rank) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  if (lane == 0) {
#pragma unroll
    for (int i = 0; i < C::kSources; ++i)
      if (i < n) { sh.wpart0[warp][i][0] = ss[i]; sh.wpart0[warp][i][1] = dt[i]; }
  }
  __syncthreads();
  if (tid < n) {
    float a = sh.wpart0[0][tid][0], b = sh.wpart0[0][tid][1];
#pragma unroll
    for (int w = 1; w < Shared<C>::kWarps; ++w) {
      a = __fadd_rn(a, sh.wpart0[w][tid][0]);
      b = __fadd_rn(b, sh.wpart0[w][tid][1]);
    }
    if constexpr (C::kSlices == 1) {
      sh.recv0[0][tid][0] = a;
      sh.recv0[0][tid][1] = b;
    } else {
#pragma unroll
      for (int r = 0; r < C::kSlices; ++r)
        st_async2(kda::cluster_map(&sh.recv0[rank][tid][0], r), a, b, kda::cluster_map(&sh.bar[0], r));
    }
  }
  if constexpr (C::kSlices == 1) {
    __syncthreads();
  } else {
    kda::mbar_wait(&sh.bar[0], 0);
  }
}

template <class C>
__device__ __forceinline__ void publish1(float v, Shared<C>& sh, unsigned rank) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  if (lane == 0) sh.wpart1[warp] = v;
  __syncthreads();
  if (tid == 0) {
    float s = sh.wpart1[0];
#pragma unroll
    for (int w = 1; w < Shared<C>::kWarps; ++w) s = __fadd_rn(s, sh.wpart1[w]);
    if constexpr (C::kSlices == 1) {
      sh.recv1[0] = s;
    } else {
#pragma unroll
      for (int r = 0; r < C::kSlices; ++r)
        kda::st_async(kda::cluster_map(&sh.recv1[rank], r), s, kda::cluster_map(&sh.bar[1], r));
    }
  }
  if constexpr (C::kSlices == 1) {
    __syncthreads();
  } else {
    kda::mbar_wait(&sh.bar[1], 0);
  }
}

template <class C>
__device__ __forceinline__ void attn_res_mix(const Params& p) {
  constexpr int kN = C::kSources, kS = C::kSlices, kW = C::kHidden / kS;
  static_assert(kW == 4 * C::kThreads && kW % 128 == 0, "4 columns per thread, one warp per FP8 group");
  __shared__ Shared<C> sh;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int row = blockIdx.x / kS, slice = blockIdx.x % kS;
  const unsigned rank = kS > 1 ? kda::cluster_ctarank() : 0u;
  const int n = p.n;
  const int col = slice * kW + 4 * tid;
  const bool seal = C::kDelta != Delta::kNone && p.seal != 0;

  if constexpr (kS > 1) {
    if (tid == 0) {
#pragma unroll
      for (int ph = 0; ph < 2; ++ph) kda::mbar_init(&sh.bar[ph], 1);
      kda::fence_mbar_init();
      kda::mbar_arrive_expect_tx(&sh.bar[0], kS * n * 8);
      kda::mbar_arrive_expect_tx(&sh.bar[1], kS * 4);
    }
    kda::cluster_arrive_relaxed();   // peers' barriers initialised before the first st.async: the
  }                                  // wait is after the loads, so it overlaps them

  // The weights are never written by a previous kernel: read them before the dependency wait.
  const float4 q = *reinterpret_cast<const float4*>(p.query + col);
  const uint2 wraw = *reinterpret_cast<const uint2*>(p.norm_w + col);
  griddep_launch_dependents();
  griddep_wait();   // sources, delta and the outputs belong to the kernels before this one

  const float* base = p.src + static_cast<long long>(row) * p.row_stride + col;
  float4 d = make_float4(0.f, 0.f, 0.f, 0.f);
  if constexpr (C::kDelta != Delta::kNone) {
    const long long off = static_cast<long long>(row) * C::kHidden + col;
    if constexpr (C::kDelta == Delta::kFp32) {
      d = *reinterpret_cast<const float4*>(static_cast<const float*>(p.delta) + off);
    } else {
      const uint2 raw = *reinterpret_cast<const uint2*>(static_cast<const __nv_bfloat16*>(p.delta) + off);
      d = make_float4(bf16_lo(raw.x), bf16_hi(raw.x), bf16_lo(raw.y), bf16_hi(raw.y));
    }
  }
  float4 v[kN];
#pragma unroll
  for (int i = 0; i < kN; ++i) {
    float4 t = make_float4(0.f, 0.f, 0.f, 0.f);
    if (i < n && !(seal && i == n - 1)) t = *reinterpret_cast<const float4*>(base + i * p.src_stride);
    if (C::kDelta != Delta::kNone && i == n - 1) {
      // The partial sum: partial + FP32(delta), or FP32(delta) for a block's first output.
      t = seal ? d : make_float4(__fadd_rn(t.x, d.x), __fadd_rn(t.y, d.y), __fadd_rn(t.z, d.z), __fadd_rn(t.w, d.w));
      *reinterpret_cast<float4*>(const_cast<float*>(base) + i * p.src_stride) = t;
    }
    v[i] = t;
  }
  if constexpr (kS > 1) kda::cluster_wait();

  // 1. per source the sum of squares and the q-dot, one exchange for both (score = r * S(V q)).
  float ss[kN], dt[kN];
#pragma unroll
  for (int i = 0; i < kN; ++i) {
    ss[i] = i < n ? warp_sum(sq4(v[i])) : 0.f;
    dt[i] = i < n ? warp_sum(dot4(v[i], q)) : 0.f;
  }
  publish0<C>(ss, dt, n, sh, rank);

  // 2. Every warp sums the table's slices itself (lane i: source i) and runs the softmax over its
  // lanes, so no CTA barrier separates the exchange from the mix: r_i = rstd(total ss_i), score_i =
  // r_i * total dot_i, max, FP64 exp of (score - max) rounded once, the sum in source order, IEEE
  // division.
  float alpha[kN];
  {
    const int i = lane < n ? lane : 0;
    float ts = sh.recv0[0][i][0], td = sh.recv0[0][i][1];
#pragma unroll
    for (int r = 1; r < kS; ++r) {
      ts = __fadd_rn(ts, sh.recv0[r][i][0]);
      td = __fadd_rn(td, sh.recv0[r][i][1]);
    }
    const float score = __fmul_rn(rstd(ts, static_cast<float>(C::kHidden), C::kEps), td);
    float m = lane < n ? score : __int_as_float(0xff800000);   // -inf
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(kFull, m, o));
    const float pe = lane < n ? __double2float_rn(exp(static_cast<double>(__fsub_rn(score, m)))) : 0.f;
    float psum = 0.f;
#pragma unroll
    for (int j = 0; j < kN; ++j) if (j < n) psum = __fadd_rn(psum, __shfl_sync(kFull, pe, j));
    const float a = __fdiv_rn(pe, psum);
#pragma unroll
    for (int j = 0; j < kN; ++j) alpha[j] = j < n ? __shfl_sync(kFull, a, j) : 0.f;
  }

  // 3. the mixed row, sum_i alpha_i V_i in source order, and its RMS.
  float4 x = make_float4(__fmul_rn(alpha[0], v[0].x), __fmul_rn(alpha[0], v[0].y), __fmul_rn(alpha[0], v[0].z),
                         __fmul_rn(alpha[0], v[0].w));
#pragma unroll
  for (int i = 1; i < kN; ++i) {
    if (i < n) {
      x.x = __fadd_rn(x.x, __fmul_rn(alpha[i], v[i].x));
      x.y = __fadd_rn(x.y, __fmul_rn(alpha[i], v[i].y));
      x.z = __fadd_rn(x.z, __fmul_rn(alpha[i], v[i].z));
      x.w = __fadd_rn(x.w, __fmul_rn(alpha[i], v[i].w));
    }
  }
  const long long orow = static_cast<long long>(row) * C::kHidden + col;
  if (p.mixed != nullptr) *reinterpret_cast<float4*>(p.mixed + orow) = x;
  publish1<C>(warp_sum(sq4(x)), sh, rank);
  float rn;
  {   // the slices in order, in every warp
    float t = sh.recv1[0];
#pragma unroll
    for (int r = 1; r < kS; ++r) t = __fadd_rn(t, sh.recv1[r]);
    rn = rstd(t, static_cast<float>(C::kHidden), C::kEps);
  }

  // 4. BF16(x * rstd * w), then act_quant_fp8 of those BF16 values (one warp = one 128-group).
  float y[4] = {mla::bf16_round(__fmul_rn(__fmul_rn(x.x, rn), bf16_lo(wraw.x))),
                mla::bf16_round(__fmul_rn(__fmul_rn(x.y, rn), bf16_hi(wraw.x))),
                mla::bf16_round(__fmul_rn(__fmul_rn(x.z, rn), bf16_lo(wraw.y))),
                mla::bf16_round(__fmul_rn(__fmul_rn(x.w, rn), bf16_hi(wraw.y)))};
  uint2 ob;
  ob.x = kda::pack_bf16x2(y[0], y[1]);
  ob.y = kda::pack_bf16x2(y[2], y[3]);
  *reinterpret_cast<uint2*>(p.out + orow) = ob;
  if constexpr (C::kFp8) {
    float amax = fmaxf(fmaxf(fabsf(y[0]), fabsf(y[1])), fmaxf(fabsf(y[2]), fabsf(y[3])));
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(kFull, amax, o));
    const float t = __fdiv_rn(amax, 448.f);
    const long long g = static_cast<long long>(row) * (C::kHidden / 128) + (slice * kW) / 128 + warp;
    float qv[4];
    if constexpr (C::kUe8m0) {
      // x / 2^(b - 127) is exact as x * 2^(127 - b) (b <= 254 for finite rows; b == 0: 2^127).
      const unsigned b = mla::ue8m0_ceil(t);
      const float inv = b == 254u ? __uint_as_float(0x00400000u) : __uint_as_float((254u - b) << 23);
#pragma unroll
      for (int i = 0; i < 4; ++i) qv[i] = __fmul_rn(y[i], inv);
      if (lane == 0) static_cast<unsigned char*>(p.scales)[g] = static_cast<unsigned char>(b);
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i) qv[i] = t == 0.f ? 0.f : __fdiv_rn(y[i], t);   // +0 codes for t == 0
      if (lane == 0) static_cast<float*>(p.scales)[g] = t;
    }
    *reinterpret_cast<unsigned*>(p.codes + orow) = e4m3x4(qv);
  }
}

}  // namespace attnres
}  // namespace k3gen
