from .dims import Dim, evaluate, sym
from .dtypes import (BF16, E2M1, E4M3, FP16, FP32, MXFP4, NVFP4, UE8M0, Fp8ScaleGranularity, GateKind,
                     KvDtype, ScaleLayout, ScaleRecipe, SsmDtype)
from .layouts import KvLayout, StatePoolLayout, TensorSpec
from .spec import OpSpec, register_op, registry, spec_from_canonical
from .target import Target

__all__ = [n for n in dir() if not n.startswith("_")]
