// MoE routing: the noaux_tc sigmoid router (grouped top-k over score + bias) and the grouped
// token-slot order for the expert GEMM. Contract: k3gen/ops/moe_route/spec.py.
//
//   route_topk  one warp per token. Each lane holds E/32 candidates as order-preserving unsigned
//               keys; the k picks are k rounds of a warp arg-max (redux.sync max over the keys, then
//               min over the expert indices holding it: ties go to the lower index), after which only
//               the winning lane re-reduces its own candidates (a 5-level tree, no local memory).
//   route_sort  per 32 experts: a histogram of all slots (shared-memory integer atomics: counts do
//               not depend on their order), an exclusive scan, then each expert's slots in token
//               order from a [32 experts x 1024 tokens] byte table of slot numbers, a warp ballot
//               per 32 tokens giving each slot its rank.
#pragma once

#include "k3gen/common/pdl.cuh"

namespace k3gen {
namespace moe {

constexpr unsigned kFull = 0xffffffffu;
constexpr int kTopkWarps = 4;
constexpr int kSortThreads = 512, kSortExperts = 32, kSortTile = 1024;

// a > b <=> key(a) > key(b) over the floats a router sees (finite, -0.0 excluded: a score is >= +0,
// and score + bias is never -0.0). Key 0 belongs to no such float and marks "no candidate".
__device__ __forceinline__ unsigned order_key(float x) {
  const unsigned u = __float_as_uint(x);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// 1 / (1 + e) in FP32 (IEEE add and division) with e = FP32(exp(-x)) evaluated in FP64 and rounded
// once: the CPU reference rounds the same double (both exps are within 1 ulp of FP64), so both get
// the same bits, where an FP32 exp would differ between the GPU's and the CPU's libraries.
__device__ __forceinline__ float sigmoid_ref(float x) {
  const float e = __double2float_rn(exp(-static_cast<double>(x)));
  return __fdiv_rn(1.f, __fadd_rn(1.f, e));
}

// Best (key, position) among the lane's untaken candidates; on equal keys the lower position,
// which is the lower expert index (positions grow with the expert index within a lane).
template <int kPer>
__device__ __forceinline__ void local_best(const unsigned (&key)[kPer], unsigned taken, unsigned& bk, int& bp) {
  unsigned k[kPer];
  int p[kPer];
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    k[i] = ((taken >> i) & 1u) ? 0u : key[i];
    p[i] = i;
  }
#pragma unroll
  for (int s = 1; s < kPer; s <<= 1) {
#pragma unroll
    for (int i = 0; i + s < kPer; i += 2 * s) {
      if (k[i + s] > k[i]) {
        k[i] = k[i + s];
        p[i] = p[i + s];
      }
    }
  }
  bk = k[0];
  bp = p[0];
}

template <class C>
struct TopkLayout {
  static constexpr int kE = C::kExperts, kVec = C::kVec;
  static constexpr int kStride = 32 * kVec;                    // experts per lane row
  static constexpr int kRows = (kE + kStride - 1) / kStride;
  static constexpr int kPer = kRows * kVec;                    // candidates per lane
  // Expert of candidate p of `lane`: rows of 32 * kVec experts, kVec consecutive ones per lane.
  __device__ static __forceinline__ int expert(int lane, int p) {
    return (p / kVec) * kStride + lane * kVec + (p % kVec);
  }
};

template <class C>
__device__ __forceinline__ void route_topk(const float* __restrict__ logits, long long ld,
                                           const float* __restrict__ bias, int* __restrict__ ids,
                                           float* __restrict__ weights, int num_tokens) {
  using L = TopkLayout<C>;
  constexpr int kE = C::kExperts, kK = C::kTopK, kVec = C::kVec, kPer = L::kPer;
  static_assert(kPer <= 32 && kK <= 32 && kK <= kE, "one taken bit per candidate, one lane per slot");
  static_assert(kVec == 1 || kE % (32 * kVec) == 0, "vector loads cover whole rows of experts");
  const int lane = threadIdx.x & 31;
  const int t = blockIdx.x * kTopkWarps + (threadIdx.x >> 5);
  griddep_launch_dependents();   // the sort grid may start; it waits for this grid before reading
  griddep_wait();                // the logits come from the previous kernel (the router GEMM)
  if (t >= num_tokens) return;   // whole warps: nothing below synchronizes the CTA
  const float* row = logits + static_cast<long long>(t) * ld;

  float choice[kPer];
  unsigned key[kPer];
#pragma unroll
  for (int r = 0; r < L::kRows; ++r) {
    const int e0 = r * L::kStride + lane * kVec;
    float x[kVec], b[kVec];
    if constexpr (kVec == 4) {
      const float4 xv = *reinterpret_cast<const float4*>(row + e0);
      const float4 bv = *reinterpret_cast<const float4*>(bias + e0);
      x[0] = xv.x; x[1] = xv.y; x[2] = xv.z; x[3] = xv.w;
      b[0] = bv.x; b[1] = bv.y; b[2] = bv.z; b[3] = bv.w;
    } else {
      x[0] = e0 < kE ? row[e0] : 0.f;
      b[0] = e0 < kE ? bias[e0] : 0.f;
    }
#pragma unroll
    for (int c = 0; c < kVec; ++c) {
      const int p = r * kVec + c;
      choice[p] = __fadd_rn(sigmoid_ref(x[c]), b[c]);
      key[p] = (e0 + c < kE) ? order_key(choice[p]) : 0u;
    }
  }

  if constexpr (C::kNGroup > 1) {
    constexpr int kG = kE / C::kNGroup;
    float gscore[C::kNGroup];
#pragma unroll
    for (int g = 0; g < C::kNGroup; ++g) {
      float b1 = -__int_as_float(0x7f800000), b2 = b1;   // the group's two best choices (a multiset)
#pragma unroll
      for (int p = 0; p < kPer; ++p) {
        const int e = L::expert(lane, p);
        if (e < kE && e / kG == g) {
          const float v = choice[p];
          if (v > b1) {
            b2 = b1;
            b1 = v;
          } else if (v > b2) {
            b2 = v;
          }
        }
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) {
        const float o1 = __shfl_xor_sync(kFull, b1, o), o2 = __shfl_xor_sync(kFull, b2, o);
        const float n2 = fmaxf(fminf(b1, o1), fmaxf(b2, o2));
        b1 = fmaxf(b1, o1);
        b2 = n2;
      }
      gscore[g] = kG >= 2 ? __fadd_rn(b1, b2) : b1;
    }
    unsigned keep = 0;   // groups ranked by score, ties to the lower group
#pragma unroll
    for (int g = 0; g < C::kNGroup; ++g) {
      int rank = 0;
#pragma unroll
      for (int h = 0; h < C::kNGroup; ++h) rank += (gscore[h] > gscore[g]) || (gscore[h] == gscore[g] && h < g);
      if (rank < C::kTopkGroup) keep |= 1u << g;
    }
#pragma unroll
    for (int p = 0; p < kPer; ++p) {
      const int e = L::expert(lane, p);
      if (e < kE && !((keep >> (e / kG)) & 1u)) key[p] = 0u;
    }
  }

  unsigned taken = 0, lk;
  int lp, my_id = 0;
  local_best<kPer>(key, taken, lk, lp);
#pragma unroll
  for (int j = 0; j < kK; ++j) {
    const unsigned m = __reduce_max_sync(kFull, lk);
    const unsigned mine = lk == m ? static_cast<unsigned>(L::expert(lane, lp)) : 0xffffffffu;
    const unsigned win = __reduce_min_sync(kFull, mine);
    if (lane == j) my_id = static_cast<int>(win);
    if (mine == win) {   // one lane: its pick is gone, find its next best
      taken |= 1u << lp;
      local_best<kPer>(key, taken, lk, lp);
    }
  }

  // Unbiased scores of the picks, recomputed from the (cached) logits with the same expression.
  const float s = lane < kK ? sigmoid_ref(row[my_id]) : 0.f;
  float w = s;
  if constexpr (C::kRenormalize) {
    float sum = 0.f;   // slot order: ((s_0 + s_1) + s_2) + ...
#pragma unroll
    for (int j = 0; j < kK; ++j) sum = __fadd_rn(sum, __shfl_sync(kFull, s, j));
    w = __fdiv_rn(s, __fadd_rn(sum, 1e-20f));
  }
  w = __fmul_rn(w, C::kScale);
  if (lane < kK) {
    ids[static_cast<long long>(t) * kK + lane] = my_id;
    weights[static_cast<long long>(t) * kK + lane] = w;
  }
}

template <class C>
__device__ __forceinline__ void route_sort(const int* __restrict__ ids, int* __restrict__ counts,
                                           int* __restrict__ offsets, int* __restrict__ perm,
                                           int* __restrict__ inv, int num_tokens) {
  constexpr int kE = C::kExperts, kK = C::kTopK, kWarps = kSortThreads / 32;
  static_assert(kE <= 2 * kSortThreads, "two experts per thread in the scan");
  __shared__ int cnt[kE];
  __shared__ int off[kE];
  __shared__ int wsum[kWarps];
  __shared__ int run[kSortExperts];
  __shared__ __align__(16) unsigned char slot[kSortExperts][kSortTile];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int e0 = blockIdx.x * kSortExperts;
  const int nslots = num_tokens * kK;

  for (int i = tid; i < kE; i += kSortThreads) cnt[i] = 0;
  if (tid < kSortExperts) run[tid] = 0;
  griddep_wait();   // ids come from route_topk
  __syncthreads();
  for (int s = tid; s < nslots; s += kSortThreads) atomicAdd(&cnt[ids[s]], 1);
  __syncthreads();

  // Exclusive scan of cnt: thread t owns experts 2t and 2t + 1.
  const int c0 = 2 * tid < kE ? cnt[2 * tid] : 0, c1 = 2 * tid + 1 < kE ? cnt[2 * tid + 1] : 0;
  int incl = c0 + c1;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int v = __shfl_up_sync(kFull, incl, o);
    if (lane >= o) incl += v;
  }
  if (lane == 31) wsum[warp] = incl;
  __syncthreads();
  int before = 0;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) before += w < warp ? wsum[w] : 0;
  const int excl = before + incl - (c0 + c1);
  if (2 * tid < kE) off[2 * tid] = excl;
  if (2 * tid + 1 < kE) off[2 * tid + 1] = excl + c0;
  __syncthreads();
  if (tid < kSortExperts && e0 + tid < kE) {
    counts[e0 + tid] = cnt[e0 + tid];
    offsets[e0 + tid] = off[e0 + tid];
  }
  if (blockIdx.x == gridDim.x - 1 && tid == 0) offsets[kE] = nslots;

  for (int t0 = 0; t0 < num_tokens; t0 += kSortTile) {
    const int nt = min(kSortTile, num_tokens - t0);
    const int ncols = (nt + 31) & ~31;   // whole 32-token chunks; columns past nt stay empty
    for (int i = tid; i < kSortExperts * (ncols / 4); i += kSortThreads) {
      const int el = i / (ncols / 4), w = i % (ncols / 4);
      reinterpret_cast<unsigned*>(slot[el])[w] = 0xffffffffu;
    }
    __syncthreads();
    for (int s = tid; s < nt * kK; s += kSortThreads) {
      const int el = ids[static_cast<long long>(t0) * kK + s] - e0;
      if (el >= 0 && el < kSortExperts) slot[el][s / kK] = static_cast<unsigned char>(s % kK);
    }
    __syncthreads();
    for (int el = warp; el < kSortExperts && e0 + el < kE; el += kWarps) {
      int pos = off[e0 + el] + run[el];
      for (int c = 0; c < ncols; c += 32) {
        const unsigned j = slot[el][c + lane];
        const unsigned bal = __ballot_sync(kFull, j != 0xffu);
        if (j != 0xffu) {
          const int p = pos + __popc(bal & ((1u << lane) - 1u));
          const int flat = (t0 + c + lane) * kK + static_cast<int>(j);
          perm[p] = flat;
          inv[flat] = p;
        }
        pos += __popc(bal);
      }
      __syncwarp();   // every lane has read run[el] (racecheck, H100 2026-12-05: lane 0's store raced them)
      if (lane == 0) run[el] = pos - off[e0 + el];
    }
    __syncthreads();
  }
}

}  // namespace moe
}  // namespace k3gen
