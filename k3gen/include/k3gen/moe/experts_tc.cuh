// moe_experts on tcgen05 (the SM100 family: sm_103a, sm_107a): variant "tcgen05" of
// k3gen/ops/moe_experts/variants.py (TcPlan mirrors Geo below; the template's static_asserts tie
// them). Contract: k3gen/ops/moe_experts/spec.py, the same as the SM90 kernel's (experts.cuh): the
// same ExpertArgs, work items (ItemList), activation (glu_act), combine entry and error word. The
// index math is replayed on the CPU by tests/nogpu/ops/test_moe_experts_tcgen05.py against the SM90
// kernel's on the same inputs. Compiled and SASS-checked only: no Blackwell GPU exists here.
//
// Why kind::f16 on exactly dequantized BF16 and not a block-scaled kind (variants.py says more): the
// contract's activations are BF16 (W4A16) and the down GEMM's input h is BF16 in every format, which
// no block-scaled kind takes; the E2M1 x scale products are exact in BF16, so the MMA sees the values
// numerics.py decodes, as the SM90 kernel does.
//
// Geometry: grid (mtiles, item rows); a CTA owns one 64-row M tile of every expert it walks (gate_up:
// gate rows 32 mt .. + 31 and the up rows I below them, MMA rows 0-31 / 32-63; down: rows 64 mt .. +
// 63 of w2) and walks items blockIdx.y, + gridDim.y, ... (expert, up to NB grouped positions: MMA N).
// Swap AB as on SM90: weights are the M side, tokens N. K in stages of kKS values (256, or K).
// Warps (448 threads, one CTA per SM):
//   0-7   decoders: a stage's raw codes (shared) -> hardware E2M1 -> BF16 conversion (F2FP) times the
//         group scale (an exact BF16 product) -> the K-major SW128 A tile; the stage's activation
//         rows (gate_up: x rows of the item's tokens, BF16 or E4M3 x UE8M0 made exact BF16; down: h
//         rows) -> the SW128 B tile.
//   8-11  epilogue (warp % 4 = its TMEM lane quarter): accumulator -> NVFP4 global -> gate_up: the
//         up rows through shared memory to the gate rows' threads, act -> BF16 h; down: FP32 y rows
//         at the flat slots perm[p].
//   12    producer (lane 0): per item the tile's scale rows (two bulk copies, every K), per stage two
//         TMA boxes [32 rows][kKS / 2 bytes] of codes; the whole warp allocates TMEM.
//   13    MMA issuer (lane 0): kKS / 16 tcgen05.mma kind::f16 m64nNBk16 per stage into one of two
//         TMEM accumulators (the epilogue of an item overlaps the next item's MMAs).
// Rings: raw (kRS stages, TMA -> decoders), operand (kOS, decoders -> MMA), scales (kSB items),
// accumulators (2). MMA columns past the item's n and K steps past K are never written: an MMA
// column depends on its own B row only, and no K step past K is issued.
#pragma once

#include <cuda_bf16.h>

#include "k3gen/common/sm100_tc.cuh"
#include "k3gen/moe/experts.cuh"

namespace k3gen {
namespace moe {
namespace tc {

constexpr int kTileRows = 64;                     // MMA M
constexpr int kDecWarps = 8, kEpiWarps = 4;
constexpr int kDecThreads = 32 * kDecWarps;
constexpr int kEpiWarp0 = kDecWarps;              // 8: warp % 4 == TMEM lane quarter
constexpr int kProdWarp = kDecWarps + kEpiWarps;  // 12
constexpr int kMmaWarp = kProdWarp + 1;           // 13
constexpr int kThreads = 32 * (kMmaWarp + 1);     // 448
constexpr int kAtom = kTileRows * 128;            // A: one [64 rows][64 K] BF16 SW128 atom

__host__ __device__ constexpr int cdiv(int a, int b) { return (a + b - 1) / b; }
__host__ __device__ constexpr int up(int a, int b) { return cdiv(a, b) * b; }

// G: kGateUp, kRows (weight rows per expert), kK, kKS (K per stage), kStages, kRS, kOS, kSB.
template <class C, class G>
struct Geo {
  static constexpr int kNB = 8 * C::kNTiles;
  static constexpr int kGroup = C::kMxfp4 ? 32 : 16;
  static constexpr int kSRow = G::kK / kGroup;               // scale bytes of a weight row
  static constexpr int kAtoms = cdiv(G::kKS, 64);            // SW128 K atoms of a stage
  static constexpr int kABytes = kAtoms * kAtom;
  static constexpr int kBAtom = kNB * 128;
  static constexpr int kBBytes = kAtoms * kBAtom;
  static constexpr int kOpBytes = kABytes + kBBytes;
  static constexpr int kRawBytes = kTileRows * G::kKS / 2;
  static constexpr int kSclBytes = up(kTileRows * kSRow, 16);
  static constexpr int kXchStride = kNB + 1;                 // floats (bank-conflict padding)
  static constexpr int kXchBytes = 32 * kXchStride * 4;
  static constexpr int kOpOff = 0;
  static constexpr int kRawOff = kOpOff + G::kOS * kOpBytes;
  static constexpr int kSclOff = kRawOff + G::kRS * kRawBytes;
  static constexpr int kXchOff = kSclOff + G::kSB * kSclBytes;
  static constexpr int kBarOff = up(kXchOff + kXchBytes, 8);
  // raw full/empty [kRS], op full/empty [kOS], scale full/empty [kSB], acc full/empty [2]
  static constexpr int kNumBars = 2 * (G::kRS + G::kOS + G::kSB + 2);
  static constexpr int kTmemOff = kBarOff + 8 * kNumBars;
  static constexpr int kEnd = kTmemOff + 16;
  static constexpr int kSmem = kEnd + 1024;                  // + the slack of aligning the base up
  static constexpr int kTmemCols = 2 * kNB <= 32 ? 32 : (2 * kNB <= 64 ? 64 : 128);
  static constexpr int kSegs = kTileRows * G::kKS / 32;      // 16-byte code segments of a stage
  static constexpr int kAPer = cdiv(kSegs, kDecThreads);
  static constexpr int kBChunks = G::kKS / 8;                // 16-byte BF16 chunks of a B row's stage
  static constexpr int kBPer = cdiv(kNB * kBChunks, kDecThreads);
  static_assert(kOpBytes % 1024 == 0 && kRawBytes % 1024 == 0, "SW128 atoms and TMA boxes stay 1024-aligned");
  static_assert(G::kKS % 32 == 0 && G::kKS <= 256 && G::kKS / 2 <= 256, "a TMA box row of whole segments");
};

// Byte offset of 16-byte chunk c (of 8) of row r in a K-major SW128 atom (rows of 128 bytes, 8-row
// groups 1024 bytes apart, chunk index XOR row % 8): what TMA's 128B swizzle writes, what the
// descriptor (SBO 1024) reads.
__host__ __device__ constexpr int sw128(int r, int c) { return (r >> 3) * 1024 + (r & 7) * 128 + ((c ^ (r & 7)) << 4); }

// Eight E2M1 codes (little-endian word, code i in bits 4i..4i+3) -> four bf16x2 by the hardware
// conversion, pair q = codes (2q, 2q+1), lower K in the low half; exact (every E2M1 value is a BF16).
__device__ __forceinline__ void e2m1x8_to_bf16_hw(u32 w, u32 (&q)[4]) {
  asm("{\n.reg .b8 b0, b1, b2, b3;\nmov.b32 {b0, b1, b2, b3}, %4;\n"
      "cvt.rn.bf16x2.e2m1x2 %0, b0;\ncvt.rn.bf16x2.e2m1x2 %1, b1;\n"
      "cvt.rn.bf16x2.e2m1x2 %2, b2;\ncvt.rn.bf16x2.e2m1x2 %3, b3;\n}\n"
      : "=r"(q[0]), "=r"(q[1]), "=r"(q[2]), "=r"(q[3])
      : "r"(w));
}
// Two E4M3 codes (low byte first) -> bf16x2, exact.
__device__ __forceinline__ u32 e4m3x2_to_bf16x2(u32 v16) {
  u32 d;
  asm("{\n.reg .b16 t;\ncvt.u16.u32 t, %1;\ncvt.rn.bf16x2.e4m3x2 %0, t;\n}\n" : "=r"(d) : "r"(v16));
  return d;
}

// One 32-value segment (16 code bytes) times its scale multipliers (lo: values 0-15, hi: 16-31, as
// segment_scales makes them) -> four 16-byte BF16 chunks of 8 values: the SM90 decode's values.
__device__ __forceinline__ void decode_segment(const uint4& v, u32 lo, u32 hi, uint4 (&o)[4]) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    u32 q[4];
    e2m1x8_to_bf16_hw(word(v, j), q);
    const u32 s = j < 2 ? lo : hi;
    o[j] = make_uint4(bf16x2_mul(q[0], s), bf16x2_mul(q[1], s), bf16x2_mul(q[2], s), bf16x2_mul(q[3], s));
  }
}

// Item `it` of the scanned list without a CTA barrier (warp roles run apart): the scan thread that
// owns it is the last one whose first item is <= it (first[] is non-decreasing and first[j + 1] =
// first[j] + count[j]), then that thread's experts are walked as ItemList::pick does.
template <class L, int kNB>
__device__ __forceinline__ Item find_item(const L& list, const int* offsets, int base, int nslots, int it) {
  int lo = 0, hi = kThreads - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (list.first[mid] <= it) lo = mid;
    else hi = mid - 1;
  }
  Item r{-1, 0, 0};
  int acc = list.first[lo];
#pragma unroll
  for (int i = 0; i < L::kPer; ++i) {
    const int2 rg = L::range(offsets, base, nslots, lo * L::kPer + i);
    const int ni = (rg.y + kNB - 1) / kNB;
    if (it >= acc && it < acc + ni) {
      const int b = (it - acc) * kNB;
      r = Item{lo * L::kPer + i, rg.x + b, min(kNB, rg.y - b)};
    }
    acc += ni;
  }
  return r;
}
template <class L, int kNB>
__device__ __forceinline__ Item warp_item(const L& list, const ExpertArgs& a, int it) {
  Item r{0, 0, 0};
  if ((threadIdx.x & 31) == 0) r = find_item<L, kNB>(list, a.offsets, a.expert_base, a.nslots, it);
  r.e = __shfl_sync(0xffffffffu, r.e, 0);
  r.p0 = __shfl_sync(0xffffffffu, r.p0, 0);
  r.n = __shfl_sync(0xffffffffu, r.n, 0);
  return r;
}

// Global weight rows of the two 32-row halves of the CTA's tile of expert e.
template <class C, class G>
__device__ __forceinline__ int2 tile_rows(int e, int mt) {
  const int r0 = e * G::kRows + (G::kGateUp ? 32 * mt : 64 * mt);
  return make_int2(r0, G::kGateUp ? r0 + C::kInter : r0 + 32);
}

// Decoder thread dt: the B chunks of stage s (activation rows of the item's columns, K [s kKS + 8 ch,
// + 8)) loaded into registers, then (store_b) written as BF16 into the SW128 B tile.
template <class C, class G>
struct BChunks {
  using Y = Geo<C, G>;
  static constexpr bool kFp8 = G::kGateUp && C::kFp8Act;
  uint4 v[Y::kBPer];
  u32 sc[Y::kBPer];   // FP8: the UE8M0 scale byte of the chunk's 128-column group
  bool ok[Y::kBPer];

  __device__ __forceinline__ void load(const ExpertArgs& a, const Item& it, int s, int dt) {
#pragma unroll
    for (int q = 0; q < Y::kBPer; ++q) {
      const int i = dt + kDecThreads * q, n = i / Y::kBChunks, kk = s * G::kKS + 8 * (i % Y::kBChunks);
      ok[q] = n < it.n && kk < G::kK;
      if (!ok[q]) continue;
      long long row = it.p0 + n;   // down: h rows in grouped order
      if (G::kGateUp) {            // gate_up: the token of the slot (perm clamped, as on SM90)
        const int f = min(max(a.perm[row], 0), a.nslots - 1);
        row = min(f / C::kTopK, a.num_tokens - 1);
      }
      if (kFp8) {
        const u8* x = static_cast<const u8*>(a.x) + row * G::kK + kk;
        const uint2 c = *reinterpret_cast<const uint2*>(x);
        v[q] = make_uint4(c.x, c.y, 0u, 0u);
        sc[q] = static_cast<const u8*>(a.xs)[row * (G::kK / 128) + kk / 128];
      } else {
        v[q] = __ldg(reinterpret_cast<const uint4*>(static_cast<const __nv_bfloat16*>(a.x) + row * G::kK + kk));
      }
    }
  }

  __device__ __forceinline__ void store(unsigned char* b_tile, int dt) const {
#pragma unroll
    for (int q = 0; q < Y::kBPer; ++q) {
      if (!ok[q]) continue;
      const int i = dt + kDecThreads * q, n = i / Y::kBChunks, ch = i % Y::kBChunks;
      uint4 w = v[q];
      if (kFp8) {   // E4M3 x 2^(b - 127): exact in BF16 for scale bytes >= 3 (variants.py's note)
        const u32 s = ue8m0_bf16x2(sc[q]);
        w = make_uint4(bf16x2_mul(e4m3x2_to_bf16x2(v[q].x & 0xFFFFu), s), bf16x2_mul(e4m3x2_to_bf16x2(v[q].x >> 16), s),
                       bf16x2_mul(e4m3x2_to_bf16x2(v[q].y & 0xFFFFu), s), bf16x2_mul(e4m3x2_to_bf16x2(v[q].y >> 16), s));
      }
      *reinterpret_cast<uint4*>(b_tile + (ch >> 3) * Y::kBAtom + sw128(n, ch & 7)) = w;
    }
  }
};

// Decoder thread dt: the code segments of stage s (raw [64 rows][kKS / 2 bytes]) into the A tile.
template <class C, class G>
__device__ __forceinline__ void decode_stage(const unsigned char* raw, const unsigned char* scl, unsigned char* a_tile,
                                             int s, int dt) {
  using Y = Geo<C, G>;
  constexpr int kSegRow = G::kKS / 32;
#pragma unroll
  for (int j = 0; j < Y::kAPer; ++j) {
    const int seg = dt + kDecThreads * j;
    if (Y::kSegs % kDecThreads != 0 && seg >= Y::kSegs) break;
    const int row = seg / kSegRow, c = seg % kSegRow, kseg = s * G::kKS + 32 * c;
    if (kseg >= G::kK) continue;
    const uint4 v = *reinterpret_cast<const uint4*>(raw + row * (G::kKS / 2) + 16 * c);
    const unsigned char* srow = scl + row * Y::kSRow;
    const u32 sb = C::kMxfp4 ? srow[kseg / 32] : *reinterpret_cast<const unsigned short*>(srow + kseg / 16);
    u32 lo, hi;
    segment_scales<C::kMxfp4>(sb, lo, hi);
    uint4 o[4];
    decode_segment(v, lo, hi, o);
    unsigned char* dst = a_tile + (c >> 1) * kAtom;
#pragma unroll
    for (int w = 0; w < 4; ++w) *reinterpret_cast<uint4*>(dst + sw128(row, (c & 1) * 4 + w)) = o[w];
  }
}

template <class C, class G>
__device__ __forceinline__ void expert_gemm_tc(const ExpertArgs& a, const sm90::TmaMap* wmap) {
  using Y = Geo<C, G>;
  using List = ItemList<C::kExperts, kThreads, Y::kNB>;
  constexpr int kNB = Y::kNB;
  constexpr unsigned kId = sm100::idesc<true, false, kTileRows, kNB>();
  // gate_up: offsets, perm and x come from the kernels before it. down: only h does (and y's last
  // reader, the previous combine, completed before gate_up started); the producer and the MMA
  // issuer read weights only, so they run ahead of the dependency wait (as the SM90 kernel's loads).
  if constexpr (G::kGateUp) {
    griddep_wait();
    griddep_launch_dependents();
  }
  __shared__ List list;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024u - (sm90::smem_addr(smem_raw) & 1023u)) & 1023u);
  const unsigned base = sm90::smem_addr(smem);
  const unsigned bar = base + Y::kBarOff;
  const unsigned raw_full = bar, raw_empty = raw_full + 8 * G::kRS, op_full = raw_empty + 8 * G::kRS,
                 op_empty = op_full + 8 * G::kOS, scl_full = op_empty + 8 * G::kOS,
                 scl_empty = scl_full + 8 * G::kSB, acc_full = scl_empty + 8 * G::kSB, acc_empty = acc_full + 16;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, mt = blockIdx.x;
  if (tid == 0) {
    sm90::mbar_init_ring(raw_full, raw_empty, G::kRS, 1, kDecWarps);
    sm90::mbar_init_ring(op_full, op_empty, G::kOS, kDecWarps, 1);
    sm90::mbar_init_ring(scl_full, scl_empty, G::kSB, 1, kDecWarps);
    sm90::mbar_init_ring(acc_full, acc_empty, 2, 1, kEpiWarps);
  }
  if (warp == kProdWarp) {
    if (lane == 0) sm90::tma_prefetch_map(wmap);
    sm100::tmem_alloc(base + Y::kTmemOff, Y::kTmemCols);
  }
  list.scan(a.offsets, a.expert_base, a.nslots, a.err);   // its barriers also publish the inits
  sm100::fence_before();
  __syncthreads();
  sm100::fence_after();
  const unsigned tmem = *reinterpret_cast<volatile unsigned*>(smem + Y::kTmemOff);

  if (warp == kProdWarp) {
    if (lane == 0) {
      int g = 0, li = 0;
      for (int it = blockIdx.y; it < list.total; it += gridDim.y, ++li) {
        const Item item = find_item<List, kNB>(list, a.offsets, a.expert_base, a.nslots, it);
        const int2 r = tile_rows<C, G>(item.e, mt);
        const int sb = li % G::kSB;
        if (li >= G::kSB) sm90::mbar_wait_or_trap(scl_empty + 8 * sb, ((li / G::kSB) & 1) ^ 1);
        const unsigned sdst = base + Y::kSclOff + sb * Y::kSclBytes;
        sm90::mbar_arrive_expect_tx(scl_full + 8 * sb, 64 * Y::kSRow);
        sm90::bulk_load(sdst, a.s + static_cast<long long>(r.x) * Y::kSRow, 32 * Y::kSRow, scl_full + 8 * sb);
        sm90::bulk_load(sdst + 32 * Y::kSRow, a.s + static_cast<long long>(r.y) * Y::kSRow, 32 * Y::kSRow,
                        scl_full + 8 * sb);
        for (int s = 0; s < G::kStages; ++s, ++g) {
          const int rs = g % G::kRS;
          if (g >= G::kRS) sm90::mbar_wait_or_trap(raw_empty + 8 * rs, ((g / G::kRS) & 1) ^ 1);
          const unsigned dst = base + Y::kRawOff + rs * Y::kRawBytes;
          sm90::mbar_arrive_expect_tx(raw_full + 8 * rs, Y::kRawBytes);
          sm90::tma_load_2d(dst, wmap, s * (G::kKS / 2), r.x, raw_full + 8 * rs);
          sm90::tma_load_2d(dst + 32 * (G::kKS / 2), wmap, s * (G::kKS / 2), r.y, raw_full + 8 * rs);
        }
      }
    }
  } else if (warp == kMmaWarp) {
    if (lane == 0) {
      int g = 0, li = 0;
      for (int it = blockIdx.y; it < list.total; it += gridDim.y, ++li) {
        const int ab = li & 1;
        if (li >= 2) sm90::mbar_wait_asm(acc_empty + 8 * ab, ((li >> 1) & 1) ^ 1);
        sm100::fence_after();
        for (int s = 0; s < G::kStages; ++s, ++g) {
          const int os = g % G::kOS;
          sm90::mbar_wait_asm(op_full + 8 * os, (g / G::kOS) & 1);
          sm100::fence_after();
          const unsigned aA = base + Y::kOpOff + os * Y::kOpBytes, aB = aA + Y::kABytes;
          const int ksteps = min(G::kKS, G::kK - s * G::kKS) / 16;
#pragma unroll
          for (int ks = 0; ks < G::kKS / 16; ++ks) {
            if (ks >= ksteps) break;
            sm100::mma(tmem + ab * kNB, sm100::desc<16, 1024>(aA + (ks >> 2) * kAtom + (ks & 3) * 32),
                          sm100::desc<16, 1024>(aB + (ks >> 2) * Y::kBAtom + (ks & 3) * 32), kId,
                          s > 0 || ks > 0);
          }
          sm100::commit(op_empty + 8 * os);   // the stage's operands are free once these MMAs are done
        }
        sm100::commit(acc_full + 8 * ab);
      }
    }
  } else if (warp < kDecWarps) {
    if constexpr (!G::kGateUp) {
      griddep_wait();   // h is gate_up's
      griddep_launch_dependents();
    }
    int g = 0, li = 0;
    for (int it = blockIdx.y; it < list.total; it += gridDim.y, ++li) {
      const Item item = warp_item<List, kNB>(list, a, it);
      const int sb = li % G::kSB;
      sm90::mbar_wait_asm(scl_full + 8 * sb, (li / G::kSB) & 1);
      const unsigned char* scl = smem + Y::kSclOff + sb * Y::kSclBytes;
      for (int s = 0; s < G::kStages; ++s, ++g) {
        const int rs = g % G::kRS, os = g % G::kOS;
        BChunks<C, G> b;
        b.load(a, item, s, tid);   // in flight while the codes are decoded
        sm90::mbar_wait_asm(raw_full + 8 * rs, (g / G::kRS) & 1);
        if (g >= G::kOS) sm90::mbar_wait_asm(op_empty + 8 * os, ((g / G::kOS) & 1) ^ 1);
        unsigned char* op = smem + Y::kOpOff + os * Y::kOpBytes;
        decode_stage<C, G>(smem + Y::kRawOff + rs * Y::kRawBytes, scl, op, s, tid);
        b.store(op + Y::kABytes, tid);
        sm90::fence_proxy_async();   // generic stores read by the MMA (async proxy)
        __syncwarp();
        if (lane == 0) {
          sm90::mbar_arrive(raw_empty + 8 * rs);
          sm90::mbar_arrive(op_full + 8 * os);
        }
      }
      __syncwarp();
      if (lane == 0) sm90::mbar_arrive(scl_empty + 8 * sb);
    }
  } else {
    if constexpr (!G::kGateUp) {
      griddep_wait();
      griddep_launch_dependents();
    }
    const int q = warp & 3, r = 16 * q + lane;   // lanes < 16 hold MMA row r (layout F)
    const unsigned lane_addr = tmem + ((32u * q) << 16);
    float* xch = reinterpret_cast<float*>(smem + Y::kXchOff);
    int li = 0;
    for (int it = blockIdx.y; it < list.total; it += gridDim.y, ++li) {
      const Item item = warp_item<List, kNB>(list, a, it);
      const int ab = li & 1;
      sm90::mbar_wait_asm(acc_full + 8 * ab, (li >> 1) & 1);
      sm100::fence_after();
      float v[kNB];
#pragma unroll
      for (int c = 0; c < kNB / 8; ++c) sm100::ld8_async(lane_addr + ab * kNB + 8 * c, *reinterpret_cast<float(*)[8]>(&v[8 * c]));
      sm100::wait_ld();
      sm100::pin(v);   // no use of v may be scheduled above the wait (the registers fill only there)
      sm100::fence_before();
      __syncwarp();
      if (lane == 0) sm90::mbar_arrive(acc_empty + 8 * ab);   // the next-but-one item may overwrite it
      if constexpr (G::kGateUp) {
        // Up rows (MMA rows 32-63, quarters 2-3) to the threads holding the gate row of the same i.
        if (q >= 2 && lane < 16) {
#pragma unroll
          for (int n = 0; n < kNB; ++n) xch[(r - 32) * Y::kXchStride + n] = v[n];
        }
        sm90::barrier_sync_divergent(1, 32 * kEpiWarps);
        if (q < 2 && lane < 16) {
          const float gg = C::kMxfp4 ? 1.f : a.gs[2 * item.e], gu = C::kMxfp4 ? 1.f : a.gs[2 * item.e + 1];
          __nv_bfloat16* h = static_cast<__nv_bfloat16*>(a.out) + 32 * mt + r;
#pragma unroll
          for (int n = 0; n < kNB; ++n) {
            if (n >= item.n) break;
            float gv = v[n], uv = xch[r * Y::kXchStride + n];
            if (!C::kMxfp4) {
              gv *= gg;
              uv *= gu;
            }
            h[static_cast<size_t>(item.p0 + n) * C::kInter] = __float2bfloat16_rn(glu_act<C>(gv, uv));
          }
        }
        sm90::barrier_sync_divergent(1, 32 * kEpiWarps);   // xch is rewritten by the next item
      } else if (lane < 16) {
        const float gsc = C::kMxfp4 ? 1.f : a.gs[item.e];
#pragma unroll
        for (int n = 0; n < kNB; ++n) {
          if (n >= item.n) break;
          const int f = a.perm[item.p0 + n];
          if (f < 0 || f >= a.nslots) {   // gate_up clamped it; its row is dropped here
            fault::report(a.err, fault::kPerm);
            continue;
          }
          static_cast<float*>(a.out)[static_cast<size_t>(f) * C::kHidden + 64 * mt + r] = C::kMxfp4 ? v[n] : v[n] * gsc;
        }
      }
    }
  }
  sm100::fence_before();
  __syncthreads();
  if (warp == kProdWarp) {
    sm100::fence_after();
    sm100::tmem_dealloc(tmem, Y::kTmemCols);
  }
}

// The dequantization probe of this kernel's decode (hardware conversion times the segment scales,
// then the NVFP4 global in FP32): the GPU test holds it to numerics.py bit for bit, as the SM90 one.
template <class C>
__device__ __forceinline__ void dequant_probe_tc(const u8* w, const u8* s, const float* gs, float* out, int which,
                                                 int e, int row0, int nrows) {
  constexpr bool kMx = C::kMxfp4;
  const int K = which == 0 ? C::kHidden : C::kInter, rows = which == 0 ? 2 * C::kInter : C::kHidden;
  const int segs = K / 32, idx = blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= nrows * segs) return;
  const int r = row0 + idx / segs, kseg = (idx % segs) * 32;
  if (r >= rows || e < 0 || e >= C::kExperts) return;
  const size_t row = static_cast<size_t>(e) * rows + r;
  const uint4 v = ldg_stream(w + row * (K / 2) + kseg / 2);
  const u8* srow = s + row * (K / (kMx ? 32 : 16));
  u32 lo, hi;
  segment_scales<kMx>(kMx ? srow[kseg / 32] : (srow[kseg / 16] | (srow[kseg / 16 + 1] << 8)), lo, hi);
  const float g = kMx ? 1.f : (which == 0 ? gs[2 * e + (r < C::kInter ? 0 : 1)] : gs[e]);
  uint4 o[4];
  decode_segment(v, lo, hi, o);
  float* dst = out + static_cast<size_t>(idx / segs) * K + kseg;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const u32 p = word(o[j], i);
      const float a0 = __uint_as_float(p << 16), a1 = __uint_as_float(p & 0xFFFF0000u);
      dst[8 * j + 2 * i] = kMx ? a0 : a0 * g;
      dst[8 * j + 2 * i + 1] = kMx ? a1 : a1 * g;
    }
  }
}

}  // namespace tc
}  // namespace moe
}  // namespace k3gen
