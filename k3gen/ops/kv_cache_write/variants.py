"""The kernels that implement kv_cache_write, in the order `auto` tries them."""
from k3gen.ir.variant import Variant, VariantTable
from k3gen.ops.kv_cache_write.spec import KvCacheWriteSpec

VARIANTS = VariantTable("kv_cache_write", (
    Variant("default", lowering="nvrtc", doc="the one kernel of this op"),
))
KvCacheWriteSpec.variants = VARIANTS
