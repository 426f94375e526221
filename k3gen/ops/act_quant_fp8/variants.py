"""The kernels that implement act_quant_fp8, in the order `auto` tries them."""
from k3gen.ir.variant import Variant, VariantTable
from k3gen.ops.act_quant_fp8.spec import ActQuantFp8Spec

VARIANTS = VariantTable("act_quant_fp8", (
    Variant("default", lowering="cute", doc="the one kernel of this op"),
))
ActQuantFp8Spec.variants = VARIANTS
