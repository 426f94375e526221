"""The Launcher base and `bind_kernel`, which generated/<target>/kernels.py calls per kernel."""
from __future__ import annotations

import functools
import importlib

from k3gen.errors import SpecError
from k3gen.ir.spec import OpSpec
from k3gen.ops import spec_from_canonical

@functools.lru_cache(maxsize=None)
def launcher_class(op: str):
    """The one Launcher subclass that k3gen/ops/<op>/launcher.py defines."""
    mod = importlib.import_module(f"k3gen.ops.{op}.launcher")
    found = [v for v in vars(mod).values()
             if isinstance(v, type) and issubclass(v, Launcher) and v.__module__ == mod.__name__]
    if len(found) != 1:
        raise SpecError("launcher", op, f"exactly one Launcher subclass in {mod.__name__}, found {len(found)}")
    return found[0]


def bind_kernel(target_name: str, canonical: str):
    """A launcher for the spec; nothing is loaded until first use (or `.load()`)."""
    from k3gen.targets import get_target
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
            from k3gen.runtime.resolve import resolve
            from k3gen.runtime.loader import CudaKernel
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
