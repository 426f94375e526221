from k3gen.ir.dims import evaluate, sym
from k3gen.ir.dtypes import (BF16, E2M1, E4M3, FP16, FP32, MXFP4, NVFP4, UE8M0, Fp8ScaleGranularity, GateKind,
                     KvDtype, ScaleLayout, ScaleRecipe, SsmDtype)
from k3gen.ir.layouts import KvLayout, StatePoolLayout, TensorSpec
from k3gen.ir.spec import OpSpec, register_op
from k3gen.ir.target import Target

__all__ = [n for n in dir() if not n.startswith("_")]
