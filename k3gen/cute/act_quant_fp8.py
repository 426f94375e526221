"""act_quant_fp8 in CuTe DSL: per-token, per-128-column FP8 (E4M3) activation quantization.

Kernel contract (shared with k3gen.reference.act_quant_fp8 and the launcher):

- x[M, K] BF16 row-major, K static and a multiple of 128; M dynamic (a field of each tensor
  parameter). codes[M, K] E4M3 bytes, scales[M, K/128] FP32, both row-major and compact.
- A thread owns VEC = 8 consecutive elements (one 16-byte load), LANES = 16 adjacent threads own
  one 128-column group, so a CTA of `threads` threads quantizes threads/16 groups. Groups are
  numbered row-major over (M, K/128) and spread over a 1-D grid of ceil(M*K/128 / (threads/16))
  CTAs, so a decode step (M = 1) still spreads one token over several SMs.
- FP32 recipe: s = amax / 448 (IEEE division), code = E4M3_rn_satfinite(x / s); where s == 0
  (all inputs of the group are zeros) the divisor is 1, so codes are signed zeros and s stays 0.
- UE8M0 recipe: t = amax / 448, s = 2^max(ceil(log2 t), -126) stored as the FP32 value of that
  power of two; code = E4M3_rn_satfinite(x * 2^-e) (a multiply by an exact power of two rounds
  exactly like the division x / s). An all-zero group gets s = 2^-126 and zero codes.

The kernel does not use shared memory and needs no cluster, so it launches with 0 dynamic
shared memory bytes; the block size is pinned with reqntid, so it must equal `threads`.
"""
from __future__ import annotations

from dataclasses import dataclass

import cuda.bindings.driver as cuda_drv
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Uint32

GROUP = 128          # columns sharing one scale
VEC = 8              # BF16 elements per thread: one 16-byte global load
LANES = GROUP // VEC  # threads per group; a power of two <= 32 so the amax reduction stays in a warp
E4M3_MAX = 448.0
UE8M0_MIN_EXP = 1    # biased FP32 exponent of the smallest scale, 2^-126 (normal, so 1/s is exact)


class ActQuantFp8Kernel:
    """One compiled variant: K, recipe and block size are compile-time constants."""

    def __init__(self, *, k: int, ue8m0: bool, threads: int):
        self.k = k
        self.groups = k // GROUP
        self.ue8m0 = ue8m0
        self.threads = threads
        self.groups_per_cta = threads // LANES

    @cute.jit
    def __call__(self, mX: cute.Tensor, mQ: cute.Tensor, mS: cute.Tensor, stream: cuda_drv.CUstream):
        # Used only to trace and compile; k3gen launches the cubin itself with the same grid.
        m = mX.shape[0]
        total = m * self.groups
        grid = (total + self.groups_per_cta - 1) // self.groups_per_cta
        self.kernel(mX, mQ, mS).launch(grid=[grid, 1, 1], block=[self.threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mQ: cute.Tensor, mS: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        m = mX.shape[0]

        g = bidx * self.groups_per_cta + tidx // LANES
        lane = tidx % LANES
        row = g // self.groups
        cg = g - row * self.groups
        vcol = cg * LANES + lane
        # Threads past the end still load (a clamped row) and shuffle, so every shuffle sees a
        # converged warp; only their stores are skipped.
        valid = g < m * self.groups
        row_ld = cutlass.min(row, m - 1)

        x_frag = cute.make_rmem_tensor((1, VEC), cutlass.BFloat16)
        cute.autovec_copy(cute.local_tile(mX, (1, VEC), (row_ld, vcol)), x_frag)
        x = x_frag.load().to(Float32)

        amax = Float32(0.0)
        for i in cutlass.range_constexpr(VEC):
            amax = cute.arch.fmax(amax, cute.math.abs(x[i]), nan=True)
        off = LANES // 2
        while off > 0:
            amax = cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(amax, offset=off), nan=True)
            off //= 2

        t = amax / Float32(E4M3_MAX)
        q_frag = cute.make_rmem_tensor((1, VEC), Float32)
        if cutlass.const_expr(self.ue8m0):
            # ceil(log2 t) from the bits: t >= 0, so bits >> 23 is the biased exponent, and any
            # mantissa bit rounds it up. Subnormal and zero t take the floor 2^-126.
            bits = t.bitcast(Uint32)
            e = (bits >> 23) + cutlass.select_((bits & 0x7FFFFF) != 0, Uint32(1), Uint32(0))
            e = cutlass.max(e, Uint32(UE8M0_MIN_EXP))
            scale = (e << 23).bitcast(Float32)
            inv = ((Uint32(254) - e) << 23).bitcast(Float32)
            for i in cutlass.range_constexpr(VEC):
                q_frag[i] = x[i] * inv
        else:
            scale = t
            # s == 0 only when every input is +-0: dividing by 1 keeps signed zero codes.
            div = cutlass.select_(t == Float32(0.0), Float32(1.0), t)
            for i in cutlass.range_constexpr(VEC):
                q_frag[i] = x[i] / div

        codes = cute.make_rmem_tensor((1, VEC), cutlass.Float8E4M3FN)
        codes.store(q_frag.load().to(cutlass.Float8E4M3FN))
        if valid:
            cute.autovec_copy(codes, cute.local_tile(mQ, (1, VEC), (row, vcol)))
            if lane == 0:
                mS[row, cg] = scale


# A short, stable symbol instead of the DSL's mangled one (which spells out every argument type).
ActQuantFp8Kernel.kernel.set_name_prefix("k3gen_act_quant_fp8", remove_cutlass_symbol=True,
                                         keep_mangled_name=False)
