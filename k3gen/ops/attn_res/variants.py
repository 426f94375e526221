"""The kernels that implement attn_res, in the order `auto` tries them."""
from k3gen.ir.variant import Variant, VariantTable
from k3gen.ops.attn_res.spec import AttnResSpec

VARIANTS = VariantTable("attn_res", (
    Variant("cluster", lowering="nvrtc",
            doc="one CTA per (row, slice), the slices of a row in a thread-block cluster exchanging "
                "partial sums by st.async; sources held in registers, read once",
            checks=((lambda s: s.target.sm >= 90,
                     "needs thread-block clusters, st.async and mbarrier tx counts (sm_90 and later)"),)),
))
AttnResSpec.variants = VARIANTS
