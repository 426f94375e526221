"""The kernels that implement act_quant_fp8, in the order `auto` tries them."""
from k3gen.ir.variant import Variant, VariantTable
from k3gen.ops.act_quant_fp8.spec import ActQuantFp8Spec

VARIANTS = VariantTable("act_quant_fp8", (
    Variant("cute", lowering="cute", doc="CuTe DSL: 16 threads per 128-column group, shuffle amax",
            checks=((lambda s: s.target.sm >= 89,
                     "needs the E4M3 conversion instruction (cvt.rn.satfinite.e4m3x2, sm_89 and later)"),)),
))
ActQuantFp8Spec.variants = VARIANTS
