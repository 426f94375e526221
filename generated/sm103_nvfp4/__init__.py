"""Generated kernels of target sm103-nvfp4. Do not edit: run `k3gen build`."""
