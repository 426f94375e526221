// kda_verify: the speculative-verify step of KDA with FP32 per-token draft records (SPEC.md
// section 3). Contract: the docstring of k3gen/ops/kda_verify/spec.py; FP32 twin:
// k3gen/ops/kda_verify/reference.py.
//
// One CTA per (sequence, head), 256 threads, the multi-token engine of kda/common.cuh: the start
// state (ssm[slot] when pending == 0, else the FP32 record pending - 1) is loaded once into
// registers, its loads in flight while the first chunk of tokens is staged; the 1 + M tokens then
// run on the register rows, and after token t the rows go out once: a typed store into ssm (t = 0)
// or an FP32 store into draft_rec[slot, t - 1]. Bytes per (sequence, head): one state read, one
// typed state write, M FP32 record writes; nothing is re-read.
//
// The conv cache conv_ext[slot, c, 0 .. 2+M] (FP32) holds (w1, w2, x_0, ..., x_M) afterwards, where
// (w0, w1, w2) are the start columns pending .. pending+2: the window after token t is columns
// t .. t+2, which is what the next step reads once the host commits pending = t.
//
// Lossless (SPEC.md section 3): each token is kda_decode's token, bit for bit. The per-token math
// is kda/token_math.cuh's (recur, the same row expressions and lane K slices as kda_decode's
// head_update; emit, the same RMSNorm sum), and with BF16 storage the register rows are rounded to
// BF16 after every token as decode's store + reload rounds them, so a record is the state decode
// would hold after that token and verify + commit == serial decode over any accepted pattern.
#pragma once

#include <cuda_bf16.h>

#include "k3gen/kda/common.cuh"

namespace k3gen {
namespace kda {
namespace verify {

using namespace multi;

struct Params {
  Tokens tk;                    // tok0 set per sequence (row b * (1 + M) + t)
  Weights w;
  const int* slots;             // [B]
  const int* pending;           // [num_slots]
  void* ssm;                    // [num_slots, H, 128, 128] FP32 or BF16
  float* draft_rec;             // [num_slots, M, H, 128, 128] FP32
  float* conv_ext;              // [num_slots, 3D, 3 + M] FP32
  int num_slots;
  unsigned* err;                // this op's error word (Config::kFaults; frozen sources leave it null)
};

// The steps after the start-state choice. kBf16Start (BF16 ssm, pending == 0) is a template
// parameter so each path has one register format for the state words: a runtime select between
// the unpacked BF16 and FP32 words would keep both sets live (255 registers and spills).
template <class C, bool kBf16Start>
__device__ __forceinline__ void body(const Params& p_, Smem& sm, const Tokens& tk, int h, int slot, int pend) {
  constexpr int H = C::kHeads, M = C::kDrafts, T = 1 + M, D = H * kDim, CE = 3 + M;
  constexpr long long kHead = kDim * kDim;
  float* rec_slot = p_.draft_rec + static_cast<long long>(slot) * M * H * kHead;
  unsigned raw[64];
  if constexpr (kBf16Start)
    load_rows_bf16(static_cast<const __nv_bfloat16*>(p_.ssm) + (static_cast<long long>(slot) * H + h) * kHead, raw);
  else if constexpr (C::kBf16State)
    load_rows_f32(rec_slot + (static_cast<long long>(pend - 1) * H + h) * kHead, raw);
  else
    load_rows_f32(pend == 0 ? static_cast<const float*>(p_.ssm) + (static_cast<long long>(slot) * H + h) * kHead
                            : rec_slot + (static_cast<long long>(pend - 1) * H + h) * kHead,
                  raw);
  // ---- conv windows at columns pend .. pend+2; columns 0, 1 become (w1, w2) ------------------
  // Each channel is read and rewritten by the one thread that owns it.
  Window win;
  float* ce = p_.conv_ext + static_cast<long long>(slot) * (3 * D) * CE;
  {
    float* ce_qk = ce + static_cast<long long>(chan_qk<H>(h)) * CE;
#pragma unroll
    for (int i = 0; i < 3; ++i) win.qk[i] = ce_qk[pend + i];
    ce_qk[0] = win.qk[1], ce_qk[1] = win.qk[2];
    if (threadIdx.x < kDim) {
      float* ce_v = ce + static_cast<long long>(chan_v<H>(h)) * CE;
#pragma unroll
      for (int i = 0; i < 3; ++i) win.v[i] = ce_v[pend + i];
      ce_v[0] = win.v[1], ce_v[1] = win.v[2];
    }
  }

  const float a_gate = expf(__ldg(p_.w.a_log + h));
  float d[kRows][8];
  // The rows leave after each token: a typed store of the golden state, FP32 records after. With
  // BF16 storage the rows are rounded first, and the next token runs on the rounded rows, exactly
  // as kda_decode stores and reloads them (so the records hold BF16 values, exact in FP32).
  // The golden token is peeled: the ssm pointer is dead before the records' loop (with the BF16
  // rounding in the loop, keeping both pointers live spilled at 128 registers).
  // The frozen original kernel (FP32 only) keeps its one loop: its SASS is recorded (golden.py).
  auto recur_chunk = [&](int t0, int n) {
    int t = 0;
    if constexpr (C::kOriginal) {
#pragma unroll 1
      for (; t < n; ++t) {
        recur<false>(d, sm, t);
        const int tt = t0 + t;
        if (tt == 0)
          store_rows_f32(static_cast<float*>(p_.ssm) + (static_cast<long long>(slot) * H + h) * kHead, d);
        else
          store_rows_f32(rec_slot + (static_cast<long long>(tt - 1) * H + h) * kHead, d);
      }
      return;
    }
    if (t0 == 0) {
      recur<C::kBf16State>(d, sm, 0);
      if constexpr (C::kBf16State)
        store_rows_bf16(static_cast<__nv_bfloat16*>(p_.ssm) + (static_cast<long long>(slot) * H + h) * kHead, d);
      else
        store_rows_f32(static_cast<float*>(p_.ssm) + (static_cast<long long>(slot) * H + h) * kHead, d);
      t = 1;
    }
    // Not unrolled: unrolled tokens let ptxas hoist later tokens' shared loads next to the rows.
#pragma unroll 1
    for (; t < n; ++t) {
      recur<C::kBf16State>(d, sm, t);
      float* rec = rec_slot;
      if constexpr (C::kBf16State) {
        // BF16: the record's address from an opaque copy of the slot, rebuilt here; the pointer
        // held across the rounding recurrence spilled at 128 registers (sm_90a, M = 2). FP32 keeps
        // rec_slot (the opaque copy spilled there instead: sm_107a, M = 1).
        int s_op;
        asm volatile("mov.b32 %0, %1;\n" : "=r"(s_op) : "r"(slot));
        rec = p_.draft_rec + static_cast<long long>(s_op) * M * H * kHead;
      }
      store_rows_f32(rec + (static_cast<long long>(t0 + t - 1) * H + h) * kHead, d);
    }
  };
  // First chunk peeled: the start words die once unpacked, before any later staging.
  constexpr int n0 = T < kChunk ? T : kChunk;
  stage<C::kGate, H>(tk, p_.w, h, 0, n0, win, sm, a_gate, ce, CE);
  __syncthreads();
  if constexpr (kBf16Start)
    rows_from_bf16(raw, d);
  else
    rows_from_f32(raw, d);
  recur_chunk(0, n0);
  __syncthreads();
  emit<H>(tk, p_.w, h, 0, n0, sm);
  if constexpr (T > kChunk) {
    constexpr int n1 = T - kChunk;
    static_assert(n1 <= kChunk, "at most two chunks (M <= 7)");
    stage<C::kGate, H>(tk, p_.w, h, kChunk, n1, win, sm, a_gate, ce, CE);
    __syncthreads();
    recur_chunk(kChunk, n1);
    __syncthreads();
    emit<H>(tk, p_.w, h, kChunk, n1, sm);
  }
}

template <class C>
__device__ __forceinline__ void run(const Params& p_) {
  constexpr int M = C::kDrafts, T = 1 + M;
  __shared__ Smem sm;
  const int h = blockIdx.x, b = blockIdx.y;
  Tokens tk = p_.tk;
  tk.tok0 = static_cast<long long>(b) * T;
  const int slot = __ldg(p_.slots + b);
  start_weights(p_.w, h, sm);
  // No thread may poll the barrier before thread 0 has initialised it (stale shared memory).
  __syncthreads();
  if (slot < 0 || slot >= p_.num_slots) {  // padded row (-1) or a bad slot: zeros out, nothing touched
    if (slot != -1 && threadIdx.x == 0) fault::report<C>(p_.err, fault::kSlot);
    zero_outputs<C::kHeads>(tk, h, T);
    mbar_wait(&sm.bar, 0);  // no bulk copy may still target this CTA when it exits
    return;
  }
  const int pend_raw = __ldg(p_.pending + slot);
  const int pend = min(max(pend_raw, 0), M);  // out-of-range input is clamped
  if (pend != pend_raw && threadIdx.x == 0) fault::report<C>(p_.err, fault::kPending);
  if constexpr (C::kBf16State) {
    if (pend == 0) {
      body<C, true>(p_, sm, tk, h, slot, pend);
      return;
    }
  }
  body<C, false>(p_, sm, tk, h, slot, pend);
}

}  // namespace verify
}  // namespace kda
}  // namespace k3gen
