"""The kernels that implement mla_prefill, in the order `auto` tries them (the spec's `kernel`
field carries the choice). `wgmma` (K/V by TMA) comes first: on the H200 (2026-12-03, one run) all
four passed tests/gpu/test_mla_prefill.py (40 of 40) and at H12 T4096 it took 145.8 us against
wgmma_cp's 290.3 us (torch SDPA 153.9 us); the overlap and pingpong forms measured within 5% of it.

All are sm_90a FA3-style warp specialization (include/k3gen/mla/prefill.cuh): Q and K from shared
memory through descriptors, P from registers for PV, V as the N-major B operand. `wgmma_cp` copies
K/V with cp.async, `wgmma` by TMA, `wgmma_ov` adds FA3's intra-warpgroup overlap, `wgmma_pp` its
pingpong of the two consumers. The SM100 family has no wgmma, and no tcgen05 variant is written yet: specs for those targets are refused with
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
                   doc="wgmma_cp's consumers, K/V tiles by TMA from one producer thread",
                   checks=(_WGMMA,)),
    PrefillVariant("wgmma_cp", lowering="nvrtc", header="k3gen/mla/prefill.cuh", tma=False,
                   doc="two consumer warpgroups of 64 rows (QK^T m64n128k16 from shared memory, PV "
                       "m64n128k16 with P in registers), K/V by cp.async from the producer warpgroup",
                   checks=(_WGMMA,)),
    PrefillVariant("wgmma_ov", lowering="nvrtc", header="k3gen/mla/prefill.cuh", overlap=True,
                   doc="wgmma with FA3's intra-warpgroup overlap: QK of tile i issued before "
                       "PV of tile i - 1, the softmax of tile i under that PV",
                   checks=(_WGMMA,)),
    PrefillVariant("wgmma_pp", lowering="nvrtc", header="k3gen/mla/prefill.cuh", overlap=True, pingpong=True,
                   doc="wgmma_ov with FA3's pingpong: the two consumers take turns at issuing their wgmmas",
                   checks=(_WGMMA,)),
))
MlaPrefillSpec.variants = VARIANTS
