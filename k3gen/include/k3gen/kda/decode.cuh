// kda_decode: one KDA decode step (one new token per sequence), fully fused. The contract is the
// docstring of k3gen/ops/kda_decode/spec.py; the FP32 twin is k3gen/ops/kda_decode/reference.py.
//
// The step is memory-bound on the state: 64 KB (FP32) read and written per (sequence, head). With
// the V-first layout each state row v updates independently once the head's q, k, exp(g), beta and
// v[v] are known:  d = exp(g) * S[v,:],  a = d.k,  c = d.q,  u = beta (v[v] - a),
// S[v,:] = d + k u,  o[v] = S[v,:].q = c + (q.k) u.  So both dot products of a row come from one
// pass over the decayed row, and nothing but 128 floats of o needs a CTA-wide step (RMSNorm).
//
// Work split: grid (S, H, B), 256 threads, S in {1,2,4,8} CTAs per (sequence, head) forming one
// cluster. CTA r owns state rows [r*128/S, (r+1)*128/S) and gate channels of the same range. A
// half-warp streams one state row, 8 K values per lane; all rows of the CTA are loaded into
// registers before any math (64 KB in flight per CTA at S = 1). The CTA's f_b rows and dt_bias
// arrive by one bulk copy into shared memory, so they cost no registers while the state is in
// flight. S > 1 serves small batches: each CTA computes exp(g) of its 128/S channels and pushes
// them to every CTA of the cluster (st.async on the peers' mbarriers), so f_b (32 KB per head) is
// read once per (sequence, head) whatever S; the RMSNorm sum of squares is exchanged the same way.
// Every CTA recomputes the conv and L2 norms of q and k (256 channels, cheap).
#pragma once

#include <cuda_bf16.h>

#include "k3gen/kda/common.cuh"

namespace k3gen {
namespace kda {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kRowVecs = kDim * 2 / 16;  // uint4 per BF16 f_b row

struct Params {
  const __nv_bfloat16* qkvg;    // [B, >= 4D] row stride qkvg_stride
  const __nv_bfloat16* fa;      // [B, 128] row stride fa_stride
  const __nv_bfloat16* beta;    // [B, H] row stride beta_stride
  const int* slots;             // [B]
  void* ssm;                    // [num_slots, H, 128, 128] FP32 or BF16
  __nv_bfloat16* conv;          // [num_slots, 3D, 3]
  const __nv_bfloat16* conv_w;  // [3D, 4]
  const uint4* fb_w;            // BF16 [D, 128], 16-byte aligned
  const float* dt_bias;         // [D], 16-byte aligned
  const float* a_log;           // [H]
  const float* norm_w;          // [128]
  __nv_bfloat16* out;           // [B, H, 128]
  long long qkvg_stride, fa_stride, beta_stride;
  int num_slots;
  int split;
  int warm;   // row kernel: CTAs that warm L2 before griddepcontrol.wait (warm_cta), 0: none
  int ahead;  // row kernel: CTA distance warmed after the own loads (warm_cta), 0: off
  unsigned* err;  // this op's error word (k3gen/runtime/faults.py)
};

enum { kBarFb = 0, kBarEg = 1, kBarSsq = 2 };

struct __align__(128) Smem {
  uint4 fb[kDim * kRowVecs];   // f_b rows of this CTA's gate channels (first R rows used)
  float dtb[kDim];             // dt_bias of the same channels
  float q[kDim], k[kDim];      // post-conv q, k (before the L2 norm), all 128 channels
  float v[kDim];               // post-conv v of this CTA's rows
  float eg[kDim];              // exp(g) of all key channels (chunk r written by cluster CTA r)
  float o[kDim];               // o of this CTA's rows
  float gs[kDim];              // sigmoid(g_out) of this CTA's rows (by the thread owning the row)
  float xs[32];                // S > 1: o^2 of the head's 32 row quads, pushed by the CTA owning each
  unsigned long long bar[3];   // kBarFb: bulk copy; S > 1: kBarEg, kBarSsq (peer pushes)
};

__device__ __forceinline__ void conv_weights(uint2 cw, float (&w)[4]) {
  w[0] = bf16_bits_to_float(cw.x & 0xffffu);
  w[1] = bf16_bits_to_float(cw.x >> 16);
  w[2] = bf16_bits_to_float(cw.y & 0xffffu);
  w[3] = bf16_bits_to_float(cw.y >> 16);
}

// The update of the rows a half-warp owns, shared by the row and stream schedules so both do the
// same arithmetic (kda/token_math.cuh's, as kda_verify's recur): q, k (post-conv, before the L2
// norm) and exp(g) of all 128 channels, and v and o by local row, in shared memory; the rows' old
// values in `frag`, new values stored to rows + local_row * kDim, o to so[local_row].
template <class Row, int RP>
__device__ __forceinline__ void head_update(const typename Row::Frag (&frag)[RP], const float* sq, const float* sk,
                                            const float* seg, const float* sv, float* so, float beta,
                                            typename Row::Elem* rows, int row_base, int half, int hl) {
  // ---- per-lane K slice of q, k, exp(g); head-wide norms from half-warp sums ------------------
  float qv[8], kv[8], ev[8];
  const float qk = load_qk_norm(sq, sk, seg, Row::k0(hl), Row::k1(hl), qv, kv, ev);

  // ---- the recurrence, one row per half-warp per pair -----------------------------------------
  // All rows' dot products first, then one reduce-scatter of the 2 RP sums over the half-warp
  // (NV - 1 + 4 - log2(NV) shuffles instead of 4 NV); u of row j returns by one broadcast each.
  constexpr int NV = 2 * RP;        // a_j = d_j.k (index j), c_j = d_j.q (index RP + j)
  constexpr int GROUP = 16 / NV;    // lanes of the half holding each reduced value
  float d[RP][8];
  float red[NV];
#pragma unroll
  for (int j = 0; j < RP; ++j) {
    Row::unpack(frag[j], d[j]);
    row_decay_dots(d[j], ev, kv, qv, red[j], red[RP + j]);
  }
  half_reduce_scatter<NV>(red, hl);
  const int idx = hl / GROUP;               // which sum this lane holds
  const bool a_lane = idx < RP;
  const int jr = a_lane ? idx : idx - RP;   // its row pair
  const float u_own = row_u(beta, sv[row_base + 2 * jr], red[0]);  // valid in a-lanes
  const float u_c = __shfl_sync(0xffffffffu, u_own, half * 16 + jr * GROUP);
  const float o = row_o(qk, u_c, red[0]);   // valid in c-lanes
  if (!a_lane && (hl % GROUP) == 0) so[row_base + 2 * jr] = o;
#pragma unroll
  for (int j = 0; j < RP; ++j) {
    row_rank1(d[j], kv, __shfl_sync(0xffffffffu, u_own, half * 16 + j * GROUP));
    Row::store(rows + (row_base + 2 * j) * kDim, hl, d[j]);
  }
}

// The gated RMSNorm sum of a head whose o rows are all in `o` (visible to the calling warp): lane l
// sums quad l, the butterfly the 32 quads (kda/token_math.cuh). Whole warps only.
__device__ __forceinline__ float head_rstd(const float* o, int lane) {
  const float* q = o + 4 * lane;
  return rms_rstd(warp_allsum(rms_quad(q[0], q[1], q[2], q[3])));
}

// L2 warming of one CTA's reads (common/pdl.cuh), by warp 0 from the slot in lane 0: the CTA's state
// rows and conv windows (lanes 0-3), with `activations` its q|k|v|g, f_a and beta lines too.
// Two uses, both aimed at the fixed cost of a launch rather than its steady rate:
// - the first wave (CTA < p.warm) warms its own reads before griddepcontrol.wait: under PDL it
//   runs while the previous kernel's last CTAs finish, so its state comes from DRAM in that
//   tail instead of after it;
// - every CTA warms the CTA p.ahead (one wave) after it once its own loads are in flight, so
//   CTAs of later waves start on L2 hits while DRAM streams the wave after theirs (the load
//   phases of co-resident CTAs line up and leave DRAM idle otherwise).
// The pre-wait read of the slot races with the previous kernel (hint_load); after the wait it is
// final. An early bench version read the hint in every CTA before its own loads: one more
// dependent load per CTA, +2.4 us at H12 B128 FP32.
template <class C, int S>
__device__ __forceinline__ void warm_cta(const Params& p, int lane, int slot_lane0, int rank, int h, int b,
                                         bool activations) {
  using Elem = typename StateRow<C::kBf16State>::Elem;
  constexpr int H = C::kHeads;
  constexpr int D = H * kDim;
  constexpr int R = kDim / S;
  const int v0 = rank * R;
  const int slot = __shfl_sync(0xffffffffu, slot_lane0, 0);
  if (slot >= 0 && slot < p.num_slots) {
    const long long head = static_cast<long long>(slot) * H + h;
    const __nv_bfloat16* conv = p.conv + (static_cast<long long>(slot) * (3 * D) + h * kDim) * 3;
    if (lane == 0)
      l2_prefetch_bulk(static_cast<const Elem*>(p.ssm) + (head * kDim + v0) * kDim, R * kDim * sizeof(Elem));
    // conv rows are 6-byte records: bulk only from a 16-byte aligned pool (offsets here are).
    const bool bulk_conv = (reinterpret_cast<unsigned long long>(p.conv) & 15) == 0;
    if (bulk_conv && lane >= 1 && lane <= 3) {
      const int sec = lane - 1;
      l2_prefetch_bulk(conv + (sec * D + (sec == 2 ? v0 : 0)) * 3, (sec == 2 ? R : kDim) * 3 * 2);
    }
  }
  if (activations) {
    const __nv_bfloat16* xrow = p.qkvg + b * p.qkvg_stride + h * kDim;
    if (lane >= 4 && lane < 12) l2_prefetch_line(xrow + ((lane - 4) >> 1) * D + ((lane - 4) & 1) * 64);
    if (lane >= 12 && lane < 14) l2_prefetch_line(p.fa + b * p.fa_stride + (lane - 12) * 64);
    if (lane == 14) l2_prefetch_line(p.beta + b * p.beta_stride + h);
  }
}

template <class C, int S>
__device__ __forceinline__ void step(const Params& p, Smem& sm) {
  using Row = StateRow<C::kBf16State>;
  using Elem = typename Row::Elem;
  constexpr int H = C::kHeads;
  constexpr int D = H * kDim;
  constexpr int R = kDim / S;           // rows (and gate channels) of this CTA
  constexpr int RP = R / (2 * kWarps);  // row pairs per warp: one row per half-warp
  static_assert(RP >= 1 && RP * 2 * kWarps == R, "128 rows over 8 warps x 2 halves");

  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, half = lane >> 4, hl = lane & 15;
  const int rank = S == 1 ? 0 : static_cast<int>(blockIdx.x);  // cluster dims (S,1,1) == grid.x
  const int h = blockIdx.y, b = blockIdx.z;
  const int v0 = rank * R;

  // ---- prologue on weights only: with PDL (KdaDecode launches this schedule with it) this runs
  // while the previous kernel finishes; everything another kernel may write is read after the wait.
  griddep_launch_dependents();
  if (tid == 0) {
    mbar_init(&sm.bar[kBarFb], 1);
    if constexpr (S > 1) {
      mbar_init(&sm.bar[kBarEg], 1);
      mbar_init(&sm.bar[kBarSsq], 1);
      fence_mbar_init();
    }
    fence_proxy_async_smem();
    mbar_arrive_expect_tx(&sm.bar[kBarFb], R * (kDim * 2 + 4));
    bulk_g2s(sm.fb, p.fb_w + static_cast<long long>(h * kDim + v0) * kRowVecs, R * kDim * 2, &sm.bar[kBarFb]);
    bulk_g2s(sm.dtb, p.dt_bias + h * kDim + v0, R * 4, &sm.bar[kBarFb]);
    if constexpr (S > 1) {
      mbar_arrive_expect_tx(&sm.bar[kBarEg], kDim * 4);  // exp(g) of all 128 channels
      mbar_arrive_expect_tx(&sm.bar[kBarSsq], 32 * 4);   // the o^2 sums of all 32 row quads
    }
  }
  // No thread may poll an mbarrier before tid 0 has initialised it: the shared memory may still
  // hold a previous CTA's barrier in a completed phase, whose try_wait would pass at once and let
  // this CTA read (and exit) before its bulk copies land.
  __syncthreads();
  if constexpr (S > 1) cluster_arrive_relaxed();  // paired with the wait before the first push

  const int sec = tid >> 7, ch = tid & (kDim - 1);  // thread -> q (sec 0) or k (sec 1) channel
  const int cq = sec * D + h * kDim + ch;           // its conv channel
  const uint2 cw_qk = __ldg(reinterpret_cast<const uint2*>(p.conv_w) + cq);
  const bool has_row = tid < R;                     // thread -> v channel / output row v0 + tid
  const int cv = 2 * D + h * kDim + v0 + (has_row ? tid : 0);
  uint2 cw_v = make_uint2(0u, 0u);
  float nw = 0.0f;
  if (has_row) {
    cw_v = __ldg(reinterpret_cast<const uint2*>(p.conv_w) + cv);
    nw = __ldg(p.norm_w + v0 + tid);
  }
  const float a_gate = expf(__ldg(p.a_log + h));
  const int cta = rank + S * (h + H * b);  // launch order
  if (warp == 0 && cta < p.warm) warm_cta<C, S>(p, lane, lane == 0 ? hint_load(p.slots + b) : 0, rank, h, b, true);

  griddep_wait();
  const int slot = __ldg(p.slots + b);
  const __nv_bfloat16* xrow = p.qkvg + b * p.qkvg_stride;
  const __nv_bfloat16 x_qk = xrow[cq];
  __nv_bfloat16 x_v = __float2bfloat16(0.0f), x_go = __float2bfloat16(0.0f);
  if (has_row) {
    x_v = xrow[cv];
    x_go = xrow[cv + D];
  }
  float fa[8];
  const __nv_bfloat16* farow = p.fa + b * p.fa_stride + 8 * hl;  // rows may be 2-byte aligned only
#pragma unroll
  for (int e = 0; e < 8; ++e) fa[e] = __bfloat162float(farow[e]);
  const float beta_logit = __bfloat162float(p.beta[b * p.beta_stride + h]);

  if (slot < 0 || slot >= p.num_slots) {  // padded row (-1) or a bad slot: zeros out, no state touched
    if (slot != -1 && threadIdx.x == 0) fault::report(p.err, fault::kSlot);
    if (has_row) p.out[(static_cast<long long>(b) * H + h) * kDim + v0 + tid] = __float2bfloat16(0.0f);
    mbar_wait(&sm.bar[kBarFb], 0);  // no bulk copy may still target this CTA when it exits
    if constexpr (S > 1) cluster_wait();
    return;  // uniform over the cluster: all its CTAs read the same slot
  }

  // ---- the state rows of this CTA: all in flight before any math ------------------------------
  Elem* head = static_cast<Elem*>(p.ssm) + (static_cast<long long>(slot) * H + h) * (kDim * kDim);
  const int row_base = warp * (R / kWarps) + half;  // local row of pair j: row_base + 2 j
  typename Row::Frag frag[RP];
#pragma unroll
  for (int j = 0; j < RP; ++j) frag[j] = Row::load(head + (v0 + row_base + 2 * j) * kDim, hl);

  // ---- conv windows; conv + SiLU of q, k (all channels) and v (own rows) ----------------------
  __nv_bfloat16* conv = p.conv + static_cast<long long>(slot) * (3 * D) * 3;
  const unsigned short* wq = reinterpret_cast<const unsigned short*>(conv) + cq * 3;
  const unsigned short w0 = wq[0], w1 = wq[1], w2 = wq[2];
  unsigned short u0 = 0, u1 = 0, u2 = 0;
  if (has_row) {
    const unsigned short* wv = reinterpret_cast<const unsigned short*>(conv) + cv * 3;
    u0 = wv[0], u1 = wv[1], u2 = wv[2];
  }
  if (warp == 0 && p.ahead > 0 && cta + p.ahead < S * H * static_cast<int>(gridDim.z)) {
    const int nx = cta + p.ahead, nh = (nx / S) % H, nb = nx / (S * H);
    warm_cta<C, S>(p, lane, lane == 0 ? __ldg(p.slots + nb) : 0, nx % S, nh, nb, false);
  }
  {
    float w[4];
    conv_weights(cw_qk, w);
    (sec == 0 ? sm.q : sm.k)[ch] = conv_silu(w, bf16_bits_to_float(w0), bf16_bits_to_float(w1),
                                             bf16_bits_to_float(w2), __bfloat162float(x_qk));
  }
  if (has_row) {
    float w[4];
    conv_weights(cw_v, w);
    sm.v[tid] = conv_silu(w, bf16_bits_to_float(u0), bf16_bits_to_float(u1), bf16_bits_to_float(u2),
                          __bfloat162float(x_v));
  }

  // ---- forget gate of this CTA's channels: half-warp hw takes channels hw + 16 j (j < RP) -----
  const int hw = tid >> 4;
  float zp[RP];
  mbar_wait(&sm.bar[kBarFb], 0);
#pragma unroll
  for (int j = 0; j < RP; ++j) {
    float wf[8];
    unpack_bf16x8(sm.fb[(hw + 16 * j) * kRowVecs + hl], wf);
    zp[j] = 0.0f;
#pragma unroll
    for (int e = 0; e < 8; ++e) zp[j] = fmaf(wf[e], fa[e], zp[j]);
  }
  half_reduce_scatter<RP>(zp, hl);  // lane hl now holds channel gi; 16/RP = 2S lanes per channel
  const int gi = hw + 16 * half_rs_index<RP>(hl);
  const float eg = decay<C::kGate>(zp[0] + sm.dtb[gi], a_gate);
  const int gsub = hl & (2 * S - 1);  // index of this lane among those holding channel gi
  if constexpr (S == 1) {
    if (gsub == 0) sm.eg[gi] = eg;
    __syncthreads();
  } else {
    // Every thread of this CTA has consumed its conv-window loads before any peer hears from it,
    // so a CTA that has heard from all peers may overwrite the windows it owns.
    __syncthreads();
    cluster_wait();  // peers' mbarriers are initialised
    if (gsub < S) st_async(cluster_map(&sm.eg[v0 + gi], gsub), eg, cluster_map(&sm.bar[kBarEg], gsub));
    mbar_wait(&sm.bar[kBarEg], 0);
  }

  // ---- conv windows shift by one, each channel by the CTA owning it ---------------------------
  if (ch >= v0 && ch < v0 + R) {
    unsigned short* wd = reinterpret_cast<unsigned short*>(conv) + cq * 3;
    wd[0] = w1;
    wd[1] = w2;
    wd[2] = __bfloat16_as_ushort(x_qk);
  }
  if (has_row) {
    unsigned short* wd = reinterpret_cast<unsigned short*>(conv) + cv * 3;
    wd[0] = u1;
    wd[1] = u2;
    wd[2] = __bfloat16_as_ushort(x_v);
  }

  const float beta = sigmoidf_(beta_logit);
  if (has_row) sm.gs[tid] = sigmoidf_(__bfloat162float(x_go));  // output gate, read back by this thread
  head_update<Row, RP>(frag, sm.q, sm.k, sm.eg, sm.v, sm.o, beta, head + v0 * kDim, row_base, half, hl);

  // ---- gated RMSNorm over the 128 outputs of the head -----------------------------------------
  // kda/token_math.cuh's sum whatever the split (and so kda_verify's): the sum of squares of each
  // quad of 4 rows, then the 32 quads by one warp butterfly. With S > 1 each CTA pushes its R / 4
  // quads to every CTA of the cluster (itself included). A CTA leaves only after every push to it
  // arrived, and it reads no peer memory: no trailing cluster barrier is needed.
  __syncthreads();  // o of this CTA's rows visible
  if constexpr (S > 1) {
    constexpr int Q = R / 4;
    if (tid < Q) {
      const float* oq = sm.o + 4 * tid;
      const float part = rms_quad(oq[0], oq[1], oq[2], oq[3]);
#pragma unroll
      for (int r = 0; r < S; ++r)
        st_async(cluster_map(&sm.xs[rank * Q + tid], r), part, cluster_map(&sm.bar[kBarSsq], r));
    }
    mbar_wait(&sm.bar[kBarSsq], 0);
  }
  if (warp * 32 < R) {  // warp-uniform: the butterfly needs whole warps
    float rstd;
    if constexpr (S == 1)
      rstd = head_rstd(sm.o, lane);
    else
      rstd = rms_rstd(warp_allsum(sm.xs[lane]));
    if (has_row)
      p.out[(static_cast<long long>(b) * H + h) * kDim + v0 + tid] = __float2bfloat16(gated_y(sm.o[tid], rstd, nw,
                                                                                               sm.gs[tid]));
  }
}

template <class C>
__device__ __forceinline__ void decode_step(const Params& p) {
  __shared__ Smem sm;
  // p.split is uniform over the grid (the launcher makes it the cluster size).
  if (p.split == 1) {
    step<C, 1>(p, sm);
  } else if constexpr (C::kMaxSplit >= 2) {
    if (p.split == 2) {
      step<C, 2>(p, sm);
    } else if constexpr (C::kMaxSplit >= 4) {
      if (p.split == 4) {
        step<C, 4>(p, sm);
      } else if constexpr (C::kMaxSplit >= 8) {
        if (p.split == 8) step<C, 8>(p, sm);
      }
    }
  }
}

}  // namespace kda
}  // namespace k3gen
