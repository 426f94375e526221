"""K3Model's weights: the formats the layers and kernels take (model/weight_types.py: `ModelWeights`,
`Fp8Linear`, packed `ExpertWeights`, ...) and the loaders.

Every checkpoint layout is converted by one assembly, model/formats/assemble.py (fusions, paddings,
the recipe's FP8 re-quantization, Kimi-Linear's variants, TP slices, streaming to the device);
model/formats/detect.py `load_model_weights` picks the layout of a folder; `load_weights` is the
ModelOpt NVFP4 entry point (model/formats/modelopt.py, TP1, CPU) that the older callers use.
"""
from __future__ import annotations

from model.formats.modelopt import CheckpointReader, load_weights  # noqa: F401
from model.weight_types import (KV_A_PAD, AttnResWeights, DenseMlpWeights, ExpertWeights, Fp8Linear,  # noqa: F401
                                GluWeights, KdaLayerWeights, KdaWeights, LayerWeights, MlaLayerWeights, ModelWeights, MoeWeights)

__all__ = ["CheckpointReader", "load_weights", "ModelWeights", "LayerWeights", "KdaLayerWeights", "MlaLayerWeights",
           "MoeWeights", "DenseMlpWeights", "GluWeights", "ExpertWeights", "Fp8Linear", "KV_A_PAD", "AttnResWeights",
           "KdaWeights"]
