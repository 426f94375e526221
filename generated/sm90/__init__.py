"""Generated kernels of target sm90. Do not edit: run `k3gen build`."""
