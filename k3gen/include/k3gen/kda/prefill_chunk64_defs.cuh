// kda_prefill `chunk64`: the record, shared-memory and parameter layouts, the small MMA helpers and
// the work-item map that prep, state and emit share (included by prefill_chunk64.cuh, whose header
// comment describes the algorithm; spec.py mirrors the sizes).
#pragma once

#include <cuda_bf16.h>

#include "k3gen/kda/common.cuh"

namespace k3gen {
namespace kda {
namespace c64 {

constexpr int kThreads = 256;          // prep and emit
constexpr int kC = 64;                 // tokens per chunk
constexpr int kBlk = 16;               // diagonal block: the exp reference points
constexpr int kBLd = kDim + 8;         // BF16 [row][128] tiles: row stride (conflict-free fragment loads)
constexpr int kTLd = kC + 8;           // [row][64] tiles: row stride
constexpr int kALd = kC + 4;           // FP32 A / Aqk rows (16-byte aligned)
constexpr int kRowVecs = kDim * 2 / 16;
constexpr int kOff = 3 * kBlk;         // rows of the off-diagonal factor tiles (blocks 1..3)

// One chunk's record in the workspace, [J][H]. The state kernel copies the head (up to ut) whole
// and the rows of ut it owns, into a StateBuf of the same layout.
struct __align__(16) Rec {
  __nv_bfloat16 w[kC][kBLd];    // -W [t][k]
  __nv_bfloat16 qg[kC][kBLd];   // e^G q [t][k]
  __nv_bfloat16 kgt[kDim][kTLd];  // (k e^(G_C - G))^T [k][t]
  __nv_bfloat16 aqk[kC][kTLd];  // Aqk [t][s], zero above the diagonal
  float egl[kDim];              // e^(G_C)
  float ut[kDim][kTLd];         // U^T [v][t]
};
constexpr unsigned kRecHead = 2 * kC * kBLd * 2 + kDim * kTLd * 2 + kC * kTLd * 2 + kDim * 4;
static_assert(sizeof(Rec) == kRecHead + kDim * kTLd * 4 && kRecHead % 16 == 0, "record layout (spec.py)");

template <int W>
struct __align__(16) StateBuf {
  __nv_bfloat16 w[kC][kBLd];
  __nv_bfloat16 qg[kC][kBLd];
  __nv_bfloat16 kgt[kDim][kTLd];
  __nv_bfloat16 aqk[kC][kTLd];
  float egl[kDim];
  float ut[16 * W][kTLd];
};

template <int W>
struct __align__(128) StateSmem {
  StateBuf<W> b[2];
  unsigned long long bar[2];
};

struct __align__(128) PrepSmem {
  float q[kC][kDim];            // post-conv q -> normalized
  float k[kC][kDim];
  float v[kC][kDim];
  float g[kC][kDim];            // log decay -> cumulative G
  union {
    uint4 fb[kDim * kRowVecs];  // f_b rows of this head (gate GEMM)
    struct {
      __nv_bfloat16 left[2 * kOff][kBLd];   // block i: rows 32(i-1) + [q | k] e^(G_r - ref_i)
      __nv_bfloat16 right[2 * kOff][kBLd];  // block i: rows 8 i (i-1) + s: k_s e^(ref_i - G_s), s < 16 i
    } f;
    // Bounded gate, after f: rows 32 i + [q | k] e^(G_r - ref_i) of block i, then rows 128 + s:
    // k_s e^(ref_i - G_s) for s in block i (ref_0 = 0)
    __nv_bfloat16 d[3 * kC][kBLd];
  } u1;
  union {
    unsigned short fa[kC][kBLd];  // f_a rows, raw BF16
    struct {
      float A[kC][kALd];
      float P[kC][kALd];          // Aqk
    } a;
  } u2;
  float dtb[kDim];
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
  Rec* rec;       // [J][H]
  float* o;       // [N][H][128] raw O
  int batch;
};

// Where prep writes each record element: a layout policy, so one prep serves both record formats
// (this padded Rec, read by chunk64's mma.sync state pass; c64tc::RecTc, the UMMA operand images of
// chunk64_tc's tcgen05 state pass). Stores: e^(G_C)[c]; 8 BF16 t = 8 r8 .. of (K e^(G_C-G))^T row
// c; e^G Q and -W at (t, k = c); 4 FP32 t = 4 r4 .. of U^T row c; the BF16 pair Aqk[t][s, s+1].
struct RecPad {
  using Ptr = Rec*;
  static __device__ __forceinline__ Rec* at(const Params& p, long long i) { return p.rec + i; }
  static __device__ __forceinline__ void egl(Rec* r, int c, float v) { r->egl[c] = v; }
  static __device__ __forceinline__ void kgt8(Rec* r, int c, int r8, uint4 v) {
    *reinterpret_cast<uint4*>(&r->kgt[c][8 * r8]) = v;
  }
  static __device__ __forceinline__ void qg(Rec* r, int t, int c, __nv_bfloat16 v) { r->qg[t][c] = v; }
  static __device__ __forceinline__ void w(Rec* r, int t, int c, __nv_bfloat16 v) { r->w[t][c] = v; }
  static __device__ __forceinline__ void ut4(Rec* r, int c, int r4, float4 v) {
    *reinterpret_cast<float4*>(&r->ut[c][4 * r4]) = v;
  }
  static __device__ __forceinline__ void aqk2(Rec* r, int t, int s, unsigned v) {
    *reinterpret_cast<unsigned*>(&r->aqk[t][s]) = v;
  }
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

// d += A B, BF16 operands, FP32 accumulate (A: 16 x 16 row-major fragment, B: 16 x 8 column-major).
__device__ __forceinline__ void mma_bf16(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ __nv_bfloat16 bf(float x) { return __float2bfloat16(x); }

// e^x for a factor that is rounded to BF16 (or into -W) next: the MUFU form (a few FP32 ulp, far
// below the 2^-9 of the rounding) at 2 instructions instead of expf's 8. Decays kept in FP32 use expf.
__device__ __forceinline__ float bexp(float x) { return __expf(x); }

// The A fragment (16 x 16, k = 16 kk ..) made of accumulator tiles 2 kk and 2 kk + 1 (m16n8 layout:
// c0, c1 row g cols 2t, 2t+1; c2, c3 row g+8): exactly m16n8k16's a0..a3.
__device__ __forceinline__ void afrag(unsigned (&a)[4], const float (&lo)[4], const float (&hi)[4]) {
  a[0] = pack_bf16x2(lo[0], lo[1]);
  a[1] = pack_bf16x2(lo[2], lo[3]);
  a[2] = pack_bf16x2(hi[0], hi[1]);
  a[3] = pack_bf16x2(hi[2], hi[3]);
}

// ---- work items (prep, emit) -------------------------------------------------------------------
__device__ __forceinline__ long long item_base(const int* cu, int b) { return __ldg(cu + b) / kC + b; }

__device__ __forceinline__ int seq_of_item(const int* cu, int batch, long long j) {
  int lo = 0, hi = batch - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (item_base(cu, mid) <= j) lo = mid; else hi = mid - 1;
  }
  return lo;
}

struct Item {
  int h, b, len, t0;
  long long tok0;
};
__device__ __forceinline__ Item item_of(const Params& p) {
  Item it;
  it.h = blockIdx.x;
  const long long j = blockIdx.y;
  it.b = seq_of_item(p.cu_seqlens, p.batch, j);
  it.tok0 = __ldg(p.cu_seqlens + it.b);
  it.len = __ldg(p.cu_seqlens + it.b + 1) - static_cast<int>(it.tok0);
  it.t0 = static_cast<int>(j - item_base(p.cu_seqlens, it.b)) * kC;
  return it;
}

// The window after the prompt (both state passes, one CTA per (sequence, head)): the last three of
// (old window, x_0 .. x_{len-1}); prep read the old window in an earlier kernel. Raw BF16 bits: exact.
template <int D, int kThreadsIn>
__device__ __forceinline__ void conv_tail(const Params& p, int slot, long long tok0, int len, bool resume, int h) {
  unsigned short* wb = reinterpret_cast<unsigned short*>(p.conv) + static_cast<long long>(slot) * (3 * D) * 3;
  const unsigned short* x = reinterpret_cast<const unsigned short*>(p.qkvg);
#pragma unroll 1
  for (int c = threadIdx.x; c < 3 * kDim; c += kThreadsIn) {
    const int chan = (c >> 7) * D + h * kDim + (c & (kDim - 1));
    unsigned short nw[3];
#pragma unroll
    for (int i = 0; i < 3; ++i) {
      const int m = len + i;  // index into (old window, x)
      nw[i] = m >= 3 ? x[(tok0 + m - 3) * p.qkvg_stride + chan] : (resume ? wb[chan * 3 + m] : 0);
    }
#pragma unroll
    for (int i = 0; i < 3; ++i) wb[chan * 3 + i] = nw[i];
  }
}

}  // namespace c64
}  // namespace kda
}  // namespace k3gen
