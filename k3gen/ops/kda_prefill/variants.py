"""The kernels that implement kda_prefill, in the order `auto` tries them (the spec's `algo` field
carries the choice): chunk16 is what the model runs; chunkpar stays selectable until the prefill
issue decides between them."""
from __future__ import annotations

from dataclasses import dataclass

from k3gen.ir.variant import VariantTable
from k3gen.ops.kda_decode.variants import ASYNC_COPIES, KdaKernel
from k3gen.ops.kda_prefill.spec import (C64_REC_BYTES, C64_REC_HEAD, C64_STATE_WARPS, KdaPrefillSpec,
                                          c64_state_smem)


@dataclass(frozen=True)
class PrefillKernel(KdaKernel):
    three_pass: bool = False   # prep / state / emit launches over a workspace instead of one kernel
    chunk64: bool = False      # the 64-token BF16 tensor-core form (its own three kernels)

    def inputs(self, spec) -> dict:
        out = {**super().inputs(spec), "doc": self.doc, "three_pass": self.three_pass, "chunk64": self.chunk64}
        if self.chunk64:
            out.update(c64_rec_bytes=C64_REC_BYTES, c64_rec_head=C64_REC_HEAD, c64_warps=C64_STATE_WARPS,
                       c64_state_smem={w: c64_state_smem(w) for w in C64_STATE_WARPS})
        return out


VARIANTS = VariantTable("kda_prefill", (
    PrefillKernel("chunk64", lowering="nvrtc", header="k3gen/kda/prefill_chunk64.cuh", three_pass=True, chunk64=True,
                  doc="64-token WY chunks, BF16 mma.sync operands with FP32 sums, FP32 state and solve; "
                      "parallel prep and emit, sequential state pass split over the state rows",
                  checks=(ASYNC_COPIES,)),
    PrefillKernel("chunk16", lowering="nvrtc", header="k3gen/kda/prefill_chunk.cuh",
                  doc="chunked WY form, 3xTF32 mma.sync, one CTA per (sequence, head)",
                  checks=(ASYNC_COPIES,)),
    PrefillKernel("chunkpar", lowering="nvrtc", header="k3gen/kda/prefill_par.cuh", three_pass=True,
                  doc="chunk16 algebra; parallel prep and emit, sequential state pass",
                  checks=(ASYNC_COPIES,)),
))
KdaPrefillSpec.variants = VARIANTS
