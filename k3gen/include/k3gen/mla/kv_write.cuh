// kv_cache_write: append MLA cache rows to paged KV (BF16, FP8 E4M3, NVFP4 + HP tail ring).
// The contract is the docstring of k3gen/ops/kv_cache_write/spec.py; the bit-exact twin of this
// file is k3gen/ops/kv_cache_write/reference.py.
//
// Grid (num_seqs, tiles_y): CTA (b, y) handles the 16-token tile start_pos[b]/16 + y of sequence
// b, or returns when that tile holds none of the new rows. tiles_y must cover the tiles a run of
// max_rows_per_seq rows may touch: (max_rows_per_seq + 14) / 16 + 1. Tiles never straddle pages
// (pages are multiples of 16 tokens).
#pragma once

#include <cuda_bf16.h>

#include "k3gen/common/faults.cuh"
#include "k3gen/common/quant.cuh"

namespace k3gen {

enum class KvKind { kBf16, kFp8, kNvfp4 };

namespace kvw {

constexpr int kRow = 576;             // values per cached token
constexpr int kLatent = 512;
constexpr int kTile = 16;             // tokens per tile (NVFP4 scale tile; grid unit of all formats)
constexpr int kRowVec = kRow / 8;     // uint4 per BF16 row (72)
constexpr int kBlocks = kRow / 16;    // 16-value scale blocks per row (36)
constexpr int kLatBlocks = kLatent / 16;
constexpr int kRopeBlocks = kBlocks - kLatBlocks;
constexpr int kFp4RowBytes = kRow / 2;

struct Params {
  const uint4* rows;                  // BF16 [N, 576] as 72 uint4 per row
  const int* cu_rows;
  const int* start_pos;
  const int* block_table;
  int bt_stride, num_pages;
  const int* ring_slot;
  void* c[4];                         // KvLayout.tensors() in order
  float scale;
  int num_seqs;
  // Error-word kernels only (Config::kFaults; a frozen source leaves them zero and never reads them).
  int num_rows, bt_cols, num_slots;   // rows.shape[0], block_table.shape[1], hp_tail.shape[0]
  unsigned* err;                      // this op's word (k3gen/runtime/faults.py)
};

// Byte offset of (row r < 128, col c) in a page's 128x4-swizzled [128, cols] scale matrix.
__device__ __forceinline__ int swizzle_128x4(int r, int c) {
  return (c & 3) + (c >> 2) * 512 + (r & 31) * 16 + ((r >> 5) & 3) * 4;
}

// ---- BF16: copy -------------------------------------------------------------------------------
template <class C>
__device__ void bf16_tile(const Params& p, int row0, int lo, int hi, int pg) {
  uint4* kv = static_cast<uint4*>(p.c[0]);
  for (int i = threadIdx.x; i < (hi - lo) * kRowVec; i += C::kThreads) {
    const int r = i / kRowVec, v = i - r * kRowVec;
    const long long dst = (static_cast<long long>(pg) * C::kPage + (lo + r) % C::kPage) * kRowVec;
    kv[dst + v] = p.rows[static_cast<long long>(row0 + r) * kRowVec + v];
  }
}

// ---- FP8: one warp per row, lane l owns values 16l..16l+15, lanes 0..3 also 512+16l.. ------------
// Values stay packed BF16 until quantized: fewer registers live across the division slow path.
__device__ __forceinline__ unsigned e4m3x8_half(const uint4& v, float s, bool hi) {
  float x[8];
  bf16x8_to_float(v, x);
  float q[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) q[i] = div_or_zero(x[(hi ? 4 : 0) + i], s);
  return e4m3x4(q);
}

__device__ __forceinline__ uint4 e4m3x16(const uint4& a, const uint4& b, float s) {
  return make_uint4(e4m3x8_half(a, s, false), e4m3x8_half(a, s, true),
                    e4m3x8_half(b, s, false), e4m3x8_half(b, s, true));
}

template <class C>
__device__ void fp8_tile(const Params& p, int row0, int lo, int hi, int pg) {
  constexpr int kWarps = C::kThreads / 32;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const bool rope = lane < kRopeBlocks;
  for (int r = lo + warp; r < hi; r += kWarps) {
    const uint4* src = p.rows + static_cast<long long>(row0 + r - lo) * kRowVec;
    const uint4 xa = src[2 * lane], xb = src[2 * lane + 1];
    uint4 ya = make_uint4(0, 0, 0, 0), yb = ya;
    if (rope) {
      ya = src[2 * (32 + lane)];
      yb = src[2 * (32 + lane) + 1];
    }
    const long long tok = static_cast<long long>(pg) * C::kPage + r % C::kPage;
    float sl = p.scale, sr = p.scale;
    if constexpr (!C::kFp8PerTensor) {
      // 128-value groups = 8 lanes; the 64-value rope group = lanes 0..3 (others hold zeros).
      float al = fmaxf(bf16x8_amax(xa), bf16x8_amax(xb));
      float ar = fmaxf(bf16x8_amax(ya), bf16x8_amax(yb));
#pragma unroll
      for (int m = 4; m >= 1; m >>= 1) al = fmaxf(al, __shfl_xor_sync(0xffffffffu, al, m));
#pragma unroll
      for (int m = 2; m >= 1; m >>= 1) ar = fmaxf(ar, __shfl_xor_sync(0xffffffffu, ar, m));
      sl = __fdiv_rn(al, 448.0f);
      sr = __fdiv_rn(ar, 448.0f);
      float* scales = static_cast<float*>(p.c[1]) + tok * 5;
      if ((lane & 7) == 0) scales[lane / 8] = sl;
      if (lane == 0) scales[4] = sr;
    }
    uint4* dst = reinterpret_cast<uint4*>(static_cast<unsigned char*>(p.c[0]) + tok * kRow);
    dst[lane] = e4m3x16(xa, xb, sl);
    if (rope) dst[32 + lane] = e4m3x16(ya, yb, sr);
  }
}

// ---- NVFP4: re-quantize a whole 16-token tile ---------------------------------------------------
struct Nvfp4Smem {
  uint4 rows[kTile][kRowVec];         // present rows of the tile, BF16
  float amax[kTile][kBlocks];         // per row, per 16-value block
  float d_lat[kLatBlocks];            // dequant step of each latent tile block
  float d_rope[kTile][kRopeBlocks];
  unsigned sc_lat[kLatBlocks / 4];    // E4M3 scale codes, 4 per word, low byte = lower column
  unsigned sc_rope[kTile];
};

template <class C>
__device__ void nvfp4_tile(const Params& p, Nvfp4Smem& sm, int b, int row0, int s, int e, int ts,
                           bool first, int pg) {
  constexpr int R = C::kRing;
  const int tid = threadIdx.x;
  const int k = min(e, ts + kTile) - ts;   // present rows ts..ts+k-1
  const int ts0 = s / kTile * kTile;       // start of the first touched tile
  uint4* ring = static_cast<uint4*>(p.c[C::kSwizzle ? 2 : 3]) +
                static_cast<long long>(p.ring_slot[b]) * R * kRowVec;

  // Rows older than this call come from the ring (only in the first tile). A new row goes to the
  // ring if it is among the last R positions; when its ring slot holds an old row the first
  // tile still has to read, the first tile's CTA writes it after reading (below).
  for (int i = tid; i < k * kRowVec; i += C::kThreads) {
    const int r = i / kRowVec, v = i - r * kRowVec, pos = ts + r;
    uint4 val;
    if (pos < s) {
      val = ring[(pos % R) * kRowVec + v];
    } else {
      val = p.rows[static_cast<long long>(row0 + pos - s) * kRowVec + v];
      if (pos >= e - R && (pos - ts0) % R >= s - ts0) ring[(pos % R) * kRowVec + v] = val;
    }
    sm.rows[r][v] = val;
  }
  __syncthreads();
  if (first) {
    // For each old row q in ts0..s-1, the one position of e-R..e-1 sharing its ring slot.
    for (int i = tid; i < (s - ts0) * kRowVec; i += C::kThreads) {
      const int j = i / kRowVec, v = i - j * kRowVec;
      const int base = e - R;
      const int pos = base + (((ts0 + j - base) % R) + R) % R;
      if (pos >= s) ring[(pos % R) * kRowVec + v] = p.rows[static_cast<long long>(row0 + pos - s) * kRowVec + v];
    }
  }
  if (pg < 0) return;  // bad page id: nothing paged is written (the host reports it)

  for (int i = tid; i < k * kBlocks; i += C::kThreads) {
    const int r = i / kBlocks, c = i - r * kBlocks;
    sm.amax[r][c] = fmaxf(bf16x8_amax(sm.rows[r][2 * c]), bf16x8_amax(sm.rows[r][2 * c + 1]));
  }
  __syncthreads();

  const float G = p.scale;
  for (int i = tid; i < kLatBlocks + k * kRopeBlocks; i += C::kThreads) {
    if (i < kLatBlocks) {
      float a = 0.f;
      for (int r = 0; r < k; ++r) a = fmaxf(a, sm.amax[r][i]);
      const unsigned code = nvfp4_scale_code(a, G);
      sm.d_lat[i] = nvfp4_step(code, G);
      reinterpret_cast<unsigned char*>(sm.sc_lat)[i] = static_cast<unsigned char>(code);
    } else {
      const int r = (i - kLatBlocks) / kRopeBlocks, c = (i - kLatBlocks) % kRopeBlocks;
      const unsigned code = nvfp4_scale_code(sm.amax[r][kLatBlocks + c], G);
      sm.d_rope[r][c] = nvfp4_step(code, G);
      reinterpret_cast<unsigned char*>(sm.sc_rope)[r * 4 + c] = static_cast<unsigned char>(code);
    }
  }
  __syncthreads();

  const int slot0 = ts % C::kPage;
  if constexpr (C::kSwizzle) {
    // The latent tile scale goes to all 16 rows of the tile; rope scales to present rows only.
    unsigned char* sc = static_cast<unsigned char*>(p.c[1]) +
                        static_cast<long long>(pg) * (C::kPage * kBlocks);
    for (int i = tid; i < kTile * (kLatBlocks / 4) + k; i += C::kThreads) {
      if (i < kTile * (kLatBlocks / 4)) {
        const int r = i / (kLatBlocks / 4), g = i % (kLatBlocks / 4);
        *reinterpret_cast<unsigned*>(sc + swizzle_128x4(slot0 + r, 4 * g)) = sm.sc_lat[g];
      } else {
        const int r = i - kTile * (kLatBlocks / 4);
        *reinterpret_cast<unsigned*>(sc + swizzle_128x4(slot0 + r, kLatBlocks)) = sm.sc_rope[r];
      }
    }
  } else {
    unsigned* tile_sc = static_cast<unsigned*>(p.c[1]) +
                        (static_cast<long long>(pg) * (C::kPage / kTile) + slot0 / kTile) * (kLatBlocks / 4);
    unsigned* rope_sc = static_cast<unsigned*>(p.c[2]) + static_cast<long long>(pg) * C::kPage + slot0;
    if (tid < kLatBlocks / 4) tile_sc[tid] = sm.sc_lat[tid];
    if (tid < k) rope_sc[tid] = sm.sc_rope[tid];
  }

  // Codes: 8 values -> one 32-bit word; a warp stores 128 contiguous bytes of a row.
  unsigned* codes = reinterpret_cast<unsigned*>(static_cast<unsigned char*>(p.c[0]) +
      (static_cast<long long>(pg) * C::kPage + slot0) * kFp4RowBytes);
  for (int i = tid; i < k * kRowVec; i += C::kThreads) {
    const int r = i / kRowVec, v = i - r * kRowVec, c = v / 2;
    const float d = c < kLatBlocks ? sm.d_lat[c] : sm.d_rope[r][c - kLatBlocks];
    float x[8];
    bf16x8_to_float(sm.rows[r][v], x);
#pragma unroll
    for (int t = 0; t < 8; ++t) x[t] = div_or_zero(x[t], d);
    codes[r * (kFp4RowBytes / 4) + v] = e2m1x8<C::kHwFp4Cvt>(x);
  }
}

// The sequence's row range and start, checked (error-word kernels): 0 when it is written, else the
// faults that skip it. `grid_short` marks rows past the tiles the grid covers (they are dropped).
template <class C>
__device__ __forceinline__ unsigned check_seq(const Params& p, int b, int row0, long long n, int s) {
  if (n == 0) return 0u;
  unsigned bad = 0;
  if (row0 < 0 || n < 0 || row0 + n > p.num_rows) bad |= fault::kRows;
  if (s < 0 || s + n > 0x7fffffffll) bad |= fault::kStart;
  if constexpr (C::kKv == KvKind::kNvfp4) {
    const int r = p.ring_slot[b];
    if (r < 0 || r >= p.num_slots) bad |= fault::kRing;
  }
  return bad;
}

template <class C>
__device__ void kv_cache_write(const Params& p) {
  constexpr bool kF = fault::On<C>::value;
  const int b = blockIdx.x;
  if (b >= p.num_seqs) return;
  const int row0 = p.cu_rows[b];
  int n = p.cu_rows[b + 1] - row0;
  const int s = p.start_pos[b];
  if constexpr (kF) {
    // Every CTA of the sequence sees the same values; CTA y == 0 reports for them all.
    const long long n64 = static_cast<long long>(p.cu_rows[b + 1]) - row0;
    const bool lead = blockIdx.y == 0 && threadIdx.x == 0;
    const unsigned bad = check_seq<C>(p, b, row0, n64, s);
    if (bad != 0) {
      if (lead) fault::report(p.err, bad);
      return;   // the sequence is skipped: nothing paged, nothing in the ring
    }
    if (lead && n64 > 0 &&
        (static_cast<long long>(s / kTile) + gridDim.y) * kTile < s + n64) fault::report(p.err, fault::kRows);
    n = static_cast<int>(n64);
  }
  if (n <= 0 || s < 0) return;
  const int e = s + n;
  int ts;
  if constexpr (kF) {
    const long long ts64 = (static_cast<long long>(s / kTile) + blockIdx.y) * kTile;
    if (ts64 >= e) return;
    ts = static_cast<int>(ts64);
  } else {
    ts = (s / kTile + static_cast<int>(blockIdx.y)) * kTile;
    if (ts >= e) return;
  }
  int pg;
  if constexpr (kF) {
    // A missing column or a page id outside the pool: nothing paged is written for the tile (the
    // NVFP4 ring, which is the sequence's own, still is).
    const int j = ts / C::kPage;
    pg = j < p.bt_cols ? p.block_table[static_cast<long long>(b) * p.bt_stride + j] : -1;
    if (pg < 0 || pg >= p.num_pages) {
      if (threadIdx.x == 0) fault::report(p.err, j < p.bt_cols ? fault::kPage : fault::kTable);
      pg = -1;
    }
  } else {
    pg = p.block_table[static_cast<long long>(b) * p.bt_stride + ts / C::kPage];
    if (pg >= p.num_pages) pg = -1;
  }
  if constexpr (C::kKv == KvKind::kNvfp4) {
    __shared__ Nvfp4Smem sm;
    nvfp4_tile<C>(p, sm, b, row0, s, e, ts, blockIdx.y == 0, pg);
  } else {
    const int lo = max(s, ts), hi = min(e, ts + kTile);
    if (pg < 0) return;
    if constexpr (C::kKv == KvKind::kBf16) bf16_tile<C>(p, row0 + lo - s, lo, hi, pg);
    else fp8_tile<C>(p, row0 + lo - s, lo, hi, pg);
  }
}

}  // namespace kvw
}  // namespace k3gen
