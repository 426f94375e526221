"""glu_act: h = act(gate, up) of the fused [gate | up] projection's BF16 output, rounded to BF16 and
quantized per token per 128 columns to E4M3 for the down projection's FP8 block GEMM (the shared
experts and the dense MLP of K3 / Kimi-Linear; SPEC.md section 1, issue 21).

Kernel contract (shared by the template, include/k3gen/glu/act.cuh, the reference and the launcher):

- In: gu[M, 2I] BF16, row-major, contiguous: gate = gu[:, :I], up = gu[:, I:]. I (`inter`) static, a
  multiple of 128; M dynamic (M * I < 2^31).
- Activation, every operation in FP64 on the exact BF16 inputs g, u, then rounded to FP32 and to BF16
  (round to nearest even both times):
  SiTU: h = ((beta * tanh(g / beta)) * (1 / (1 + exp(-g)))) * (linear_beta * tanh(u / linear_beta))
  (model/arch.situ, the published `hidden_act: situ`); SiLU: h = (g * (1 / (1 + exp(-g)))) * u.
  FP64 so that the kernel and the CPU reference agree bit for bit: two FP64 libraries differ by an
  ulp of FP64, which moves the BF16 value only when it lies within ~2^-52 of a rounding edge.
- Out: codes[M, I] E4M3 bytes and scales[M, I/128] exactly act_quant_fp8 (this spec's recipe) of the
  BF16 h (ops/act_quant_fp8/spec.py: FP32 amax / 448, or its UE8M0 power of two).

Launch: one warp per (row, 128-column group), 4 columns per lane; CTAs of 4 warps, grid
ceil(M * I / 128 / 4); programmatic dependent launch (griddepcontrol.wait before reading gu).
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from k3gen.errors import SpecError
from k3gen.ir.dims import sym
from k3gen.ir.dtypes import ScaleRecipe
from k3gen.ir.spec import OpSpec, register_op

GROUP = 128
WARPS = 4                   # groups per CTA
THREADS = 32 * WARPS
MAX_ELEMENTS = 2 ** 31


class GluKind(str, enum.Enum):
    SITU = "situ"
    SILU = "silu"

    def __str__(self) -> str:
        return self.value


def _posfloat(v) -> bool:
    return isinstance(v, float) and not isinstance(v, bool) and math.isfinite(v) and v > 0.0


@register_op("glu_act")
@dataclass(frozen=True, kw_only=True)
class GluActSpec(OpSpec):
    inter: int                          # I: the intermediate width (columns of gate, of up)
    act: GluKind = GluKind.SITU
    beta: float = 4.0                   # SiTU's beta (activation_situ_beta)
    linear_beta: float = 25.0           # SiTU's linear_beta (activation_situ_linear_beta)
    recipe: ScaleRecipe | None = None   # defaults to the target's GEMM scale recipe

    def resolve(self) -> None:
        if self.recipe is None:
            object.__setattr__(self, "recipe", self.target.scale_recipe)

    def validate(self) -> None:
        i = self.inter
        if isinstance(i, bool) or not isinstance(i, int) or i <= 0 or i % GROUP:
            raise SpecError("inter", i, f"positive multiples of {GROUP}", "one FP8 scale per 128 columns")
        if not isinstance(self.act, GluKind):
            raise SpecError("act", self.act, [a.value for a in GluKind])
        for f in ("beta", "linear_beta"):
            if not _posfloat(getattr(self, f)):
                raise SpecError(f, getattr(self, f), "a finite float > 0")
        if self.act is GluKind.SILU and (self.beta, self.linear_beta) != (4.0, 25.0):
            raise SpecError("beta", (self.beta, self.linear_beta), [(4.0, 25.0)], "SiLU has no betas (defaults)")
        if not isinstance(self.recipe, ScaleRecipe):
            raise SpecError("recipe", self.recipe, [r.value for r in ScaleRecipe])
        self.impl  # noqa: B018  (a kernel for this target, or SpecError with each variant's reason)

    # -- kernel contract --------------------------------------------------------------------
    @property
    def groups(self) -> int:
        return self.inter // GROUP

    def grid(self, m: int) -> tuple[int, int, int]:
        return (-(-m * self.groups // WARPS), 1, 1)

    def literal(self, v: float) -> str:
        """A beta as the C++ double the kernel divides and multiplies by (the reference's float64)."""
        return repr(float(v))

    def slug(self) -> str:
        s = f"i{self.inter}-{self.act.value}-{self.recipe.value}"
        if self.act is GluKind.SITU and (self.beta, self.linear_beta) != (4.0, 25.0):
            s += f"-b{self.beta:g}-lb{self.linear_beta:g}"
        return s

    # -- estimates --------------------------------------------------------------------------
    def bytes_moved(self):
        """Per M rows: gu in (BF16), codes and scales out."""
        M = sym("M")
        return M * 2 * self.inter * 2 + M * self.inter + M * self.groups * (4 if self.recipe is ScaleRecipe.FP32 else 1)

    def flops(self):
        """Per element: two tanh and an exp in FP64 (~20 operations each), the products, the quantization."""
        M = sym("M")
        return M * self.inter * 70
