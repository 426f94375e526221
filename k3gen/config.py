"""Every K3GEN_* setting, declared once, typed, range-checked and documented.

Each knob is one `Setting` descriptor on `Settings`: the attribute name, the variable, its type,
default, allowed range and doc live together, and the value is read from the environment at each
access (never cached at import), so tests can monkeypatch the environment. A malformed value is a
typed error when it is read (`SettingError`; `CacheError` for a cache folder that cannot be one),
never a silent fallback: `check_all()` reads every knob, which the CLI does before any work.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import platformdirs

from k3gen.errors import CacheError, SpecError

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


class SettingError(SpecError):
    """A K3GEN_* variable holds a value its knob does not accept."""


def _bool(name: str, raw: str) -> bool:
    v = raw.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise SettingError(name, raw, "/".join(_TRUE) + " or " + "/".join(_FALSE))


def _number(kind: type, lo, hi):
    def parse(name: str, raw: str):
        try:
            v = kind(raw.strip())
        except ValueError:
            v = None
        if v is None or v != v or v < lo or (hi is not None and v > hi):  # v != v: NaN
            rng = f">= {lo}" if hi is None else f"{lo}..{hi}"
            raise SettingError(name, raw, f"{'an integer' if kind is int else 'a number'} {rng}")
        return v
    return parse


def _existing_file_in(p: Path) -> Path | None:
    """The first component of `p` (itself included) that exists and is not a folder."""
    for q in (p, *p.parents):
        if q.exists():
            return None if q.is_dir() else q
    return None


def _folder(name: str, raw: str) -> Path:
    p = Path(raw).expanduser()
    bad = _existing_file_in(p)
    if bad is not None:
        raise SettingError(name, raw, "a folder (or a path where one can be made)", f"{bad} is a file")
    return p


def _cache_folder(name: str, raw: str) -> Path:
    p = Path(raw).expanduser()
    bad = _existing_file_in(p)
    if bad is not None:
        raise CacheError(f"{name}={raw!r} cannot hold the kernel cache: {bad} is a file, not a folder; "
                         f"point {name} at a folder (or unset it for {_default_cache()})")
    return p


def _folders(name: str, raw: str) -> str:
    for f in raw.split(os.pathsep):
        if f and Path(f).expanduser().exists() and not Path(f).expanduser().is_dir():
            raise SettingError(name, raw, f"{os.pathsep!r}-separated folders written by `k3gen build --out`",
                               f"{f} is a file")
    return raw


def _flags(name: str, raw: str) -> str:
    bad = [f for f in raw.split() if not f.startswith("-")]
    if bad:
        raise SettingError(name, raw, "space-separated NVRTC options, each starting with '-'",
                           f"{' '.join(bad)} is not an option")
    return raw


def _default_cache() -> Path:
    return Path(platformdirs.user_cache_dir("k3gen"))


class Setting:
    """A descriptor: `Settings().<attr>` parses `os.environ[name]`, or gives the default when unset or empty."""

    def __init__(self, name: str, parse: Callable[[str, str], object], default: object, doc: str,
                 allowed: str = ""):
        self.name, self.parse, self.default, self.doc, self.allowed = name, parse, default, doc, allowed
        self.attr = ""

    def __set_name__(self, owner, attr: str) -> None:
        self.attr = attr

    def __get__(self, obj, owner=None):
        return self if obj is None else self.read()

    def __set__(self, obj, value) -> None:
        raise AttributeError(f"{self.attr} comes from ${self.name}; set the variable instead")

    @property
    def raw(self) -> str | None:
        v = os.environ.get(self.name)
        return None if v is None or v == "" else v

    def read(self):
        raw = self.raw
        return self.default if raw is None else self.parse(self.name, raw)

    def __repr__(self) -> str:
        return f"Setting({self.name!r}, default={self.default!r})"


class Settings:
    __slots__ = ()

    cache_dir = Setting("K3GEN_CACHE_DIR", _cache_folder, _default_cache(),
                        "Root of the content-addressed cubin cache.", "a folder")
    disable_jit = Setting("K3GEN_DISABLE_JIT", _bool, False,
                          "Never compile at run time; a kernel not built ahead of time raises MissingKernelError.",
                          "0/1")
    prebuilt = Setting("K3GEN_PREBUILT", _folders, "",
                       "os.pathsep-separated folders written by `k3gen build --out`; searched before the cache.",
                       "folders")
    dump = Setting("K3GEN_DUMP", _folder, None,
                   "If set, every stage's products (canonical spec, source, PTX, cubin, SASS) are written "
                   "under this folder as the stage runs.", "a folder")
    validate = Setting("K3GEN_VALIDATE", _bool, False,
                       "Check launch inputs on the host (page ids in range, shapes). Syncs; not graph-safe.", "0/1")
    jobs = Setting("K3GEN_JOBS", _number(int, 0, 4096), 0,
                   "Parallel compile processes for `k3gen build` (0: one per core).", "0..4096")
    nvrtc_extra = Setting("K3GEN_NVRTC_EXTRA", _flags, "",
                          "Extra NVRTC flags (space separated); part of the cache key.", "-options")
    gpu_tests = Setting("K3GEN_GPU", _bool, False,
                        "Run the GPU test tier (tests marked gpu). Off by default: CI must never touch the driver.",
                        "0/1")
    pdl = Setting("K3GEN_PDL", _bool, True,
                  "Launch the kernels that support it with programmatic dependent launch (their weight-only "
                  "prologue overlaps the previous kernel's tail).", "0/1")
    progress_seconds = Setting("K3GEN_PROGRESS_SECONDS", _number(float, 0.1, 3600.0), 10.0,
                               "Seconds between the plain progress lines `k3gen build` prints when its output "
                               "is not a terminal (CI, logs).", "0.1..3600")

    @classmethod
    def all(cls) -> tuple[Setting, ...]:
        return tuple(v for v in vars(cls).values() if isinstance(v, Setting))

    def __repr__(self) -> str:
        return "Settings(" + ", ".join(f"{s.attr}={s.read()!r}" for s in self.all()) + ")"


_SETTINGS = Settings()


def settings() -> Settings:
    """The settings; each attribute reads its variable when accessed."""
    return _SETTINGS


def check_all() -> None:
    """Parse every knob; raises the first SettingError / CacheError. The CLI calls it before any work."""
    for s in Settings.all():
        s.read()


def describe() -> list[tuple[str, str, str]]:
    """(name, value in effect, where it comes from) for each knob; a malformed one shows its error."""
    out = []
    for s in Settings.all():
        try:
            v = s.read()
            shown = "" if v is None else str(v)
        except (SettingError, CacheError) as e:
            shown = f"invalid: {e}"
        out.append((s.name, shown, "default" if s.raw is None else "environment"))
    return out
