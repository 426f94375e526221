"""The kernels that implement kda_decode, in the order `auto` tries them."""
from k3gen.ir.variant import Variant, VariantTable
from k3gen.ops.kda_decode.spec import KdaDecodeSpec

VARIANTS = VariantTable("kda_decode", (
    Variant("default", lowering="nvrtc", doc="the one kernel of this op"),
))
KdaDecodeSpec.variants = VARIANTS
