"""The kernels that implement glu_act, in the order `auto` tries them."""
from k3gen.ir.variant import Variant, VariantTable
from k3gen.ops.glu_act.spec import GluActSpec

VARIANTS = VariantTable("glu_act", (
    Variant("warp_group", lowering="nvrtc",
            doc="one warp per (row, 128-column group): 4 gate and 4 up columns per lane, the activation in "
                "FP64, the group amax by shuffles, E4M3 codes by cvt",
            checks=((lambda s: s.target.sm >= 90,
                     "needs the E4M3 conversion (sm_89+) and griddepcontrol (sm_90 and later)"),)),
))
GluActSpec.variants = VARIANTS
