"""The kernels that implement kda_verify, in the order `auto` tries them (the spec's `variant`
field carries the choice), and the measured bands the launcher picks a schedule by (the
measurements: bench/NOTES.md, "KDA schedule bands (moved from the code)").
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from k3gen.ir.dtypes import SsmDtype
from k3gen.ir.variant import VariantTable
from k3gen.ops.kda_decode.variants import ASYNC_COPIES, KdaKernel
from k3gen.ops.kda_verify.spec import KdaVerifySpec

SCHEDULES = ("rows", "prefetch", "split")
PERSISTENT_MAX_DRAFTS = 3   # the prefetch and split kernels stage all 1 + M tokens in one chunk


@dataclass(frozen=True)
class VerifyKernel(KdaKernel):
    persistent: bool = False   # the cubin also carries the prefetch and split schedules (M <= 3)
    original: bool = False     # the frozen target's kernel: one FP32 row path for state and records

    def schedules(self, spec) -> tuple[str, ...]:
        """The launch schedules the spec's cubin carries."""
        return SCHEDULES if self.persistent and spec.drafts <= PERSISTENT_MAX_DRAFTS else SCHEDULES[:1]

    def inputs(self, spec) -> dict:
        return {**super().inputs(spec), "original": "true" if self.original else "false",
                "schedules": self.schedules(spec), **fault_inputs(spec)}


def fault_inputs(spec) -> dict:
    """The error word's template parts (include/k3gen/common/faults.cuh); empty for a frozen target,
    whose original kernel's source (tests/golden) predates it and renders byte for byte as landed."""
    if spec.target.frozen:
        return {"faults_cfg": "", "fault_params": "", "fault_args": ""}
    return {"faults_cfg": "\n  static constexpr bool kFaults = true;", "fault_params": ", unsigned* err",
            "fault_args": ", err"}


VARIANTS = VariantTable("kda_verify", (
    VerifyKernel("nvfp4", lowering="nvrtc", header="k3gen/kda/verify.cuh", persistent=True,
                 doc="typed SSM loads and stores, FP32 draft records; row, prefetch and split schedules",
                 checks=(ASYNC_COPIES,
                         (lambda s: not s.target.frozen,
                          "the target's sources are frozen with the original shared verify kernel"))),
    VerifyKernel("original", lowering="nvrtc", header="k3gen/kda/verify.cuh", original=True,
                 doc="the FP32-only shared verify kernel of the original SM100 MXFP4 target (rows only)",
                 checks=(ASYNC_COPIES,
                         (lambda s: s.ssm is SsmDtype.FP32,
                          "stores FP32 state only (one row path for state and records)"))),
))
KdaVerifySpec.variants = VARIANTS


# Schedule by (head, sequence) items per SM: (upper bound, schedule), the first that holds wins.
SCHEDULE_BANDS = ((0.3, "split"), (math.inf, "prefetch"))
