"""The kernels that implement router_logits, in the order `auto` tries them."""
from k3gen.ir.variant import Variant, VariantTable
from k3gen.ops.router_logits.spec import RouterLogitsSpec

VARIANTS = VariantTable("router_logits", (
    Variant("warp_expert", lowering="nvrtc",
            doc="one warp per expert, 8 rows per CTA: 16-byte weight and row loads, FP32 FMA in the "
                "contract's order, an XOR-butterfly lane sum",
            checks=((lambda s: s.target.sm >= 90, "needs griddepcontrol (sm_90 and later)"),)),
))
RouterLogitsSpec.variants = VARIANTS
