from k3gen.ops.kda_verify.launcher import KdaVerify  # noqa: F401  (frozen kernels.py)
