"""Every K3GEN_* setting, declared once, typed and documented.

Each knob is one `Setting` descriptor on `Settings`: the attribute name, the variable, its type,
default and doc live on one line, and the value is read from the environment at each access (never
cached at import), so tests can monkeypatch the environment.
"""
from __future__ import annotations

import os
from pathlib import Path

import platformdirs


def _bool(v: str) -> bool:
    return v.strip().lower() in ("1", "true", "yes", "on")


class Setting:
    """A descriptor: `Settings().<attr>` parses `os.environ[name]`, or gives the default when unset or empty."""

    def __init__(self, name: str, kind: type, default: object, doc: str):
        self.name, self.kind, self.default, self.doc = name, kind, default, doc
        self.attr = ""

    def __set_name__(self, owner, attr: str) -> None:
        self.attr = attr

    def __get__(self, obj, owner=None):
        return self if obj is None else self.read()

    def __set__(self, obj, value) -> None:
        raise AttributeError(f"{self.attr} comes from ${self.name}; set the variable instead")

    def read(self):
        raw = os.environ.get(self.name)
        if raw is None or raw == "":
            return self.default
        if self.kind is bool:
            return _bool(raw)
        if self.kind is Path:
            return Path(raw).expanduser()
        return self.kind(raw)

    def __repr__(self) -> str:
        return f"Setting({self.name!r}, {self.kind.__name__}, default={self.default!r})"


class Settings:
    __slots__ = ()

    cache_dir = Setting("K3GEN_CACHE_DIR", Path, Path(platformdirs.user_cache_dir("k3gen")),
                        "Root of the content-addressed cubin cache.")
    disable_jit = Setting("K3GEN_DISABLE_JIT", bool, False,
                          "Never compile at run time; a kernel not built ahead of time raises MissingKernelError.")
    prebuilt = Setting("K3GEN_PREBUILT", str, "",
                       "os.pathsep-separated folders written by `k3gen build --out`; searched before the cache.")
    dump = Setting("K3GEN_DUMP", Path, None,
                   "If set, every stage's products (canonical spec, source, PTX, cubin, SASS) are written "
                   "under this folder as the stage runs.")
    validate = Setting("K3GEN_VALIDATE", bool, False,
                       "Check launch inputs on the host (page ids in range, shapes). Syncs; not graph-safe.")
    jobs = Setting("K3GEN_JOBS", int, 0, "Parallel compile processes for `k3gen build` (0: one per core).")
    nvrtc_extra = Setting("K3GEN_NVRTC_EXTRA", str, "", "Extra NVRTC flags (space separated); part of the cache key.")
    gpu_tests = Setting("K3GEN_GPU", bool, False,
                        "Run the GPU test tier (tests marked gpu). Off by default: CI must never touch the driver.")
    pdl = Setting("K3GEN_PDL", bool, True,
                  "Launch the kernels that support it with programmatic dependent launch (their weight-only "
                  "prologue overlaps the previous kernel's tail).")

    @classmethod
    def all(cls) -> tuple[Setting, ...]:
        return tuple(v for v in vars(cls).values() if isinstance(v, Setting))

    def __repr__(self) -> str:
        return "Settings(" + ", ".join(f"{s.attr}={s.read()!r}" for s in self.all()) + ")"


_SETTINGS = Settings()


def settings() -> Settings:
    """The settings; each attribute reads its variable when accessed."""
    return _SETTINGS


def describe() -> list[tuple[str, str, str]]:
    """(name, current value, doc) for `k3gen collect-env`."""
    return [(s.name, os.environ.get(s.name, ""), s.doc) for s in Settings.all()]
