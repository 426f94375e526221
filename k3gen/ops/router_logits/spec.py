"""router_logits: out[m, e] = x[m, :] . w[e, :] in FP32, the MoE router's logits (SPEC.md section 1:
the noaux_tc sigmoid router's input; issue 21: the last PyTorch piece of the FFN step).

Kernel contract (shared by the template, include/k3gen/router/logits.cuh, the reference and the
launcher):

- In: x [M, H] BF16 (the FFN input rows), w [E, H] (the router weight) in `weight` dtype: BF16, or
  FP32 as K3's checkpoint stores it (its values are BF16 values; the kernel rounds each to BF16 to
  nearest even, a no-op for them, so every product stays exact), both row-major and contiguous.
  H (`hidden`) static, a multiple of 256; E (`experts`) static, <= 1024; M dynamic (M * E < 2^31).
- Out: logits [M, E] FP32, each in one fixed order whatever M and the other rows: lane l (0..31) of
  the expert's warp takes the 8-value chunks c = l, l + 32, l + 64, ... and adds the products of K
  values 8c .. 8c + 7, in K order, into an FP32 accumulator that starts at +0 by FMA (a product of
  two BF16 values is exact in FP32, so each step is one rounding of acc + x w); then the 32 lane sums
  meet in an XOR butterfly (offsets 16, 8, 4, 2, 1; a + b == b + a, so every lane holds the same
  bits). Row-invariant by construction: a verify row's logits equal the decode row's bit for bit.
  reference.py replays this order on the CPU, so a GPU result is checked bit for bit.
- Launch: CTAs of 4 warps (one expert each) x 8 rows: grid (ceil(E / 4), ceil(M / 8)); a warp streams
  its expert's weight row once per row block with 16-byte loads and keeps 8 row accumulators.
  Programmatic dependent launch: griddepcontrol.wait before the first read of x.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

from k3gen.errors import SpecError
from k3gen.ir.dims import sym
from k3gen.ir.spec import OpSpec, register_op

CHUNK = 8                  # K values per lane load (16 bytes of BF16)
LANES = 32
WARPS = 4                  # experts per CTA
ROWS = 8                   # rows per CTA (the accumulators a lane keeps)
THREADS = LANES * WARPS
MAX_EXPERTS = 1024
MAX_ELEMENTS = 2 ** 31


class RouterWeight(str, enum.Enum):
    BF16 = "bf16"
    FP32 = "fp32"

    def __str__(self) -> str:
        return self.value


def has_kernel(target, hidden: int, experts: int) -> bool:
    """Whether `target` builds router_logits for a router of this shape: the op on its menu (not the
    frozen sm100-mxfp4 one) and a width the kernel takes. The enumerator lists it and the model runs it
    exactly there; elsewhere the model keeps its FP64 PyTorch router."""
    return ("router_logits" in target.menu and hidden > 0 and hidden % (CHUNK * LANES) == 0
            and 1 <= experts <= MAX_EXPERTS)


@register_op("router_logits")
@dataclass(frozen=True, kw_only=True)
class RouterLogitsSpec(OpSpec):
    hidden: int      # H: the router's input width (the model's hidden size)
    experts: int     # E: routed experts (router weight rows)
    weight: RouterWeight = RouterWeight.BF16

    def validate(self) -> None:
        h, e = self.hidden, self.experts
        if isinstance(h, bool) or not isinstance(h, int) or h <= 0 or h % (CHUNK * LANES):
            raise SpecError("hidden", h, f"positive multiples of {CHUNK * LANES}",
                            "each lane takes whole 8-value chunks in turn")
        if isinstance(e, bool) or not isinstance(e, int) or not 1 <= e <= MAX_EXPERTS:
            raise SpecError("experts", e, f"1..{MAX_EXPERTS}")
        if not isinstance(self.weight, RouterWeight):
            raise SpecError("weight", self.weight, [w.value for w in RouterWeight])
        self.impl  # noqa: B018  (a kernel for this target, or SpecError with each variant's reason)

    # -- kernel contract --------------------------------------------------------------------
    @property
    def chunks_per_lane(self) -> int:
        return self.hidden // (CHUNK * LANES)

    def grid(self, m: int) -> tuple[int, int, int]:
        return (-(-self.experts // WARPS), -(-m // ROWS), 1)

    def slug(self) -> str:
        return f"h{self.hidden}-e{self.experts}" + ("-wf32" if self.weight is RouterWeight.FP32 else "")

    # -- estimates --------------------------------------------------------------------------
    def bytes_moved(self):
        """Per M rows: the weight once (each further 8-row block rereads it, from L2 at K3's 12.8 MB),
        x, the FP32 logits."""
        M = sym("M")
        wb = 2 if self.weight is RouterWeight.BF16 else 4
        return self.experts * self.hidden * wb + M * self.hidden * 2 + M * self.experts * 4

    def flops(self):
        M = sym("M")
        return 2 * M * self.experts * self.hidden
