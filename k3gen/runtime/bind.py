"""Binding of generated specs to launcher classes, used by generated/<target>/kernels.py."""
from __future__ import annotations

import functools

from ..ir.spec import OpSpec, spec_from_canonical

# op name -> "module.Class" of its launcher. A test checks every registered op has one.
LAUNCHERS = {
    "kv_cache_write": "k3gen.runtime.ops.kv_cache_write.KvCacheWrite",
    "act_quant_fp8": "k3gen.runtime.ops.act_quant_fp8.ActQuantFp8",
    "kda_decode": "k3gen.runtime.ops.kda_decode.KdaDecode",
    "kda_verify": "k3gen.runtime.ops.kda_verify.KdaVerify",
    "kda_prefill": "k3gen.runtime.ops.kda_prefill.KdaPrefill",
    "fp8_block_gemm": "k3gen.runtime.ops.fp8_block_gemm.Fp8BlockGemm",
    "mla_q_absorb": "k3gen.runtime.ops.mla_q_absorb.MlaQAbsorb",
    "mla_vb_gate": "k3gen.runtime.ops.mla_vb_gate.MlaVbGate",
    "mla_decode": "k3gen.runtime.ops.mla_decode.MlaDecode",
}


def launcher_class(op: str):
    import importlib
    mod, cls = LAUNCHERS[op].rsplit(".", 1)
    return getattr(importlib.import_module(mod), cls)


def bind_kernel(target_name: str, canonical: str):
    """A launcher for the spec; nothing is loaded until first use (or `.load()`)."""
    from ..targets import get_target
    spec = spec_from_canonical(canonical, get_target(target_name))
    return launcher_class(spec.op)(spec)


class Launcher:
    """Base of the per-op launchers: owns the spec and, once loaded, the kernel."""

    def __init__(self, spec: OpSpec):
        self.spec = spec
        self._kernel = None
        self.meta: dict = {}

    def load(self):
        """Resolve the cubin (prebuilt, cache or JIT) and load it. Call before graph capture."""
        if self._kernel is None:
            from ..build import resolve
            from .loader import CudaKernel
            cubin, self.meta = resolve(self.spec)
            self._kernel = CudaKernel(cubin, self.meta["entry"])
        return self

    @property
    def kernel(self):
        return self.load()._kernel

    @functools.cached_property
    def device_index(self) -> int:
        import torch
        return torch.cuda.current_device()

    @functools.cached_property
    def sm_count(self) -> int:
        """Multiprocessors of the device; launchers that size grids by it read it in load()."""
        import torch
        return torch.cuda.get_device_properties(self.device_index).multi_processor_count

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec.file_stem})"
