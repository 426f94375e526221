"""The kernels that implement kv_cache_write, in the order `auto` tries them."""
from __future__ import annotations

from dataclasses import dataclass

from k3gen.ir.dtypes import Fp8ScaleGranularity, KvDtype, ScaleLayout
from k3gen.ir.variant import Variant, VariantTable
from k3gen.ops.kv_cache_write.spec import KvCacheWriteSpec

KV_KIND = {KvDtype.BF16: "kBf16", KvDtype.FP8: "kFp8", KvDtype.NVFP4: "kNvfp4"}
# sm_100a-family FP4 conversion; without it the header's software encoder runs (bit-identical).
FP4_CVT_GUARD = ('#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ < 1000)\n'
                 '#error "kHwFp4Cvt needs cvt.rn.satfinite.e2m1x2.f32 (sm_100a family)"\n'
                 '#endif\n')


def _cpp(b: bool) -> str:
    return "true" if b else "false"


@dataclass(frozen=True)
class KvWriteKernel(Variant):
    def inputs(self, spec) -> dict:
        """C++ spellings of the template's Config (`fp4_guard` ends in a newline or is empty)."""
        return {"kv_kind": KV_KIND[spec.kv],
                "fp8_per_tensor": _cpp(spec.fp8_scales is Fp8ScaleGranularity.PER_TENSOR),
                "swizzle": _cpp(spec.scale_layout is ScaleLayout.SWIZZLE_128X4),
                "hw_fp4_cvt": _cpp(spec.target.fp4_cvt),
                "fp4_guard": FP4_CVT_GUARD if spec.target.fp4_cvt else "",
                **fault_inputs(spec)}


def fault_inputs(spec) -> dict:
    """The error word's template parts (include/k3gen/common/faults.cuh); empty for a frozen target,
    whose sources (tests/golden) predate it, so they render byte for byte as landed."""
    if spec.target.frozen:
        return {"faults_cfg": "", "fault_params": "", "fault_args": ""}
    return {"faults_cfg": "\n  static constexpr bool kFaults = true;",
            "fault_params": ",\n    int num_rows, int bt_cols, int num_slots, unsigned* err",
            "fault_args": ",\n                             num_rows, bt_cols, num_slots, err"}


VARIANTS = VariantTable("kv_cache_write", (
    KvWriteKernel("tiles", lowering="nvrtc", doc="one CTA per 16-token tile of a sequence, every KV format",
                  checks=((lambda s: s.target.sm >= 89,
                           "needs the E4M3 conversion instruction (cvt.rn.satfinite.e4m3x2, sm_89 and later)"),)),
))
KvCacheWriteSpec.variants = VARIANTS
