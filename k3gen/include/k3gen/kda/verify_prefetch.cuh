// kda_verify, prefetch schedule (M <= 3, one chunk of tokens): the same arithmetic as
// kda/verify.cuh (stage / recur / emit expressions, so both schedules give the same bits), but a
// CTA walks a range of (head, sequence) items instead of owning one, at two CTAs per SM.
//
// Why (bench/NOTES.md, kda_verify): the row kernel spends a CTA's life in three serial phases per
// (sequence, head): slot -> pending -> start-state load (three dependent global round trips, the
// 64 KB load exposed), staging (per-token fa loads and the g_out loads of the norm are further
// round trips), then four 64 KB store bursts. The two CTAs of an SM start together and stay in
// step, so their exposed phases coincide and the SM's share of DRAM idles. Here
//  - thread 0 bulk-copies the *next* item's start state (64 KB FP32 record, or the 32 KB BF16
//    ssm) into shared memory as soon as the current rows are in registers, so the load runs under
//    the current item's four store bursts; the slot and pending of the next item travel with it;
//  - every global load of the staging (conv window, raw q/k/v, fa, beta, g_out, norm_w) is issued
//    up front while no state register is live (one round trip instead of about six);
//  - f_b stays in shared memory while consecutive items share a head.
// Shared memory: 64 KB state buffer + the row kernel's 44.7 KB, dynamic (two CTAs per SM).
//
// PDL (common/pdl.cuh): the kernel may start while the previous one finishes. Everything before
// griddepcontrol.wait only warms L2 (when `warm`): the first item's start state, its f_b rows and
// its staging inputs, at addresses from racing hint reads of its slot and pending.
#pragma once

#include "k3gen/kda/verify.cuh"
#include "k3gen/common/pdl.cuh"

namespace k3gen {
namespace kda {
namespace verify {

struct __align__(128) PrefetchSmem {
  float state[kDim * kDim];       // next item's start state: FP32 words, or BF16 halves packed
  Smem s;                         // f_b, dt_bias, the staged chunk, the weights' barrier
  float gsig[kChunk][kDim];       // sigmoid(g_out) of each token
  float nw[kDim];                 // norm_w
  unsigned long long sbar;        // state copy
  int meta[2][2];                 // (slot, pending) of the item of each parity; slot -1: padded
};

// Two CTAs per SM: 2 x (this + 1 KB the system reserves per CTA) within the 228 KB of an SM.
static_assert(2 * (sizeof(PrefetchSmem) + 1024) <= 228 * 1024, "two prefetch CTAs per SM");

template <class C>
constexpr int prefetch_smem_bytes() {
  return static_cast<int>(sizeof(PrefetchSmem));
}

// Item i of the whole grid is (head i / B, sequence i % B); CTA c owns items [c N / P, (c+1) N / P).
struct Item {
  int h, b;
};
__device__ __forceinline__ Item item_of(long long i, int batch) {
  return Item{static_cast<int>(i / batch), static_cast<int>(i % batch)};
}

// Slot and clamped pending of a sequence (slot -1: padded row). Thread 0 loads the next item's
// slot at the start of the current item and resolves its pending after the staging, so neither
// dependent load stalls warp 0 before its staging loads are out.
struct Lookup {
  int slot, pend;
};
template <class C>
__device__ __forceinline__ Lookup resolve(const Params& p_, int slot) {
  if (slot < 0 || slot >= p_.num_slots) {   // -1: padded row; else a fault, skipped alike
    if (slot != -1) fault::report<C>(p_.err, fault::kSlot);
    return Lookup{-1, 0};
  }
  const int raw = __ldg(p_.pending + slot);
  const int pend = min(max(raw, 0), C::kDrafts);
  if (pend != raw) fault::report<C>(p_.err, fault::kPending);
  return Lookup{slot, pend};
}

// Thread 0: record the item's slot / pending in meta[par] and start its state copy (none for a
// padded row). Callers barrier first: every generic read of the buffer is complete.
// Where the start state of head h of a valid slot lives and its size: ssm[slot, h] (FP32, or
// BF16 halves) when nothing is pending, else the FP32 record draft_rec[slot, pend - 1, h].
template <class C>
__device__ __forceinline__ const void* start_state(const Params& p_, int h, Lookup lk, unsigned& bytes) {
  constexpr int H = C::kHeads, M = C::kDrafts;
  constexpr long long kHead = kDim * kDim;
  bytes = kHead * 4;
  const long long at = static_cast<long long>(lk.slot) * H + h;
  if (lk.pend == 0) {
    if constexpr (C::kBf16State) {
      bytes = kHead * 2;
      return static_cast<const __nv_bfloat16*>(p_.ssm) + at * kHead;
    } else {
      return static_cast<const float*>(p_.ssm) + at * kHead;
    }
  }
  return p_.draft_rec + ((static_cast<long long>(lk.slot) * M + lk.pend - 1) * H + h) * kHead;
}

template <class C>
__device__ __forceinline__ void issue_state(const Params& p_, PrefetchSmem& sm, int h, Lookup lk, int par) {
  sm.meta[par][0] = lk.slot;
  sm.meta[par][1] = lk.pend;
  if (lk.slot < 0) return;
  unsigned bytes;
  const void* src = start_state<C>(p_, h, lk, bytes);
  fence_proxy_async_smem();  // generic-proxy reads of the buffer before the async-proxy write
  mbar_arrive_expect_tx(&sm.sbar, bytes);
  bulk_g2s(sm.state, src, bytes, &sm.sbar);
}

// ---- staging pieces shared by the prefetch and split kernels (same expressions, same bits) ----
// Conv window of channel c (columns pend .. pend+2 of its FP32 conv-cache row) and its T raw inputs.
template <int T, int CE>
__device__ __forceinline__ void load_channel(const float* ce, int c, int pend, const Tokens& tk, float (&w)[3],
                                             float (&x)[T]) {
  const float* col = ce + static_cast<long long>(c) * CE;
#pragma unroll
  for (int i = 0; i < 3; ++i) w[i] = col[pend + i];
#pragma unroll
  for (int t = 0; t < T; ++t) x[t] = __bfloat162float(tk.qkvg[(tk.tok0 + t) * tk.qkvg_stride + c]);
}

// The 8 fa values of lane hl for each of the T tokens (rows may be 2-byte aligned only).
template <int T>
__device__ __forceinline__ void load_fa(const Tokens& tk, int hl, float (&fa)[T][8]) {
#pragma unroll
  for (int t = 0; t < T; ++t) {
    const __nv_bfloat16* farow = tk.fa + (tk.tok0 + t) * tk.fa_stride + 8 * hl;
#pragma unroll
    for (int e = 0; e < 8; ++e) fa[t][e] = __bfloat162float(farow[e]);
  }
}

// Conv + SiLU of one channel's T tokens into dst[t * stride]; shifts the window.
template <int T>
__device__ __forceinline__ void conv_tokens(const float (&taps)[4], float (&w)[3], const float (&x)[T], float* dst,
                                            int stride) {
#pragma unroll
  for (int t = 0; t < T; ++t) {
    dst[t * stride] = conv_silu(taps, w[0], w[1], w[2], x[t]);
    w[0] = w[1], w[1] = w[2], w[2] = x[t];
  }
}

// stage()'s forget-gate pre-activation for G f_b rows against one token's fa: each lane's 8-term
// dot products, reduce-scattered over the half-warp (lane hl then holds row hl >> 2's sum).
template <int G>
__device__ __forceinline__ float gate_preact(const uint4 (&rows)[G], const float (&fa)[8], int hl) {
  float zp[G];
#pragma unroll
  for (int j = 0; j < G; ++j) {
    float wf[8];
    unpack_bf16x8(rows[j], wf);
    zp[j] = 0.0f;
#pragma unroll
    for (int e = 0; e < 8; ++e) zp[j] = fmaf(wf[e], fa[e], zp[j]);
  }
  half_reduce_scatter<G>(zp, hl);
  return zp[0];
}

// Staging of all T <= kChunk tokens with every global load issued before any dependent math.
// Writes sm.s.{q,k,v,eg,beta}, gsig, nw and the conv cache columns exactly as stage() + emit().
template <class C>
__device__ __forceinline__ void stage_all(const Params& p_, PrefetchSmem& ps, const Tokens& tk, int h, int slot,
                                          int pend, float a_gate, unsigned wphase) {
  constexpr int H = C::kHeads, M = C::kDrafts, T = 1 + M, D = H * kDim, CE = 3 + M;
  Smem& sm = ps.s;
  const int tid = threadIdx.x, hw = tid >> 4, hl = tid & 15;
  const int sec = tid >> 7, ch = tid & (kDim - 1);
  const bool has_v = tid < kDim;
  const int cqk = chan_qk<H>(h), cv = chan_v<H>(h);
  float* ce = p_.conv_ext + static_cast<long long>(slot) * (3 * D) * CE;
  float* ce_qk = ce + static_cast<long long>(cqk) * CE;
  float* ce_v = ce + static_cast<long long>(cv) * CE;
  // ---- loads -------------------------------------------------------------------------------
  float wq[3], wv[3] = {0.0f, 0.0f, 0.0f}, xq[T], xv[T] = {}, fa[T][8], gl[2], bl = 0.0f, nwl = 0.0f;
  load_channel<T, CE>(ce, cqk, pend, tk, wq, xq);
  if (has_v) load_channel<T, CE>(ce, cv, pend, tk, wv, xv);
  load_fa<T>(tk, hl, fa);
#pragma unroll
  for (int j = 0; j < 2; ++j) {  // g_out of tokens sec, sec + 2 at channel ch
    const int t = sec + 2 * j;
    gl[j] = t < T ? __bfloat162float(tk.qkvg[(tk.tok0 + t) * tk.qkvg_stride + 3 * D + h * kDim + ch]) : 0.0f;
  }
  if (tid < T) bl = __bfloat162float(tk.beta[(tk.tok0 + tid) * tk.beta_stride + h]);
  if (tid < kDim) nwl = __ldg(p_.w.norm_w + tid);
  float tq[4], tv[4];
  taps_of(p_.w.conv_w, cqk, tq);
  taps_of(p_.w.conv_w, cv, tv);
  // ---- conv cache: (w1, w2, x_0 .. x_M), each channel by its owner -------------------------
  ce_qk[0] = wq[1], ce_qk[1] = wq[2];
#pragma unroll
  for (int t = 0; t < T; ++t) ce_qk[2 + t] = xq[t];
  if (has_v) {
    ce_v[0] = wv[1], ce_v[1] = wv[2];
#pragma unroll
    for (int t = 0; t < T; ++t) ce_v[2 + t] = xv[t];
  }
  // ---- conv + SiLU, beta, norm gate ----------------------------------------------------------
  conv_tokens<T>(tq, wq, xq, (sec == 0 ? sm.q[0] : sm.k[0]) + ch, kDim);
  if (has_v) conv_tokens<T>(tv, wv, xv, sm.v[0] + tid, kDim);
#pragma unroll
  for (int j = 0; j < 2; ++j)
    if (sec + 2 * j < T) ps.gsig[sec + 2 * j][ch] = sigmoidf_(gl[j]);
  if (tid < T) sm.beta[tid] = sigmoidf_(bl);
  if (tid < kDim) ps.nw[tid] = nwl;
  // ---- forget gates (stage()'s expression: two groups of 4 channels per half-warp) ----------
  mbar_wait(&sm.bar, wphase);
  constexpr int G = kRows / 2;
#pragma unroll
  for (int t = 0; t < T; ++t) {
#pragma unroll
    for (int g = 0; g < 2; ++g) {
      uint4 rows[G];
#pragma unroll
      for (int j = 0; j < G; ++j) rows[j] = sm.fb[(hw + 16 * (g * G + j)) * kRowVecs + hl];
      const float z = gate_preact<G>(rows, fa[t], hl);
      const int gi = hw + 16 * (g * G + (hl >> 2));
      if ((hl & 3) == 0) sm.eg[t][gi] = decay<C::kGate>(z + sm.dtb[gi], a_gate);
    }
  }
}

// The next item's staging inputs into L2 (one 128-byte line per unit j, hints only, no registers
// held): its q|k|v|g slices and fa / beta of every token, and its conv-cache channels. Its staging
// then waits for L2, not DRAM. `slot` is the next item's (valid) slot. Units 0 .. kPrefetchUnits-1;
// each conv-cache run gets 32 unit slots (power-of-two index math, nothing worth keeping live).
constexpr int kPrefetchUnits = 4 * (4 * 2 + 3 + 1) + 3 * 32;
static_assert(kThreads >= kPrefetchUnits, "one prefetch unit per thread of a prefetch CTA");

template <class C>
__device__ __forceinline__ void prefetch_inputs(const Params& p_, Item it, int slot, int j) {
  constexpr int H = C::kHeads, M = C::kDrafts, T = 1 + M, D = H * kDim, CE = 3 + M;
  constexpr int kTok = 4 * 2, kFa = 3, kCe = (kDim * CE * 4 + 127) / 128 + 1;  // lines per unit
  static_assert(kCe <= 32, "a conv-cache run spans at most 32 lines");
  const Tokens& tk = p_.tk;
  const long long tok0 = static_cast<long long>(it.b) * T;
  if (j < T * kTok) {  // section j / 2 % 4 of token j / 8, 256 bytes = two lines
    const int t = j / kTok, sec = (j % kTok) >> 1;
    l2_prefetch_line(reinterpret_cast<const char*>(tk.qkvg + (tok0 + t) * tk.qkvg_stride + sec * D + it.h * kDim) +
                128 * (j & 1));
    return;
  }
  j -= T * kTok;
  if (j < T * kFa) {  // a 256-byte fa row at any 2-byte alignment spans at most three lines
    const int t = j / kFa;
    l2_prefetch_line(reinterpret_cast<const char*>(tk.fa + (tok0 + t) * tk.fa_stride) + 127 * (j % kFa));
    return;
  }
  j -= T * kFa;
  if (j < T) {
    l2_prefetch_line(tk.beta + (tok0 + j) * tk.beta_stride + it.h);
    return;
  }
  j -= T;
  if (j < 3 * 32 && (j & 31) < kCe) {  // conv-cache channels of q, k, v of the head: 3 runs of 128 * CE floats
    const int sec = j >> 5;
    const float* run = p_.conv_ext + static_cast<long long>(slot) * (3 * D) * CE +
                       static_cast<long long>(sec * D + it.h * kDim) * CE;
    const char* line = reinterpret_cast<const char*>(run) + 128 * (j & 31);
    if (line < reinterpret_cast<const char*>(run + kDim * CE)) l2_prefetch_line(line);
  }
}

// emit() with the gate and norm weight from shared memory (same expression order).
template <int H>
__device__ __forceinline__ void emit_staged(const Tokens& tk, int h, int n, const PrefetchSmem& ps) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (warp >= n) return;
  const long long tok = tk.tok0 + warp;
  gated_rmsnorm<H>(
      tk, tok, h, lane, [&](int i) { return ps.s.o[warp][4 * lane + i]; }, [&](int i) { return ps.nw[4 * lane + i]; },
      [&](int i) { return ps.gsig[warp][4 * lane + i]; });
}

// Rows of this thread from the landed state buffer (FP32 words, or BF16 when kBf16).
template <bool kBf16>
__device__ __forceinline__ void rows_from_smem(const float* buf, float (&d)[kRows][8]) {
  const int hl = threadIdx.x & 15;
#pragma unroll
  for (int j = 0; j < kRows; ++j) {
    if constexpr (kBf16) {
      const uint2* p = reinterpret_cast<const uint2*>(reinterpret_cast<const __nv_bfloat16*>(buf) + row_of(j) * kDim);
      const uint2 a = p[hl], b = p[16 + hl];
      const unsigned w[4] = {a.x, a.y, b.x, b.y};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        d[j][2 * i] = __uint_as_float(w[i] << 16);
        d[j][2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
      }
    } else {
      const float4* p = reinterpret_cast<const float4*>(buf + row_of(j) * kDim);
      const float4 a = p[hl], b = p[16 + hl];
      d[j][0] = a.x, d[j][1] = a.y, d[j][2] = a.z, d[j][3] = a.w;
      d[j][4] = b.x, d[j][5] = b.y, d[j][6] = b.z, d[j][7] = b.w;
    }
  }
}

// The item's start rows once its bulk copy has landed (phase flips): BF16 halves when a BF16 ssm
// is the start (pending 0), else FP32 words.
template <class C>
__device__ __forceinline__ void take_rows(const float* buf, unsigned long long* bar, unsigned& phase, int pend,
                                          float (&d)[kRows][8]) {
  mbar_wait(bar, phase);
  phase ^= 1;
  if (C::kBf16State && pend == 0)
    rows_from_smem<true>(buf, d);
  else
    rows_from_smem<false>(buf, d);
}

// L2 warming of item `it` before the PDL wait, by the whole CTA: its start state (record or ssm,
// chosen from racing hint reads of slot and pending), the f_b rows of its head and one line each
// of its staging inputs. Hints only: nothing is read into registers or shared memory.
template <class C>
__device__ __forceinline__ void warm_item(const Params& p_, Item it) {
  const int slot = hint_load(p_.slots + it.b);
  if (slot < 0 || slot >= p_.num_slots) return;
  const Lookup lk{slot, min(max(hint_load(p_.pending + slot), 0), C::kDrafts)};
  unsigned bytes;
  const char* src = static_cast<const char*>(start_state<C>(p_, it.h, lk, bytes));
  const unsigned piece = bytes / kThreads;  // 256 or 128 bytes per thread
  l2_prefetch_bulk(src + threadIdx.x * piece, piece);
  constexpr unsigned kFb = kDim * kDim * 2 / kThreads;
  l2_prefetch_bulk(reinterpret_cast<const char*>(p_.w.fb_w + static_cast<long long>(it.h) * kDim * kRowVecs) +
                       threadIdx.x * kFb, kFb);
  prefetch_inputs<C>(p_, it, slot, threadIdx.x);
}

template <class C>
__device__ __forceinline__ void run_prefetch(const Params& p_, int batch, int warm) {
  constexpr int H = C::kHeads, M = C::kDrafts, T = 1 + M;
  static_assert(T <= kChunk, "the prefetch schedule stages all tokens at once (M <= 3)");
  constexpr long long kHead = kDim * kDim;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  PrefetchSmem& ps = *reinterpret_cast<PrefetchSmem*>(smem_raw);
  Smem& sm = ps.s;
  const long long n_items = static_cast<long long>(H) * batch;
  const long long i0 = n_items * blockIdx.x / gridDim.x, i1 = n_items * (blockIdx.x + 1) / gridDim.x;
  griddep_launch_dependents();   // under PDL the next kernel may start its own prologue
  if (i0 >= i1) return;
  if (warm) warm_item<C>(p_, item_of(i0, batch));
  griddep_wait();   // every read below may see the previous kernel's writes
  if (threadIdx.x == 0) {
    mbar_init(&sm.bar, 1);
    mbar_init(&ps.sbar, 1);
    fence_proxy_async_smem();
    const Item it = item_of(i0, batch);
    issue_state<C>(p_, ps, it.h, resolve<C>(p_, __ldg(p_.slots + it.b)), 0);
  }
  unsigned wphase = 0, sphase = 0;
  int cur_h = -1;
  for (long long i = i0; i < i1; ++i) {
    const Item it = item_of(i, batch);
    const int par = static_cast<int>((i - i0) & 1);
    // Barrier: meta[par] is written; the previous item's readers of f_b / staged chunk are done.
    __syncthreads();
    if (it.h != cur_h) {
      // A head whose items were all padded never waited for its weights: the copy must land
      // before the barrier is re-armed and the buffer rewritten.
      if (cur_h >= 0) {
        if (threadIdx.x == 0) mbar_wait(&sm.bar, wphase);
        wphase ^= 1;
      }
      cur_h = it.h;
      if (threadIdx.x == 0) {
        fence_proxy_async_smem();
        mbar_arrive_expect_tx(&sm.bar, kDim * (kDim * 2 + 4));
        bulk_g2s(sm.fb, p_.w.fb_w + static_cast<long long>(it.h) * kDim * kRowVecs, kDim * kDim * 2, &sm.bar);
        bulk_g2s(sm.dtb, p_.w.dt_bias + it.h * kDim, kDim * 4, &sm.bar);
      }
    }
    Tokens tk = p_.tk;
    tk.tok0 = static_cast<long long>(it.b) * T;
    const int slot = ps.meta[par][0], pend = ps.meta[par][1];
    const bool has_next = i + 1 < i1;
    const Item nx = item_of(has_next ? i + 1 : i, batch);
    const int nslot = has_next ? __ldg(p_.slots + nx.b) : -1;  // every thread: L2 prefetch below
    if (slot < 0) {  // padded row: zeros out, nothing touched; hand the buffer to the next item
      zero_outputs<H>(tk, it.h, T);
      if (threadIdx.x == 0 && has_next) issue_state<C>(p_, ps, nx.h, resolve<C>(p_, nslot), par ^ 1);
      continue;
    }
    const float a_gate = expf(__ldg(p_.w.a_log + it.h));
    stage_all<C>(p_, ps, tk, it.h, slot, pend, a_gate, wphase);
    Lookup nlk{-1, 0};
    if (threadIdx.x == 0 && has_next) nlk = resolve<C>(p_, nslot);
    if (nslot >= 0 && nslot < p_.num_slots) prefetch_inputs<C>(p_, nx, nslot, threadIdx.x);
    float d[kRows][8];
    take_rows<C>(ps.state, &ps.sbar, sphase, pend, d);
    __syncthreads();  // staged chunk visible; every thread's rows are out of the buffer
    if (threadIdx.x == 0 && has_next) issue_state<C>(p_, ps, nx.h, nlk, par ^ 1);
    float* rec_slot = p_.draft_rec + static_cast<long long>(slot) * M * H * kHead;
#pragma unroll 1
    for (int t = 0; t < T; ++t) {
      recur<C::kBf16State>(d, sm, t);  // BF16: rounded as decode's store + reload (verify.cuh)
      if (t == 0) {
        if constexpr (C::kBf16State)
          store_rows_bf16(static_cast<__nv_bfloat16*>(p_.ssm) + (static_cast<long long>(slot) * H + it.h) * kHead, d);
        else
          store_rows_f32(static_cast<float*>(p_.ssm) + (static_cast<long long>(slot) * H + it.h) * kHead, d);
      } else {
        store_rows_f32(rec_slot + (static_cast<long long>(t - 1) * H + it.h) * kHead, d);
      }
    }
    __syncthreads();
    emit_staged<H>(tk, it.h, T, ps);
  }
  // No bulk copy may still target this CTA's shared memory when it exits: every issued state
  // copy was waited for (the last item issues none) and the weights' copy was waited for by a
  // live item; a range of padded rows only issued nothing or waits below.
  if (cur_h >= 0 && threadIdx.x == 0) mbar_wait(&sm.bar, wphase);
}

}  // namespace verify
}  // namespace kda
}  // namespace k3gen
