"""act_quant_fp8: per-token, per-128-column FP8 (E4M3) quantization of activations.

Runs ahead of the FP8 block GEMM (SPEC.md section 6). Kernel contract (shared by the CuTe DSL
kernel ops/act_quant_fp8/cute_kernel.py, the reference ops/act_quant_fp8/reference.py and the
launcher):

- In: x[M, K] BF16, row-major, contiguous. K is static (a multiple of 128), M is dynamic.
- Out: codes[M, K] E4M3 bytes (uint8 storage), scales[M, K/128], both row-major, contiguous.
  Group g of row m is x[m, 128 g : 128 (g + 1)], amax = max |x| over it (NaN propagates).
- FP32 recipe: scales are FP32, s = amax / 448 (IEEE division); code = E4M3_rn_satfinite(x / s);
  where s == 0 (an all-zero group) every code is 0x00 and s stays 0.
- UE8M0 recipe: scales are UE8M0 *bytes* (uint8): b = the biased exponent of
  2^ceil(log2(amax / 448)), clamped to [0, 254], i.e. s = 2^(b - 127); an all-zero group gets
  b = 0 (s = 2^-127, finite) and zero codes (0x80 for -0 inputs: x / s keeps the sign);
  code = E4M3_rn_satfinite(x / s). NaN in a group gives b = 255. Bytes rather than
  FP32 values so that a GEMM built for the other recipe cannot read these scales by mistake: the
  scale tensor's dtype differs and the launcher rejects it. `k3gen.numerics.ue8m0_decode` gives
  the FP32 value.
- Requirements checked by the launcher: x and codes 16-byte aligned (one 16-byte load and one
  8-byte store per thread), M * K < 2^31 (32-bit index math).

Launch geometry: 16 threads own one group (8 elements each), a CTA of `threads` threads owns
threads / 16 consecutive groups of the row-major (M, K/128) group grid; grid = (ceil(M K / 128 /
(threads / 16)), 1, 1), no dynamic shared memory.
"""
from __future__ import annotations

from dataclasses import dataclass

from k3gen.errors import SpecError
from k3gen.ir.dims import sym
from k3gen.ir.dtypes import BF16, E4M3, FP32, UE8M0, ScaleRecipe
from k3gen.ir.spec import OpSpec, register_op

GROUP = 128                # columns per scale
VEC = 8                    # BF16 elements per thread: one 16-byte load
LANES = GROUP // VEC       # threads per group; <= 32 so the amax reduction is a warp shuffle
THREADS = (64, 128, 256, 512)
MAX_ELEMENTS = 2 ** 31     # M * K bound of the kernel's 32-bit offsets


@register_op("act_quant_fp8")
@dataclass(frozen=True, kw_only=True)
class ActQuantFp8Spec(OpSpec):
    k: int                                # columns, static; multiple of 128
    recipe: ScaleRecipe | None = None     # defaults to the target's GEMM scale recipe
    threads: int = 128

    def resolve(self) -> None:
        if self.recipe is None:
            object.__setattr__(self, "recipe", self.target.scale_recipe)

    def validate(self) -> None:
        if not isinstance(self.k, int) or isinstance(self.k, bool) or self.k <= 0 or self.k % GROUP:
            raise SpecError("k", self.k, f"positive multiples of {GROUP}", "one scale per 128 columns")
        if not isinstance(self.recipe, ScaleRecipe):
            raise SpecError("recipe", self.recipe, [r.value for r in ScaleRecipe])
        if self.threads not in THREADS:
            raise SpecError("threads", self.threads, THREADS, "whole warps of 16-thread groups")
        self.impl  # noqa: B018  (a kernel for this target, or SpecError with each variant's reason)

    # -- kernel contract --------------------------------------------------------------------
    @property
    def groups(self) -> int:
        """Scales per row."""
        return self.k // GROUP

    @property
    def groups_per_cta(self) -> int:
        return self.threads // LANES

    @property
    def scale_dtype(self):
        return FP32 if self.recipe is ScaleRecipe.FP32 else UE8M0

    def grid(self, m: int) -> tuple[int, int, int]:
        """CTAs for M tokens (0 for M == 0: the launcher must then skip the launch)."""
        return (-(-m * self.groups // self.groups_per_cta), 1, 1)

    def slug(self) -> str:
        s = f"k{self.k}-{self.recipe.value}"
        if self.threads != 128:
            s += f"-t{self.threads}"
        return s

    # -- estimates --------------------------------------------------------------------------
    def bytes_moved(self):
        """Bytes for M tokens (sympy over M): read x, write codes and scales."""
        M = sym("M")
        return M * self.k * int(BF16.bytes + E4M3.bytes) + M * self.groups * int(self.scale_dtype.bytes)

    def flops(self):
        """Per element: |x| max, scaling (division or power-of-two multiply), conversion."""
        M = sym("M")
        return M * self.k * 3
