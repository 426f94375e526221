// kda_verify, split schedule (M <= 3): the prefetch schedule's persistent walk over (head,
// sequence) items, with each item's 128 state rows split between the two CTAs of a cluster.
//
// State rows are independent in the V-first layout (kda/common.cuh, recur), so half an item is 64
// rows: 160 KB, one 128-thread CTA with the same 8 register rows per half-warp. Four such CTAs
// fit an SM (128 registers, ~48 KB of shared memory each). Measured (bench/NOTES.md, kda_verify:
// split schedule): the fastest schedule up to ~0.3 items per SM, where each item's bytes then
// stream through two SMs (H12 B1: 12.0 us vs 15.2 rows, 13.3 prefetch); built to shorten the tail
// of the prefetch kernel at H12 B128, which it does not (a half item at four CTAs per SM takes as
// long as a whole one at two).
//
// What the two halves share, and how:
//  - q, k and exp(g) of all 128 key channels: every CTA computes them (conv of 256 channels, the
//    f_b projection from L2: f_b is 32 KB per head and hot in L2, so no shared copy is kept);
//  - the gated RMSNorm over the 128 outputs of a token: each CTA pushes the 16 per-lane o^2
//    partials of its rows (the lanes 16 r .. 16 r + 15 of the row kernel's emit warp) into both
//    CTAs' exchange buffer with st.async; both then run emit's butterfly over the same 32 values,
//    so rstd, and every output, state and record, is bit for bit the row kernel's;
//  - the conv cache: both CTAs read the windows of all q/k channels, so a CTA writes the columns
//    of the channels it owns (q, k channels 64 r .. 64 r + 63 and its v channels) only after the
//    peer's exchange push for that item, which follows the peer's window reads.
// The exchange buffer and its mbarrier alternate by the parity of the exchange count (padded items
// exchange nothing): a CTA re-arms a barrier right after its CTA-wide wait, and the peer can only
// push into that buffer again after receiving this CTA's next push.
#pragma once

#include "k3gen/kda/verify_prefetch.cuh"

namespace k3gen {
namespace kda {
namespace verify {

constexpr int kSplitThreads = 128;
constexpr int kHalfRows = kDim / 2;  // state rows per CTA

struct __align__(128) SplitSmem {
  float state[kHalfRows * kDim];         // next item's 64 start rows: FP32 words, or BF16 halves packed
  float q[kChunk][kDim], k[kChunk][kDim], eg[kChunk][kDim];
  float v[kChunk][kHalfRows], o[kChunk][kHalfRows];  // this CTA's rows, by row_of
  float beta[kChunk];
  float gsig[kChunk][kHalfRows];         // sigmoid(g_out) of this CTA's rows
  float nw[kHalfRows];
  float xs[2][kChunk][32];               // o^2 partial of emit lane 16 r + l, by exchange parity
  float cols[3][2 + kChunk][kHalfRows];  // conv-cache columns of the owned q, k, v channels
  unsigned long long sbar, xbar[2];
  int meta[2][2];                        // (slot, pending) of the item of each parity
  int begin, end;                        // item range, read from here instead of held (spilled) in registers
};

static_assert(4 * (sizeof(SplitSmem) + 1024) <= 228 * 1024, "four split CTAs per SM");
static_assert(2 * kSplitThreads >= kPrefetchUnits, "the pair covers every prefetch unit");

template <class C>
constexpr int split_smem_bytes() {
  return static_cast<int>(sizeof(SplitSmem));
}

// Thread 0: record the item's slot / pending in meta[par] and start the copy of this CTA's 64 rows
// of its start state (contiguous: rows 64 r .. 64 r + 63).
template <class C>
__device__ __forceinline__ void issue_half(const Params& p_, SplitSmem& sm, int h, Lookup lk, int par, int rank) {
  sm.meta[par][0] = lk.slot;
  sm.meta[par][1] = lk.pend;
  if (lk.slot < 0) return;
  unsigned bytes;
  const char* src = static_cast<const char*>(start_state<C>(p_, h, lk, bytes));
  bytes /= 2;
  fence_proxy_async_smem();  // generic-proxy reads of the buffer before the async-proxy write
  mbar_arrive_expect_tx(&sm.sbar, bytes);
  bulk_g2s(sm.state, src + rank * bytes, bytes, &sm.sbar);
}

// stage_all() for one half: every global load first, then conv + SiLU of all q, k channels and of
// this CTA's v channels, beta, the norm gate and weight of its rows, and exp(g) of all 128 key
// channels with stage()'s expression (half-warp hw takes channels hw + 8 j).
template <class C>
__device__ __forceinline__ void stage_half(const Params& p_, SplitSmem& sm, const Tokens& tk, int h, int slot,
                                           int pend, int rank, float a_gate) {
  constexpr int H = C::kHeads, M = C::kDrafts, T = 1 + M, D = H * kDim, CE = 3 + M;
  const int tid = threadIdx.x, hw = tid >> 4, hl = tid & 15;
  const int v0 = rank * kHalfRows;
  const bool has_v = tid < kHalfRows, owns_qk = (tid >> 6) == rank;
  const int cq = h * kDim + tid, ck = D + cq, cv = 2 * D + h * kDim + v0 + (tid & (kHalfRows - 1));
  const float* ce = p_.conv_ext + static_cast<long long>(slot) * (3 * D) * CE;
  // ---- loads -------------------------------------------------------------------------------
  float wq[3], wk[3], wv[3] = {0.0f, 0.0f, 0.0f}, xq[T], xk[T], xv[T] = {}, fa[T][8], gl[2], bl = 0.0f, nwl = 0.0f;
  load_channel<T, CE>(ce, cq, pend, tk, wq, xq);
  load_channel<T, CE>(ce, ck, pend, tk, wk, xk);
  if (has_v) load_channel<T, CE>(ce, cv, pend, tk, wv, xv);
  load_fa<T>(tk, hl, fa);
  const int gc = tid & (kHalfRows - 1);
#pragma unroll
  for (int j = 0; j < 2; ++j) {  // g_out of tokens (tid >> 6) + 2 j at row v0 + gc
    const int t = (tid >> 6) + 2 * j;
    gl[j] = t < T ? __bfloat162float(tk.qkvg[(tk.tok0 + t) * tk.qkvg_stride + 3 * D + h * kDim + v0 + gc]) : 0.0f;
  }
  if (tid < T) bl = __bfloat162float(tk.beta[(tk.tok0 + tid) * tk.beta_stride + h]);
  if (has_v) nwl = __ldg(p_.w.norm_w + v0 + tid);
  float tq[4], tk4[4], tv[4];
  taps_of(p_.w.conv_w, cq, tq);
  taps_of(p_.w.conv_w, ck, tk4);
  taps_of(p_.w.conv_w, cv, tv);
  // ---- conv-cache columns (w1, w2, x_0 .. x_M) of the owned channels, written after the exchange
  if (owns_qk) {
    float* cq_cols = &sm.cols[0][0][tid & (kHalfRows - 1)];
    float* ck_cols = &sm.cols[1][0][tid & (kHalfRows - 1)];
    cq_cols[0] = wq[1], cq_cols[kHalfRows] = wq[2], ck_cols[0] = wk[1], ck_cols[kHalfRows] = wk[2];
#pragma unroll
    for (int t = 0; t < T; ++t) cq_cols[(2 + t) * kHalfRows] = xq[t], ck_cols[(2 + t) * kHalfRows] = xk[t];
  }
  if (has_v) {
    float* cv_cols = &sm.cols[2][0][tid];
    cv_cols[0] = wv[1], cv_cols[kHalfRows] = wv[2];
#pragma unroll
    for (int t = 0; t < T; ++t) cv_cols[(2 + t) * kHalfRows] = xv[t];
  }
  // ---- conv + SiLU, beta, norm gate ----------------------------------------------------------
  conv_tokens<T>(tq, wq, xq, sm.q[0] + tid, kDim);
  conv_tokens<T>(tk4, wk, xk, sm.k[0] + tid, kDim);
  if (has_v) conv_tokens<T>(tv, wv, xv, sm.v[0] + tid, kHalfRows);
#pragma unroll
  for (int j = 0; j < 2; ++j)
    if ((tid >> 6) + 2 * j < T) sm.gsig[(tid >> 6) + 2 * j][gc] = sigmoidf_(gl[j]);
  if (tid < T) sm.beta[tid] = sigmoidf_(bl);
  if (has_v) sm.nw[tid] = nwl;
  // ---- forget gates: stage()'s expression per channel, f_b rows straight from L2 ------------
  constexpr int G = kRows / 2;
  const uint4* fb = p_.w.fb_w + static_cast<long long>(h) * kDim * kRowVecs;
#pragma unroll
  for (int g = 0; g < 4; ++g) {
    uint4 wraw[G];
#pragma unroll
    for (int j = 0; j < G; ++j) wraw[j] = __ldg(fb + (hw + 8 * (g * G + j)) * kRowVecs + hl);
    const int gi = hw + 8 * (g * G + (hl >> 2));
    const float dtb = __ldg(p_.w.dt_bias + h * kDim + gi);
#pragma unroll
    for (int t = 0; t < T; ++t) {
      const float z = gate_preact<G>(wraw, fa[t], hl);
      if ((hl & 3) == 0) sm.eg[t][gi] = decay<C::kGate>(z + dtb, a_gate);
    }
  }
}

// Zeros for the T <= 4 outputs of this CTA's rows of a padded item: thread -> row tid % 64, tokens
// tid / 64 and tid / 64 + 2 (no per-thread index math to keep live across the item loop).
template <int H, int T>
__device__ __forceinline__ void zero_half(const Tokens& tk, int h, int v0) {
  const int tid = threadIdx.x;
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const int t = (tid >> 6) + 2 * j;
    if (t < T) tk.out[((tk.tok0 + t) * H + h) * kDim + v0 + (tid & (kHalfRows - 1))] = __float2bfloat16(0.0f);
  }
}

template <class C>
__device__ __forceinline__ void run_split(const Params& p_, int batch) {
  constexpr int H = C::kHeads, M = C::kDrafts, T = 1 + M, D = H * kDim, CE = 3 + M;
  static_assert(T <= kChunk && T <= kSplitThreads / 32, "all tokens staged at once, one emit warp each");
  constexpr long long kHead = kDim * kDim;
  constexpr unsigned kXBytes = T * 16 * 4;  // the peer's o^2 partials of one exchange
  extern __shared__ __align__(128) unsigned char smem_raw[];
  SplitSmem& sm = *reinterpret_cast<SplitSmem*>(smem_raw);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int rank = static_cast<int>(cluster_ctarank()), peer = rank ^ 1, v0 = rank * kHalfRows;
  // Cluster cl owns items [i0, i1): n_items / n_cl each, the first n_items % n_cl one more (32-bit:
  // the launcher keeps H * B below 2^31; a 64-bit division is a subroutine whose results spill).
  const int n_items = H * batch, n_cl = static_cast<int>(gridDim.x / 2), cl = static_cast<int>(blockIdx.x / 2);
  const int per = n_items / n_cl, extra = n_items % n_cl;
  const int i0 = cl * per + min(cl, extra), i1 = i0 + per + (cl < extra ? 1 : 0);
  griddep_launch_dependents();
  if (tid == 0) {
    mbar_init(&sm.sbar, 1);
    mbar_init(&sm.xbar[0], 1);
    mbar_init(&sm.xbar[1], 1);
    fence_mbar_init();
    fence_proxy_async_smem();
    mbar_arrive_expect_tx(&sm.xbar[0], kXBytes);
    mbar_arrive_expect_tx(&sm.xbar[1], kXBytes);
    sm.begin = i0;
    sm.end = i1;
  }
  __syncthreads();
  // Both CTAs' barriers are initialised and armed before either pushes (and this overlaps the
  // previous kernel under PDL).
  cluster_arrive_relaxed();
  cluster_wait();
  const int first = sm.begin;
  if (first >= sm.end) return;  // uniform over the cluster
  griddep_wait();        // every read below may see the previous kernel's writes
  if (tid == 0) {
    const Item it = Item{first / batch, first % batch};
    issue_half<C>(p_, sm, it.h, resolve<C>(p_, __ldg(p_.slots + it.b)), 0, rank);
  }
  unsigned sphase = 0, nx_ex = 0;
  for (int i = first; i < sm.end; ++i) {
    const Item it = Item{i / batch, i % batch};
    const int par = (i - first) & 1;
    __syncthreads();  // meta[par] is written; the previous item's readers of shared memory are done
    Tokens tk = p_.tk;
    tk.tok0 = static_cast<long long>(it.b) * T;
    const int slot = sm.meta[par][0], pend = sm.meta[par][1];
    const bool has_next = i + 1 < sm.end;
    const Item nx = Item{(has_next ? i + 1 : i) / batch, (has_next ? i + 1 : i) % batch};
    const int nslot = has_next ? __ldg(p_.slots + nx.b) : -1;
    if (slot < 0) {  // padded row (both CTAs see it): zeros out, no exchange
      zero_half<H, T>(tk, it.h, v0);
      if (tid == 0 && has_next) issue_half<C>(p_, sm, nx.h, resolve<C>(p_, nslot), par ^ 1, rank);
      continue;
    }
    const float a_gate = expf(__ldg(p_.w.a_log + it.h));
    stage_half<C>(p_, sm, tk, it.h, slot, pend, rank, a_gate);
    Lookup nlk{-1, 0};
    if (tid == 0 && has_next) nlk = resolve<C>(p_, nslot);
    if (nslot >= 0 && nslot < p_.num_slots) {
      // An opaque copy of the unit index: ptxas would otherwise hoist its per-thread index math
      // out of the item loop and keep (spill) it across the recurrence.
      int unit;
      asm volatile("mov.b32 %0, %1;\n" : "=r"(unit) : "r"(tid + rank * kSplitThreads));
      prefetch_inputs<C>(p_, nx, nslot, unit);
    }
    float d[kRows][8];
    take_rows<C>(sm.state, &sm.sbar, sphase, pend, d);
    __syncthreads();  // staged values visible; every thread's rows are out of the buffer
    if (tid == 0 && has_next) issue_half<C>(p_, sm, nx.h, nlk, par ^ 1, rank);
    const long long at = (static_cast<long long>(slot) * H + it.h) * kHead + v0 * kDim;
    float* rec = p_.draft_rec + static_cast<long long>(slot) * M * H * kHead + it.h * kHead + v0 * kDim;
#pragma unroll 1
    for (int t = 0; t < T; ++t) {
      recur<C::kBf16State>(d, sm, t);  // BF16: rounded as decode's store + reload (verify.cuh)
      if (t == 0) {
        if constexpr (C::kBf16State)
          store_rows_bf16(static_cast<__nv_bfloat16*>(p_.ssm) + at, d);
        else
          store_rows_f32(static_cast<float*>(p_.ssm) + at, d);
      } else {
        store_rows_f32(rec + static_cast<long long>(t - 1) * H * kHead, d);
      }
    }
    __syncthreads();  // o of every row visible
    // ---- RMSNorm across the pair -------------------------------------------------------------
    const int xb = static_cast<int>(nx_ex & 1);
    const unsigned xph = (nx_ex >> 1) & 1;
    ++nx_ex;
    float o[4];
    if (warp < T && lane < 16) {  // emit's per-lane partial (rms_quad) of lane 16 rank + lane
#pragma unroll
      for (int e = 0; e < 4; ++e) o[e] = sm.o[warp][4 * lane + e];
      const float ssq = rms_quad(o[0], o[1], o[2], o[3]);
      float* slot_x = &sm.xs[xb][warp][16 * rank + lane];
      *slot_x = ssq;
      st_async(cluster_map(slot_x, peer), ssq, cluster_map(&sm.xbar[xb], peer));
    }
    mbar_wait(&sm.xbar[xb], xph);  // the peer's partials; its conv-window reads are behind them
    __syncthreads();               // own partials visible; nobody polls this phase any more
    if (tid == 0) mbar_arrive_expect_tx(&sm.xbar[xb], kXBytes);  // for exchange nx_ex + 1
    if (warp < T) {
      const float rstd = rms_rstd(warp_allsum(sm.xs[xb][warp][lane]));
      if (lane < 16) {
        float y[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) y[e] = gated_y(o[e], rstd, sm.nw[4 * lane + e], sm.gsig[warp][4 * lane + e]);
        *reinterpret_cast<uint2*>(tk.out + ((tk.tok0 + warp) * H + it.h) * kDim + v0 + 4 * lane) =
            make_uint2(pack_bf16x2(y[0], y[1]), pack_bf16x2(y[2], y[3]));
      }
    }
    // ---- conv cache of the owned channels (the peer has read every window of this item) -----
    // The slot is re-read after the barriers so the addresses are rebuilt here instead of being
    // kept live (spilled at 128 registers) across the recurrence since the staging.
    float* ce = p_.conv_ext + static_cast<long long>(sm.meta[par][0]) * (3 * D) * CE;
    const int c = tid & (kHalfRows - 1);
    if ((tid >> 6) == rank) {
      float* dq = ce + static_cast<long long>(it.h * kDim + tid) * CE;
      float* dk = dq + static_cast<long long>(D) * CE;
#pragma unroll
      for (int j = 0; j < 2 + T; ++j) dq[j] = sm.cols[0][j][c], dk[j] = sm.cols[1][j][c];
    }
    if (tid < kHalfRows) {
      float* dv = ce + static_cast<long long>(2 * D + it.h * kDim + v0 + tid) * CE;
#pragma unroll
      for (int j = 0; j < 2 + T; ++j) dv[j] = sm.cols[2][j][tid];
    }
  }
  // No bulk copy targets this CTA when it exits (every issued state copy was waited for), and
  // every push the peer makes into it belongs to an exchange this CTA waited for.
}

}  // namespace verify
}  // namespace kda
}  // namespace k3gen
