from k3gen.ops.kv_cache_write.launcher import KvCacheWrite  # noqa: F401  (frozen kernels.py)
