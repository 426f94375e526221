"""The kernels that implement mla_vb_gate, in the order `auto` tries them."""
from k3gen.ir.variant import Variant, VariantTable
from k3gen.ops.mla_vb_gate.spec import MlaVbGateSpec

VARIANTS = VariantTable("mla_vb_gate", (
    Variant("default", lowering="nvrtc", doc="the one kernel of this op"),
))
MlaVbGateSpec.variants = VARIANTS
