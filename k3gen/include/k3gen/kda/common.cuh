// Pieces of the KDA step shared by the decode kernel and the later prefill / verify kernels:
// the forget gate, the causal conv tap sum, BF16 packing, state-row I/O and cluster barriers.
// The math is SPEC.md section 2; the FP32 twin is k3gen/ops/kda_decode/reference.py.
#pragma once

#include <cuda_bf16.h>

#include "k3gen/common/faults.cuh"
#include "k3gen/common/pdl.cuh"
#include "k3gen/common/sm90_async.cuh"
#include "k3gen/kda/token_math.cuh"

namespace k3gen {
namespace kda {

enum class Gate { kBounded, kSoftplus };

constexpr int kDim = 128;              // K = V
constexpr float kBoundedLower = -5.0f;
constexpr float kL2Eps = 1e-6f;

__device__ __forceinline__ float bf16_bits_to_float(unsigned bits16) { return __uint_as_float(bits16 << 16); }

__device__ __forceinline__ float sigmoidf_(float x) { return 1.0f / (1.0f + expf(-x)); }

// exp(g) for one key channel. Precise expf/log1pf: 128 channels per head, off the critical path.
template <Gate G>
__device__ __forceinline__ float decay(float z, float a /* = exp(A_log[h]) */) {
  float g;
  if constexpr (G == Gate::kBounded) {
    g = kBoundedLower * sigmoidf_(a * z);
  } else {
    // torch's softplus switches to the identity above 20; matching it keeps the reference exact.
    const float sp = z > 20.0f ? z : log1pf(expf(z));
    g = -a * sp;
  }
  return expf(g);
}

// SiLU of the depthwise conv over (x_{t-3}, x_{t-2}, x_{t-1}, x_t), tap 0 oldest.
__device__ __forceinline__ float conv_silu(const float (&w)[4], float x0, float x1, float x2, float x3) {
  float acc = w[0] * x0;
  acc = fmaf(w[1], x1, acc);
  acc = fmaf(w[2], x2, acc);
  acc = fmaf(w[3], x3, acc);
  return acc / (1.0f + expf(-acc));
}

__device__ __forceinline__ void unpack_bf16x8(const uint4& u, float (&x)[8]) {
  const unsigned w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    x[2 * i] = __uint_as_float(w[i] << 16);
    x[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}

// One state row (128 K values of S^T[v, :]) seen by a half-warp: lane l of the half owns the 8 K
// values of kda/token_math.cuh's lane slice, K = 4l .. 4l+3 and 64+4l .. 64+4l+3, whatever the
// storage dtype (the multi-token kernels hold their register rows so too: same partial sums, same
// bits). FP32 rows: two float4, each 16-lane LDG.128 covering 256 contiguous bytes; BF16 rows: two
// 8-byte words, each 16-lane LDG.64 covering 128 contiguous bytes. Streaming hints (.cs): the state
// is touched once per step and must not push the f_b weights out of L2.
template <bool kBf16>
struct StateRow;

template <>
struct StateRow<false> {
  using Elem = float;
  struct Frag { float4 a, b; };
  static __device__ __forceinline__ int k0(int l) { return lane_k0(l); }
  static __device__ __forceinline__ int k1(int l) { return lane_k1(l); }
  static __device__ __forceinline__ Frag load(const float* row, int l) {
    const float4* p = reinterpret_cast<const float4*>(row);
    return Frag{__ldcs(p + l), __ldcs(p + 16 + l)};
  }
  static __device__ __forceinline__ Frag load_shared(const float* row, int l) {
    const float4* p = reinterpret_cast<const float4*>(row);
    return Frag{p[l], p[16 + l]};
  }
  static __device__ __forceinline__ void unpack(const Frag& f, float (&x)[8]) {
    x[0] = f.a.x; x[1] = f.a.y; x[2] = f.a.z; x[3] = f.a.w;
    x[4] = f.b.x; x[5] = f.b.y; x[6] = f.b.z; x[7] = f.b.w;
  }
  static __device__ __forceinline__ void store(float* row, int l, const float (&x)[8]) {
    float4* p = reinterpret_cast<float4*>(row);
    __stcs(p + l, make_float4(x[0], x[1], x[2], x[3]));
    __stcs(p + 16 + l, make_float4(x[4], x[5], x[6], x[7]));
  }
};

template <>
struct StateRow<true> {
  using Elem = __nv_bfloat16;
  struct Frag { uint2 a, b; };  // BF16 pairs at K = 4l .. 4l+3 (a) and 64+4l .. 64+4l+3 (b)
  static __device__ __forceinline__ int k0(int l) { return lane_k0(l); }
  static __device__ __forceinline__ int k1(int l) { return lane_k1(l); }
  static __device__ __forceinline__ Frag load(const __nv_bfloat16* row, int l) {
    const uint2* p = reinterpret_cast<const uint2*>(row);
    return Frag{__ldcs(p + l), __ldcs(p + 16 + l)};
  }
  static __device__ __forceinline__ Frag load_shared(const __nv_bfloat16* row, int l) {
    const uint2* p = reinterpret_cast<const uint2*>(row);
    return Frag{p[l], p[16 + l]};
  }
  static __device__ __forceinline__ void unpack(const Frag& f, float (&x)[8]) {
    const unsigned w[4] = {f.a.x, f.a.y, f.b.x, f.b.y};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      x[2 * i] = __uint_as_float(w[i] << 16);
      x[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
  }
  static __device__ __forceinline__ void store(__nv_bfloat16* row, int l, const float (&x)[8]) {
    uint2* p = reinterpret_cast<uint2*>(row);
    __stcs(p + l, make_uint2(pack_bf16x2(x[0], x[1]), pack_bf16x2(x[2], x[3])));
    __stcs(p + 16 + l, make_uint2(pack_bf16x2(x[4], x[5]), pack_bf16x2(x[6], x[7])));
  }
};

// Sum over the 16 lanes of a half-warp (xor offsets < 16 never cross halves).
__device__ __forceinline__ float half_sum(float x) {
#pragma unroll
  for (int m = 8; m >= 1; m >>= 1) x += __shfl_xor_sync(0xffffffffu, x, m);
  return x;
}

// A lane's 8 key channels (i0 .. i0 + 3 and i1 .. i1 + 3) of q, k and exp(g) from shared rows, q
// and k L2-normalized over the head from half-warp sums (q also by 128^-0.5). Returns q.k of the
// normalized vectors. The decode row update and the multi-token recurrence both start so.
__device__ __forceinline__ float load_qk_norm(const float* sq, const float* sk, const float* seg, int i0, int i1,
                                              float (&qv)[8], float (&kv)[8], float (&ev)[8]) {
  {
    const float* src[3] = {sq, sk, seg};
    float* dst[3] = {qv, kv, ev};
#pragma unroll
    for (int t = 0; t < 3; ++t) {
      const float4 lo = *reinterpret_cast<const float4*>(src[t] + i0);
      const float4 hi = *reinterpret_cast<const float4*>(src[t] + i1);
      dst[t][0] = lo.x, dst[t][1] = lo.y, dst[t][2] = lo.z, dst[t][3] = lo.w;
      dst[t][4] = hi.x, dst[t][5] = hi.y, dst[t][6] = hi.z, dst[t][7] = hi.w;
    }
  }
  float ssq_q = 0.0f, ssq_k = 0.0f, qk = 0.0f;
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    ssq_q = fmaf(qv[e], qv[e], ssq_q);
    ssq_k = fmaf(kv[e], kv[e], ssq_k);
    qk = fmaf(qv[e], kv[e], qk);
  }
  ssq_q = half_sum(ssq_q);
  ssq_k = half_sum(ssq_k);
  qk = half_sum(qk);
  const float iq = rsqrtf(ssq_q + kL2Eps) * 0.08838834764831845f;  // 128^-0.5
  const float ik = rsqrtf(ssq_k + kL2Eps);
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    qv[e] *= iq;
    kv[e] *= ik;
  }
  qk *= iq * ik;
  return qk;
}

// Sums N values (N = 2^p <= 16) over the 16 lanes of a half-warp, leaving lane l with the sum of
// value half_rs_index<N>(l) (16/N lanes hold each). It exchanges N-1+4-p values instead of 4N,
// and each per-value sum is the same float expression as half_sum's (a + b == b + a).
template <int N, int M = 8>
__device__ __forceinline__ void half_reduce_scatter(float* x, int hl) {
  if constexpr (M >= 1) {
    if constexpr (N > 1) {
      const bool lower = (hl & M) == 0;
#pragma unroll
      for (int i = 0; i < N / 2; ++i) {
        const float send = lower ? x[i + N / 2] : x[i];
        const float keep = lower ? x[i] : x[i + N / 2];
        x[i] = keep + __shfl_xor_sync(0xffffffffu, send, M);
      }
      half_reduce_scatter<N / 2, M / 2>(x, hl);
    } else {
      x[0] += __shfl_xor_sync(0xffffffffu, x[0], M);
      half_reduce_scatter<1, M / 2>(x, hl);
    }
  }
}

template <int N>
__device__ __forceinline__ int half_rs_index(int hl) {
  int j = 0;
#pragma unroll
  for (int bit = 3, n = N; n > 1; --bit, n >>= 1) j = (j << 1) | ((hl >> bit) & 1);
  return j;
}

// ---- thread-block clusters (sm_90+): DSMEM exchange through mbarriers ------------------------
// A CTA pushes values into peers' shared memory with st.async, which completes bytes on the
// receiver's mbarrier: no release fence is needed (a release barrier.cluster arrive compiles to
// MEMBAR.ALL.GPU, which would wait for every state store in flight).
// .aligned barriers: every thread of a warp executes them (callers are uniform).
__device__ __forceinline__ void cluster_arrive_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.aligned;\n" ::: "memory"); }

__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// Address of this CTA's shared variable `p` in the window of cluster CTA `rank`.
__device__ __forceinline__ unsigned cluster_map(const void* p, unsigned rank) {
  unsigned remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(smem_addr(p)), "r"(rank));
  return remote;
}

__device__ __forceinline__ void mbar_init(unsigned long long* bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}

// Makes mbarrier.init visible to peers; pair with a cluster arrive/wait before they use it.
__device__ __forceinline__ void fence_mbar_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

__device__ __forceinline__ void mbar_arrive_expect_tx(unsigned long long* bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void mbar_wait(unsigned long long* bar, unsigned parity) {
  const unsigned a = smem_addr(bar);
  unsigned done = 0;
  do {
    asm volatile(
        "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(a), "r"(parity)
        : "memory");
  } while (!done);
}

// Makes barrier initialisation (generic proxy) visible to the bulk-copy engine (async proxy).
__device__ __forceinline__ void fence_proxy_async_smem() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// sm90::bulk_load on shared-memory pointers (16-byte aligned addresses, size a multiple of 16).
__device__ __forceinline__ void bulk_g2s(void* dst, const void* src, unsigned bytes, unsigned long long* bar) {
  sm90::bulk_load(smem_addr(dst), src, bytes, smem_addr(bar));
}

// 4 bytes into a peer's shared memory (cluster address), completing 4 tx-bytes on its mbarrier.
__device__ __forceinline__ void st_async(unsigned remote_addr, float v, unsigned remote_bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];\n" ::"r"(remote_addr),
               "r"(__float_as_uint(v)), "r"(remote_bar)
               : "memory");
}

// Rank of this CTA in its cluster (0 without a cluster launch).
__device__ __forceinline__ unsigned cluster_ctarank() {
  unsigned r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}

// Gated RMSNorm of token tok by one warp: lane's O values o_at(i) (O[4 lane + i], i < 4), y = o *
// rstd * nw(i) * gate(i) in that order, to tk.out ([tok][H][kDim] BF16): kda/token_math.cuh's
// expressions, which kda_decode follows too. The functors keep each caller's loads where they were
// (its parameters are read at first use, as written out before).
template <int H, class T, class OAt, class Nw, class Gate>
__device__ __forceinline__ void gated_rmsnorm(const T& tk, long long tok, int h, int lane, OAt o_at, Nw nw,
                                              Gate gate) {
  float o[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) o[i] = o_at(i);
  const float rstd = rms_rstd(warp_allsum(rms_quad(o[0], o[1], o[2], o[3])));
  float y[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) y[i] = o[i] * rstd * nw(i) * gate(i);  // gated_y, loads in this order
  *reinterpret_cast<uint2*>(tk.out + (tok * H + h) * kDim + 4 * lane) =
      make_uint2(pack_bf16x2(y[0], y[1]), pack_bf16x2(y[2], y[3]));
}

// ---- multi-token engine (verify, prefill) ---------------------------------------------------
// One CTA of 256 threads per (sequence, head) keeps the whole 128 x 128 state in registers (8 rows
// per half-warp, 8 K values per lane) across every token it processes, so the state crosses
// device memory once in and once per store the op asks for. Tokens are staged kChunk at a time:
// conv, L2-norm inputs and forget gates of the chunk go to shared memory first (one barrier), the
// recurrence then runs token after token with half-warp shuffles only, and the chunk's gated
// RMSNorm runs after a second barrier. Lane l holds K = 4l..4l+3 and 64+4l..64+4l+3 of each row:
// the FP32 records (the bulk of the bytes) then move as 256 contiguous bytes per half-warp LDG/STG.
namespace multi {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kRowVecs = kDim * 2 / 16;  // uint4 per BF16 f_b row
constexpr int kRows = 8;                 // state rows per half-warp (128 / 16)
constexpr int kChunk = 4;                // tokens staged at once: keeps static smem under 48 KB

struct Weights {
  const __nv_bfloat16* conv_w;  // [3D, 4]
  const uint4* fb_w;            // BF16 [D, 128], 16-byte aligned
  const float* dt_bias;         // [D], 16-byte aligned
  const float* a_log;           // [H]
  const float* norm_w;          // [128]
};

// The token rows of one sequence: token t is row tok0 + t of every activation tensor.
struct Tokens {
  const __nv_bfloat16* qkvg;
  const __nv_bfloat16* fa;
  const __nv_bfloat16* beta;
  __nv_bfloat16* out;           // [tokens, H, 128]
  long long qkvg_stride, fa_stride, beta_stride;
  long long tok0;
};

struct __align__(128) Smem {
  uint4 fb[kDim * kRowVecs];    // f_b rows of this head (32 KB), bulk-copied once
  float dtb[kDim];
  float q[kChunk][kDim], k[kChunk][kDim], v[kChunk][kDim], eg[kChunk][kDim], o[kChunk][kDim];
  float beta[kChunk];
  unsigned long long bar;
};

// Per-thread conv channels: the q or k channel `tid` of the head, and v channel `tid` (tid < 128).
// Only the windows stay in registers across chunks; taps and channel indices are re-derived per
// chunk (L1 hits), so the rows keep the register file.
struct Window {
  float qk[3], v[3];            // raw inputs, oldest first
};

template <int H>
__device__ __forceinline__ int chan_qk(int h) {
  const int tid = threadIdx.x;
  return (tid >> 7) * (H * kDim) + h * kDim + (tid & (kDim - 1));
}

template <int H>
__device__ __forceinline__ int chan_v(int h) {  // valid for tid < 128
  return 2 * (H * kDim) + h * kDim + (threadIdx.x & (kDim - 1));
}

__device__ __forceinline__ void taps_of(const __nv_bfloat16* conv_w, int c, float (&w)[4]) {
  const uint2 cw = __ldg(reinterpret_cast<const uint2*>(conv_w) + c);
  w[0] = bf16_bits_to_float(cw.x & 0xffffu);
  w[1] = bf16_bits_to_float(cw.x >> 16);
  w[2] = bf16_bits_to_float(cw.y & 0xffffu);
  w[3] = bf16_bits_to_float(cw.y >> 16);
}

// Thread 0 starts the f_b / dt_bias bulk copy. Callers __syncthreads() before anyone polls bar
// (a previous CTA's completed barrier may still sit in this shared memory). W: any parameters with
// fb_w and dt_bias; S: any shared layout with fb, dtb and bar (also the prefill's).
template <class W, class S>
__device__ __forceinline__ void start_weights(const W& w, int h, S& sm) {
  if (threadIdx.x == 0) {
    mbar_init(&sm.bar, 1);
    fence_proxy_async_smem();
    mbar_arrive_expect_tx(&sm.bar, kDim * (kDim * 2 + 4));
    bulk_g2s(sm.fb, w.fb_w + static_cast<long long>(h) * kDim * kRowVecs, kDim * kDim * 2, &sm.bar);
    bulk_g2s(sm.dtb, w.dt_bias + h * kDim, kDim * 4, &sm.bar);
  }
}

// Stage tokens t0 .. t0+n-1 (n <= kChunk) into shared memory: conv + SiLU of q, k, v, sigmoid(b)
// and exp(g); shifts the register windows. With `ext` (verify), raw input t also goes to column
// 2 + t0 + t of the FP32 conv cache of the slot ([3D, ext_cols]).
template <Gate G_, int H>
__device__ __forceinline__ void stage(const Tokens& tk, const Weights& w, int h, int t0, int n, Window& win,
                                      Smem& sm, float a_gate, float* ext = nullptr, int ext_cols = 0) {
  const int tid = threadIdx.x, hw = tid >> 4, hl = tid & 15;
  const int sec = tid >> 7, ch = tid & (kDim - 1);
  const bool has_v = tid < kDim;
  const int cqk = chan_qk<H>(h), cv = chan_v<H>(h);
  float wqk[4], wv[4];
  taps_of(w.conv_w, cqk, wqk);
  taps_of(w.conv_w, cv, wv);
#pragma unroll
  for (int t = 0; t < kChunk; ++t) {
    if (t < n) {
      const __nv_bfloat16* xrow = tk.qkvg + (tk.tok0 + t0 + t) * tk.qkvg_stride;
      const float x = __bfloat162float(xrow[cqk]);
      (sec == 0 ? sm.q[t] : sm.k[t])[ch] = conv_silu(wqk, win.qk[0], win.qk[1], win.qk[2], x);
      win.qk[0] = win.qk[1], win.qk[1] = win.qk[2], win.qk[2] = x;
      if (ext) ext[static_cast<long long>(cqk) * ext_cols + 2 + t0 + t] = x;
      if (has_v) {
        const float xv = __bfloat162float(xrow[cv]);
        sm.v[t][tid] = conv_silu(wv, win.v[0], win.v[1], win.v[2], xv);
        win.v[0] = win.v[1], win.v[1] = win.v[2], win.v[2] = xv;
        if (ext) ext[static_cast<long long>(cv) * ext_cols + 2 + t0 + t] = xv;
      }
    }
  }
  if (tid < n) sm.beta[tid] = sigmoidf_(__bfloat162float(tk.beta[(tk.tok0 + t0 + tid) * tk.beta_stride + h]));
  mbar_wait(&sm.bar, 0);  // completed once; later chunks pass at once
  // Half-warp hw computes channels hw + 16 j in two groups of 4 rows (fewer f_b words in flight
  // next to the start state's registers); each reduce-scatter leaves one channel in 4 lanes.
  constexpr int G = kRows / 2;
#pragma unroll 1
  for (int t = 0; t < n; ++t) {
    float fa[8];
    const __nv_bfloat16* farow = tk.fa + (tk.tok0 + t0 + t) * tk.fa_stride + 8 * hl;  // 2-byte aligned rows
#pragma unroll
    for (int e = 0; e < 8; ++e) fa[e] = __bfloat162float(farow[e]);
#pragma unroll
    for (int g = 0; g < 2; ++g) {
      float zp[G];
#pragma unroll
      for (int j = 0; j < G; ++j) {
        float wf[8];
        unpack_bf16x8(sm.fb[(hw + 16 * (g * G + j)) * kRowVecs + hl], wf);
        zp[j] = 0.0f;
#pragma unroll
        for (int e = 0; e < 8; ++e) zp[j] = fmaf(wf[e], fa[e], zp[j]);
      }
      half_reduce_scatter<G>(zp, hl);
      const int gi = hw + 16 * (g * G + (hl >> 2));
      if ((hl & 3) == 0) sm.eg[t][gi] = decay<G_>(zp[0] + sm.dtb[gi], a_gate);
    }
  }
}

// This thread's 8 rows: row_of(j) = warp * 16 + half + 2 j.
__device__ __forceinline__ int row_of(int j) {
  const int tid = threadIdx.x;
  return (tid >> 5) * 16 + ((tid >> 4) & 1) + 2 * j;
}

// Raw 32-bit words of the start state, loaded before the chunk staging so the loads overlap it.
// FP32 rows fill all 64 words; BF16 rows the first 32 (unpacked by rows_from_bf16).
__device__ __forceinline__ void load_rows_f32(const float* head, unsigned (&raw)[64]) {
  const int hl = threadIdx.x & 15;
#pragma unroll
  for (int j = 0; j < kRows; ++j) {
    const float4* p = reinterpret_cast<const float4*>(head + row_of(j) * kDim);
    const float4 a = __ldcs(p + hl), b = __ldcs(p + 16 + hl);
    raw[8 * j + 0] = __float_as_uint(a.x), raw[8 * j + 1] = __float_as_uint(a.y);
    raw[8 * j + 2] = __float_as_uint(a.z), raw[8 * j + 3] = __float_as_uint(a.w);
    raw[8 * j + 4] = __float_as_uint(b.x), raw[8 * j + 5] = __float_as_uint(b.y);
    raw[8 * j + 6] = __float_as_uint(b.z), raw[8 * j + 7] = __float_as_uint(b.w);
  }
}

__device__ __forceinline__ void load_rows_bf16(const __nv_bfloat16* head, unsigned (&raw)[64]) {
  const int hl = threadIdx.x & 15;
#pragma unroll
  for (int j = 0; j < kRows; ++j) {
    const uint2* p = reinterpret_cast<const uint2*>(head + row_of(j) * kDim);
    const uint2 a = __ldcs(p + hl), b = __ldcs(p + 16 + hl);
    raw[4 * j + 0] = a.x, raw[4 * j + 1] = a.y, raw[4 * j + 2] = b.x, raw[4 * j + 3] = b.y;
  }
}

__device__ __forceinline__ void rows_from_f32(const unsigned (&raw)[64], float (&d)[kRows][8]) {
#pragma unroll
  for (int j = 0; j < kRows; ++j)
#pragma unroll
    for (int e = 0; e < 8; ++e) d[j][e] = __uint_as_float(raw[8 * j + e]);
}

__device__ __forceinline__ void rows_from_bf16(const unsigned (&raw)[64], float (&d)[kRows][8]) {
#pragma unroll
  for (int j = 0; j < kRows; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      d[j][2 * i] = __uint_as_float(raw[4 * j + i] << 16);
      d[j][2 * i + 1] = __uint_as_float(raw[4 * j + i] & 0xffff0000u);
    }
}

__device__ __forceinline__ void store_rows_f32(float* head, const float (&d)[kRows][8]) {
  const int hl = threadIdx.x & 15;
#pragma unroll
  for (int j = 0; j < kRows; ++j) {
    float4* p = reinterpret_cast<float4*>(head + row_of(j) * kDim);
    __stcs(p + hl, make_float4(d[j][0], d[j][1], d[j][2], d[j][3]));
    __stcs(p + 16 + hl, make_float4(d[j][4], d[j][5], d[j][6], d[j][7]));
  }
}

__device__ __forceinline__ void store_rows_bf16(__nv_bfloat16* head, const float (&d)[kRows][8]) {
  const int hl = threadIdx.x & 15;
#pragma unroll
  for (int j = 0; j < kRows; ++j) {
    uint2* p = reinterpret_cast<uint2*>(head + row_of(j) * kDim);
    __stcs(p + hl, make_uint2(pack_bf16x2(d[j][0], d[j][1]), pack_bf16x2(d[j][2], d[j][3])));
    __stcs(p + 16 + hl, make_uint2(pack_bf16x2(d[j][4], d[j][5]), pack_bf16x2(d[j][6], d[j][7])));
  }
}

// One token of the recurrence on the register rows (the decode kernel's row algebra:
// d = e^g S[v,:], a = d.k, c = d.q, u = beta (v - a), S[v,:] = d + k u, o = c + (q.k) u).
// Writes o of the token to sm.o[t]; no barrier. Any shared layout with q, k, eg (all 128 key
// channels), v, o (by row_of) and beta: the split verify kernel keeps only its 64 rows' v and o.
// kBf16: BF16 storage, each row rounded right after its update (round_rows_bf16's rounding, fewer
// values live at once than a pass after the token).
template <bool kBf16, class Sm>
__device__ __forceinline__ void recur(float (&d)[kRows][8], Sm& sm, int t) {
  const int tid = threadIdx.x, half = (tid >> 4) & 1, hl = tid & 15;
  float qv[8], kv[8], ev[8];
  const float qk = load_qk_norm(sm.q[t], sm.k[t], sm.eg[t], lane_k0(hl), lane_k1(hl), qv, kv, ev);
  const float beta = sm.beta[t];
  // Rows in two groups of 4: each group's 8 dot products (a_j, c_j) are reduce-scattered together,
  // so only 8 partial sums are live next to the 64 row values (the same shuffle count as one
  // 16-value reduce-scatter, and no spills under the 128-register cap of two CTAs per SM).
  constexpr int G = kRows / 2;
#pragma unroll
  for (int g = 0; g < 2; ++g) {
    float red[2 * G];  // a_j (index j), c_j (index G + j) of rows g G + j
#pragma unroll
    for (int j = 0; j < G; ++j) row_decay_dots(d[g * G + j], ev, kv, qv, red[j], red[G + j]);
    half_reduce_scatter<2 * G>(red, hl);  // lane hl holds sum hl / 2
    const int idx = hl >> 1;
    const bool a_lane = idx < G;
    const int jr = g * G + (idx & (G - 1));
    const float u_own = row_u(beta, sm.v[t][row_of(jr)], red[0]);  // valid in a-lanes
    const float u_c = __shfl_sync(0xffffffffu, u_own, half * 16 + 2 * (idx & (G - 1)));
    if (!a_lane && (hl & 1) == 0) sm.o[t][row_of(jr)] = row_o(qk, u_c, red[0]);
#pragma unroll
    for (int j = 0; j < G; ++j) {
      row_rank1(d[g * G + j], kv, __shfl_sync(0xffffffffu, u_own, half * 16 + 2 * j));
      if constexpr (kBf16) round_bf16x8(d[g * G + j]);
    }
  }
}

// recur<true>: with BF16 storage the register rows are rounded as a BF16 store and reload would
// (kda/token_math.cuh) after every token, so the next token and every record see what serial
// decoding sees.

// Gated RMSNorm of tokens t0 .. t0+n-1 (after a barrier): warp t takes token t.
template <int H>
__device__ __forceinline__ void emit(const Tokens& tk, const Weights& w, int h, int t0, int n, const Smem& sm) {
  constexpr int D = H * kDim;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (warp >= n) return;
  const long long tok = tk.tok0 + t0 + warp;
  gated_rmsnorm<H>(
      tk, tok, h, lane, [&](int i) { return sm.o[warp][4 * lane + i]; },
      [&](int i) { return __ldg(w.norm_w + 4 * lane + i); },
      [&](int i) {
        const __nv_bfloat16* go = tk.qkvg + tok * tk.qkvg_stride + 3 * D + h * kDim + 4 * lane;
        return sigmoidf_(__bfloat162float(go[i]));
      });
}

// Zeros for the outputs of tokens [0, n) of a padded row.
template <int H>
__device__ __forceinline__ void zero_outputs(const Tokens& tk, int h, long long n) {
  for (long long i = threadIdx.x; i < n * kDim; i += kThreads)
    tk.out[((tk.tok0 + i / kDim) * H + h) * kDim + i % kDim] = __float2bfloat16(0.0f);
}

}  // namespace multi

}  // namespace kda
}  // namespace k3gen
