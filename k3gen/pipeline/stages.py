"""The build pipeline as data: spec -> source -> cubin (+ PTX) -> resources and SASS, into the cache.

Each stage fills part of an Artifact and names what it leaves behind; one dump loop writes those
products under K3GEN_DUMP (canonical spec, source, PTX, cubin, SASS) as the stage finishes. Nothing
here touches the CUDA driver or imports the runtime.
"""
from __future__ import annotations

import hashlib
import os
import time
import warnings
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from k3gen.config import settings
from k3gen.errors import K3genError
from k3gen.ir.spec import OpSpec
from k3gen.ops import spec_from_canonical
from k3gen.pipeline.inputs import compiler_id, flags, kernel_key, spec_inputs_digest
from k3gen.pipeline.store import KernelCache


@dataclass
class Artifact:
    """One kernel as it moves through the stages. The key is known before the source exists."""
    spec: OpSpec
    key: str
    flags: list[str]
    inputs: str                 # digest of every file the source is generated from
    source: str = ""            # generated CUDA C++ (NVRTC ops) or the CuTe module's text (cute ops)
    ptx: str = field(default="", repr=False)
    cubin: bytes = field(default=b"", repr=False)
    meta: dict = field(default_factory=dict, repr=False)

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


# -- the stages ----------------------------------------------------------------------------------

def _lower(art: Artifact) -> None:
    spec = art.spec
    if spec.lowering == "nvrtc":
        from k3gen.pipeline.render import render
        art.source = render(spec)
    else:
        from k3gen.pipeline.cute import cute_source
        art.source = cute_source(spec)


def _compile(art: Artifact) -> None:
    spec = art.spec
    t0 = time.perf_counter()
    art.meta = {"spec": spec.canonical(), "file": art.file_name, "arch": spec.target.arch,
                "compiler": compiler_id(spec), "source_sha256": art.source_sha256, "inputs_sha256": art.inputs}
    if spec.lowering == "nvrtc":
        from k3gen.pipeline.nvrtc import compile_program
        dump = settings().dump
        c = compile_program(art.source, spec.file_stem, spec.target, extra=tuple(settings().nvrtc_extra.split()),
                            source_dir=dump, want_ptx=dump is not None)
        art.cubin, art.ptx = c.cubin, c.ptx
        art.meta["entry"] = spec.entry
        art.meta["log"] = c.log
    else:
        from k3gen.pipeline.cute import compile_cute
        res = compile_cute(spec)
        art.cubin, art.ptx = res.cubin, res.ptx
        art.meta["entry"] = res.entry
        art.meta["params"] = res.params_json()
    art.meta["compile_seconds"] = round(time.perf_counter() - t0, 3)


def _inspect(art: Artifact) -> None:
    from k3gen.pipeline.inspect import resources
    art.meta["resources"] = [r.to_json() for r in resources(art.cubin)]


def _sass(art: Artifact) -> str | None:
    from k3gen.pipeline.inspect import sass_text
    try:
        return sass_text(art.cubin)
    except K3genError as e:  # cuobjdump missing: the other products are still worth having
        warnings.warn(f"K3GEN_DUMP: no SASS for {art.spec.file_stem}: {e}", stacklevel=2)
        return None


@dataclass(frozen=True)
class Product:
    """A file a stage leaves under K3GEN_DUMP: its name from the artifact, its content (None: skip)."""
    what: str
    name: Callable[[Artifact], str]
    content: Callable[[Artifact], str | bytes | None]


@dataclass(frozen=True)
class Stage:
    name: str
    run: Callable[[Artifact], None]
    products: tuple[Product, ...] = ()


LOWER = Stage("lower", _lower, (
    Product("spec", lambda a: a.spec.file_stem + ".spec.json", lambda a: a.spec.canonical() + "\n"),
    Product("source", lambda a: a.file_name, lambda a: a.source),
))
COMPILE = Stage("compile", _compile, (
    Product("ptx", lambda a: a.spec.file_stem + ".ptx", lambda a: a.ptx or None),
    Product("cubin", lambda a: a.spec.file_stem + ".cubin", lambda a: a.cubin),
))
INSPECT = Stage("inspect", _inspect, (
    Product("sass", lambda a: a.spec.file_stem + ".sass", _sass),
))
STAGES: tuple[Stage, ...] = (LOWER, COMPILE, INSPECT)


def dump(art: Artifact, stage: Stage) -> list[Path]:
    """Write the stage's products under K3GEN_DUMP (nothing when it is unset)."""
    d = settings().dump
    if d is None:
        return []
    d.mkdir(parents=True, exist_ok=True)
    written = []
    for p in stage.products:
        data = p.content(art)
        if data is None:
            continue
        path = d / p.name(art)
        path.write_bytes(data if isinstance(data, bytes) else data.encode())
        written.append(path)
    return written


def run(stage: Stage, art: Artifact) -> Artifact:
    stage.run(art)
    dump(art, stage)
    return art


# -- driving them ---------------------------------------------------------------------------------

def plan(spec: OpSpec) -> Artifact:
    """The artifact before any stage ran: its cache key needs no rendering."""
    return Artifact(spec, kernel_key(spec), list(flags(spec)), spec_inputs_digest(spec))


def lower(spec: OpSpec) -> Artifact:
    """Stage 1: spec -> source (and the cache key)."""
    return run(LOWER, plan(spec))


def compile_artifact(art: Artifact) -> tuple[bytes, dict]:
    """The stages after lowering: what the cache stores for the key."""
    for stage in STAGES[1:]:
        run(stage, art)
    return art.cubin, art.meta


def build_one(spec: OpSpec, cache: KernelCache | None = None) -> BuildResult:
    """Lower, then compile unless the cache holds it (one compile across processes)."""
    cache = cache or KernelCache()
    art = lower(spec)
    t0 = time.perf_counter()
    entry, built = cache.get_or_build(art.key, lambda: compile_artifact(art), source=art.source)
    if not built and settings().dump is not None:
        # A cache hit ran no compile stage; the cubin and its SASS are still what a dump is for.
        art.cubin, art.meta = entry.cubin, entry.meta
        for stage in STAGES[1:]:
            dump(art, stage)
    return BuildResult(art, entry.cubin, entry.meta, built, time.perf_counter() - t0,
                       entry.meta.get("resources", []))


def _job(canonical: str, target_name: str, cache_root: str) -> tuple[str, bool, float]:
    from k3gen.targets import get_target
    spec = spec_from_canonical(canonical, get_target(target_name))
    r = build_one(spec, KernelCache(Path(cache_root)))
    return r.artifact.key, r.built, r.seconds


PR_SET_PDEATHSIG = 1   # <linux/prctl.h>; prctl(2): the signal a child gets when its parent thread exits


def _exit_if_orphaned(parent: int) -> None:
    if os.getppid() != parent:
        os._exit(1)


def _worker_init(parent: int, poll_seconds: float = 1.0) -> None:
    """Pool initializer: a build worker dies with the process that started it, even when that one
    is SIGKILLed (a pool cannot clean up then, and its workers would compile on, then idle).
    PR_SET_PDEATHSIG fires when the *thread* that forked the worker ends (prctl(2)): the pool is
    made and fed by the thread that calls build_many, which outlives it."""
    import signal
    import sys
    import threading
    if sys.platform.startswith("linux"):
        import ctypes
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass   # the watchdog below still ends the worker
    # The parent may have died before prctl ran; prctl only covers deaths after it.
    _exit_if_orphaned(parent)

    def watch():   # where prctl is missing or failed (not Linux): poll for the re-parenting
        while True:
            time.sleep(poll_seconds)
            _exit_if_orphaned(parent)
    threading.Thread(target=watch, name="k3gen-orphan-watch", daemon=True).start()


def build_many(specs: list[OpSpec], jobs: int = 0, cache: KernelCache | None = None,
               progress=None, running=None, tick: float | None = None) -> list[BuildResult]:
    """Build specs, compiling cache misses in parallel processes (NVRTC holds the GIL).

    `progress(art, built)` is called as each kernel is done (cached ones first); `running(arts)`
    with the kernels being compiled, when that set changes and at least every `tick` seconds
    while a compile runs in a pool (a heartbeat for logs that would otherwise stay silent).
    """
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
    if jobs < 1:
        raise K3genError(f"jobs={jobs}: need at least one compile process")
    if missing:
        if jobs == 1 or len(missing) == 1:
            for a in missing:
                if running:
                    running([a])
                r = build_one(a.spec, cache)
                results[a.key] = r
                if progress:
                    progress(a, r.built)
        else:
            _pool_build(missing, min(jobs, len(missing)), cache, results, progress, running, tick)
    return [results[a.key] for a in arts]


def _pool_build(missing, workers: int, cache, results, progress, running, tick) -> None:
    from concurrent.futures import FIRST_COMPLETED, wait
    ex = ProcessPoolExecutor(max_workers=workers, initializer=_worker_init, initargs=(os.getpid(),))
    try:
        futs = {ex.submit(_job, a.spec.canonical(), a.spec.target.name, str(cache.root)): a for a in missing}
        pending = list(futs)   # submission order: the pool starts them in this order
        while pending:
            if running:
                running([futs[f] for f in pending[:workers]])
            done, _ = wait(pending, timeout=tick, return_when=FIRST_COMPLETED)
            for fut in [f for f in pending if f in done]:
                a = futs[fut]
                key, built, secs = fut.result()
                e = cache.get(key)
                results[key] = BuildResult(a, e.cubin, e.meta, built, secs, e.meta.get("resources", []))
                if progress:
                    progress(a, built)
            pending = [f for f in pending if f not in done]
    except BaseException:
        # A failed compile or ^C: the queued kernels need not run.
        ex.shutdown(wait=True, cancel_futures=True)
        raise
    ex.shutdown(wait=True)
