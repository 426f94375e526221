"""The build pipeline: specs of a target -> generated sources -> cubins in the cache.

Stages are separate functions (render, compile, inspect, write) so each output can be dumped
(K3GEN_DUMP) and tested on its own. Nothing here touches the CUDA driver.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from k3gen.config import settings
from k3gen.errors import MissingKernelError
from k3gen.ir.spec import OpSpec
from k3gen.ops import spec_from_canonical
from k3gen.ir.target import Target
from k3gen.pipeline.store import KernelCache, cache_key

REPO_ROOT = Path(__file__).resolve().parents[2]
GENERATED_ROOT = REPO_ROOT / "generated"


@dataclass
class Artifact:
    """Everything about one kernel short of its cubin."""
    spec: OpSpec
    source: str          # generated CUDA C++ (NVRTC ops) or the CuTe module's text (cute ops)
    key: str
    flags: list[str]
    inputs: str = ""     # digest of the template and every header the source may include

    @property
    def file_name(self) -> str:
        return self.spec.file_stem + (".cu" if self.spec.lowering == "nvrtc" else ".cute.py")

    @property
    def source_sha256(self) -> str:
        return hashlib.sha256(self.source.encode()).hexdigest()


@dataclass
class BuildResult:
    artifact: Artifact
    cubin: bytes
    meta: dict
    built: bool
    seconds: float = 0.0
    resources: list = field(default_factory=list)


def _compiler_id(spec: OpSpec) -> str:
    from k3gen.pipeline.toolchain import cutlass_dsl_version, nvrtc_version
    return f"nvrtc-{nvrtc_version()}" if spec.lowering == "nvrtc" else f"cutlass-dsl-{cutlass_dsl_version()}"


def lower(spec: OpSpec) -> Artifact:
    """Stage: spec -> source and cache key."""
    extra = tuple(settings().nvrtc_extra.split())
    if spec.lowering == "nvrtc":
        from k3gen.pipeline.nvrtc import flags_for
        from k3gen.pipeline.render import render, template_inputs_digest
        source, inputs, flags = render(spec), template_inputs_digest(spec.op), flags_for(spec.target, extra)
    else:
        from k3gen.pipeline.cute import cute_source, cute_flags
        source, flags = cute_source(spec), cute_flags(spec)
        inputs = hashlib.sha256(source.encode()).hexdigest()
    key = cache_key(spec_digest=spec.digest(), source=source, inputs_digest=inputs,
                    compiler=_compiler_id(spec), target=spec.target.arch, flags=flags)
    art = Artifact(spec, source, key, list(flags), inputs)
    _dump(art.file_name, source)
    return art


def _dump(name: str, data) -> None:
    d = settings().dump
    if d is None:
        return
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_bytes(data if isinstance(data, bytes) else data.encode())


def _compile(art: Artifact) -> tuple[bytes, dict]:
    """Stage: source -> cubin + metadata (resources, SASS histogram, entry symbol)."""
    from k3gen.pipeline.inspect import resources
    t0 = time.perf_counter()
    spec = art.spec
    meta: dict = {"spec": spec.canonical(), "file": art.file_name, "arch": spec.target.arch,
                  "compiler": _compiler_id(spec), "source_sha256": art.source_sha256,
                  "inputs_sha256": art.inputs}
    if spec.lowering == "nvrtc":
        from k3gen.pipeline.nvrtc import compile_cubin
        dump = settings().dump
        cubin, log = compile_cubin(art.source, spec.file_stem, spec.target,
                                   extra=tuple(settings().nvrtc_extra.split()), source_dir=dump)
        meta["entry"] = spec.entry
        meta["log"] = log
    else:
        from k3gen.pipeline.cute import compile_cute
        res = compile_cute(spec)
        cubin = res.cubin
        meta["entry"] = res.entry
        meta["params"] = res.params_json()
    meta["compile_seconds"] = round(time.perf_counter() - t0, 3)
    meta["resources"] = [r.to_json() for r in resources(cubin)]
    _dump(spec.file_stem + ".cubin", cubin)
    return cubin, meta


def build_one(spec: OpSpec, cache: KernelCache | None = None) -> BuildResult:
    """Lower, then compile unless the cache holds it (one compile across processes)."""
    cache = cache or KernelCache()
    art = lower(spec)
    t0 = time.perf_counter()
    entry, built = cache.get_or_build(art.key, lambda: _compile(art), source=art.source)
    return BuildResult(art, entry.cubin, entry.meta, built, time.perf_counter() - t0,
                       entry.meta.get("resources", []))


def _job(canonical: str, target_name: str, cache_root: str) -> tuple[str, bool, float]:
    from k3gen.targets import get_target
    spec = spec_from_canonical(canonical, get_target(target_name))
    r = build_one(spec, KernelCache(Path(cache_root)))
    return r.artifact.key, r.built, r.seconds


def build_many(specs: list[OpSpec], jobs: int = 0, cache: KernelCache | None = None,
               progress=None) -> list[BuildResult]:
    """Build specs, compiling cache misses in parallel processes (NVRTC holds the GIL)."""
    cache = cache or KernelCache()
    arts = [lower(s) for s in specs]
    results: dict[str, BuildResult] = {}
    missing = []
    for a in arts:
        e = cache.get(a.key)
        if e is not None:
            results[a.key] = BuildResult(a, e.cubin, e.meta, False, 0.0, e.meta.get("resources", []))
            if progress:
                progress(a, False)
        else:
            missing.append(a)
    jobs = jobs or settings().jobs or os.cpu_count() or 1
    if missing:
        if jobs == 1 or len(missing) == 1:
            for a in missing:
                r = build_one(a.spec, cache)
                results[a.key] = r
                if progress:
                    progress(a, r.built)
        else:
            with ProcessPoolExecutor(max_workers=min(jobs, len(missing))) as ex:
                futs = {ex.submit(_job, a.spec.canonical(), a.spec.target.name, str(cache.root)): a
                        for a in missing}
                for fut, a in futs.items():
                    key, built, secs = fut.result()
                    e = cache.get(key)
                    results[key] = BuildResult(a, e.cubin, e.meta, built, secs, e.meta.get("resources", []))
                    if progress:
                        progress(a, built)
    return [results[a.key] for a in arts]


# -- generated/<target>/ --------------------------------------------------------------------

def generated_files(target: Target, specs: list[OpSpec]) -> dict[str, str]:
    """Relative path -> content of the committed tree for a target. Deterministic."""
    arts = [lower(s) for s in specs]
    files: dict[str, str] = {}
    kernels = []
    for a in arts:
        if a.spec.lowering == "nvrtc":
            files[a.file_name] = a.source
        kernels.append({
            "name": a.spec.kernel_name, "op": a.spec.op, "file": a.file_name if a.spec.lowering == "nvrtc" else None,
            "lowering": a.spec.lowering, "digest": a.spec.digest(), "spec": json.loads(a.spec.canonical()),
            "source_sha256": a.source_sha256, "entry": a.spec.entry,
        })
    kernels.sort(key=lambda k: k["name"])
    files["manifest.json"] = json.dumps({"target": target.name, "arch": target.arch, "kernels": kernels},
                                        indent=1, sort_keys=True) + "\n"
    files["kernels.py"] = _kernels_module(target, arts)
    files["__init__.py"] = f'"""Generated kernels of target {target.name}. Do not edit: run `k3gen build`."""\n'
    return files


def _kernels_module(target: Target, arts: list[Artifact]) -> str:
    from k3gen.ops import launcher_path
    # The frozen tree's kernels.py predates ops/<op>/: it imports forwarding modules (k3gen.runtime.bind,
    # k3gen.runtime.ops.<op>) that must keep existing.
    binder = "k3gen.runtime.bind" if target.frozen else "k3gen.runtime.launcher"

    def where(op):
        mod, cls = launcher_path(op)
        return (f"k3gen.runtime.ops.{op}" if target.frozen else mod), cls
    lines = [f'"""Typed launch wrappers for target {target.name} ({target.arch}).',
             "", "Generated by `k3gen build`; do not edit. Each name is a lazily loaded launcher:",
             "the cubin is looked up (prebuilt bundle, cache) or compiled on first use.", '"""',
             f"from {binder} import bind_kernel"]
    imports = sorted({where(a.spec.op) for a in arts})
    for mod, cls in imports:
        lines.append(f"from {mod} import {cls}")
    lines += ["", f'TARGET = "{target.name}"', ""]
    names = []
    for a in sorted(arts, key=lambda a: a.spec.kernel_name):
        cls = launcher_path(a.spec.op)[1]
        lines.append(f"{a.spec.kernel_name}: {cls} = bind_kernel(TARGET, {a.spec.canonical()!r})")
        names.append(a.spec.kernel_name)
    lines += ["", "__all__ = [" + ", ".join(repr(n) for n in names) + "]", ""]
    return "\n".join(lines)


def write_generated(target: Target, specs: list[OpSpec], root: Path = GENERATED_ROOT) -> list[str]:
    """Write the tree; return the files that changed (removed sources included). Frozen targets may
    only gain files, so their stale sources stay (check_generated reports them)."""
    d = root / target.module_name
    d.mkdir(parents=True, exist_ok=True)
    want = generated_files(target, specs)
    changed = []
    for name, content in want.items():
        p = d / name
        if not p.exists() or p.read_text() != content:
            p.write_text(content)
            changed.append(name)
    if not target.frozen:
        # A spec whose resolution changed (a new default schedule, say) leaves its old source behind.
        for p in sorted(d.glob("*.cu")):
            if p.name not in want:
                p.unlink()
                changed.append(p.name)
    return changed


def check_generated(target: Target, specs: list[OpSpec], root: Path = GENERATED_ROOT) -> list[str]:
    """Differences between the committed tree and what k3gen generates now."""
    d = root / target.module_name
    want = generated_files(target, specs)
    problems = []
    for name, content in want.items():
        p = d / name
        if not p.exists():
            problems.append(f"missing: {p}")
        elif p.read_text() != content:
            problems.append(f"drifted: {p}")
    if d.exists():
        for p in sorted(d.iterdir()):
            if p.is_file() and p.name not in want and p.suffix in (".cu", ".json", ".py"):
                problems.append(f"stale: {p}")
    return problems


# -- prebuilt bundles (k3gen build --out) ----------------------------------------------------

def write_bundle(out: Path, target: Target, results: list[BuildResult]) -> Path:
    d = Path(out) / target.module_name
    d.mkdir(parents=True, exist_ok=True)
    index = {}
    for r in results:
        stem = r.artifact.spec.file_stem
        (d / f"{stem}.cubin").write_bytes(r.cubin)
        index[stem] = {k: r.meta.get(k) for k in ("entry", "arch", "compiler", "source_sha256", "inputs_sha256",
                                                  "params", "resources", "spec")}
    (d / "bundle.json").write_text(json.dumps(index, indent=1, sort_keys=True) + "\n")
    return d


def find_prebuilt(spec: OpSpec, source_sha256: str, inputs_sha256: str) -> tuple[bytes, dict] | None:
    """A bundle cubin built from this exact source and these template/header contents."""
    for folder in filter(None, settings().prebuilt.split(os.pathsep)):
        d = Path(folder) / spec.target.module_name
        idx = d / "bundle.json"
        if not idx.exists():
            continue
        meta = json.loads(idx.read_text()).get(spec.file_stem)
        if meta and meta.get("source_sha256") == source_sha256 and meta.get("inputs_sha256") == inputs_sha256 \
                and (d / f"{spec.file_stem}.cubin").exists():
            return (d / f"{spec.file_stem}.cubin").read_bytes(), meta
    return None


def resolve(spec: OpSpec) -> tuple[bytes, dict]:
    """cubin + metadata for a spec: prebuilt bundle, then cache, then JIT (unless disabled)."""
    art = lower(spec)
    hit = find_prebuilt(spec, art.source_sha256, art.inputs)
    if hit:
        return hit
    cache = KernelCache()
    e = cache.get(art.key)
    if e is not None:
        return e.cubin, e.meta
    if settings().disable_jit:
        raise MissingKernelError(
            f"{spec.kernel_name} ({spec.file_stem}, target {spec.target.name}) was not built ahead of "
            f"time and K3GEN_DISABLE_JIT=1; run `k3gen build --arch {spec.target.name}` or point "
            f"K3GEN_PREBUILT at a `k3gen build --out` folder. spec: {spec.canonical()}")
    entry, _ = cache.get_or_build(art.key, lambda: _compile(art), source=art.source)
    return entry.cubin, entry.meta

