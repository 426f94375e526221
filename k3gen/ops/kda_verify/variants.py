"""The kernels that implement kda_verify, in the order `auto` tries them."""
from k3gen.ir.variant import Variant, VariantTable
from k3gen.ops.kda_verify.spec import KdaVerifySpec

VARIANTS = VariantTable("kda_verify", (
    Variant("default", lowering="nvrtc", doc="the one kernel of this op"),
))
KdaVerifySpec.variants = VARIANTS
