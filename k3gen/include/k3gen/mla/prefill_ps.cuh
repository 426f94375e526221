// mla_prefill's persistent sm_90a kernel (variant wgmma_ps): wgmma_pp's warpgroups and tile loop
// (mla/prefill.cuh: consume, produce) run over work items instead of one CTA per item.
//
// Why: at H96 8 x 1024 a CTA averages 4.5 key tiles, and its prologue (launch, barrier set-up, the
// Q copy and the first K/V tiles from DRAM, a first QK with nothing to overlap) and epilogue cost
// about as much as a tile each (H100: 3.15 us per tile there against 2.37 at T4096). One CTA per SM
// that keeps its barriers, its ring and its turn-taking across items loads item j + 1's Q and first
// tiles while the consumers finish item j's last softmax, PV and output stores.
//
// Work items: heads x q_blocks x B in the non-persistent grid's order (mla/prefill_common.cuh
// item_xyz: long first), drawn one at a time from a counter (Params::sched[0]) by the producer's
// thread 0, so the CTAs balance the causal items' unequal lengths as the hardware's block scheduler
// did. Each CTA draws until it gets a ticket past the end; the last CTA to do so (sched[1]) sets both
// counters back to 0, so every launch (eager or a graph replay) starts from zero with no memset.
// Items of sequences shorter than max_seqlen_q (an empty q-block) are skipped by the producer.
//
// Q comes by TMA (6 boxes of [64 rows][128 bytes], one SW128 block each, on Q-full); rows past the
// sequence are the next sequence's rows or zeros past the tensor: each row's scores are its own, and
// those rows are masked to -inf and never stored. The consumers arrive on Q-empty (256) once their
// last QK of the item retired; the producer waits on it before the next item's Q.
#pragma once

#include "k3gen/mla/prefill.cuh"

namespace k3gen {
namespace mla {
namespace prefill {

// In the 128-byte barrier block after the 8 stage barriers: Q-full, Q-empty, the item tickets (2 ints).
constexpr int kQFullOff = 64, kQEmptyOff = 72, kItemOff = 80;

__device__ __forceinline__ void tma_q(unsigned base, unsigned bar, const Maps& maps, int h, int row0) {
  sm90::mbar_arrive_expect_tx(bar, kQBytes);
#pragma unroll
  for (int c = 0; c < 2; ++c)
#pragma unroll
    for (int kb = 0; kb < 3; ++kb) tma_load_3d(base + (c * 3 + kb) * kQBlk, maps.q, kb * 128, h, row0 + 64 * c, bar);
}

// One ticket; one thread per CTA.
__device__ __forceinline__ int draw(int* sched, int items) {
  const int t = atomicAdd(sched, 1);
  if (t >= items) {
    __threadfence();   // this CTA's last draw is performed before it is counted
    if (atomicAdd(sched + 1, 1) == static_cast<int>(gridDim.x) - 1) {
      sched[0] = 0;   // every CTA has drawn its last ticket: no draw can follow in this launch
      sched[1] = 0;
    }
  }
  return t;
}

// The flat consumer (variant wgmma_pf): one pipeline over all of the CTA's tiles, item after item. The
// step that issues an item's last PV also issues the next item's first QK (one turn), runs that
// tile's softmax while the PV is in flight, then stores the finished item's rows: no item starts
// or ends with the tensor core idle for this warpgroup. The rows' state (limits, running max) is
// the item under QK's; o and l belong to the item under PV until its rows are stored.
template <class C>
__device__ __forceinline__ void consume_flat(const Params& p, unsigned base, unsigned q_full, unsigned q_empty,
                                             volatile int* slot, int items) {
  const Bars bars{base + kBarOff};
  const int wt = threadIdx.x % 128, warp = wt / 32, lane = threadIdx.x % 32;
  const int c = threadIdx.x / 128 - 1;
  const unsigned aQ = base + c * 3 * kQBlk;
  const int rloc = 64 * c + 16 * warp + (lane >> 2);   // this thread's rows rloc, rloc + 8 of the block
  const float scale = C::kSoftmaxScale * kLog2e;
  const unsigned long long ones = sm90::wgmma_desc<128, 256, 0>(base + kOnesOff);
  const int col = 2 * (lane & 3);
  auto take = [&] {
    if constexpr (C::kPingpong) sm90::barrier_sync_divergent(kBarTurn + c, 256);
  };
  auto pass = [&] {
    if constexpr (C::kPingpong) sm90::barrier_arrive(kBarTurn + (c ^ 1), 256);
  };
  auto stage = [&](int g) { return base + kStageOff + (g & 1) * kStageBytes; };
  int j = 0;   // items read from Q-full
  auto next = [&](Work& w) -> bool {   // the next item with keys; false at the end ticket
    for (;;) {
      wait_stage(q_full, j & 1);
      const int t = slot[j & 1];
      ++j;
      if (t >= items) return false;
      int x, y, z;
      item_xyz(p, C::kHeads, t, x, y, z);
      w = work_at(p, x, y, z);
      if (w.n > 0) return true;
      sm90::mbar_arrive(q_empty);   // no key (fewer keys than queries): the rows are zeros
      float zo[64], zl[4];
#pragma unroll
      for (int i = 0; i < 64; ++i) zo[i] = 0.f;
#pragma unroll
      for (int i = 0; i < 4; ++i) zl[i] = 0.f;
      store_rows<C>(p, w, zo, zl, rloc, lane);
    }
  };
  int lim[2], free_end = 0;
  float m[2];
  auto setup = [&](const Work& w) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int i = w.i0 + rloc + 8 * r;
      lim[r] = i < w.s.lq ? min(w.pre + i, w.s.lk - 1) : -1;
      m[r] = K3GEN_PF_NEG_INF;
    }
    free_end = w.pre + w.i0 + 64 * c;   // tiles wholly at or below the warpgroup's first row's limit: no mask
  };
  auto soft = [&](float (&sc)[64], int it, float (&a)[2]) {
    if (it * kBN + kBN - 1 <= free_end)
      softmax<false>(sc, m, lim, it * kBN + col, scale, a);
    else
      softmax<true>(sc, m, lim, it * kBN + col, scale, a);
  };
  if constexpr (C::kPingpong)
    if (c == 1) sm90::barrier_arrive(kBarTurn, 256);   // consumer 0 goes first, once per CTA
  float o[64], sc[64], a[2], l[4] = {0.f, 0.f, 0.f, 0.f};
  unsigned pk[32];
#pragma unroll
  for (int i = 0; i < 64; ++i) o[i] = 0.f;
  Work cw;
  bool more = next(cw);
  int g = 0, it = 1;   // g: the CTA's tile count of the next QK; it: that tile's index in cw
  if (more) {
    setup(cw);
    first_step(sc, pk, a, aQ, base, bars, 0, take, pass, [&] { if (cw.n == 1) sm90::mbar_arrive(q_empty); }, soft);
    g = 1;
  }
  while (more) {
    const int st = g & 1, sp = st ^ 1;
    if (it < cw.n) {
      step(o, l, sc, pk, a, aQ, base, bars, g, it, ones, take, pass,
           [&] { if (it == cw.n - 1) sm90::mbar_arrive(q_empty); }, soft);
      ++it;
      ++g;
      continue;
    }
    // cw's last PV, and the next item's first QK in the same turn.
    Work nw;
    more = next(nw);
    rescale(o, l, a);
    pin(o);
    pin(l);
    wait_stage(bars.vfull(sp), ((g - 1) >> 1) & 1);
    if (more) {   // two straight paths: no branch between the wgmmas of one turn (ptxas serializes them)
      wait_stage(bars.kfull(st), (g >> 1) & 1);
      take();
      sm90::wgmma_fence();
      qk(sc, aQ, stage(g));
      sm90::wgmma_commit();
      sm90::wgmma_fence();
      pv(o, l, pk, stage(g - 1) + kKBytes, ones);
      sm90::wgmma_commit();
      pass();
      sm90::wgmma_wait<1>();
      pin(sc);
      if (nw.n == 1) sm90::mbar_arrive(q_empty);
      sm90::mbar_arrive(bars.kempty(st));
      setup(nw);
      soft(sc, 0, a);   // a = 0 (no earlier max): the next rescale clears nothing that is not zero
    } else {
      take();
      sm90::wgmma_fence();
      pv(o, l, pk, stage(g - 1) + kKBytes, ones);
      sm90::wgmma_commit();
      pass();
    }
    sm90::wgmma_wait<0>();
    pin(o);
    pin(l);
    pin(pk);
    sm90::mbar_arrive(bars.vempty(sp));
    store_rows<C>(p, cw, o, l, rloc, lane);
    if (!more) break;
#pragma unroll
    for (int i = 0; i < 64; ++i) o[i] = 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) l[i] = 0.f;
    pack(sc, pk);
    cw = nw;
    it = 1;
    ++g;
  }
  if constexpr (C::kPingpong)
    if (c == 0) sm90::barrier_sync_divergent(kBarTurn, 256);   // consumer 1's last pass: none left dangling
}

template <class C, bool kFlat>
__device__ void run_persistent_impl(const Params& p, const Maps& maps) {
  static_assert(C::kTma && C::kOverlap, "the persistent kernel is wgmma_ov / wgmma_pp's");
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  const unsigned base = smem_u32(smem);
  const Bars bars{base + kBarOff};
  const unsigned q_full = base + kBarOff + kQFullOff, q_empty = base + kBarOff + kQEmptyOff;
  volatile int* slot = reinterpret_cast<volatile int*>(smem + kBarOff + kItemOff);
  const int items = C::kHeads * p.q_blocks * p.batch;
  const int tid = threadIdx.x, wgi = tid / 128;
  if (tid == 0) {
    for (int st = 0; st < kStages; ++st) {
      sm90::mbar_init(bars.kfull(st), 1);
      sm90::mbar_init(bars.vfull(st), 1);
      sm90::mbar_init(bars.kempty(st), 256);
      sm90::mbar_init(bars.vempty(st), 256);
    }
    sm90::mbar_init(q_full, 1);
    sm90::mbar_init(q_empty, 256);
    sm90::fence_mbar_init();
  }
  if (tid < 32)   // BF16 1.0 pairs, made visible to the async proxy by the fence below
    *reinterpret_cast<uint4*>(smem + kOnesOff + 16 * tid) = make_uint4(0x3f803f80u, 0x3f803f80u, 0x3f803f80u, 0x3f803f80u);
  sm90::fence_proxy_async();
  __syncthreads();

  if (wgi == 0) {
    sm90::setmaxnreg_dec<kProducerRegs>();
    reload_barrier();
    const int wt = tid % 128;
    if (wt == 0) {
      sm90::tma_prefetch_map(maps.kn);
      sm90::tma_prefetch_map(maps.kpe);
      sm90::tma_prefetch_map(maps.v);
      sm90::tma_prefetch_map(maps.q);
    }
    int g = 0;   // tiles of this CTA's earlier items: the stage ring's running count
    for (int j = 0;; ++j) {
      int t;
      Work w;
      for (;;) {   // the next item with rows (the producer threads all need it: tail-tile V copies)
        if (wt == 0) {
          const int d = draw(p.sched, items);
          // slot j & 1 was last read for item j - 2, before the consumers' QKs of item j - 1 ended
          if (j > 0) sm90::mbar_wait_or_trap(q_empty, (j - 1) & 1);
          slot[j & 1] = d;
        }
        sm90::barrier_sync_divergent(kBarProducer, 128);
        t = slot[j & 1];
        if (t >= items) break;
        int x, y, z;
        item_xyz(p, C::kHeads, t, x, y, z);
        if (wt == 0 && x == 0 && y == 0) report_seq_of<C>(p, z);
        w = work_at(p, x, y, z);
        if (w.i0 < w.s.lq) break;
        sm90::barrier_sync_divergent(kBarProducer, 128);   // all have read the slot before it is rewritten
      }
      if (t >= items) {
        if (wt == 0) sm90::mbar_arrive(q_full);   // the consumers read the end ticket and leave
        break;
      }
      if (wt == 0) tma_q(base, q_full, maps, w.h, w.s.q0 + w.i0);
      produce(p, w.s, w.h, w.n, base, bars, maps, wt, g, 0);
      g += w.n;
    }
    return;
  }
  sm90::setmaxnreg_inc<kConsumerRegs>();
  reload_barrier();
  if constexpr (kFlat) {
    consume_flat<C>(p, base, q_full, q_empty, slot, items);
    return;
  }
  const int c = tid / 128 - 1;
  if constexpr (C::kPingpong)
    if (c == 1) sm90::barrier_arrive(kBarTurn, 256);   // consumer 0 goes first, once per CTA
  int g = 0;
  for (int j = 0;; ++j) {
    wait_stage(q_full, j & 1);
    const int t = slot[j & 1];
    if (t >= items) break;
    int x, y, z;
    item_xyz(p, C::kHeads, t, x, y, z);
    const Work w = work_at(p, x, y, z);
    consume<C>(p, w, base, g, q_empty);
    g += w.n;
  }
  if constexpr (C::kPingpong)
    if (c == 0) sm90::barrier_sync_divergent(kBarTurn, 256);   // consumer 1's last pass: none left dangling
}

template <class C>
__device__ void run_persistent(const Params& p, const Maps& maps) {
  run_persistent_impl<C, false>(p, maps);
}
template <class C>
__device__ void run_persistent_flat(const Params& p, const Maps& maps) {
  run_persistent_impl<C, true>(p, maps);
}

}  // namespace prefill
}  // namespace mla
}  // namespace k3gen
