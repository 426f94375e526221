// kda_prefill `chunk64`: the chunked WY form of SPEC.md section 2 with 64-token chunks, BF16 tensor-core
// operands and FP32 sums, an FP32 state and an FP32 triangular solve. Contract: the docstring of
// k3gen/ops/kda_prefill/spec.py; FP32 twin: reference.py (token loop; chunk64_emulation is this file's
// algebra with its rounding points). Three launches over a workspace sized from (N, B, H):
//
// 1. prep (grid H x J, J = N / 64 + B; item j of sequence b covers tokens 64 c .. 64 c + 63 with
//    c = j - base(b), base(b) = cu[b] / 64 + b): conv + SiLU, L2 norms, the f_b gate GEMM, the
//    cumulative log decay G (from the chunk start), beta, then
//      A[r,s]   = beta_r sum_i k_r[i] k_s[i] e^(G_r[i]-G_s[i])  (s < r)
//      Aqk[r,s] =        sum_i q_r[i] k_s[i] e^(G_r[i]-G_s[i])  (s <= r)
//    Off the four 16 x 16 diagonal blocks, with block i's reference ref_i = G at the last token of
//    block i-1 (G is non-increasing), the factors split into x_r e^(G_r - ref_i) and k_s e^(ref_i - G_s),
//    both exp of a difference <= 0: finite for any gate, stored as BF16 tiles and contracted on tensor
//    cores. On the diagonal blocks the bounded gate splits the same way (ref_0 = 0; e^(ref_i - G_s) <=
//    e^80 over 16 tokens of g >= -5); the softplus gate forms every factor per element (FP32). Then the
//    forward substitution (I + A) [W | U] = diag(beta) [e^G K | V] in FP32, one column a thread, and
//    the chunk's record (Rec): -W, e^G Q, (K e^(G_C - G))^T, Aqk as BF16, U^T and e^(G_C) as FP32,
//    stored through a layout policy (RecPad; chunk64_tc's prep stores the same values as c64tc::RecTc).
// 2. state (grid H x B x 8 / W, W warps): warp w owns 16 rows of S^T (the rows are independent), all
//    128 k, in mma m16n8 accumulators; a pair of accumulator tiles is already an m16n8k16 A fragment,
//    so per chunk, on the warp's own registers:
//      V_new^T = U^T + S^T (-W)^T ;  O^T = S^T (e^G Q)^T + V_new^T Aqk^T ;
//      S^T <- S^T e^(G_C) + V_new^T (K e^(G_C - G))
//    with the next records bulk-copied (double buffer) while this one computes. Raw O to workspace.
// 3. emit (grid H x J): gated RMSNorm of the item's raw O rows to BF16 `out` (zeros for padding).
#pragma once

#include <cuda_bf16.h>

#include "k3gen/kda/prefill_chunk64_defs.cuh"

namespace k3gen {
namespace kda {
namespace c64 {

// ---- 1. prep -----------------------------------------------------------------------------------
template <class C, class L = RecPad>
__device__ __forceinline__ void prep(const Params& p, PrepSmem& sm) {
  constexpr int H = C::kHeads, D = H * kDim;
  const Item it = item_of(p);
  const int slot = __ldg(p.slots + it.b);
  if (it.t0 >= it.len || slot < 0 || slot >= p.num_slots) return;  // uniform, before any barrier
  const int h = it.h, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gq = lane >> 2, tq = lane & 3;
  const int n = it.len - it.t0 < kC ? it.len - it.t0 : kC;
  const long long tok = it.tok0 + it.t0;
  if (tid == 0) {
    mbar_init(&sm.bar, 1);
    fence_proxy_async_smem();
    mbar_arrive_expect_tx(&sm.bar, kDim * (kDim * 2 + 4));
    bulk_g2s(sm.u1.fb, p.fb_w + static_cast<long long>(h) * kDim * kRowVecs, kDim * kDim * 2, &sm.bar);
    bulk_g2s(sm.dtb, p.dt_bias + h * kDim, kDim * 4, &sm.bar);
  }
  __syncthreads();  // no thread may poll the barrier before thread 0 has initialised it (stale shared memory)
  // f_a rows and beta loaded first, stored after the conv (their loads in flight with the conv's):
  // thread tid takes 32 channels of token tid / 4 (any row stride, 2-byte aligned).
  const int fat = tid >> 2, fac0 = 32 * (tid & 3);
  unsigned fapk[16];
  {
    const unsigned short* farow = reinterpret_cast<const unsigned short*>(p.fa) + (tok + fat) * p.fa_stride + fac0;
#pragma unroll
    for (int e = 0; e < 16; ++e)
      fapk[e] = fat < n ? static_cast<unsigned>(farow[2 * e]) | static_cast<unsigned>(farow[2 * e + 1]) << 16 : 0u;
  }
  const float beta_raw = tid < n ? __bfloat162float(p.beta[(tok + tid) * p.beta_stride + h]) : 0.0f;
  // Conv + SiLU: thread tid takes channel ch of q, k and v for tokens 32 half .. 32 half + 31 (every
  // thread the same work). Its window: for half 0 the slot's (first item) or the three raw inputs
  // before t0; for half 1 the chunk's tokens 29 .. 31 (the outputs past n are zero anyway).
  const int half = tid >> 7, ch = tid & (kDim - 1);
  int cc[3];
#pragma unroll
  for (int j = 0; j < 3; ++j) cc[j] = j * D + h * kDim + ch;
  float win[3][3];
  if (half == 0 && it.t0 == 0) {
    const bool resume = __ldg(p.resume + it.b) != 0;
    const unsigned short* wb = reinterpret_cast<const unsigned short*>(p.conv) + static_cast<long long>(slot) * (3 * D) * 3;
#pragma unroll
    for (int j = 0; j < 3; ++j)
#pragma unroll
      for (int i = 0; i < 3; ++i) win[j][i] = resume ? bf16_bits_to_float(wb[cc[j] * 3 + i]) : 0.0f;
  } else {
    const int tw = 32 * half - 3;  // token offset of the window's oldest input (>= -3)
#pragma unroll
    for (int i = 0; i < 3; ++i) {
      const __nv_bfloat16* xrow = p.qkvg + (tok + tw + i) * p.qkvg_stride;
      const bool in = tw + i < n;
#pragma unroll
      for (int j = 0; j < 3; ++j) win[j][i] = in ? __bfloat162float(xrow[cc[j]]) : 0.0f;
    }
  }
  {
    float taps[3][4];
#pragma unroll
    for (int j = 0; j < 3; ++j) multi::taps_of(p.conv_w, cc[j], taps[j]);
    float* tile[3] = {&sm.q[0][0], &sm.k[0][0], &sm.v[0][0]};
#pragma unroll
    for (int sb = 0; sb < 2; ++sb) {
      const int t0 = 32 * half + 16 * sb;
      float x[3][19];  // the window, then 16 inputs: every load issued before the first use
#pragma unroll
      for (int j = 0; j < 3; ++j)
#pragma unroll
        for (int i = 0; i < 3; ++i) x[j][i] = win[j][i];
#pragma unroll
      for (int t = 0; t < 16; ++t) {
        const __nv_bfloat16* xrow = p.qkvg + (tok + t0 + t) * p.qkvg_stride;
#pragma unroll
        for (int j = 0; j < 3; ++j) x[j][3 + t] = t0 + t < n ? __bfloat162float(xrow[cc[j]]) : 0.0f;
      }
#pragma unroll
      for (int t = 0; t < 16; ++t)
#pragma unroll
        for (int j = 0; j < 3; ++j) {
          float acc = taps[j][0] * x[j][t];
          acc = fmaf(taps[j][1], x[j][t + 1], acc);
          acc = fmaf(taps[j][2], x[j][t + 2], acc);
          acc = fmaf(taps[j][3], x[j][t + 3], acc);
          // SiLU with the fast reciprocal: 0 (the limit) once 1 + e^-acc passes 2^126
          const float y = __fdividef(acc, 1.0f + __expf(-acc));
          tile[j][(t0 + t) * kDim + ch] = t0 + t < n ? y : 0.0f;
        }
#pragma unroll
      for (int j = 0; j < 3; ++j)
#pragma unroll
        for (int i = 0; i < 3; ++i) win[j][i] = x[j][16 + i];
    }
  }
#pragma unroll
  for (int q4 = 0; q4 < 4; ++q4)
    *reinterpret_cast<uint4*>(&sm.u2.fa[fat][fac0 + 8 * q4]) =
        make_uint4(fapk[4 * q4], fapk[4 * q4 + 1], fapk[4 * q4 + 2], fapk[4 * q4 + 3]);
  if (tid < kC) sm.beta[tid] = tid < n ? sigmoidf_(beta_raw) : 0.0f;
  mbar_wait(&sm.bar, 0);
  __syncthreads();
  {  // gate pre-activations z[t][c] = f_a[t] . f_b[c]: warp w tokens 16 (w & 3) .., channels 64 (w >> 2) ..
    const int mt = warp & 3, c0 = 64 * (warp >> 2), r0 = 16 * mt + gq;
    const unsigned* fa32 = reinterpret_cast<const unsigned*>(&sm.u2.fa[0][0]);
    const unsigned* fb32 = reinterpret_cast<const unsigned*>(sm.u1.fb);
    constexpr int kFaW = kBLd / 2, kFbW = kDim / 2;
    float z[8][4];
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) z[nt][e] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < kDim / 16; ++kk) {
      const int w0 = 8 * kk + tq;
      const unsigned a[4] = {fa32[r0 * kFaW + w0], fa32[(r0 + 8) * kFaW + w0], fa32[r0 * kFaW + w0 + 4],
                             fa32[(r0 + 8) * kFaW + w0 + 4]};
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
        const int c = c0 + 8 * nt + gq;
        mma_bf16(z[nt], a, fb32[c * kFbW + w0], fb32[c * kFbW + w0 + 4]);
      }
    }
    const float a_gate = expf(__ldg(p.a_log + h));
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int t = r0 + 8 * (e >> 1), c = c0 + 8 * nt + 2 * tq + (e & 1);
        sm.g[t][c] = t < n ? log_decay<C::kGate>(z[nt][e] + sm.dtb[c], a_gate) : 0.0f;
      }
  }
  __syncthreads();
  // The cumulative decay G, thread (channel c, half): half 0 writes rows 0 .. 31, half 1 rows 32 .. 63
  // from the same sequential sum (bitwise the one-thread loop), the loads before a barrier so no
  // row is overwritten before it is read. Then the L2 norms (warp w: rows 16 w .. of [q | k]).
  {
    const int c = tid & (kDim - 1), hf = tid >> 7;
    float gr[kC];
#pragma unroll
    for (int t = 0; t < kC; ++t)
      if (t < 32 * (hf + 1)) gr[t] = sm.g[t][c];
    __syncthreads();
    float acc = 0.0f;
#pragma unroll
    for (int t = 0; t < kC; ++t)
      if (t < 32 * (hf + 1)) {
        acc += gr[t];
        if (t >= 32 * hf) sm.g[t][c] = acc;
      }
  }
#pragma unroll 4
  for (int i = 0; i < 16; ++i) {
    const int row = 16 * warp + i;
    float* r = row < kC ? sm.q[row] : sm.k[row - kC];
    float x[4], ss = 0.0f;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      x[e] = r[lane + 32 * e];
      ss = fmaf(x[e], x[e], ss);
    }
#pragma unroll
    for (int m = 16; m >= 1; m >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, m);
    const float sc = rsqrtf(ss + kL2Eps) * (row < kC ? 0.08838834764831845f : 1.0f);  // q: 128^-0.5
#pragma unroll
    for (int e = 0; e < 4; ++e) r[lane + 32 * e] = x[e] * sc;
  }
  __syncthreads();
  // Off-diagonal factor tiles (BF16): thread (column c, row parity r0) reads each of its rows once
  // and writes the row's left factor (its own block's reference) and right factors (the later blocks'
  // references); j unrolled, so every row's block is a constant.
  const int fc = tid & (kDim - 1), r0 = tid >> 7;
  float ref[4];  // ref[b]: G at the last token of block b - 1 (ref[0] = 0: the chunk start)
  ref[0] = 0.0f;
#pragma unroll
  for (int b = 1; b < 4; ++b) ref[b] = sm.g[kBlk * b - 1][fc];
#pragma unroll
  for (int j = 0; j < kC / 2; ++j) {
    const int b = j >> 3, rl = 2 * (j & 7) + r0, s = kBlk * b + rl;
    const float gs = sm.g[s][fc], ks = sm.k[s][fc];
    if (b >= 1) {
      const float f = bexp(gs - ref[b]);
      sm.u1.f.left[32 * (b - 1) + rl][fc] = bf(sm.q[s][fc] * f);
      sm.u1.f.left[32 * (b - 1) + 16 + rl][fc] = bf(ks * f);
    }
#pragma unroll
    for (int i = b + 1; i < 4; ++i) sm.u1.f.right[8 * i * (i - 1) + s][fc] = bf(ks * bexp(ref[i] - gs));
  }
  // Diagonal blocks, softplus gate (unbounded decay: every factor per element; the bounded gate's
  // are on tensor cores below): warp w takes rows h and 15 - h of a block for its 4 row pairs
  // (17 (r, s) pairs each, so the warps balance), loading q_r, k_r and G_r once per row.
#pragma unroll 1
  for (int rp = warp; rp < (C::kGate == Gate::kBounded ? 0 : (kC / kBlk) * (kBlk / 2)); rp += kThreads / 32) {
    const int blk = rp / (kBlk / 2), hr = rp % (kBlk / 2);
#pragma unroll 1
    for (int side = 0; side < 2; ++side) {
      const int r = kBlk * blk + (side ? kBlk - 1 - hr : hr);
      float qr[4], kr[4], gr[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        qr[e] = sm.q[r][lane + 32 * e];
        kr[e] = sm.k[r][lane + 32 * e];
        gr[e] = sm.g[r][lane + 32 * e];
      }
#pragma unroll 1
      for (int s = kBlk * blk; s <= r; ++s) {
        float pa = 0.0f, aa = 0.0f;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int i = lane + 32 * e;
          const float ks = sm.k[s][i] * expf(gr[e] - sm.g[s][i]);
          pa = fmaf(qr[e], ks, pa);
          aa = fmaf(kr[e], ks, aa);
        }
#pragma unroll
        for (int m = 16; m >= 1; m >>= 1) {
          pa += __shfl_xor_sync(0xffffffffu, pa, m);
          aa += __shfl_xor_sync(0xffffffffu, aa, m);
        }
        if (lane == 0) {
          sm.u2.a.P[r][s] = pa;
          sm.u2.a.A[r][s] = s < r ? sm.beta[r] * aa : 0.0f;
        }
      }
    }
  }
  __syncthreads();
  // Off-diagonal blocks on tensor cores: 24 units (block row i, q or k rows, an 8-column s tile).
#pragma unroll 1
  for (int u = warp; u < 24; u += kThreads / 32) {
    const int i = u < 4 ? 1 : (u < 12 ? 2 : 3);
    const int rem = u - (i == 1 ? 0 : (i == 2 ? 4 : 12));
    const int qk = rem & 1, nt = rem >> 1;
    const unsigned* L = reinterpret_cast<const unsigned*>(&sm.u1.f.left[32 * (i - 1) + 16 * qk][0]);
    const unsigned* R = reinterpret_cast<const unsigned*>(&sm.u1.f.right[8 * i * (i - 1) + 8 * nt][0]);
    constexpr int kW = kBLd / 2;
    float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int kk = 0; kk < kDim / 16; ++kk) {
      const int w0 = 8 * kk + tq;
      const unsigned a[4] = {L[gq * kW + w0], L[(gq + 8) * kW + w0], L[gq * kW + w0 + 4], L[(gq + 8) * kW + w0 + 4]};
      mma_bf16(d, a, R[gq * kW + w0], R[gq * kW + w0 + 4]);
    }
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int r = kBlk * i + gq + 8 * (e >> 1), s = 8 * nt + 2 * tq + (e & 1);
      if (qk == 0)
        sm.u2.a.P[r][s] = d[e];
      else
        sm.u2.a.A[r][s] = sm.beta[r] * d[e];
    }
  }
  __syncthreads();
  if constexpr (C::kGate == Gate::kBounded) {
    // g >= -5: G falls by at most 80 over a block, so k_s e^(ref_i - G_s) <= e^80 is finite in FP32
    // and BF16 and the diagonal blocks split like the others (the off-diagonal tiles are done with);
    // the products above the diagonal are finite too and masked.
#pragma unroll
    for (int j = 0; j < kC / 2; ++j) {
      const int b = j >> 3, rl = 2 * (j & 7) + r0, s = kBlk * b + rl;
      const float gs = sm.g[s][fc], ks = sm.k[s][fc];
      const float f = bexp(gs - ref[b]);
      sm.u1.d[32 * b + rl][fc] = bf(sm.q[s][fc] * f);
      sm.u1.d[32 * b + 16 + rl][fc] = bf(ks * f);
      sm.u1.d[2 * kC + s][fc] = bf(ks * bexp(ref[b] - gs));
    }
    __syncthreads();
    // 16 units: block i, q or k rows, an 8-column s tile.
#pragma unroll 1
    for (int u = warp; u < 16; u += kThreads / 32) {
      const int i = u >> 2, qk = (u >> 1) & 1, nt = u & 1;
      const unsigned* L = reinterpret_cast<const unsigned*>(&sm.u1.d[32 * i + 16 * qk][0]);
      const unsigned* R = reinterpret_cast<const unsigned*>(&sm.u1.d[2 * kC + kBlk * i + 8 * nt][0]);
      constexpr int kW = kBLd / 2;
      float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
      for (int kk = 0; kk < kDim / 16; ++kk) {
        const int w0 = 8 * kk + tq;
        const unsigned a[4] = {L[gq * kW + w0], L[(gq + 8) * kW + w0], L[gq * kW + w0 + 4], L[(gq + 8) * kW + w0 + 4]};
        mma_bf16(d, a, R[gq * kW + w0], R[gq * kW + w0 + 4]);
      }
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = kBlk * i + gq + 8 * (e >> 1), s = kBlk * i + 8 * nt + 2 * tq + (e & 1);
        if (qk == 0) {
          if (s <= r) sm.u2.a.P[r][s] = d[e];
        } else if (s < r) {
          sm.u2.a.A[r][s] = sm.beta[r] * d[e];
        }
      }
    }
    __syncthreads();
  }
  // Forward substitution, one column a thread (threads < 128: W from e^G k; the others: U from v),
  // then the record. Rows past n are zero throughout (zero k, v, beta, decay).
  const typename L::Ptr rec = L::at(p, static_cast<long long>(blockIdx.y) * H + h);
  {
    const int c = tid & (kDim - 1);
    const bool wcol = tid < kDim;
    // The parts that need no solve first (fewer values live next to x), split so both halves of
    // the CTA do about the same work: W threads e^(G_C) and (K e^(G_C - G))^T, U threads e^G Q.
    if (wcol) {
      const float gl = sm.g[kC - 1][c];
      L::egl(rec, c, expf(gl));
#pragma unroll 1
      for (int r8 = 0; r8 < kC / 8; ++r8) {
        unsigned wd[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int t = 8 * r8 + 2 * e;
          wd[e] = pack_bf16x2(sm.k[t][c] * bexp(gl - sm.g[t][c]), sm.k[t + 1][c] * bexp(gl - sm.g[t + 1][c]));
        }
        L::kgt8(rec, c, r8, make_uint4(wd[0], wd[1], wd[2], wd[3]));
      }
    } else {
#pragma unroll 4
      for (int r = 0; r < kC; ++r) L::qg(rec, r, c, bf(sm.q[r][c] * bexp(sm.g[r][c])));
    }
    // Four partial sums per row: a quarter of the dependent FMA chain.
    float x[kC];
#pragma unroll
    for (int r = 0; r < kC; ++r) {
      const float y = wcol ? sm.k[r][c] * bexp(sm.g[r][c]) : sm.v[r][c];
      float acc[4] = {sm.beta[r] * y, 0.0f, 0.0f, 0.0f};
      const float* Ar = sm.u2.a.A[r];
#pragma unroll
      for (int s = 0; s < r; ++s) acc[s & 3] = fmaf(-Ar[s], x[s], acc[s & 3]);
      x[r] = (acc[0] + acc[1]) + (acc[2] + acc[3]);
    }
    if (wcol) {
#pragma unroll
      for (int r = 0; r < kC; ++r) L::w(rec, r, c, bf(-x[r]));
    } else {
#pragma unroll
      for (int r4 = 0; r4 < kC / 4; ++r4)
        L::ut4(rec, c, r4, make_float4(x[4 * r4], x[4 * r4 + 1], x[4 * r4 + 2], x[4 * r4 + 3]));
    }
  }
#pragma unroll 1
  for (int e = tid; e < kC * kC / 2; e += kThreads) {
    const int t = e >> 5, s = 2 * (e & 31);
    const float a0 = s <= t ? sm.u2.a.P[t][s] : 0.0f, a1 = s + 1 <= t ? sm.u2.a.P[t][s + 1] : 0.0f;
    L::aqk2(rec, t, s, pack_bf16x2(a0, a1));
  }
}

// ---- 2. state ----------------------------------------------------------------------------------
template <bool kBf16>
__device__ __forceinline__ void load_state(const void* head, float (&st)[16][4], int rb) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, v = 16 * rb + g;
#pragma unroll
  for (int kt = 0; kt < 16; ++kt) {
    const int k = 8 * kt + 2 * t;
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const long long off = static_cast<long long>(v + 8 * hr) * kDim + k;
      if constexpr (kBf16) {
        const unsigned u = *reinterpret_cast<const unsigned*>(static_cast<const __nv_bfloat16*>(head) + off);
        st[kt][2 * hr] = __uint_as_float(u << 16);
        st[kt][2 * hr + 1] = __uint_as_float(u & 0xffff0000u);
      } else {
        const float2 f = *reinterpret_cast<const float2*>(static_cast<const float*>(head) + off);
        st[kt][2 * hr] = f.x;
        st[kt][2 * hr + 1] = f.y;
      }
    }
  }
}

template <bool kBf16>
__device__ __forceinline__ void store_state(void* head, const float (&st)[16][4], int rb) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, v = 16 * rb + g;
#pragma unroll
  for (int kt = 0; kt < 16; ++kt) {
    const int k = 8 * kt + 2 * t;
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const long long off = static_cast<long long>(v + 8 * hr) * kDim + k;
      if constexpr (kBf16)
        *reinterpret_cast<unsigned*>(static_cast<__nv_bfloat16*>(head) + off) =
            pack_bf16x2(st[kt][2 * hr], st[kt][2 * hr + 1]);
      else
        *reinterpret_cast<float2*>(static_cast<float*>(head) + off) = make_float2(st[kt][2 * hr], st[kt][2 * hr + 1]);
    }
  }
}

// One chunk on this warp's 16 rows of S^T (row block rb; wl = its block within the CTA's ut rows):
// writes raw O of the first n tokens to o (row stride ldo). No barrier.
template <int W>
__device__ __forceinline__ void chunk_step(float (&st)[16][4], const StateBuf<W>& t, float* o, long long ldo, int n,
                                           int rb, int wl) {
  const int lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
  const unsigned* W32 = reinterpret_cast<const unsigned*>(&t.w[0][0]);
  const unsigned* Q32 = reinterpret_cast<const unsigned*>(&t.qg[0][0]);
  const unsigned* K32 = reinterpret_cast<const unsigned*>(&t.kgt[0][0]);
  const unsigned* A32 = reinterpret_cast<const unsigned*>(&t.aqk[0][0]);
  constexpr int kBW = kBLd / 2, kTW = kTLd / 2;
  float vn[8][4], oi[8][4];
#pragma unroll
  for (int nt = 0; nt < 8; ++nt) {
    const float2 u0 = *reinterpret_cast<const float2*>(&t.ut[16 * wl + g][8 * nt + 2 * tq]);
    const float2 u1 = *reinterpret_cast<const float2*>(&t.ut[16 * wl + g + 8][8 * nt + 2 * tq]);
    vn[nt][0] = u0.x, vn[nt][1] = u0.y, vn[nt][2] = u1.x, vn[nt][3] = u1.y;
#pragma unroll
    for (int e = 0; e < 4; ++e) oi[nt][e] = 0.0f;
  }
  // V_new^T = U^T + S^T (-W)^T and O^T = S^T (e^G Q)^T, contracting k in 8 steps of 16.
#pragma unroll
  for (int kk = 0; kk < 8; ++kk) {
    unsigned a[4];
    afrag(a, st[2 * kk], st[2 * kk + 1]);
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      const int w = (8 * nt + g) * kBW + 8 * kk + tq;
      mma_bf16(vn[nt], a, W32[w], W32[w + 4]);
      mma_bf16(oi[nt], a, Q32[w], Q32[w + 4]);
    }
  }
  unsigned va[4][4];
#pragma unroll
  for (int ks = 0; ks < 4; ++ks) afrag(va[ks], vn[2 * ks], vn[2 * ks + 1]);
  // O^T += V_new^T Aqk^T over s <= t (s blocks of 16 past the 8-token tile are zero).
#pragma unroll
  for (int nt = 0; nt < 8; ++nt)
#pragma unroll
    for (int ks = 0; ks <= nt / 2; ++ks) {
      const int w = (8 * nt + g) * kTW + 8 * ks + tq;
      mma_bf16(oi[nt], va[ks], A32[w], A32[w + 4]);
    }
  // S^T <- S^T e^(G_C) + V_new^T (K e^(G_C - G)).
#pragma unroll
  for (int nt = 0; nt < 16; ++nt) {
    const float2 e = *reinterpret_cast<const float2*>(&t.egl[8 * nt + 2 * tq]);
    st[nt][0] *= e.x;
    st[nt][1] *= e.y;
    st[nt][2] *= e.x;
    st[nt][3] *= e.y;
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
      const int w = (8 * nt + g) * kTW + 8 * ks + tq;
      mma_bf16(st[nt], va[ks], K32[w], K32[w + 4]);
    }
  }
  const int v = 16 * rb + g;
#pragma unroll
  for (int nt = 0; nt < 8; ++nt) {
    const int r = 8 * nt + 2 * tq;
    if (r < n) {
      o[r * ldo + v] = oi[nt][0];
      o[r * ldo + v + 8] = oi[nt][2];
    }
    if (r + 1 < n) {
      o[(r + 1) * ldo + v] = oi[nt][1];
      o[(r + 1) * ldo + v + 8] = oi[nt][3];
    }
  }
}

template <class C, int W>
__device__ __forceinline__ void state(const Params& p, StateSmem<W>& sm) {
  constexpr int H = C::kHeads, D = H * kDim;
  constexpr long long kHead = kDim * kDim;
  constexpr unsigned kUtBytes = 16 * W * kTLd * 4;
  const int h = blockIdx.x, b = blockIdx.y, wl = threadIdx.x >> 5;
  const int rb = W * blockIdx.z + wl;
  const long long tok0 = __ldg(p.cu_seqlens + b);
  const int len = __ldg(p.cu_seqlens + b + 1) - static_cast<int>(tok0);
  const int slot = __ldg(p.slots + b);
  if (slot < 0 || slot >= p.num_slots || len <= 0) return;  // prep and emit handle padding
  const Rec* recs = p.rec + item_base(p.cu_seqlens, b) * H + h;  // chunk c at recs[c * H]
  const int nc = (len + kC - 1) / kC;
  auto issue = [&](int buf, int c) {
    const Rec* r = recs + static_cast<long long>(c) * H;
    mbar_arrive_expect_tx(&sm.bar[buf], kRecHead + kUtBytes);
    bulk_g2s(&sm.b[buf], r, kRecHead, &sm.bar[buf]);
    bulk_g2s(&sm.b[buf].ut[0][0], &r->ut[16 * W * blockIdx.z][0], kUtBytes, &sm.bar[buf]);
  };
  if (threadIdx.x == 0) {
    mbar_init(&sm.bar[0], 1);
    mbar_init(&sm.bar[1], 1);
    fence_proxy_async_smem();
    for (int c = 0; c < 2 && c < nc; ++c) issue(c, c);
  }
  const bool resume = __ldg(p.resume + b) != 0;
  void* head = C::kBf16State
                   ? static_cast<void*>(static_cast<__nv_bfloat16*>(p.ssm) + (static_cast<long long>(slot) * H + h) * kHead)
                   : static_cast<void*>(static_cast<float*>(p.ssm) + (static_cast<long long>(slot) * H + h) * kHead);
  float st[16][4];
  if (resume) {
    load_state<C::kBf16State>(head, st, rb);
  } else {
#pragma unroll
    for (int kt = 0; kt < 16; ++kt)
#pragma unroll
      for (int e = 0; e < 4; ++e) st[kt][e] = 0.0f;
  }
  __syncthreads();  // barriers initialised before anyone polls them
#pragma unroll 1
  for (int c = 0; c < nc; ++c) {
    const int buf = c & 1;
    mbar_wait(&sm.bar[buf], (c >> 1) & 1);
    const int n = len - c * kC < kC ? len - c * kC : kC;
    chunk_step<W>(st, sm.b[buf], p.o + ((tok0 + static_cast<long long>(c) * kC) * H + h) * kDim,
                  static_cast<long long>(H) * kDim, n, rb, wl);
    __syncthreads();  // every warp is done with b[buf]
    if (threadIdx.x == 0 && c + 2 < nc) {
      fence_proxy_async_smem();  // generic reads of b[buf] before the async-proxy refill
      issue(buf, c + 2);
    }
  }
  store_state<C::kBf16State>(head, st, rb);
  if (blockIdx.z != 0) return;
  conv_tail<D, W * 32>(p, slot, tok0, len, resume, h);
}

// ---- 3. emit -----------------------------------------------------------------------------------
template <class C>
__device__ __forceinline__ void emit(const Params& p) {
  constexpr int H = C::kHeads, D = H * kDim;
  const Item it = item_of(p);
  if (it.t0 >= it.len) return;
  const int n = it.len - it.t0 < kC ? it.len - it.t0 : kC;
  const long long tok = it.tok0 + it.t0;
  const int slot = __ldg(p.slots + it.b), h = it.h;
  if (slot < 0 || slot >= p.num_slots) {
    for (int i = threadIdx.x; i < n * kDim; i += kThreads)
      p.out[((tok + i / kDim) * H + h) * kDim + i % kDim] = __float2bfloat16(0.0f);
    return;
  }
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const float* o_rows = p.o + (tok * H + h) * kDim;
  constexpr long long ldo = static_cast<long long>(H) * kDim;
#pragma unroll 1
  for (int t = warp; t < n; t += kThreads / 32) {
    const long long tk = tok + t;
    gated_rmsnorm<H>(
        p, tk, h, lane, [&](int i) { return o_rows[t * ldo + 4 * lane + i]; },
        [&](int i) { return __ldg(p.norm_w + 4 * lane + i); },
        [&](int i) {
          const __nv_bfloat16* go = p.qkvg + tk * p.qkvg_stride + 3 * D + h * kDim + 4 * lane;
          return sigmoidf_(__bfloat162float(go[i]));
        });
  }
}

}  // namespace c64
}  // namespace kda
}  // namespace k3gen
