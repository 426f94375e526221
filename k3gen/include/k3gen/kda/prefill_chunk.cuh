// kda_prefill, chunked (WY) form of SPEC.md section 2 with tensor cores. Contract: the docstring of
// k3gen/ops/kda_prefill/spec.py; FP32 twin: k3gen/ops/kda_prefill/reference.py (token loop) and the chunk
// algebra in k3gen/ops/kda_prefill/reference.py:chunk_emulation.
//
// One CTA (8 warps) per (sequence, head). Tokens go in chunks of C = 16 (the sub-chunk of SPEC.md:
// exp(+-G) over 16 tokens stays finite in FP32 for any gate, because every decay factor below is
// formed as exp of a difference <= 0). Per chunk, with G_r the inclusive cumulative log-decay:
//   A[r,s] = beta_r sum_i k_r[i] k_s[i] e^(G_r[i]-G_s[i])  (s < r)
//   P[r,s] =        sum_i q_r[i] k_s[i] e^(G_r[i]-G_s[i])  (s <= r, zero above)
//   (I + A) [W | U] = diag(beta) [e^G * K | V]             (forward substitution, one column a thread)
//   V_new = U - W S ;  O = (e^G * Q) S + P V_new ;  S <- e^(G_C) * S + (K * e^(G_C - G))^T V_new
// The state S^T [v, k] lives in registers as mma.sync m16n8k8 accumulators: warp w owns v rows
// 16w .. 16w+15, all 128 k. An accumulator tile holds columns (2t, 2t+1) of each 8-column block,
// so it is already an A operand whose k order is permuted (slot t <-> 2t, slot t+4 <-> 2t+1); the
// B operands are read from shared memory with the same permutation. Hence S^T W^T, S^T Q^T, the
// V_new^T P^T and V_new^T Kd products run on the warp's own registers with no exchange, and V_new
// never leaves registers. Every product is 3xTF32 (big/small split, FP32 accumulate), so the
// recurrence keeps FP32 accuracy (the tests hold the state to 1e-5 of the FP32 token loop).
#pragma once

#include <cuda_bf16.h>

#include "k3gen/kda/common.cuh"

namespace k3gen {
namespace kda {
namespace chunk {

constexpr int kThreads = 256;
constexpr int kC = 16;                  // tokens per chunk
constexpr int kLd = kDim + 8;           // padded row stride (floats) of the [token][channel] tiles
constexpr int kRowVecs = kDim * 2 / 16; // uint4 per BF16 f_b row
constexpr int kFaLd = kDim + 8;         // padded f_a row (BF16): fragment loads hit 32 distinct banks

struct __align__(128) Smem {
  uint4 fb[kDim * kRowVecs];            // f_b rows of this head (32 KB)
  float dtb[kDim];
  float q[kC][kLd];                     // post-conv q -> normalized q -> e^G * q
  float k[kC][kLd];                     // post-conv k -> normalized k -> k * e^(G_C - G)
  float v[kC][kLd];                     // post-conv v -> U
  float g[kC][kLd];                     // log decay -> cumulative G -> -W
  float o[kC][kLd];                     // O of the chunk (before the gated RMSNorm)
  unsigned short fa[kC][kFaLd];         // f_a rows of the chunk, raw BF16 (gate A operand)
  float A[kC][kC + 1];
  float P[kC][kC + 1];
  float egl[kDim];                      // e^(G_C)
  float beta[kC];
  unsigned long long bar;
};

struct Params {
  const __nv_bfloat16* qkvg;
  const __nv_bfloat16* fa;
  const __nv_bfloat16* beta;
  __nv_bfloat16* out;
  long long qkvg_stride, fa_stride, beta_stride;
  const __nv_bfloat16* conv_w;
  const uint4* fb_w;
  const float* dt_bias;
  const float* a_log;
  const float* norm_w;
  const int* cu_seqlens;
  const int* slots;
  const int* resume;
  void* ssm;
  __nv_bfloat16* conv;
  int num_slots;
};

template <Gate G>
__device__ __forceinline__ float log_decay(float z, float a) {
  if constexpr (G == Gate::kBounded) {
    return kBoundedLower * sigmoidf_(a * z);
  } else {
    const float sp = z > 20.0f ? z : log1pf(expf(z));
    return -a * sp;
  }
}

// ---- tensor-core pieces ----------------------------------------------------------------------
__device__ __forceinline__ unsigned tf32(float x) {
  unsigned r;
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
  return r;
}

__device__ __forceinline__ void split(float x, unsigned& big, unsigned& small) {
  big = tf32(x);
  small = tf32(x - __uint_as_float(big));
}

__device__ __forceinline__ void mma(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// d += A B, BF16 inputs, FP32 accumulate (A: 16 x 16 row-major fragment, B: 16 x 8 column-major).
__device__ __forceinline__ void mma_bf16(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// d += A B in 3xTF32; A given as the FP32 accumulator tile c (k order permuted, see the top),
// B as its two FP32 values (k slots t and t+4 of column g).
struct SplitA {
  unsigned big[4], small[4];
  __device__ __forceinline__ explicit SplitA(const float (&c)[4]) {
    // accumulator (c0, c1, c2, c3) = (row g col 2t, row g col 2t+1, row g+8 col 2t, row g+8 col 2t+1)
    // operand     (a0, a1, a2, a3) = (row g slot t, row g+8 slot t, row g slot t+4, row g+8 slot t+4)
    split(c[0], big[0], small[0]);
    split(c[2], big[1], small[1]);
    split(c[1], big[2], small[2]);
    split(c[3], big[3], small[3]);
  }
};

__device__ __forceinline__ void mma3(float (&d)[4], const SplitA& a, float b0, float b1) {
  unsigned bb0, bs0, bb1, bs1;
  split(b0, bb0, bs0);
  split(b1, bb1, bs1);
  mma(d, a.small, bb0, bb1);
  mma(d, a.big, bs0, bs1);
  mma(d, a.big, bb0, bb1);
}

// ---- one chunk --------------------------------------------------------------------------------
// Conv + SiLU of q, k, v and the log decays of tokens t0 .. t0+n-1 into the chunk tiles; rows
// n .. kC-1 are zeros (no contribution: zero k, v, beta and decay). Every global load of the chunk
// is issued before the first use: a per-token load -> use loop costs one device-memory latency per
// token (the first chunk16 version spent ~32 such round trips, ~25 us, per 16-token chunk).
template <Gate G_, int H>
__device__ __forceinline__ void stage(const Params& p, long long tok0, int h, int n, multi::Window& win, Smem& sm,
                                      float a_gate) {
  const int tid = threadIdx.x;
  const int sec = tid >> 7, ch = tid & (kDim - 1);
  const bool has_v = tid < kDim;
  const int cqk = multi::chan_qk<H>(h), cv = multi::chan_v<H>(h);
  float xq[kC], xv[kC];
#pragma unroll
  for (int t = 0; t < kC; ++t) {
    const __nv_bfloat16* xrow = p.qkvg + (tok0 + t) * p.qkvg_stride;
    xq[t] = t < n ? __bfloat162float(xrow[cqk]) : 0.0f;
    xv[t] = t < n && has_v ? __bfloat162float(xrow[cv]) : 0.0f;
  }
  {  // f_a rows of the chunk: thread tid stages 8 channels of token tid / 16 (any row stride)
    const int t = tid >> 4, c0 = 8 * (tid & 15);
    unsigned f[8];
    const unsigned short* farow = reinterpret_cast<const unsigned short*>(p.fa) + (tok0 + t) * p.fa_stride + c0;
#pragma unroll
    for (int e = 0; e < 8; ++e) f[e] = t < n ? farow[e] : 0u;
    *reinterpret_cast<uint4*>(&sm.fa[t][c0]) =
        make_uint4(f[0] | f[1] << 16, f[2] | f[3] << 16, f[4] | f[5] << 16, f[6] | f[7] << 16);
  }
  if (tid < kC) sm.beta[tid] = tid < n ? sigmoidf_(__bfloat162float(p.beta[(tok0 + tid) * p.beta_stride + h])) : 0.0f;
  float wqk[4], wv[4];
  multi::taps_of(p.conv_w, cqk, wqk);
  multi::taps_of(p.conv_w, cv, wv);
  float* qk_tile = sec == 0 ? &sm.q[0][0] : &sm.k[0][0];
#pragma unroll
  for (int t = 0; t < kC; ++t) {
    float yqk = 0.0f, yv = 0.0f;
    if (t < n) {
      yqk = conv_silu(wqk, win.qk[0], win.qk[1], win.qk[2], xq[t]);
      win.qk[0] = win.qk[1], win.qk[1] = win.qk[2], win.qk[2] = xq[t];
      if (has_v) {
        yv = conv_silu(wv, win.v[0], win.v[1], win.v[2], xv[t]);
        win.v[0] = win.v[1], win.v[1] = win.v[2], win.v[2] = xv[t];
      }
    }
    qk_tile[t * kLd + ch] = yqk;
    if (has_v) sm.v[t][ch] = yv;
  }
  mbar_wait(&sm.bar, 0);  // f_b rows (completed once; later chunks pass at once)
  __syncthreads();        // the f_a tile
  // Gate pre-activations z[t][c] = f_b[c] . f_a[t] on tensor cores (BF16 m16n8k16): warp w
  // computes channels 16w .. 16w+15 of the 16 tokens. BF16 products are exact in FP32; each k
  // step of 16 starts from a zero accumulator and is added in FP32 here, so the rounding matches
  // the FP32 CUDA-core sum (no long in-mma accumulation).
  const int warp = tid >> 5, gq = (tid & 31) >> 2, tq = tid & 3;
  const unsigned* fa32 = reinterpret_cast<const unsigned*>(&sm.fa[0][0]);
  const unsigned* fb32 = reinterpret_cast<const unsigned*>(sm.fb);
  constexpr int kFaW = kFaLd / 2, kFbW = kDim / 2;  // 32-bit words per row
  float z[2][4];
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) z[nt][e] = 0.0f;
#pragma unroll
  for (int kk = 0; kk < kDim / 16; ++kk) {
    const int w0 = 8 * kk + tq;  // columns 16 kk + 2 tq, +1
    const unsigned a[4] = {fa32[gq * kFaW + w0], fa32[(gq + 8) * kFaW + w0], fa32[gq * kFaW + w0 + 4],
                           fa32[(gq + 8) * kFaW + w0 + 4]};
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      const int c = 16 * warp + 8 * nt + gq;
      float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      mma_bf16(d, a, fb32[c * kFbW + w0], fb32[c * kFbW + w0 + 4]);
#pragma unroll
      for (int e = 0; e < 4; ++e) z[nt][e] += d[e];
    }
  }
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
    const int c = 16 * warp + 8 * nt + 2 * tq;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int t = gq + 8 * (e >> 1), ce = c + (e & 1);
      sm.g[t][ce] = t < n ? log_decay<G_>(z[nt][e] + sm.dtb[ce], a_gate) : 0.0f;
    }
  }
}

// After stage + barrier: L2 norms, cumulative decays, A and P, then (barrier) the forward
// substitution and the operand tiles of the tensor-core phase. Ends with a barrier.
__device__ __forceinline__ void prepare(Smem& sm) {
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  // L2 norms: warp w normalizes tokens 2w and 2w+1, q and k.
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int t = 2 * warp + (i >> 1);
    float* row = (i & 1) ? sm.k[t] : sm.q[t];
    float x[4], ss = 0.0f;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      x[e] = row[lane + 32 * e];
      ss = fmaf(x[e], x[e], ss);
    }
#pragma unroll
    for (int m = 16; m >= 1; m >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, m);
    const float sc = rsqrtf(ss + kL2Eps) * ((i & 1) ? 1.0f : 0.08838834764831845f);  // q: 128^-0.5
#pragma unroll
    for (int e = 0; e < 4; ++e) row[lane + 32 * e] = x[e] * sc;
  }
  // Cumulative log decay per channel (threads 128..255 have nothing to do here).
  if (tid < kDim) {
    float acc = 0.0f;
#pragma unroll
    for (int t = 0; t < kC; ++t) {
      acc += sm.g[t][tid];
      sm.g[t][tid] = acc;
    }
  }
  if (tid < kC * kC) {  // P is a full B operand: zero above the diagonal
    const int r = tid / kC, s = tid % kC;
    if (s > r) sm.P[r][s] = 0.0f;
  }
  __syncthreads();
  // A and P: the 136 pairs s <= r over the 8 warps, e^(G_r - G_s) shared by both.
#pragma unroll 1
  for (int pr = warp; pr < kC * (kC + 1) / 2; pr += 8) {
    int r = 0;
    while ((r + 1) * (r + 2) / 2 <= pr) ++r;
    const int s = pr - r * (r + 1) / 2;
    float pa = 0.0f, aa = 0.0f;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int i = lane + 32 * e;
      const float ks = sm.k[s][i] * expf(sm.g[r][i] - sm.g[s][i]);
      pa = fmaf(sm.q[r][i], ks, pa);
      aa = fmaf(sm.k[r][i], ks, aa);
    }
#pragma unroll
    for (int m = 16; m >= 1; m >>= 1) {
      pa += __shfl_xor_sync(0xffffffffu, pa, m);
      aa += __shfl_xor_sync(0xffffffffu, aa, m);
    }
    if (lane == 0) {
      sm.P[r][s] = pa;
      sm.A[r][s] = s < r ? sm.beta[r] * aa : 0.0f;
    }
  }
  __syncthreads();
  // Forward substitution, one column a thread: columns 0..127 give W (from e^G * k), 128..255 U.
  {
    const int c = tid & (kDim - 1);
    const bool wcol = tid < kDim;
    const float gl = sm.g[kC - 1][c];
    float x[kC];
#pragma unroll
    for (int r = 0; r < kC; ++r) {
      const float y = wcol ? sm.k[r][c] * expf(sm.g[r][c]) : sm.v[r][c];
      float acc = sm.beta[r] * y;
#pragma unroll
      for (int s = 0; s < r; ++s) acc = fmaf(-sm.A[r][s], x[s], acc);
      x[r] = acc;
    }
    if (wcol) {
      // This thread is the only reader and writer of column c of q, k and g from here on.
#pragma unroll
      for (int r = 0; r < kC; ++r) {
        const float G = sm.g[r][c];
        sm.q[r][c] *= expf(G);
        sm.k[r][c] *= expf(gl - G);
        sm.g[r][c] = -x[r];
      }
      sm.egl[c] = expf(gl);
    } else {
#pragma unroll
      for (int r = 0; r < kC; ++r) sm.v[r][c] = x[r];
    }
  }
  __syncthreads();
}

// The tensor-core phase of one chunk on this warp's 16 state rows; writes the first n rows of O
// (row stride ldo) to o. `sm` holds the prepared tiles q, k, v, g, P, egl (Smem or a saved Tiles).
// No barrier. With NT = 8 (k split), the warp holds k tiles 8 kh .. 8 kh + 7 of the rows and its
// partner warp (warp ^ 1, same rows) the other half: the partial V_new^T / O^T sums meet in xch
// (one __syncthreads, every thread of the CTA calls this), both warps then hold the same V_new^T
// (a + b == b + a) for their half of the state update, and the kh = 0 warp finishes O.
template <class T, int NT = 16>
__device__ __forceinline__ void chunk_mma(float (&st)[NT][4], const T& sm, float* o, long long ldo, int n, int rb,
                                          int kh = 0, float* xch = nullptr) {
  static_assert(NT == 16 || NT == 8, "whole k range or one half");
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int v0 = 16 * rb, kt0 = NT * kh;
  float vn[2][4], oi[2][4], vn2[2][4], oi2[2][4];
  // V_new^T starts as U^T; O^T as zero.
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int r = 8 * j + 2 * t;
    const bool u = kh == 0;  // U^T enters one partial sum only
    vn[j][0] = u ? sm.v[r][v0 + g] : 0.0f;
    vn[j][1] = u ? sm.v[r + 1][v0 + g] : 0.0f;
    vn[j][2] = u ? sm.v[r][v0 + g + 8] : 0.0f;
    vn[j][3] = u ? sm.v[r + 1][v0 + g + 8] : 0.0f;
#pragma unroll
    for (int e = 0; e < 4; ++e) oi[j][e] = vn2[j][e] = oi2[j][e] = 0.0f;
  }
  // V_new^T += S^T (-W)^T ; O^T += S^T (e^G q)^T, contracting over k in 16 steps of 8. Even and
  // odd steps go to separate accumulators (summed after): 8 independent chains of 24 dependent
  // mma per warp instead of 4 of 48, so the tensor pipe is not waiting on mma latency.
#pragma unroll
  for (int kk = 0; kk < NT; ++kk) {
    const SplitA a(st[kk]);
    const int kc = 8 * (kt0 + kk) + 2 * t;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const float2 w = *reinterpret_cast<const float2*>(&sm.g[8 * j + g][kc]);
      mma3((kk & 1) ? vn2[j] : vn[j], a, w.x, w.y);
      const float2 q = *reinterpret_cast<const float2*>(&sm.q[8 * j + g][kc]);
      mma3((kk & 1) ? oi2[j] : oi[j], a, q.x, q.y);
    }
  }
#pragma unroll
  for (int j = 0; j < 2; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) vn[j][e] += vn2[j][e], oi[j][e] += oi2[j][e];
  if constexpr (NT < 16) {
    float* mine = xch + (threadIdx.x >> 5) * 512;  // [V_new^T | O^T][8 values][32 lanes]
    const float* other = xch + ((threadIdx.x >> 5) ^ 1) * 512;
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        mine[(4 * j + e) * 32 + lane] = vn[j][e];
        if (kh) mine[256 + (4 * j + e) * 32 + lane] = oi[j][e];
      }
    __syncthreads();
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        vn[j][e] += other[(4 * j + e) * 32 + lane];
        if (!kh) oi[j][e] += other[256 + (4 * j + e) * 32 + lane];
      }
  }
  // O^T += V_new^T P^T (contract over tokens s); the state decays and gains V_new^T Kd.
  const SplitA an0(vn[0]), an1(vn[1]);
  if (kh == 0) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int r = 8 * j + g;
      mma3(oi[j], an0, sm.P[r][2 * t], sm.P[r][2 * t + 1]);
      mma3(oi[j], an1, sm.P[r][8 + 2 * t], sm.P[r][8 + 2 * t + 1]);
    }
  }
#pragma unroll
  for (int i = 0; i < NT; ++i) {
    const int kt = kt0 + i;
    const int kc = 8 * kt + 2 * t;
    const float e0 = sm.egl[kc], e1 = sm.egl[kc + 1];
    st[i][0] *= e0;
    st[i][1] *= e1;
    st[i][2] *= e0;
    st[i][3] *= e1;
    const int kn = 8 * kt + g;
    mma3(st[i], an0, sm.k[2 * t][kn], sm.k[2 * t + 1][kn]);
    mma3(st[i], an1, sm.k[8 + 2 * t][kn], sm.k[8 + 2 * t + 1][kn]);
  }
  if (kh != 0) return;
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int r = 8 * j + 2 * t;
    if (r < n) {
      o[r * ldo + v0 + g] = oi[j][0];
      o[r * ldo + v0 + g + 8] = oi[j][2];
    }
    if (r + 1 < n) {
      o[(r + 1) * ldo + v0 + g] = oi[j][1];
      o[(r + 1) * ldo + v0 + g + 8] = oi[j][3];
    }
  }
}

// Gated RMSNorm of n tokens whose raw O rows are o (row stride ldo), after a barrier: warp w
// takes tokens w, w + 8, ...
template <int H>
__device__ __forceinline__ void emit(const Params& p, long long tok0, int h, int n, const float* o_rows, long long ldo) {
  constexpr int D = H * kDim;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
#pragma unroll 1
  for (int t = warp; t < n; t += 8) {
    const long long tok = tok0 + t;
    gated_rmsnorm<H>(
        p, tok, h, lane, [&](int i) { return o_rows[t * ldo + 4 * lane + i]; },
        [&](int i) { return __ldg(p.norm_w + 4 * lane + i); },
        [&](int i) {
          const __nv_bfloat16* go = p.qkvg + tok * p.qkvg_stride + 3 * D + h * kDim + 4 * lane;
          return sigmoidf_(__bfloat162float(go[i]));
        });
  }
}

// ---- state I/O in the accumulator layout ------------------------------------------------------
template <bool kBf16, int NT = 16>
__device__ __forceinline__ void load_state(const void* head, float (&st)[NT][4], int rb, int kt0 = 0) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, v = 16 * rb + g;
#pragma unroll
  for (int kt = 0; kt < NT; ++kt) {
    const int k = 8 * (kt0 + kt) + 2 * t;
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const long long off = static_cast<long long>(v + 8 * hr) * kDim + k;
      if constexpr (kBf16) {
        const unsigned u = *reinterpret_cast<const unsigned*>(static_cast<const __nv_bfloat16*>(head) + off);
        st[kt][2 * hr] = __uint_as_float(u << 16);
        st[kt][2 * hr + 1] = __uint_as_float(u & 0xffff0000u);
      } else {
        const float2 f = *reinterpret_cast<const float2*>(static_cast<const float*>(head) + off);
        st[kt][2 * hr] = f.x;
        st[kt][2 * hr + 1] = f.y;
      }
    }
  }
}

template <bool kBf16, int NT = 16>
__device__ __forceinline__ void store_state(void* head, const float (&st)[NT][4], int rb, int kt0 = 0) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, v = 16 * rb + g;
#pragma unroll
  for (int kt = 0; kt < NT; ++kt) {
    const int k = 8 * (kt0 + kt) + 2 * t;
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const long long off = static_cast<long long>(v + 8 * hr) * kDim + k;
      if constexpr (kBf16)
        *reinterpret_cast<unsigned*>(static_cast<__nv_bfloat16*>(head) + off) =
            pack_bf16x2(st[kt][2 * hr], st[kt][2 * hr + 1]);
      else
        *reinterpret_cast<float2*>(static_cast<float*>(head) + off) = make_float2(st[kt][2 * hr], st[kt][2 * hr + 1]);
    }
  }
}

template <class C>
__device__ __forceinline__ void run(const Params& p, Smem& sm) {
  constexpr int H = C::kHeads, D = H * kDim;
  constexpr long long kHead = kDim * kDim;
  const int h = blockIdx.x, b = blockIdx.y;
  const long long tok0 = __ldg(p.cu_seqlens + b);
  const int len = __ldg(p.cu_seqlens + b + 1) - static_cast<int>(tok0);
  const int slot = __ldg(p.slots + b);
  multi::start_weights(p, h, sm);
  // No thread may poll the barrier before thread 0 has initialised it (stale shared memory).
  __syncthreads();
  if (slot < 0 || slot >= p.num_slots || len <= 0) {  // padded row or empty sequence
    for (long long i = threadIdx.x; i < static_cast<long long>(len > 0 ? len : 0) * kDim; i += kThreads)
      p.out[((tok0 + i / kDim) * H + h) * kDim + i % kDim] = __float2bfloat16(0.0f);
    mbar_wait(&sm.bar, 0);  // no bulk copy may still target this CTA when it exits
    return;
  }
  const bool resume = __ldg(p.resume + b) != 0;
  void* head = C::kBf16State
                   ? static_cast<void*>(static_cast<__nv_bfloat16*>(p.ssm) + (static_cast<long long>(slot) * H + h) * kHead)
                   : static_cast<void*>(static_cast<float*>(p.ssm) + (static_cast<long long>(slot) * H + h) * kHead);
  multi::Window win;
#pragma unroll
  for (int i = 0; i < 3; ++i) win.qk[i] = win.v[i] = 0.0f;
  const int cqk = multi::chan_qk<H>(h), cv = multi::chan_v<H>(h);
  const bool has_v = threadIdx.x < kDim;
  unsigned short* wbase = reinterpret_cast<unsigned short*>(p.conv) + static_cast<long long>(slot) * (3 * D) * 3;
  float st[16][4];
  if (resume) {
#pragma unroll
    for (int i = 0; i < 3; ++i) win.qk[i] = bf16_bits_to_float(wbase[cqk * 3 + i]);
    if (has_v) {
#pragma unroll
      for (int i = 0; i < 3; ++i) win.v[i] = bf16_bits_to_float(wbase[cv * 3 + i]);
    }
    load_state<C::kBf16State>(head, st, threadIdx.x >> 5);
  } else {
#pragma unroll
    for (int kt = 0; kt < 16; ++kt)
#pragma unroll
      for (int e = 0; e < 4; ++e) st[kt][e] = 0.0f;
  }
  const float a_gate = expf(__ldg(p.a_log + h));
#pragma unroll 1
  for (int t0 = 0; t0 < len; t0 += kC) {
    const int n = len - t0 < kC ? len - t0 : kC;
    stage<C::kGate, H>(p, tok0 + t0, h, n, win, sm, a_gate);
    __syncthreads();
    prepare(sm);
    chunk_mma(st, sm, &sm.o[0][0], kLd, kC, threadIdx.x >> 5);
    __syncthreads();
    emit<H>(p, tok0 + t0, h, n, &sm.o[0][0], kLd);
    __syncthreads();  // the next chunk's staging overwrites the tiles emit and the mma phase read
  }
  store_state<C::kBf16State>(head, st, threadIdx.x >> 5);
  // Each channel's window is owned by the one thread that read it; raw BF16 values: exact.
#pragma unroll
  for (int i = 0; i < 3; ++i) wbase[cqk * 3 + i] = __bfloat16_as_ushort(__float2bfloat16(win.qk[i]));
  if (has_v) {
#pragma unroll
    for (int i = 0; i < 3; ++i) wbase[cv * 3 + i] = __bfloat16_as_ushort(__float2bfloat16(win.v[i]));
  }
}

}  // namespace chunk
}  // namespace kda
}  // namespace k3gen
