"""The kernels that implement mla_q_absorb, in the order `auto` tries them."""
from k3gen.errors import SpecError
from k3gen.ir.variant import Variant, VariantTable
from k3gen.ops.mla_q_absorb.spec import MlaQAbsorbSpec


def _has_gemm(spec) -> bool:
    try:
        spec.gemm_spec
    except SpecError:
        return False
    return True


VARIANTS = VariantTable("mla_q_absorb", (
    Variant("three_launch", lowering="nvrtc",
            doc="RMSNorm + quantization, the Q-B fp8_block_gemm, absorption + pe copy",
            checks=((lambda s: s.target.sm >= 89,
                     "needs the E4M3 conversion instruction (cvt.rn.satfinite.e4m3x2, sm_89 and later)"),
                    (_has_gemm, "no fp8_block_gemm kernel can implement its Q-B projection on this target"))),
))
MlaQAbsorbSpec.variants = VARIANTS
