// kda_prefill: the prompt tokens of a varlen batch, token-sequential (SPEC.md section 2 says this is
// the correct, simpler first version; the chunked WY form is the fast one and comes later).
// Contract: the docstring of k3gen/ir/ops/kda_prefill.py; FP32 twin: k3gen/reference/kda_prefill.py.
//
// One CTA per (sequence, head) runs the multi-token engine of kda/common.cuh over all the
// sequence's tokens, kChunk at a time, with the state in registers from the first token to the
// last: the pool slot is read once (when resuming) and written once, in its storage dtype. The
// conv windows live in registers too; the last three raw inputs go back to the BF16 window.
#pragma once

#include <cuda_bf16.h>

#include "k3gen/kda/common.cuh"

namespace k3gen {
namespace kda {
namespace prefill {

using namespace multi;

struct Params {
  Tokens tk;                    // tok0 = cu_seqlens[b]
  Weights w;
  const int* cu_seqlens;        // [B + 1]
  const int* slots;             // [B]
  const int* resume;            // [B]: non-zero continues from the pool's state and window
  void* ssm;                    // [num_slots, H, 128, 128] FP32 or BF16
  __nv_bfloat16* conv;          // [num_slots, 3D, 3]
  int num_slots;
};

template <class C>
__device__ __forceinline__ void run(const Params& p_) {
  using Elem = typename StateRow<C::kBf16State>::Elem;
  constexpr int H = C::kHeads, D = H * kDim;
  constexpr long long kHead = kDim * kDim;
  __shared__ Smem sm;
  const int h = blockIdx.x, b = blockIdx.y;
  Tokens tk = p_.tk;
  tk.tok0 = __ldg(p_.cu_seqlens + b);
  const int len = __ldg(p_.cu_seqlens + b + 1) - static_cast<int>(tk.tok0);
  const int slot = __ldg(p_.slots + b);
  start_weights(p_.w, h, sm);
  // No thread may poll the barrier before thread 0 has initialised it (stale shared memory).
  __syncthreads();
  if (slot < 0 || slot >= p_.num_slots || len <= 0) {  // padded row or empty sequence
    if (len > 0) zero_outputs<H>(tk, h, len);
    mbar_wait(&sm.bar, 0);
    return;
  }
  const bool resume = __ldg(p_.resume + b) != 0;
  Elem* head = static_cast<Elem*>(p_.ssm) + (static_cast<long long>(slot) * H + h) * kHead;
  Window w3;
#pragma unroll
  for (int i = 0; i < 3; ++i) w3.qk[i] = w3.v[i] = 0.0f;
  unsigned short* win = reinterpret_cast<unsigned short*>(p_.conv) + static_cast<long long>(slot) * (3 * D) * 3;
  const int cqk = chan_qk<H>(h), cv = chan_v<H>(h);
  const bool has_v = threadIdx.x < kDim;
  if (resume) {
#pragma unroll
    for (int i = 0; i < 3; ++i) w3.qk[i] = bf16_bits_to_float(win[cqk * 3 + i]);
    if (has_v) {
#pragma unroll
      for (int i = 0; i < 3; ++i) w3.v[i] = bf16_bits_to_float(win[cv * 3 + i]);
    }
  }
  const float a_gate = expf(__ldg(p_.w.a_log + h));
  float d[kRows][8];

  // The first chunk is peeled so the start state is loaded straight into the rows.
  int n = len < kChunk ? len : kChunk;
  stage<C::kGate, H>(tk, p_.w, h, 0, n, w3, sm, a_gate);
  __syncthreads();
  {
    // Loaded after the first staging: one exposed load latency per prompt, and no raw words next
    // to the staging's registers.
    unsigned raw[64];
    if constexpr (C::kBf16State) {
      if (resume) load_rows_bf16(head, raw);
      rows_from_bf16(raw, d);
    } else {
      if (resume) load_rows_f32(head, raw);
      rows_from_f32(raw, d);
    }
    if (!resume) {
#pragma unroll
      for (int j = 0; j < kRows; ++j)
#pragma unroll
        for (int e = 0; e < 8; ++e) d[j][e] = 0.0f;
    }
  }
#pragma unroll 1
  for (int t = 0; t < n; ++t) recur(d, sm, t);
  __syncthreads();
  emit<H>(tk, p_.w, h, 0, n, sm);

#pragma unroll 1
  for (int t0 = kChunk; t0 < len; t0 += kChunk) {
    n = len - t0 < kChunk ? len - t0 : kChunk;
    stage<C::kGate, H>(tk, p_.w, h, t0, n, w3, sm, a_gate);
    __syncthreads();
#pragma unroll 1
    for (int t = 0; t < n; ++t) recur(d, sm, t);
    __syncthreads();
    emit<H>(tk, p_.w, h, t0, n, sm);
  }

  if constexpr (C::kBf16State)
    store_rows_bf16(head, d);
  else
    store_rows_f32(head, d);
  // Each channel's window is owned by the one thread that read it above.
  // Window values are raw BF16 inputs (or the resumed BF16 window): the conversion is exact.
  // The re-read of the slot pointer keeps it out of registers during the token loop.
  unsigned short* wout = reinterpret_cast<unsigned short*>(p_.conv) + static_cast<long long>(slot) * (3 * D) * 3;
#pragma unroll
  for (int i = 0; i < 3; ++i) wout[cqk * 3 + i] = __bfloat16_as_ushort(__float2bfloat16(w3.qk[i]));
  if (has_v) {
#pragma unroll
    for (int i = 0; i < 3; ++i) wout[cv * 3 + i] = __bfloat16_as_ushort(__float2bfloat16(w3.v[i]));
  }
}

}  // namespace prefill
}  // namespace kda
}  // namespace k3gen
