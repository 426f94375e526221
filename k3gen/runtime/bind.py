"""Forwarding module: generated/sm100_mxfp4/kernels.py (frozen byte for byte) imports bind_kernel here."""
from k3gen.runtime.launcher import bind_kernel  # noqa: F401
