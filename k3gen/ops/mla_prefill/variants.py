"""The kernels that implement mla_prefill, in the order `auto` tries them (the spec's `kernel`
field carries the choice).

`wgmma` (sm_90a): FA3-style warp specialization, K/V tiles by TMA, Q and K from shared memory through
descriptors, P from registers for PV, V as the N-major B operand (include/k3gen/mla/prefill.cuh);
`wgmma_ov` adds FA3's intra-warpgroup overlap, `wgmma_pp` its pingpong of the two consumers;
`wgmma_cp` copies K/V with cp.async instead of TMA. The SM100 family
has no wgmma, and no tcgen05 variant is written yet: specs for those targets are refused with
this reason, and the model keeps its PyTorch attention there (targets.has_prefill_kernel).
"""
from __future__ import annotations

from dataclasses import dataclass

from k3gen.ir.variant import Variant, VariantTable
from k3gen.ops.mla_prefill.spec import MlaPrefillSpec

_WGMMA = (lambda s: s.target.mma == "wgmma",
          "needs wgmma (sm_90a); no tcgen05 prefill kernel exists yet for this target")


@dataclass(frozen=True)
class PrefillVariant(Variant):
    header: str = ""
    overlap: bool = False
    pingpong: bool = False    # with overlap: the consumers take turns at issuing their wgmmas
    tma: bool = True          # K/V tiles by TMA boxes (else cp.async from the producer warpgroup)

    def inputs(self, spec) -> dict:
        return {"header": self.header, "doc": self.doc, "overlap": "true" if self.overlap else "false",
                "pingpong": "true" if self.pingpong else "false",
                "tma": "true" if self.tma else "false",
                "out_f32": "true" if spec.out_dtype.value == "fp32" else "false"}


VARIANTS = VariantTable("mla_prefill", (
    PrefillVariant("wgmma", lowering="nvrtc", header="k3gen/mla/prefill.cuh",
                   doc="warp-specialized: cp.async producer, two consumer warpgroups of 64 rows, "
                       "QK^T m64n128k16 (SS), PV m64n128k16 (P in registers)",
                   checks=(_WGMMA,)),
    PrefillVariant("wgmma_ov", lowering="nvrtc", header="k3gen/mla/prefill.cuh", overlap=True,
                   doc="wgmma's warpgroups with FA3's intra-warpgroup overlap: QK of tile i issued before "
                       "PV of tile i - 1, the softmax of tile i under that PV",
                   checks=(_WGMMA,)),
    PrefillVariant("wgmma_pp", lowering="nvrtc", header="k3gen/mla/prefill.cuh", overlap=True, pingpong=True,
                   doc="wgmma_ov with FA3's pingpong: the two consumers take turns at issuing their wgmmas",
                   checks=(_WGMMA,)),
    PrefillVariant("wgmma_cp", lowering="nvrtc", header="k3gen/mla/prefill.cuh", tma=False,
                   doc="wgmma's consumers with K/V by cp.async from the producer warpgroup (no tensor maps)",
                   checks=(_WGMMA,)),
))
MlaPrefillSpec.variants = VARIANTS
