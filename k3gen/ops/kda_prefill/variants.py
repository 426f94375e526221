"""The kernels that implement kda_prefill, in the order `auto` tries them (the spec's `algo` field
carries the choice): chunk16 is what the model runs; chunkpar stays selectable until the prefill
issue decides between them."""
from __future__ import annotations

from dataclasses import dataclass

from k3gen.ir.variant import VariantTable
from k3gen.ops.kda_decode.variants import ASYNC_COPIES, KdaKernel
from k3gen.ops.kda_prefill.spec import KdaPrefillSpec


@dataclass(frozen=True)
class PrefillKernel(KdaKernel):
    three_pass: bool = False   # prep / state / emit launches over a workspace instead of one kernel

    def inputs(self, spec) -> dict:
        return {**super().inputs(spec), "doc": self.doc, "three_pass": self.three_pass}


VARIANTS = VariantTable("kda_prefill", (
    PrefillKernel("chunk16", lowering="nvrtc", header="k3gen/kda/prefill_chunk.cuh",
                  doc="chunked WY form, 3xTF32 mma.sync, one CTA per (sequence, head)",
                  checks=(ASYNC_COPIES,)),
    PrefillKernel("chunkpar", lowering="nvrtc", header="k3gen/kda/prefill_par.cuh", three_pass=True,
                  doc="chunk16 algebra; parallel prep and emit, sequential state pass",
                  checks=(ASYNC_COPIES,)),
))
KdaPrefillSpec.variants = VARIANTS
