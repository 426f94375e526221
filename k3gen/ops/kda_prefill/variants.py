"""The kernels that implement kda_prefill, in the order `auto` tries them."""
from k3gen.ir.variant import Variant, VariantTable
from k3gen.ops.kda_prefill.spec import KdaPrefillSpec

VARIANTS = VariantTable("kda_prefill", (
    Variant("default", lowering="nvrtc", doc="the one kernel of this op"),
))
KdaPrefillSpec.variants = VARIANTS
