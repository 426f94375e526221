"""Generated kernels of target sm100-mxfp4. Do not edit: run `k3gen build`."""
