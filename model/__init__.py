"""Kimi K3 assembled from k3gen's kernels: config, checkpoint, layers, hybrid cache, generation.

Every layer has two paths chosen by `TargetConfig.path`: "reference" (k3gen's FP32 PyTorch
references, runs on the CPU) and "kernel" (the generated launchers of generated/<target>/).
"""
