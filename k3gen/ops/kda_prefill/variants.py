"""The kernel that implements kda_prefill (the spec's `algo` field carries the choice; `auto`
resolves to it): chunk64. The 16-token 3xTF32 forms (`chunk16`, `chunkpar`) were deleted once
chunk64 passed the H200 tests (issue 30); the FP32 token loop in reference.py stays the oracle."""
from __future__ import annotations

from dataclasses import dataclass

from k3gen.ir.variant import VariantTable
from k3gen.ops.kda_decode.variants import ASYNC_COPIES, KdaKernel
from k3gen.ops.kda_prefill.spec import (C64_REC_BYTES, C64_REC_HEAD, C64_STATE_WARPS, KdaPrefillSpec,
                                          c64_state_smem)


@dataclass(frozen=True)
class PrefillKernel(KdaKernel):
    def inputs(self, spec) -> dict:
        return {**super().inputs(spec), "doc": self.doc, "c64_rec_bytes": C64_REC_BYTES, "c64_rec_head": C64_REC_HEAD,
                "c64_warps": C64_STATE_WARPS, "c64_state_smem": {w: c64_state_smem(w) for w in C64_STATE_WARPS}}


VARIANTS = VariantTable("kda_prefill", (
    PrefillKernel("chunk64", lowering="nvrtc", header="k3gen/kda/prefill_chunk64.cuh",
                  doc="64-token WY chunks, BF16 mma.sync operands with FP32 sums, FP32 state and solve; "
                      "parallel prep and emit, sequential state pass split over the state rows",
                  checks=(ASYNC_COPIES,)),
))
KdaPrefillSpec.variants = VARIANTS
