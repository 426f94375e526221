// kda_decode, streaming schedule: the large-batch form of the step in kda_decode.cuh.
//
// Why: the row schedule (one CTA per (sequence, head), whole state in registers, 2 CTAs per SM)
// measured latency-bound on the H200: the load phases of co-resident CTAs line up, DRAM idles while
// both compute, 80.7% of copy at H12 B128. Here one persistent CTA per SM walks a contiguous range
// of (head, sequence) items, and thread 0 keeps the next NS-1 items' state (64 KB FP32 / 32 KB
// BF16, contiguous per (slot, head)), conv windows and q|k|v|g slices landing in a shared-memory
// ring by bulk copies while all 256 threads compute the current item from shared memory. The
// state goes back with streaming stores straight from registers.
//
// Items are numbered head-major (item = h * B + b) so a CTA's range crosses few heads; f_b and
// dt_bias of a head are bulk-copied with the first item of each head into one of two buffers.
// Overwriting a buffer waits for nothing: the load of head run r+2 is issued after item j-NS
// finished, and run r ended before run r+1 (>= B items) began, so B >= NS-1 makes it safe (the
// launcher enforces it).
//
// The arithmetic of an item is the row schedule's at split 1, operation for operation, so both
// schedules give the same bits (a GPU test holds them to it).
#pragma once

#include "k3gen/kda_decode.cuh"

namespace k3gen {
namespace kda {

struct StreamParams {
  Params p;        // the row schedule's arguments (p.split unused)
  int batch;       // B
};

template <bool kBf16>
struct StreamStages {
  static constexpr int kStages = kBf16 ? 4 : 2;  // ~140 KB of ring either way
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

template <class Elem, int NS>
struct __align__(128) StreamSmem {
  uint4 fb[2][kDim * kRowVecs];
  float dtb[2][kDim];
  StreamStage<Elem> st[NS];
  float q[kDim], k[kDim], v[kDim], eg[kDim], o[kDim];
  float warp_ssq[kWarps];
  StreamMeta meta[NS];
  unsigned long long full[NS];
};

template <class C>
constexpr int stream_smem_bytes() {
  using Elem = typename StateRow<C::kBf16State>::Elem;
  return static_cast<int>(sizeof(StreamSmem<Elem, StreamStages<C::kBf16State>::kStages>));
}

// Thread 0's side of the ring: issues item j into stage j % NS.
template <class C, class Elem, int NS>
struct StreamProducer {
  int last_h = -1;
  int fbuf = 1;
  int next_slot = 0;  // slot of the item to issue next, loaded one issue ahead

  __device__ __forceinline__ void issue(const StreamParams& sp, StreamSmem<Elem, NS>& sm, int first, int j,
                                        int n) {
    constexpr int H = C::kHeads;
    constexpr int D = H * kDim;
    const Params& p = sp.p;
    const int item = first + j;
    const int h = item / sp.batch, b = item - h * sp.batch;
    const int slot = next_slot;
    if (j + 1 < n) {
      const int nitem = item + 1;
      next_slot = __ldg(p.slots + (nitem - (nitem / sp.batch) * sp.batch));
    }
    const bool valid = slot >= 0 && slot < p.num_slots;
    const bool new_head = h != last_h;
    if (new_head) fbuf ^= 1, last_h = h;
    const int s = j % NS;
    StreamStage<Elem>& st = sm.st[s];
    sm.meta[s] = StreamMeta{slot, fbuf};
    unsigned bytes = 4 * kDim * 2;
    if (valid) bytes += sizeof(st.state) + sizeof(st.conv);
    if (new_head) bytes += sizeof(sm.fb[0]) + sizeof(sm.dtb[0]);
    mbar_arrive_expect_tx(&sm.full[s], bytes);
    const __nv_bfloat16* xrow = p.qkvg + b * p.qkvg_stride + h * kDim;
#pragma unroll
    for (int sec = 0; sec < 4; ++sec) bulk_g2s(st.x[sec], xrow + sec * D, kDim * 2, &sm.full[s]);
    if (valid) {
      const Elem* head = static_cast<const Elem*>(p.ssm) + (static_cast<long long>(slot) * H + h) * (kDim * kDim);
      bulk_g2s(st.state, head, sizeof(st.state), &sm.full[s]);
      const __nv_bfloat16* conv = p.conv + (static_cast<long long>(slot) * (3 * D) + h * kDim) * 3;
#pragma unroll
      for (int sec = 0; sec < 3; ++sec) bulk_g2s(st.conv[sec], conv + sec * D * 3, kDim * 3 * 2, &sm.full[s]);
    }
    if (new_head) {
      bulk_g2s(sm.fb[fbuf], p.fb_w + static_cast<long long>(h) * kDim * kRowVecs, sizeof(sm.fb[0]), &sm.full[s]);
      bulk_g2s(sm.dtb[fbuf], p.dt_bias + h * kDim, sizeof(sm.dtb[0]), &sm.full[s]);
    }
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

  StreamProducer<C, Elem, NS> prod;
  if (tid == 0) {
#pragma unroll
    for (int s = 0; s < NS; ++s) mbar_init(&sm.full[s], 1);
    fence_proxy_async_smem();
    if (n > 0) prod.next_slot = __ldg(p.slots + (first - (first / sp.batch) * sp.batch));
    for (int j = 0; j < NS && j < n; ++j) prod.issue(sp, sm, first, j, n);
  }
  __syncthreads();

  // Per-head constants stay in registers across a head run; f_a and the beta logit of the next
  // item are loaded one item ahead (their rows need not be 16-byte aligned, so no bulk copy).
  int cur_h = -1;
  uint2 cw_qk = make_uint2(0u, 0u), cw_v = make_uint2(0u, 0u);
  float nw = 0.0f, a_gate = 0.0f;
  float fa[8], beta_logit;
  auto load_fa = [&](int item, float (&dst)[8], float& bl) {
    const int h = item / sp.batch, b = item - h * sp.batch;
    const __nv_bfloat16* farow = p.fa + b * p.fa_stride + 8 * hl;
#pragma unroll
    for (int e = 0; e < 8; ++e) dst[e] = __bfloat162float(farow[e]);
    bl = __bfloat162float(p.beta[b * p.beta_stride + h]);
  };
  if (n > 0) load_fa(first, fa, beta_logit);

  for (int i = 0; i < n; ++i) {
    const int s = i % NS;
    const int item = first + i;
    const int h = item / sp.batch, b = item - h * sp.batch;
    if (h != cur_h) {  // uniform over the CTA
      cur_h = h;
      const int cq = sec * D + h * kDim + ch;
      cw_qk = __ldg(reinterpret_cast<const uint2*>(p.conv_w) + cq);
      if (has_row) {
        cw_v = __ldg(reinterpret_cast<const uint2*>(p.conv_w) + 2 * D + h * kDim + tid);
        nw = __ldg(p.norm_w + tid);
      }
      a_gate = expf(__ldg(p.a_log + h));
    }
    float fa_n[8], bl_n = 0.0f;
    if (i + 1 < n) load_fa(item + 1, fa_n, bl_n);

    mbar_wait(&sm.full[s], (i / NS) & 1);
    const StreamMeta meta = sm.meta[s];
    const StreamStage<Elem>& st = sm.st[s];
    __nv_bfloat16* out = p.out + (static_cast<long long>(b) * H + h) * kDim;
    const bool valid = meta.slot >= 0 && meta.slot < p.num_slots;
    float o = 0.0f, out_scale = 0.0f;
    bool o_lane = false;
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
        out_scale = nw * sigmoidf_(__bfloat162float(st.x[3][tid]));
      }
      // ---- forget gate: half-warp hw takes channels hw + 16 j ---------------------------------
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
      const float eg = decay<C::kGate>(zp[0] + sm.dtb[meta.fbuf][gi], a_gate);
      if ((hl & 1) == 0) sm.eg[gi] = eg;
    }
    __syncthreads();
    if (valid) {
      const float beta = sigmoidf_(beta_logit);
      Elem* head = static_cast<Elem*>(p.ssm) + (static_cast<long long>(meta.slot) * H + h) * (kDim * kDim);
      typename Row::Frag frag[RP];
#pragma unroll
      for (int j = 0; j < RP; ++j) frag[j] = Row::load_shared(st.state + (row_base + 2 * j) * kDim, hl);
      o = head_update<Row, RP>(frag, sm.q, sm.k, sm.eg, sm.v, sm.o, beta, head, row_base, half, hl, o_lane);
    }
    float ssq_o = o_lane ? o * o : 0.0f;
#pragma unroll
    for (int m = 16; m >= 1; m >>= 1) ssq_o += __shfl_xor_sync(0xffffffffu, ssq_o, m);
    if (lane == 0) sm.warp_ssq[warp] = ssq_o;
    // Every read of stage s is behind this barrier: thread 0 may refill it.
    __syncthreads();
    if (tid == 0 && i + NS < n) prod.issue(sp, sm, first, i + NS, n);
    if (has_row) {
      if (valid) {
        float total = 0.0f;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) total += sm.warp_ssq[w];
        const float rstd = rsqrtf(total * (1.0f / kDim) + kNormEps);
        out[tid] = __float2bfloat16(sm.o[tid] * rstd * out_scale);
      } else {
        out[tid] = __float2bfloat16(0.0f);
      }
    }
    if (i + 1 < n) {
#pragma unroll
      for (int e = 0; e < 8; ++e) fa[e] = fa_n[e];
      beta_logit = bl_n;
    }
  }
}

}  // namespace kda
}  // namespace k3gen
