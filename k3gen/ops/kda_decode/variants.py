"""The kernels that implement kda_decode, in the order `auto` tries them, and the measured bands
the launcher chooses its launch-time schedule by (the measurements: bench/NOTES.md, "KDA schedule
bands (moved from the code)").

One cubin carries both schedules of the fused step: the row kernel (grid (split, H, B), the split
CTAs of a (sequence, head) in one thread-block cluster) and the persistent stream kernel; which
one runs, and with what split, depends on the batch alone, so it is chosen at launch.
"""
from __future__ import annotations

from dataclasses import dataclass

from k3gen.ir.dtypes import GateKind, SsmDtype
from k3gen.ir.variant import Variant, VariantTable
from k3gen.ops.kda_decode.spec import KdaDecodeSpec

# Every KDA kernel stages its rows with bulk copies on mbarriers; decode and verify-split also
# exchange through thread-block clusters: all arrived with sm_90.
ASYNC_COPIES = (lambda s: s.target.sm >= 90,
                "needs bulk copies, mbarriers and thread-block clusters (sm_90 and later)")


@dataclass(frozen=True)
class KdaKernel(Variant):
    """A KDA kernel: `header` is its algorithm (under include/); `inputs` are the template's values."""
    header: str = ""

    def inputs(self, spec) -> dict:
        """C++ spellings of the spec fields every KDA template's Config carries."""
        return {"header": self.header,
                "bf16_state": "true" if spec.ssm is SsmDtype.BF16 else "false",
                "gate": "kBounded" if spec.gate is GateKind.BOUNDED else "kSoftplus"}


VARIANTS = VariantTable("kda_decode", (
    KdaKernel("fused", lowering="nvrtc", header="k3gen/kda/decode_stream.cuh",
              doc="the fused step per (sequence, head): the row kernel split over a cluster and the "
                  "persistent stream kernel, chosen at launch by SCHEDULE_BANDS",
              checks=(ASYNC_COPIES,)),
))
KdaDecodeSpec.variants = VARIANTS


@dataclass(frozen=True)
class DecodeBands:
    """Where each launch-time choice of the fused kernel changes (H200 measurements)."""
    split_pairs_per_sm_pdl: float     # the largest split with (sequence, head) pairs x split <= this x SMs
    split_pairs_per_sm_plain: float   # the same without programmatic dependent launch
    stream_min_items_per_sm: int      # BF16 state, bulk-copyable rows: the stream kernel from here up
    warm_max_waves: int               # row kernel: warm L2 before the PDL wait up to this many waves
    ahead_min_waves: int              # row kernel: warm L2 one wave ahead from this many waves


SCHEDULE_BANDS = DecodeBands(split_pairs_per_sm_pdl=1.5, split_pairs_per_sm_plain=0.75,
                             stream_min_items_per_sm=40, warm_max_waves=1, ahead_min_waves=8)
