// Pieces of the KDA step shared by the decode kernel and the later prefill / verify kernels:
// the forget gate, the causal conv tap sum, BF16 packing, state-row I/O and cluster barriers.
// The math is SPEC.md section 2; the FP32 twin is k3gen/reference/kda_decode.py.
#pragma once

#include <cuda_bf16.h>

namespace k3gen {
namespace kda {

enum class Gate { kBounded, kSoftplus };

constexpr int kDim = 128;              // K = V
constexpr float kBoundedLower = -5.0f;
constexpr float kL2Eps = 1e-6f;
constexpr float kNormEps = 1e-5f;

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

__device__ __forceinline__ unsigned pack_bf16x2(float lo, float hi) {
  const __nv_bfloat162 p = __floats2bfloat162_rn(lo, hi);  // round to nearest even
  return *reinterpret_cast<const unsigned*>(&p);
}

// One state row (128 K values of S^T[v, :]) seen by a half-warp: lane l of the half owns 8 K
// values. FP32 rows: two float4 at K = 4l and 64 + 4l, so each 16-lane LDG.128 covers 256
// contiguous bytes. BF16 rows: one 16-byte chunk at K = 8l. Streaming hints (.cs): the state is
// touched once per step and must not push the f_b weights out of L2.
template <bool kBf16>
struct StateRow;

template <>
struct StateRow<false> {
  using Elem = float;
  struct Frag { float4 a, b; };
  static __device__ __forceinline__ int k0(int l) { return 4 * l; }
  static __device__ __forceinline__ int k1(int l) { return 64 + 4 * l; }
  static __device__ __forceinline__ Frag load(const float* row, int l) {
    const float4* p = reinterpret_cast<const float4*>(row);
    return Frag{__ldcs(p + l), __ldcs(p + 16 + l)};
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
  struct Frag { uint4 a; };
  static __device__ __forceinline__ int k0(int l) { return 8 * l; }
  static __device__ __forceinline__ int k1(int l) { return 8 * l + 4; }
  static __device__ __forceinline__ Frag load(const __nv_bfloat16* row, int l) {
    return Frag{__ldcs(reinterpret_cast<const uint4*>(row) + l)};
  }
  static __device__ __forceinline__ void unpack(const Frag& f, float (&x)[8]) { unpack_bf16x8(f.a, x); }
  static __device__ __forceinline__ void store(__nv_bfloat16* row, int l, const float (&x)[8]) {
    const uint4 u = make_uint4(pack_bf16x2(x[0], x[1]), pack_bf16x2(x[2], x[3]), pack_bf16x2(x[4], x[5]),
                               pack_bf16x2(x[6], x[7]));
    __stcs(reinterpret_cast<uint4*>(row) + l, u);
  }
};

// Sum over the 16 lanes of a half-warp (xor offsets < 16 never cross halves).
__device__ __forceinline__ float half_sum(float x) {
#pragma unroll
  for (int m = 8; m >= 1; m >>= 1) x += __shfl_xor_sync(0xffffffffu, x, m);
  return x;
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

// Bulk copy global -> this CTA's shared memory, completing `bytes` tx-bytes on `bar` (16-byte
// aligned addresses, size a multiple of 16).
__device__ __forceinline__ void bulk_g2s(void* dst, const void* src, unsigned bytes, unsigned long long* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                   smem_addr(dst)),
               "l"(src), "r"(bytes), "r"(smem_addr(bar))
               : "memory");
}

// 4 bytes into a peer's shared memory (cluster address), completing 4 tx-bytes on its mbarrier.
__device__ __forceinline__ void st_async(unsigned remote_addr, float v, unsigned remote_bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.b32 [%0], %1, [%2];\n" ::"r"(remote_addr),
               "r"(__float_as_uint(v)), "r"(remote_bar)
               : "memory");
}

}  // namespace kda
}  // namespace k3gen
