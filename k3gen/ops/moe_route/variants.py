"""The kernels that implement moe_route, in the order `auto` tries them."""
from k3gen.ir.variant import Variant, VariantTable
from k3gen.ops.moe_route.spec import MoeRouteSpec

VARIANTS = VariantTable("moe_route", (
    Variant("warp_topk", lowering="nvrtc",
            doc="one warp per token (redux.sync arg-max k times), then a shared-memory counting sort "
                "of the slots per 32 experts",
            checks=((lambda s: s.target.sm >= 80, "needs redux.sync (sm_80 and later)"),)),
))
MoeRouteSpec.variants = VARIANTS
