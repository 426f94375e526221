"""act_quant_fp8 in CuTe DSL: per-token, per-128-column FP8 (E4M3) activation quantization.

The contract (layouts, rounding, zero groups, UE8M0 bytes, launch geometry) is stated once in
`k3gen/ops/act_quant_fp8/spec.py`; this module implements it:

- A thread loads VEC = 8 BF16 (one 16-byte load), LANES = 16 adjacent threads own a group, and
  the group's amax is a 4-step butterfly shuffle, so no shared memory and no barrier are needed.
- Threads past the last group still load (from a clamped row) and shuffle, so every shuffle runs
  in a converged warp; only their stores are skipped.
- FP32 recipe: q = x / s with IEEE division (div.rn.f32), since a reciprocal multiply rounds
  differently from the reference. UE8M0 recipe: s is a power of two, so q = x * 2^(127 - b) is
  exact and rounds like the division; no division is needed.
- E4M3 conversion is cvt.rn.satfinite.e4m3x2.f32: round-to-nearest-even, saturating at +-448.

Importing this module imports cutlass; only the compile worker (k3gen.pipeline.cute) does.
"""
from __future__ import annotations

import cuda.bindings.driver as cuda_drv
import cutlass
import cutlass.cute as cute
from cutlass import Float32, Uint32
from cutlass.cute.runtime import make_fake_compact_tensor

from k3gen.ir.dtypes import ScaleRecipe
from k3gen.ops.act_quant_fp8.spec import GROUP, LANES, VEC, ActQuantFp8Spec

E4M3_MAX = 448.0
_MANT_MASK = 0x7FFFFF
_POW2_M127 = 0x400000       # FP32 bits of 2^-127 (a subnormal: they are its mantissa)


class ActQuantFp8Kernel:
    """One compiled variant: K, recipe and block size are compile-time constants."""

    def __init__(self, spec: ActQuantFp8Spec):
        self.groups = spec.groups
        self.ue8m0 = spec.recipe is ScaleRecipe.UE8M0
        self.threads = spec.threads
        self.groups_per_cta = spec.groups_per_cta

    @cute.jit
    def __call__(self, mX: cute.Tensor, mQ: cute.Tensor, mS: cute.Tensor, stream: cuda_drv.CUstream):
        # Traced only to compile; k3gen launches the cubin itself with the spec's grid.
        total = mX.shape[0] * self.groups
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
        q = cute.make_rmem_tensor((1, VEC), Float32)
        if cutlass.const_expr(self.ue8m0):
            # b = biased exponent of 2^ceil(log2 t). t >= 0 (or NaN), so bits >> 23 is its biased
            # exponent; any mantissa bit rounds up. Subnormal t: 2^-126 above 2^-127, else 2^-127
            # (b = 0, also for t == 0). Inf saturates to 254, NaN gives 255.
            bits = t.bitcast(Uint32)
            biased = bits >> 23
            mant = bits & _MANT_MASK
            b = biased + Uint32(cutlass.select_(mant != 0, Uint32(1), Uint32(0)))
            sub = Uint32(cutlass.select_(mant > _POW2_M127, Uint32(1), Uint32(0)))
            b = Uint32(cutlass.select_(biased == 0, sub, b))
            b = cutlass.min(b, Uint32(254))
            # 2^(127 - b) from its exponent bits; b = 254 (only from an infinite amax) needs the
            # subnormal 2^-127, which has no exponent field of its own.
            inv = ((Uint32(254) - b) << 23).bitcast(Float32)
            inv = Float32(cutlass.select_(b == 254, Uint32(_POW2_M127).bitcast(Float32), inv))
            nan = t != t
            inv = Float32(cutlass.select_(nan, t, inv))
            b = Uint32(cutlass.select_(nan, Uint32(255), b))
            for i in cutlass.range_constexpr(VEC):
                q[i] = x[i] * inv
            scale = b.to(cutlass.Uint8)
        else:
            zero = t == Float32(0.0)
            div = Float32(cutlass.select_(zero, Float32(1.0), t))
            for i in cutlass.range_constexpr(VEC):
                q[i] = Float32(cutlass.select_(zero, Float32(0.0), x[i] / div))
            scale = t

        codes = cute.make_rmem_tensor((1, VEC), cutlass.Float8E4M3FN)
        codes.store(q.load().to(cutlass.Float8E4M3FN))
        if valid:
            cute.autovec_copy(codes, cute.local_tile(mQ, (1, VEC), (row, vcol)))
            if lane == 0:
                mS[row, cg] = scale


# A short, stable symbol instead of the DSL's mangled one (which spells out every argument type).
ActQuantFp8Kernel.kernel.set_name_prefix("k3gen_act_quant_fp8", remove_cutlass_symbol=True,
                                         keep_mangled_name=False)


def compile_args(spec: ActQuantFp8Spec):
    """(jit callable, [(name, fake tensor), ...]) in kernel parameter order, for cute.compile.

    Every tensor shares one dynamic M (a 32-bit SymInt); K and all strides are static, so each
    tensor parameter carries its pointer and M only. The alignments promised here are what the
    launcher checks.
    """
    m = cute.sym_int32(symbol="M")
    scale_t = cutlass.Uint8 if spec.recipe is ScaleRecipe.UE8M0 else cutlass.Float32
    args = [
        ("x", make_fake_compact_tensor(cutlass.BFloat16, (m, spec.k), stride_order=(1, 0),
                                       assumed_align=16)),
        ("codes", make_fake_compact_tensor(cutlass.Float8E4M3FN, (m, spec.k), stride_order=(1, 0),
                                           assumed_align=16)),
        ("scales", make_fake_compact_tensor(scale_t, (m, spec.k // GROUP), stride_order=(1, 0),
                                            assumed_align=scale_t.width // 8)),
    ]
    return ActQuantFp8Kernel(spec), args
