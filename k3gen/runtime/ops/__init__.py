"""Forwarding modules for the frozen generated/sm100_mxfp4/kernels.py; launchers live in k3gen/ops/<op>/."""
