"""Generated kernels of target sm107-nvfp4. Do not edit: run `k3gen build`."""
