// kda_prefill `chunkpar`: the chunk16 algebra (include/k3gen/kda/prefill_chunk.cuh) split so that
// only the state recurrence is sequential. Contract: the docstring of k3gen/ops/kda_prefill/spec.py.
//
// 1. prep  (grid H x J, J = N / 64 + B): work item j of sequence b covers tokens 64 c .. 64 c + 63
//    (c = j - base(b), base(b) = cu[b] / 64 + b, so the items of different sequences never overlap
//    and J bounds them all). It stages and prepares the item's four 16-token sub-chunks exactly as
//    chunk16 does (conv, norms, gates, A, P, forward substitution) and saves the prepared tiles
//    (e^G q, K e^(G_C - G), -W, U, P, e^(G_C)) to the workspace. None of this reads the state.
// 2. state (grid H x B x 2 KS, 128 threads): the FP32 state stays in registers and runs chunk_mma
//    over the saved tiles (bulk copies, double-buffered), writing the raw O rows to the workspace,
//    then stores the state; CTA z = 0 also writes the windows. The V rows of the state are
//    independent in this recurrence, so CTAs of different rows share nothing. KS = 1: a warp per
//    16 rows (2 CTAs per head); KS = 2: two warps per 16 rows, each half the k range (4 CTAs per
//    head, half the sequential mma chain per warp; the launcher takes it while the CTAs fit one
//    per SM).
// 3. emit  (grid H x J): gated RMSNorm of the item's raw O rows into `out` (zeros for padding).
#pragma once

#include "k3gen/kda/prefill_chunk.cuh"

namespace k3gen {
namespace kda {
namespace par {

using chunk::kC;
using chunk::kLd;
constexpr int kItem = 64;              // tokens per work item of prep / emit
constexpr int kSub = kItem / kC;       // 16-token sub-chunks per item
constexpr int kStateWarps = 4;         // warps per state CTA: one per SM sub-partition

// One prepared sub-chunk: the tiles chunk_mma reads, in the layout of chunk::Smem.
struct __align__(16) Tiles {
  float q[kC][kLd];
  float k[kC][kLd];
  float v[kC][kLd];
  float g[kC][kLd];
  float P[kC][kC + 1];
  float egl[kDim];
};
static_assert(sizeof(Tiles) % 16 == 0, "bulk copy size");

struct __align__(128) StateSmem {
  Tiles t[2];
  float xch[kStateWarps][512];          // k split: partial V_new^T / O^T sums (chunk::chunk_mma)
  unsigned long long bar[2];
};

struct Params {
  chunk::Params c;
  Tiles* tiles;     // [J * kSub, H]
  float* o;         // [N, H, 128] raw O
  int batch;
};

__device__ __forceinline__ long long item_base(const int* cu, int b) { return __ldg(cu + b) / kItem + b; }

// The sequence owning item j: the last b with base(b) <= j (base is non-decreasing).
__device__ __forceinline__ int seq_of_item(const int* cu, int batch, long long j) {
  int lo = 0, hi = batch - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (item_base(cu, mid) <= j) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// This CTA's work item: head blockIdx.x, item j = blockIdx.y of sequence b (tokens tok0 .. tok0 +
// len - 1 of the batch), its first token t0 within the sequence.
struct Item {
  int h, b, len, t0;
  long long tok0, base;
};
__device__ __forceinline__ Item item_of(const chunk::Params& p, int batch) {
  Item it;
  it.h = blockIdx.x;
  const long long j = blockIdx.y;
  it.b = seq_of_item(p.cu_seqlens, batch, j);
  it.tok0 = __ldg(p.cu_seqlens + it.b);
  it.len = __ldg(p.cu_seqlens + it.b + 1) - static_cast<int>(it.tok0);
  it.base = item_base(p.cu_seqlens, it.b);
  it.t0 = static_cast<int>(j - it.base) * kItem;
  return it;
}

template <class C>
__device__ __forceinline__ void prep(const Params& pp, chunk::Smem& sm) {
  constexpr int H = C::kHeads, D = H * kDim;
  const chunk::Params& p = pp.c;
  const Item it = item_of(p, pp.batch);
  const int h = it.h, b = it.b, len = it.len, t0 = it.t0;
  const long long tok0 = it.tok0, base = it.base;
  const int slot = __ldg(p.slots + b);
  if (t0 >= len || slot < 0 || slot >= p.num_slots) return;  // uniform over the CTA, before any barrier
  multi::start_weights(p, h, sm);
  __syncthreads();
  // The conv window before token t0: the slot's window for the first item, else the three raw
  // inputs before it (all inside this sequence: t0 >= 64).
  const int cqk = multi::chan_qk<H>(h), cv = multi::chan_v<H>(h);
  const bool has_v = threadIdx.x < kDim;
  multi::Window win;
  if (t0 == 0) {
    const bool resume = __ldg(p.resume + b) != 0;
    const unsigned short* wb = reinterpret_cast<const unsigned short*>(p.conv) + static_cast<long long>(slot) * (3 * D) * 3;
#pragma unroll
    for (int i = 0; i < 3; ++i) {
      win.qk[i] = resume ? bf16_bits_to_float(wb[cqk * 3 + i]) : 0.0f;
      win.v[i] = resume && has_v ? bf16_bits_to_float(wb[cv * 3 + i]) : 0.0f;
    }
  } else {
#pragma unroll
    for (int i = 0; i < 3; ++i) {
      const __nv_bfloat16* xrow = p.qkvg + (tok0 + t0 - 3 + i) * p.qkvg_stride;
      win.qk[i] = __bfloat162float(xrow[cqk]);
      win.v[i] = has_v ? __bfloat162float(xrow[cv]) : 0.0f;
    }
  }
  const float a_gate = expf(__ldg(p.a_log + h));
#pragma unroll 1
  for (int s = 0; s < kSub; ++s) {
    const int ts = t0 + s * kC;
    if (ts >= len) break;
    const int n = len - ts < kC ? len - ts : kC;
    chunk::stage<C::kGate, H>(p, tok0 + ts, h, n, win, sm, a_gate);
    __syncthreads();
    chunk::prepare(sm);
    Tiles* dst = pp.tiles + ((base * kSub + ts / kC) * H + h);
    // q, k, v, g are consecutive [kC][kLd] arrays in both layouts.
    const float4* src4 = reinterpret_cast<const float4*>(&sm.q[0][0]);
    float4* dst4 = reinterpret_cast<float4*>(&dst->q[0][0]);
    for (int i = threadIdx.x; i < 4 * kC * kLd / 4; i += chunk::kThreads) dst4[i] = src4[i];
    for (int i = threadIdx.x; i < kC * (kC + 1); i += chunk::kThreads) (&dst->P[0][0])[i] = (&sm.P[0][0])[i];
    if (threadIdx.x < kDim) dst->egl[threadIdx.x] = sm.egl[threadIdx.x];
    __syncthreads();  // the next sub-chunk's staging overwrites the tiles
  }
}

template <class C, int KS>
__device__ __forceinline__ void state(const Params& pp, StateSmem& sm) {
  constexpr int NT = 16 / KS, kRowsPerCta = kStateWarps / KS;
  constexpr int H = C::kHeads, D = H * kDim;
  constexpr long long kHead = kDim * kDim;
  constexpr unsigned kTileBytes = sizeof(Tiles);
  const chunk::Params& p = pp.c;
  const int h = blockIdx.x, b = blockIdx.y, w = threadIdx.x >> 5;
  const int rb = kRowsPerCta * blockIdx.z + w / KS, kh = w % KS;
  const long long tok0 = __ldg(p.cu_seqlens + b);
  const int len = __ldg(p.cu_seqlens + b + 1) - static_cast<int>(tok0);
  const int slot = __ldg(p.slots + b);
  if (slot < 0 || slot >= p.num_slots || len <= 0) return;  // prep and emit handle padding
  const Tiles* tiles = pp.tiles + item_base(p.cu_seqlens, b) * kSub * H + h;  // sub-chunk s at tiles[s * H]
  const int ns = (len + kC - 1) / kC;
  if (threadIdx.x == 0) {
    mbar_init(&sm.bar[0], 1);
    mbar_init(&sm.bar[1], 1);
    fence_proxy_async_smem();
    for (int s = 0; s < 2 && s < ns; ++s) {
      mbar_arrive_expect_tx(&sm.bar[s], kTileBytes);
      bulk_g2s(&sm.t[s], tiles + static_cast<long long>(s) * H, kTileBytes, &sm.bar[s]);
    }
  }
  const bool resume = __ldg(p.resume + b) != 0;
  void* head = C::kBf16State
                   ? static_cast<void*>(static_cast<__nv_bfloat16*>(p.ssm) + (static_cast<long long>(slot) * H + h) * kHead)
                   : static_cast<void*>(static_cast<float*>(p.ssm) + (static_cast<long long>(slot) * H + h) * kHead);
  float st[NT][4];
  if (resume) {
    chunk::load_state<C::kBf16State, NT>(head, st, rb, NT * kh);
  } else {
#pragma unroll
    for (int kt = 0; kt < NT; ++kt)
#pragma unroll
      for (int e = 0; e < 4; ++e) st[kt][e] = 0.0f;
  }
  __syncthreads();  // barriers initialised before anyone polls them
#pragma unroll 1
  for (int s = 0; s < ns; ++s) {
    const int buf = s & 1;
    mbar_wait(&sm.bar[buf], (s >> 1) & 1);
    const int n = len - s * kC < kC ? len - s * kC : kC;
    chunk::chunk_mma<Tiles, NT>(st, sm.t[buf], pp.o + ((tok0 + s * kC) * H + h) * kDim,
                                static_cast<long long>(H) * kDim, n, rb, kh, &sm.xch[0][0]);
    __syncthreads();  // every warp is done with t[buf]
    if (threadIdx.x == 0 && s + 2 < ns) {
      fence_proxy_async_smem();  // generic reads of t[buf] before the async-proxy refill
      mbar_arrive_expect_tx(&sm.bar[buf], kTileBytes);
      bulk_g2s(&sm.t[buf], tiles + static_cast<long long>(s + 2) * H, kTileBytes, &sm.bar[buf]);
    }
  }
  chunk::store_state<C::kBf16State, NT>(head, st, rb, NT * kh);
  if (blockIdx.z != 0) return;
  // The window after the prompt: the last three of (old window, x_0 .. x_{len-1}); prep has read
  // the old window in an earlier kernel. Raw BF16 bits: exact.
  unsigned short* wb = reinterpret_cast<unsigned short*>(p.conv) + static_cast<long long>(slot) * (3 * D) * 3;
  const unsigned short* x = reinterpret_cast<const unsigned short*>(p.qkvg);
#pragma unroll 1
  for (int c = threadIdx.x; c < 3 * kDim; c += kStateWarps * 32) {
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

template <class C>
__device__ __forceinline__ void emit(const Params& pp) {
  constexpr int H = C::kHeads;
  const chunk::Params& p = pp.c;
  const Item it = item_of(p, pp.batch);
  const int h = it.h, b = it.b, len = it.len, t0 = it.t0;
  const long long tok0 = it.tok0;
  if (t0 >= len) return;
  const int n = len - t0 < kItem ? len - t0 : kItem;
  const int slot = __ldg(p.slots + b);
  if (slot < 0 || slot >= p.num_slots) {
    for (int i = threadIdx.x; i < n * kDim; i += chunk::kThreads)
      p.out[((tok0 + t0 + i / kDim) * H + h) * kDim + i % kDim] = __float2bfloat16(0.0f);
    return;
  }
  chunk::emit<H>(p, tok0 + t0, h, n, pp.o + ((tok0 + t0) * H + h) * kDim, static_cast<long long>(H) * kDim);
}

}  // namespace par
}  // namespace kda
}  // namespace k3gen
