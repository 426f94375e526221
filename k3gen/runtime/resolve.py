"""spec -> (cubin, metadata): a prebuilt bundle, then the cache, then JIT, in that order.

Neither lookup renders a template: the bundle manifest is keyed by the spec's file stem and checked
against the spec and the inputs digest, and the cache key is computed from the same digest
(k3gen.pipeline.inputs). JIT is the only path back into the pipeline's stages.
"""
from __future__ import annotations

import os
from pathlib import Path

from k3gen.config import settings
from k3gen.errors import MissingKernelError
from k3gen.ir.spec import OpSpec
from k3gen.pipeline.bundle import cubin_path, read_manifest
from k3gen.pipeline.inputs import kernel_key, spec_inputs_digest
from k3gen.pipeline.store import KernelCache


def find_prebuilt(spec: OpSpec) -> tuple[bytes, dict] | None:
    """The cubin of a K3GEN_PREBUILT bundle built for this spec from these exact inputs."""
    folders = [Path(f) for f in settings().prebuilt.split(os.pathsep) if f]
    if not folders:
        return None
    stem, module = spec.file_stem, spec.target.module_name
    canonical, inputs = spec.canonical(), spec_inputs_digest(spec)
    for folder in folders:
        meta = read_manifest(folder, module).get(stem)
        if not meta or meta.get("spec") != canonical or meta.get("inputs_sha256") != inputs:
            continue
        path = cubin_path(folder, module, stem)
        if path.exists():
            return path.read_bytes(), dict(meta)
    return None


def resolve(spec: OpSpec, cache: KernelCache | None = None) -> tuple[bytes, dict]:
    """cubin + metadata for a spec: prebuilt bundle, then cache, then JIT (unless disabled)."""
    hit = find_prebuilt(spec)
    if hit:
        return hit
    cache = cache or KernelCache()
    e = cache.get(kernel_key(spec))
    if e is not None:
        return e.cubin, e.meta
    if settings().disable_jit:
        raise MissingKernelError(
            f"{spec.kernel_name} ({spec.file_stem}, target {spec.target.name}) was not built ahead of "
            f"time and K3GEN_DISABLE_JIT=1; run `k3gen build --arch {spec.target.name}` or point "
            f"K3GEN_PREBUILT at a `k3gen build --out` folder. spec: {spec.canonical()}")
    from k3gen.pipeline.stages import build_one
    r = build_one(spec, cache)
    return r.cubin, r.meta
