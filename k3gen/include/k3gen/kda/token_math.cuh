// The float expressions of one KDA token that every kernel computing a token must evaluate the
// same way: kda_decode (row and stream schedules, any cluster split) and kda_verify (row, prefetch
// and split schedules) call these and nothing else for the state update, o and the gated RMSNorm,
// so verify + commit == serial decode bit for bit by construction (SPEC.md section 3), and decode's
// bits do not depend on its launch-time split or schedule.
//
// What is fixed here, and must stay fixed for those equalities:
//  - the lane's K slice of a state row: lane l of a half-warp holds K = 4l .. 4l+3, 64+4l .. 64+4l+3
//    (element e < 4 at 4l + e, e >= 4 at 64 + 4l + e - 4) for FP32 and BF16 rows alike, and its
//    partial sums run e = 0 .. 7 (the half-warp tree over lanes is half_reduce_scatter's / half_sum's);
//  - the per-row algebra: d = e^g S[v,:], a = d.k, c = d.q, u = beta (v - a), o = c + (q.k) u,
//    S[v,:] = d + k u, with the fmaf placement below;
//  - BF16 storage: the state is rounded to BF16 (round to nearest even, one cvt per pair) after
//    every token, and the next token starts from the rounded value (store + reload, or round_bf16x8
//    in registers: the same cvt, so the same bits, NaN included);
//  - the RMSNorm sum: quad i = rows 4i .. 4i+3 summed by fmaf from 0 (rms_quad), then the 32 quads
//    by the xor butterfly 16, 8, 4, 2, 1 (warp_allsum); y = ((o rstd) nw) sigmoid(g_out).
#pragma once

#include <cuda_bf16.h>

namespace k3gen {
namespace kda {

constexpr float kNormEps = 1e-5f;   // the gated RMSNorm's epsilon

__device__ __forceinline__ unsigned pack_bf16x2(float lo, float hi) {
  const __nv_bfloat162 p = __floats2bfloat162_rn(lo, hi);  // round to nearest even
  return *reinterpret_cast<const unsigned*>(&p);
}

// The lane's K slice (see above): element e of lane l is K = lane_k(l, e).
__device__ __forceinline__ int lane_k0(int l) { return 4 * l; }
__device__ __forceinline__ int lane_k1(int l) { return 64 + 4 * l; }

// Row update, part 1: decay the row by exp(g) in place and return its two dot products.
__device__ __forceinline__ void row_decay_dots(float (&d)[8], const float (&ev)[8], const float (&kv)[8],
                                               const float (&qv)[8], float& a, float& c) {
  a = 0.0f;
  c = 0.0f;
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    d[e] *= ev[e];
    a = fmaf(d[e], kv[e], a);
    c = fmaf(d[e], qv[e], c);
  }
}

// u of a row from its reduced a = d.k; o from its reduced c = d.q and u.
__device__ __forceinline__ float row_u(float beta, float v, float a) { return beta * (v - a); }
__device__ __forceinline__ float row_o(float qk, float u, float c) { return fmaf(qk, u, c); }

// Row update, part 2: the rank-1 update S[v,:] = d + k u.
__device__ __forceinline__ void row_rank1(float (&d)[8], const float (&kv)[8], float u) {
#pragma unroll
  for (int e = 0; e < 8; ++e) d[e] = fmaf(kv[e], u, d[e]);
}

// The BF16 storage rounding of 8 values in registers: exactly a BF16 store and reload.
__device__ __forceinline__ void round_bf16x8(float (&d)[8]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const unsigned w = pack_bf16x2(d[2 * i], d[2 * i + 1]);
    d[2 * i] = __uint_as_float(w << 16);
    d[2 * i + 1] = __uint_as_float(w & 0xffff0000u);
  }
}

// Sum of squares of the quad o[0..3] (rows 4i .. 4i+3 of a head).
__device__ __forceinline__ float rms_quad(float o0, float o1, float o2, float o3) {
  float s = fmaf(o0, o0, 0.0f);
  s = fmaf(o1, o1, s);
  s = fmaf(o2, o2, s);
  return fmaf(o3, o3, s);
}

// Lane l holds quad l: the total over the warp, in every lane (full warp, converged).
__device__ __forceinline__ float warp_allsum(float x) {
#pragma unroll
  for (int m = 16; m >= 1; m >>= 1) x += __shfl_xor_sync(0xffffffffu, x, m);
  return x;
}

__device__ __forceinline__ float rms_rstd(float total) { return rsqrtf(total * (1.0f / 128.0f) + kNormEps); }

// One gated output: o rstd nw gate, left to right (gate = sigmoid(g_out)).
__device__ __forceinline__ float gated_y(float o, float rstd, float nw, float gate) { return o * rstd * nw * gate; }

}  // namespace kda
}  // namespace k3gen
