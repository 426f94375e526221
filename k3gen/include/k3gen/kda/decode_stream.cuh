// kda_decode, streaming schedule: the large-batch form of the step in kda/decode.cuh.
//
// Why: the row schedule (one CTA per (sequence, head), whole state in registers, 2 CTAs per SM)
// measured latency-bound on the H200: the load phases of co-resident CTAs line up, DRAM idles while
// both compute, 80.7% of copy at H12 B128. Here persistent CTAs walk contiguous ranges of
// (head, sequence) items, and thread 0 bulk-copies the next item's state (64 KB FP32 / 32 KB BF16,
// contiguous per (slot, head)), conv windows and q|k|v|g slices into shared memory while all 256
// threads compute the current item. The state goes back with streaming stores from registers.
//
// Two CTAs per SM, one stage each (kStages = 1): the first version ran one CTA per SM with a
// two/four-stage ring and measured 0-4% (FP32) / 15-27% (BF16) slower than the row schedule
// (bench/NOTES.md 2026-11-29 20:44): one CTA exposes the per-item dependency chain (conv, gate,
// three reductions, RMSNorm). Two CTAs overlap two chains as the row schedule does, and the
// refill of a stage is issued as soon as its rows are in registers, so the next item's 64 KB load
// runs under this item's math and stores.
//
// Items are numbered head-major (item = h * B + b) so a CTA's range crosses few heads; f_b and
// dt_bias of a head are bulk-copied with the first item of each head. With one stage, one f_b
// buffer suffices: item j+1 is issued after every read of item j's gate. With NS >= 2 stages the
// buffers are two and B >= NS-1 keeps an overwritten buffer idle (a head run lasts >= B items).
//
// The arithmetic of an item is the row schedule's at split 1, operation for operation, so both
// schedules give the same bits (a GPU test holds them to it).
#pragma once

#include "k3gen/kda/decode.cuh"

namespace k3gen {
namespace kda {

struct StreamParams {
  Params p;        // the row schedule's arguments (p.split unused)
  int batch;       // B
};

template <bool kBf16>
struct StreamStages {
  static constexpr int kStages = 1;
  static constexpr int kCtasPerSm = 2;
};

template <class Elem>
struct __align__(128) StreamStage {
  Elem state[kDim * kDim];                   // S^T of the item's (slot, head), as stored
  unsigned short conv[3][kDim * 3];          // raw windows of the head's q | k | v channels
  __nv_bfloat16 x[4][kDim];                  // the head's q | k | v | g_out slices of the row
};

struct StreamMeta {
  int slot;   // < 0 or >= num_slots: padded row
  int fbuf;   // which f_b buffer holds this item's head
};

// Thread 0's producer state, in shared memory: registers of thread 0 are registers of every
// thread, and the update already needs ~124 of the 128 that two CTAs per SM allow.
struct StreamProducerState {
  const void* state_src;  // state of the item issue_inputs() armed (nullptr: padded)
  int last_h;
  int fbuf;
  int next_slot;          // slot of the item to issue next, loaded one issue ahead
};

template <class Elem, int NS, int FB = (NS == 1 ? 1 : 2)>
struct __align__(128) StreamSmem {
  uint4 fb[FB][kDim * kRowVecs];
  float dtb[FB][kDim];
  StreamStage<Elem> st[NS];
  float q[kDim], k[kDim], v[kDim], eg[kDim], o[kDim];
  float gs[kDim];   // sigmoid(g_out) by row, read back by the thread that wrote it
  StreamMeta meta[NS];
  StreamProducerState prod;
  unsigned long long full[NS];
};

template <class C>
constexpr int stream_smem_bytes() {
  using Elem = typename StateRow<C::kBf16State>::Elem;
  return static_cast<int>(sizeof(StreamSmem<Elem, StreamStages<C::kBf16State>::kStages>));
}

// Thread 0's side of the ring, in two halves per item j (stage j % NS): issue_inputs() copies
// the q|k|v|g slices, conv windows and (new head) f_b / dt_bias and arms the stage's barrier for
// every byte; issue_state() copies the state. The decode loop calls them at two points (after the
// last read of the stage's inputs, and after the last read of its state), so the state copy,
// issued while the rows are live in registers, needs nothing but one pointer.
template <class C, class Elem, int NS>
struct StreamProducer {
  static constexpr int kFb = NS == 1 ? 1 : 2;

  static __device__ __forceinline__ void init(const StreamParams& sp, StreamSmem<Elem, NS>& sm, int first) {
    sm.prod = StreamProducerState{nullptr, -1, kFb - 1,
                                  __ldg(sp.p.slots + (first - (first / sp.batch) * sp.batch))};
  }

  static __device__ __forceinline__ void issue_inputs(const StreamParams& sp, StreamSmem<Elem, NS>& sm, int first, int j,
                                               int n) {
    constexpr int H = C::kHeads;
    constexpr int D = H * kDim;
    const Params& p = sp.p;
    const int item = first + j;
    const int h = item / sp.batch, b = item - h * sp.batch;
    StreamProducerState& ps = sm.prod;
    const int slot = ps.next_slot;
    if (j + 1 < n) {
      const int nitem = item + 1;
      ps.next_slot = __ldg(p.slots + (nitem - (nitem / sp.batch) * sp.batch));
    }
    const bool valid = slot >= 0 && slot < p.num_slots;   // -1: padded row; else a fault, skipped alike
    if (!valid && slot != -1) fault::report(p.err, fault::kSlot);
    const bool new_head = h != ps.last_h;
    int fbuf = ps.fbuf;
    if (new_head) fbuf = (fbuf + 1) % kFb, ps.fbuf = fbuf, ps.last_h = h;
    const int s = j % NS;
    StreamStage<Elem>& st = sm.st[s];
    sm.meta[s] = StreamMeta{slot, fbuf};
    unsigned bytes = 4 * kDim * 2;
    if (valid) bytes += sizeof(st.state) + sizeof(st.conv);
    if (new_head) bytes += sizeof(sm.fb[0]) + sizeof(sm.dtb[0]);
    fence_proxy_async_smem();  // generic-proxy reads of the stage before the async-proxy writes
    mbar_arrive_expect_tx(&sm.full[s], bytes);
    const __nv_bfloat16* xrow = p.qkvg + b * p.qkvg_stride + h * kDim;
#pragma unroll
    for (int sec = 0; sec < 4; ++sec) bulk_g2s(st.x[sec], xrow + sec * D, kDim * 2, &sm.full[s]);
    ps.state_src = nullptr;
    if (valid) {
      ps.state_src = static_cast<const Elem*>(p.ssm) + (static_cast<long long>(slot) * H + h) * (kDim * kDim);
      const __nv_bfloat16* conv = p.conv + (static_cast<long long>(slot) * (3 * D) + h * kDim) * 3;
#pragma unroll
      for (int sec = 0; sec < 3; ++sec) bulk_g2s(st.conv[sec], conv + sec * D * 3, kDim * 3 * 2, &sm.full[s]);
    }
    if (new_head) {
      bulk_g2s(sm.fb[fbuf], p.fb_w + static_cast<long long>(h) * kDim * kRowVecs, sizeof(sm.fb[0]), &sm.full[s]);
      bulk_g2s(sm.dtb[fbuf], p.dt_bias + h * kDim, sizeof(sm.dtb[0]), &sm.full[s]);
    }
  }

  static __device__ __forceinline__ void issue_state(StreamSmem<Elem, NS>& sm, int j) {
    const int s = j % NS;
    const void* src = sm.prod.state_src;
    if (src == nullptr) return;
    fence_proxy_async_smem();
    bulk_g2s(sm.st[s].state, src, sizeof(sm.st[s].state), &sm.full[s]);
  }
};

template <class C>
__device__ __forceinline__ void decode_stream(const StreamParams& sp) {
  using Row = StateRow<C::kBf16State>;
  using Elem = typename Row::Elem;
  constexpr int NS = StreamStages<C::kBf16State>::kStages;
  constexpr int H = C::kHeads;
  constexpr int D = H * kDim;
  constexpr int RP = kDim / (2 * kWarps);  // 8 row pairs per warp
  extern __shared__ __align__(128) unsigned char smem_raw[];
  auto& sm = *reinterpret_cast<StreamSmem<Elem, NS>*>(smem_raw);
  const Params& p = sp.p;

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, half = lane >> 4, hl = lane & 15;
  const int items = sp.batch * H;
  const int first = static_cast<int>(static_cast<long long>(blockIdx.x) * items / gridDim.x);
  const int n = static_cast<int>(static_cast<long long>(blockIdx.x + 1) * items / gridDim.x) - first;
  const int sec = tid >> 7, ch = tid & (kDim - 1);
  const bool has_row = tid < kDim;
  const int row_base = warp * (kDim / kWarps) + half;
  const int hw = tid >> 4;

  // Under PDL (the launcher's default) the grid may start while the previous kernel finishes; it
  // reads nothing before the wait. Warming L2 before it, as the row kernel's one-wave grids do,
  // measured 0.3-1.2% slower here (bench/NOTES.md, L2 warming, 2026-11-30 04:00-04:13).
  griddep_launch_dependents();
  griddep_wait();

  using Prod = StreamProducer<C, Elem, NS>;
  if (tid == 0) {
#pragma unroll
    for (int s = 0; s < NS; ++s) mbar_init(&sm.full[s], 1);
    fence_proxy_async_smem();
    if (n > 0) Prod::init(sp, sm, first);
    for (int j = 0; j < NS && j < n; ++j) {
      Prod::issue_inputs(sp, sm, first, j, n);
      Prod::issue_state(sm, j);
    }
  }
  __syncthreads();

  // The f_a slice and beta logit of the next item are loaded one item ahead (f_a rows are 2-byte
  // aligned in the K3 [f_a | b] row, so no bulk copy), f_a kept as 4 packed BF16 pairs; per-head
  // weights are re-read per item (L1 hits) rather than held across the update: 128 registers.
  auto load_fa = [&](int item, uint4& fa_dst, float& bl) {
    const int h = item / sp.batch, b = item - h * sp.batch;
    const unsigned short* farow = reinterpret_cast<const unsigned short*>(p.fa + b * p.fa_stride) + 8 * hl;
    unsigned w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) w[i] = farow[2 * i] | (static_cast<unsigned>(farow[2 * i + 1]) << 16);
    fa_dst = make_uint4(w[0], w[1], w[2], w[3]);
    bl = __bfloat162float(p.beta[b * p.beta_stride + h]);
  };
  uint4 fa_pk = make_uint4(0u, 0u, 0u, 0u);
  float beta_logit = 0.0f;
  if (n > 0) load_fa(first, fa_pk, beta_logit);

  for (int i = 0; i < n; ++i) {
    const int s = i % NS;
    const int item = first + i;
    const int h = item / sp.batch, b = item - h * sp.batch;
    const uint2 cw_qk = __ldg(reinterpret_cast<const uint2*>(p.conv_w) + sec * D + h * kDim + ch);
    uint2 cw_v = make_uint2(0u, 0u);
    float nw = 0.0f;
    if (has_row) {
      cw_v = __ldg(reinterpret_cast<const uint2*>(p.conv_w) + 2 * D + h * kDim + tid);
      nw = __ldg(p.norm_w + tid);
    }
    const float a_log = __ldg(p.a_log + h);

    uint4 fa_n = fa_pk;
    float bl_n = beta_logit;
    if (i + 1 < n) load_fa(item + 1, fa_n, bl_n);
    mbar_wait(&sm.full[s], (i / NS) & 1);
    const StreamMeta meta = sm.meta[s];
    const StreamStage<Elem>& st = sm.st[s];
    const bool valid = meta.slot >= 0 && meta.slot < p.num_slots;
    if (valid) {
      __nv_bfloat16* conv = p.conv + static_cast<long long>(meta.slot) * (3 * D) * 3;
      // ---- conv + SiLU of q, k (all channels) and v; windows shift by one -------------------
      {
        const unsigned short* w = st.conv[sec] + ch * 3;
        const unsigned short w0 = w[0], w1 = w[1], w2 = w[2];
        const __nv_bfloat16 x = st.x[sec][ch];
        float cw[4];
        conv_weights(cw_qk, cw);
        (sec == 0 ? sm.q : sm.k)[ch] = conv_silu(cw, bf16_bits_to_float(w0), bf16_bits_to_float(w1),
                                                 bf16_bits_to_float(w2), __bfloat162float(x));
        unsigned short* wd = reinterpret_cast<unsigned short*>(conv) + (sec * D + h * kDim + ch) * 3;
        wd[0] = w1;
        wd[1] = w2;
        wd[2] = __bfloat16_as_ushort(x);
      }
      if (has_row) {
        const unsigned short* w = st.conv[2] + tid * 3;
        const unsigned short u0 = w[0], u1 = w[1], u2 = w[2];
        const __nv_bfloat16 x = st.x[2][tid];
        float cw[4];
        conv_weights(cw_v, cw);
        sm.v[tid] = conv_silu(cw, bf16_bits_to_float(u0), bf16_bits_to_float(u1), bf16_bits_to_float(u2),
                              __bfloat162float(x));
        unsigned short* wd = reinterpret_cast<unsigned short*>(conv) + (2 * D + h * kDim + tid) * 3;
        wd[0] = u1;
        wd[1] = u2;
        wd[2] = __bfloat16_as_ushort(x);
        sm.gs[tid] = sigmoidf_(__bfloat162float(st.x[3][tid]));
      }
      // ---- forget gate: half-warp hw takes channels hw + 16 j ---------------------------------
      float fa[8];
      unpack_bf16x8(fa_pk, fa);
      float zp[RP];
#pragma unroll
      for (int j = 0; j < RP; ++j) {
        float wf[8];
        unpack_bf16x8(sm.fb[meta.fbuf][(hw + 16 * j) * kRowVecs + hl], wf);
        zp[j] = 0.0f;
#pragma unroll
        for (int e = 0; e < 8; ++e) zp[j] = fmaf(wf[e], fa[e], zp[j]);
      }
      half_reduce_scatter<RP>(zp, hl);
      const int gi = hw + 16 * half_rs_index<RP>(hl);
      const float eg = decay<C::kGate>(zp[0] + sm.dtb[meta.fbuf][gi], expf(a_log));
      if ((hl & 1) == 0) sm.eg[gi] = eg;
    }
    // Every read of stage s's windows and slices, of its meta and of this item's f_b is behind
    // this barrier: thread 0 refills them now.
    __syncthreads();
    if (tid == 0 && i + NS < n) Prod::issue_inputs(sp, sm, first, i + NS, n);
    // Unconditional (a padded item's buffer holds stale bytes, never used): a conditional load
    // leaves the rows half-defined across the barrier below and ptxas spilled them.
    typename Row::Frag frag[RP];
#pragma unroll
    for (int j = 0; j < RP; ++j) frag[j] = Row::load_shared(st.state + (row_base + 2 * j) * kDim, hl);
    // ... and every read of its state behind this one: the next state's load runs under this
    // item's update and stores.
    __syncthreads();
    if (tid == 0 && i + NS < n) Prod::issue_state(sm, i + NS);
    if (valid) {
      const float beta = sigmoidf_(beta_logit);
      Elem* head = static_cast<Elem*>(p.ssm) + (static_cast<long long>(meta.slot) * H + h) * (kDim * kDim);
      head_update<Row, RP>(frag, sm.q, sm.k, sm.eg, sm.v, sm.o, beta, head, row_base, half, hl);
    }
    fa_pk = fa_n;
    beta_logit = bl_n;
    __syncthreads();  // o of every row visible
    __nv_bfloat16* out = p.out + (static_cast<long long>(b) * H + h) * kDim;
    if (has_row) {  // warps 0-3, whole warps (the butterfly of head_rstd)
      if (valid) {
        const float rstd = head_rstd(sm.o, lane);
        out[tid] = __float2bfloat16(gated_y(sm.o[tid], rstd, nw, sm.gs[tid]));
      } else {
        out[tid] = __float2bfloat16(0.0f);
      }
    }
  }
}

}  // namespace kda
}  // namespace k3gen
