"""Benchmark cases, one module per op (`bench/cases/<op>.py`); every function marked `@case` there is
a benchmark named after the function (`python -m bench --op NAME`, `python -m bench --list`).

The registry is read from the files, so adding a case is adding a function to its op's module.
Importing a case module needs no GPU: torch and the launchers are imported inside the cases.
"""
from __future__ import annotations

import importlib
import pkgutil


def _modules() -> list:
    return [importlib.import_module(f"{__name__}.{m.name}") for m in pkgutil.iter_modules(__path__)
            if not m.name.startswith("_")]


def registry() -> dict:
    """name -> case function, in module then definition order."""
    out = {}
    for mod in _modules():
        for name, obj in vars(mod).items():
            info = getattr(obj, "bench_case", None)
            if info is not None and obj.__module__ == mod.__name__:
                out[name] = obj
    return out


def get(name: str):
    """The case function named `name`, or None."""
    return registry().get(name)


def __getattr__(name: str):
    # `from bench.cases import fp8_block_gemm_specs` and `bench.cases.mla_decode_heads`: names
    # defined in the case modules stay reachable from the package, as before the split.
    if name.startswith("__"):
        raise AttributeError(name)
    for mod in _modules():
        if name in vars(mod):
            return vars(mod)[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
