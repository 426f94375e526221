"""Every K3GEN_* setting, declared once, typed and documented.

Read through `settings()` at the point of use (never cached at import), so tests can
monkeypatch the environment.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, fields
from pathlib import Path

import platformdirs


def _bool(v: str) -> bool:
    return v.strip().lower() in ("1", "true", "yes", "on")


@dataclass(frozen=True)
class Setting:
    name: str
    kind: type
    default: object
    doc: str

    def read(self):
        raw = os.environ.get(self.name)
        if raw is None or raw == "":
            return self.default
        if self.kind is bool:
            return _bool(raw)
        if self.kind is Path:
            return Path(raw).expanduser()
        return self.kind(raw)


SETTINGS: tuple[Setting, ...] = (
    Setting("K3GEN_CACHE_DIR", Path, Path(platformdirs.user_cache_dir("k3gen")),
            "Root of the content-addressed cubin cache."),
    Setting("K3GEN_DISABLE_JIT", bool, False,
            "Never compile at run time; a kernel not built ahead of time raises MissingKernelError."),
    Setting("K3GEN_PREBUILT", str, "",
            "os.pathsep-separated folders written by `k3gen build --out`; searched before the cache."),
    Setting("K3GEN_DUMP", Path, None,
            "If set, every stage (canonical spec, source, cubin, SASS) is dumped under this folder."),
    Setting("K3GEN_VALIDATE", bool, False,
            "Check launch inputs on the host (page ids in range, shapes). Syncs; not graph-safe."),
    Setting("K3GEN_JOBS", int, 0, "Parallel compile processes for `k3gen build` (0: one per core)."),
    Setting("K3GEN_NVRTC_EXTRA", str, "", "Extra NVRTC flags (space separated); part of the cache key."),
    Setting("K3GEN_GPU", bool, False,
            "Run the GPU test tier (tests marked gpu). Off by default: CI must never touch the driver."),
    Setting("K3GEN_PDL", bool, True,
            "Launch the kernels that support it with programmatic dependent launch (their weight-only "
            "prologue overlaps the previous kernel's tail)."),
)

_BY_NAME = {s.name: s for s in SETTINGS}


@dataclass(frozen=True)
class Settings:
    cache_dir: Path
    disable_jit: bool
    prebuilt: str
    dump: Path | None
    validate: bool
    jobs: int
    nvrtc_extra: str
    gpu_tests: bool
    pdl: bool


def settings() -> Settings:
    vals = [s.read() for s in SETTINGS]
    names = [f.name for f in fields(Settings)]
    return Settings(**dict(zip(names, vals)))


def describe() -> list[tuple[str, str, str]]:
    """(name, current value, doc) for `k3gen collect-env`."""
    return [(s.name, os.environ.get(s.name, ""), s.doc) for s in SETTINGS]
