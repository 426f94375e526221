"""The Python-side table behind the `k3gen::` ops: a kernel handle is the spec's canonical JSON.

An op never chooses a kernel: the caller picks the spec at plan time (the enumerator, a test, an
engine's config) and passes its handle, a plain `str`, as the op's first argument. The handle is
self-describing (target and every field), so a graph that holds it (torch.compile, torch.export)
dispatches in any process that has the cubin; the spec and the loaded launcher are cached per
handle. Nothing here autotunes: the launchers' run-time choices (cluster split, schedule) are
functions of the shapes and the SM count only.
"""
from __future__ import annotations

import json
import threading

from k3gen.errors import MissingKernelError, SpecError

_lock = threading.Lock()
_specs: dict = {}        # handle -> OpSpec
_launchers: dict = {}    # handle -> Launcher (loaded)
_cache_names: dict = {}  # handle -> the KV cache tensor names of its KvLayout, in order


def handle_of(spec) -> str:
    """The handle of `spec` (its canonical JSON), remembered so `spec_of` needs no parsing."""
    h = spec.canonical()
    with _lock:
        _specs.setdefault(h, spec)
    return h


def as_handle(spec_or_handle) -> str:
    return spec_or_handle if isinstance(spec_or_handle, str) else handle_of(spec_or_handle)


def spec_of(handle: str, op: str | None = None):
    """The spec a handle names; `op` checks that it is that op's (a SpecError names both)."""
    spec = _specs.get(handle)
    if spec is None:
        from k3gen.ops import spec_from_canonical
        from k3gen.targets import get_target
        try:
            d = json.loads(handle)
            target = get_target(d["target"]["name"])
        except (ValueError, KeyError, TypeError) as e:
            raise SpecError("handle", handle[:80], "a spec's canonical JSON (k3gen.api.prepare(spec))",
                            f"{type(e).__name__}: {e}") from None
        spec = spec_from_canonical(handle, target)
        with _lock:
            spec = _specs.setdefault(handle, spec)
    if op is not None and spec.op != op:
        raise SpecError("handle", spec.file_stem, f"a {op} spec", "each k3gen:: op takes its own op's handle")
    return spec


def launcher(handle: str, op: str | None = None):
    """The loaded launcher of a handle. Loading resolves a cubin (prebuilt, cache or JIT) and
    loads it: never inside a CUDA-graph capture, so `prepare` every handle before capturing."""
    lau = _launchers.get(handle)
    if lau is not None and lau._kernel is not None:
        if op is not None and lau.spec.op != op:
            spec_of(handle, op)
        return lau
    spec = spec_of(handle, op)
    import torch
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise MissingKernelError(f"{spec.file_stem} is not loaded and a CUDA graph is being captured: call "
                                 f"k3gen.api.prepare(spec) for every kernel before capture (or before "
                                 f"torch.compile(mode='reduce-overhead') runs)")
    with _lock:
        lau = _launchers.get(handle)
        if lau is None:
            from k3gen.runtime.launcher import launcher_class
            lau = _launchers[handle] = launcher_class(spec.op)(spec)
    return lau.load()


def cache_names(handle: str) -> tuple:
    """The names of the KV cache tensors a kv_cache_write / mla_decode handle reads, in the order
    its op takes them (a plain dict lookup after the first call: cheap to trace)."""
    names = _cache_names.get(handle)
    if names is None:
        names = _cache_names[handle] = tuple(spec_of(handle).layout.tensors())
    return names


def loaded(handle: str) -> bool:
    lau = _launchers.get(handle)
    return lau is not None and lau._kernel is not None
