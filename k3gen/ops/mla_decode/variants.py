"""The kernels that implement mla_decode, in the order `auto` tries them."""
from k3gen.ir.variant import Variant, VariantTable
from k3gen.ops.mla_decode.spec import MlaDecodeSpec

VARIANTS = VariantTable("mla_decode", (
    Variant("default", lowering="nvrtc", doc="the one kernel of this op"),
))
MlaDecodeSpec.variants = VARIANTS
