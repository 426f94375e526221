"""Benchmarks (GPU): `python -m bench --op OP` or `k3gen bench`."""
