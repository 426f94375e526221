"""The kernels that implement mla_q_absorb, in the order `auto` tries them."""
from k3gen.ir.variant import Variant, VariantTable
from k3gen.ops.mla_q_absorb.spec import MlaQAbsorbSpec

VARIANTS = VariantTable("mla_q_absorb", (
    Variant("default", lowering="nvrtc", doc="the one kernel of this op"),
))
MlaQAbsorbSpec.variants = VARIANTS
