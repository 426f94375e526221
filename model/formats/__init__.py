"""Checkpoint format readers: each turns one on-disk format into the canonical dict of dense FP32
tensors that model/reference.py's `Fp32Reference` reads (names of the published checkpoints
without kimi_k3's `language_model.` wrapper)."""
