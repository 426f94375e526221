// mla_decode on sm_90a: what the warp-specialized wgmma kernels share (decode_wg_fp8.cuh,
// decode_wg_nvfp4.cuh, decode_wg_qm.cuh; variants "wgmma" and "wgmma_qm" of
// k3gen/ops/mla_decode/variants.py). 384 threads = a producer warpgroup and two consumer warpgroups,
// one CTA per SM: register split, the SW128 K-major operand layout and its descriptors, the
// accumulator column reductions, the FP32 output rows. Address math is replayed on the CPU by
// tests/nogpu/test_mla_decode_wg*.py against the PTX layouts (k3gen/arch/sm90.py).
//
// Operands use the SW128 K-major layout of 128-byte rows: a [rows][576] BF16 operand is 9 blocks
// of [rows][64 elements]; row r of a block at (r / 8) * 1024 + (r % 8) * 128, 16-byte chunk c at
// (c ^ (r % 8)) * 16. Read MN-major, a [64 tokens][64 dims] block is exactly the SW128 MN-major
// atom stack of those 64 dims: one 128-byte row per token, 8 tokens per 1024-byte atom.
#pragma once

#include <cuda_bf16.h>

#include "k3gen/mla/decode.cuh"
#include "k3gen/common/sm90_async.cuh"

#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
#error "the wgmma kernels of mla_decode need sm_90a"
#endif

namespace k3gen {
namespace mla {
namespace wg {

constexpr int kBlk = kTok * 128;             // one [64 tokens][64 dims] SW128 block
constexpr int kOStride = kLat + 4;           // merge buffer row (FP32)
constexpr int kProducerRegs = 56, kConsumerRegs = 224;
static_assert(128 * kProducerRegs + 256 * kConsumerRegs <= 65536, "register file");

// Byte offset of 16-byte chunk c (of 72) of row `row` in a [rows][576] BF16 operand (9 SW128 blocks).
__device__ __forceinline__ int sw_off(int rows, int row, int c) {
  return (c >> 3) * rows * 128 + (row >> 3) * 1024 + (row & 7) * 128 + (((c & 7) ^ (row & 7)) << 4);
}
// K-major SW128 operand (LBO unused), SBO = the 8-row group stride.
__device__ __forceinline__ unsigned long long desc_k(unsigned a) { return sm90::wgmma_desc<16, 1024, 1>(a); }
// The same descriptor split in its two words (the FP8 and NVFP4 kernels): the high one (SBO 1024,
// layout 128B swizzle) also serves MN-major operands of one 64-element M block (whose LBO, the
// M-block stride, is never applied), and adding (bytes >> 4) to the low word moves the start
// (shared addresses < 2^18, so it never carries into the LBO field).
constexpr unsigned kDescHi = static_cast<unsigned>(sm90::wgmma_desc<16, 1024, 1>(0u) >> 32);
static_assert(static_cast<unsigned>(sm90::wgmma_desc<1024, 1024, 1>(0u) >> 32) == kDescHi, "one high word");
__device__ __forceinline__ unsigned desc_lo(unsigned addr) {
  return static_cast<unsigned>(sm90::wgmma_desc<16, 1024, 1>(addr));
}
__device__ __forceinline__ unsigned long long desc(unsigned lo) {
  return (static_cast<unsigned long long>(kDescHi) << 32) | lo;
}

// A compile-time consumer index (one instantiation per consumer keeps its descriptors uniform).
template <int V>
struct IntC {
  static constexpr int value = V;
};

// max |q| over the 16 query rows r0 .. of sequence b (rows past ht excluded), all kThreads
// threads of the CTA (a barrier inside; scratch: kThreads / 32 floats).
template <int kThreads>
__device__ __forceinline__ float q_amax16(const uint4* qg, int r0, int ht, float* scratch) {
  const int tid = threadIdx.x;
  float mx = 0.f;
  for (int i = tid; i < 16 * kChunks; i += kThreads) {
    if (r0 + i / kChunks >= ht) break;
    mx = fmaxf(mx, bf16x8_amax(qg[i]));
  }
  return block_max<kThreads>(mx, scratch);
}

// Max / sum over the 8 lanes that hold the same accumulator column (lanes differing in lane / 4).
__device__ __forceinline__ float col_max8(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 4));
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 8));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 16));
}
__device__ __forceinline__ float col_sum8(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 4);
  x += __shfl_xor_sync(0xffffffffu, x, 8);
  return x + __shfl_xor_sync(0xffffffffu, x, 16);
}

// The CTA's n_rows output rows from the FP32 merge buffer ([rows][kOStride]), 4 columns per
// thread over the 256 consumer threads (i0 = tid - 128): BF16 out with one split, FP32 partials
// with several.
__device__ __forceinline__ void rows_out(const Params& p, const float* buf, int n_rows, int b, int split, int r0,
                                         int ht, int i0) {
  for (int i = i0; i < n_rows * (kLat / 4); i += 256) {
    const int row = i / (kLat / 4), col = (i - row * (kLat / 4)) * 4;
    if (r0 + row >= ht) break;
    const float4 v = *reinterpret_cast<const float4*>(buf + row * kOStride + col);
    if (p.splits == 1) {
      *reinterpret_cast<uint2*>(p.out + (static_cast<long long>(b) * ht + r0 + row) * kLat + col) =
          make_uint2(bf16x2(v.x, v.y), bf16x2(v.z, v.w));
    } else {
      *reinterpret_cast<float4*>(p.part_o + ((static_cast<long long>(b) * p.splits + split) * ht + r0 + row) * kLat +
                                 col) = v;
    }
  }
}

}  // namespace wg
}  // namespace mla
}  // namespace k3gen
