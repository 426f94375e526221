"""One module per fused op; importing this package registers them all."""
from . import kv_cache_write  # noqa: F401
