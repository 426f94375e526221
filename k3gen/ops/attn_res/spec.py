"""attn_res: the Attention Residuals mix of decode / verify rows (SPEC.md section 1), fused with the
RMSNorm that follows it and, optionally, the FP8 per-token-128 quantization of the next GEMM.

Kernel contract (shared by the template, include/k3gen/attn_res/mix.cuh, the reference and the launcher):

- Sources: src[N_max, M', hidden] FP32, a buffer allocated once (unit inner stride, rows and sources
  at strides that are multiples of 4 elements, 16-byte aligned); sources 0..n-1 of rows 0..M-1 are
  valid, n (1 <= n <= max_sources) a launch argument. Source n-1 is the running partial sum of the
  current block, the others the completed blocks (source 0: the embedding).
- Per row and source i: r_i = 1 / sqrt(S(V_i * V_i) / hidden + eps); score_i = r_i * S(V_i * q)
  with q = res_norm.weight * res_proj (FP32 [hidden]); alpha = softmax(score) over i < n:
  p_i = FP32(exp(score_i - max)) (the exp in FP64, rounded once), alpha_i = p_i / (p_0 + ... + p_{n-1})
  (sum in source order); x = alpha_0 V_0 + alpha_1 V_1 + ... (source order, each product rounded).
  S(.) is the row sum in the one order include/k3gen/attn_res/mix.cuh states (it depends on
  hidden alone, never on M or a row's position: rows are invariant). Every operation is an FP32
  operation rounded once (no fused multiply-add).
- out = BF16((x * rn) * w) with rn = 1 / sqrt(S(x * x) / hidden + eps), w the BF16 norm weight
  (model/layers.rms_norm); with fp8, codes[M, hidden] E4M3 + scales[M, hidden/128] are exactly
  act_quant_fp8 (this spec's recipe) of out. `mixed` (optional, FP32 [M, hidden]) receives x.
- Block sealing: the partial sum becomes a completed block where it lies, so sealing only starts
  the next source. With delta (a spec field: the dtype of the previous layer's output [M, hidden]),
  the kernel first updates source n-1 in place: += FP32(delta) (`seal=False`), or = FP32(delta)
  (`seal=True`: source n-1 is the new block's first partial and is not read), then mixes. Without
  delta the caller does it with a slice op (launcher.accumulate / launcher.seal), graph-safe.

Launch: grid (M * slices), one CTA per (row, slice) of hidden / slices columns, the slices of a row
in one thread-block cluster; hidden / slices / 4 threads (4 columns each, one warp per FP8 group);
programmatic dependent launch (the weights are read before griddepcontrol.wait, everything the
previous kernels write after it).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

from k3gen.errors import SpecError
from k3gen.ir.dims import sym
from k3gen.ir.dtypes import ScaleRecipe
from k3gen.ir.spec import OpSpec, register_op

GROUP = 128
MAX_SOURCES = 16        # registers: 4 FP32 per source per thread
MAX_SLICES = 8          # the portable thread-block cluster size
MAX_THREADS = 1024


class ResDelta(str, enum.Enum):
    """Dtype of the layer output the kernel adds into the partial sum first (none: no update)."""
    NONE = "none"
    BF16 = "bf16"
    FP32 = "fp32"

    def __str__(self) -> str:
        return self.value


def slices_for(hidden: int) -> int:
    """CTAs per row: the most (<= 8) that cut hidden into whole 128-column groups."""
    groups = hidden // GROUP
    for s in (8, 4, 2, 1):
        if groups % s == 0 and hidden // s // 4 <= MAX_THREADS:
            return s
    return 0


@register_op("attn_res")
@dataclass(frozen=True, kw_only=True)
class AttnResSpec(OpSpec):
    hidden: int                           # K3: 7168
    max_sources: int = 9                  # N_max (K3: embedding + 8 blocks)
    eps: float = 1e-5
    fp8: bool = True                      # also write act_quant_fp8 of the normed row
    recipe: ScaleRecipe | None = None     # FP8 scale recipe; defaults to the target's when fp8
    delta: ResDelta = ResDelta.NONE

    def resolve(self) -> None:
        if self.recipe is None and self.fp8 is True:
            object.__setattr__(self, "recipe", self.target.scale_recipe)

    def validate(self) -> None:
        h = self.hidden
        if isinstance(h, bool) or not isinstance(h, int) or h <= 0 or h % GROUP or not slices_for(h):
            raise SpecError("hidden", h, f"positive multiples of {GROUP} up to {MAX_SLICES * MAX_THREADS * 4}",
                            "one FP8 group per warp")
        if isinstance(self.max_sources, bool) or not isinstance(self.max_sources, int) \
                or not 1 <= self.max_sources <= MAX_SOURCES:
            raise SpecError("max_sources", self.max_sources, f"1..{MAX_SOURCES}")
        if not isinstance(self.eps, float) or not 0.0 < self.eps < 1.0:
            raise SpecError("eps", self.eps, "a float in (0, 1)")
        if not isinstance(self.fp8, bool):
            raise SpecError("fp8", self.fp8, [True, False])
        if self.fp8 and not isinstance(self.recipe, ScaleRecipe):
            raise SpecError("recipe", self.recipe, [r.value for r in ScaleRecipe])
        if not self.fp8 and self.recipe is not None:
            raise SpecError("recipe", self.recipe, [None], "no FP8 output (fp8=False)")
        if not isinstance(self.delta, ResDelta):
            raise SpecError("delta", self.delta, [d.value for d in ResDelta])
        self.impl  # noqa: B018  (a kernel for this target, or SpecError with each variant's reason)

    # -- kernel contract --------------------------------------------------------------------
    @property
    def slices(self) -> int:
        return slices_for(self.hidden)

    @property
    def threads(self) -> int:
        return self.hidden // self.slices // 4

    @property
    def groups(self) -> int:
        return self.hidden // GROUP

    def grid(self, m: int) -> tuple[int, int, int]:
        return (m * self.slices, 1, 1)

    def slug(self) -> str:
        s = f"h{self.hidden}-n{self.max_sources}-" + (self.recipe.value if self.fp8 else "bf16")
        if self.delta is not ResDelta.NONE:
            s += f"-d{self.delta.value}"
        if self.eps != 1e-5:
            s += f"-eps{self.eps:g}"
        return s

    # -- estimates --------------------------------------------------------------------------
    def bytes_moved(self):
        """Per M rows mixing N sources (sympy over M, N): the sources, query and norm weight in;
        the BF16 row (+ codes and scales) out; with delta, delta in and the partial sum out."""
        M, N = sym("M"), sym("N")
        h = self.hidden
        b = M * N * h * 4 + h * 4 + h * 2 + M * h * 2
        if self.fp8:
            b += M * h + M * self.groups * (4 if self.recipe is ScaleRecipe.FP32 else 1)
        if self.delta is not ResDelta.NONE:
            b += M * h * (2 if self.delta is ResDelta.BF16 else 4) + M * h * 4
        return b

    def flops(self):
        M, N = sym("M"), sym("N")
        return M * N * self.hidden * 7 + M * self.hidden * 6
