"""kv_cache_write: the contract is spec.py; the kernels are variants.py."""
from k3gen.ops.kv_cache_write import variants as _variants  # noqa: F401  (attaches the variant table)
from k3gen.ops.kv_cache_write.spec import *  # noqa: F401,F403
