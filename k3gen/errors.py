"""Typed errors. Runtime checks raise these, never `assert`."""
from __future__ import annotations


class K3genError(Exception):
    """Base of every error k3gen raises on purpose."""


class SpecError(K3genError, ValueError):
    """An operator spec, target or deployment option is illegal.

    Carries the offending field, its value and what is allowed, so the message is actionable.
    """

    def __init__(self, field: str, value, allowed, why: str = ""):
        self.field, self.value, self.allowed = field, value, allowed
        allowed_s = allowed if isinstance(allowed, str) else ", ".join(map(str, allowed))
        msg = f"{field}={value!r} is not allowed; allowed: {allowed_s}"
        if why:
            msg += f" ({why})"
        super().__init__(msg)


class TargetError(SpecError):
    """A spec or option does not fit the chosen target."""


class CompileError(K3genError):
    """NVRTC or CuTe DSL failed. Carries everything needed to reproduce."""

    def __init__(self, message: str, *, log: str = "", options=(), source_path: str | None = None,
                 repro: str = ""):
        self.log, self.options, self.source_path, self.repro = log, list(options), source_path, repro
        parts = [message]
        if source_path:
            parts.append(f"generated source: {source_path}")
        if self.options:
            parts.append("options: " + " ".join(self.options))
        if repro:
            parts.append(f"repro: {repro}")
        if log:
            parts.append("log:\n" + log.strip())
        super().__init__("\n".join(parts))


class MissingKernelError(K3genError):
    """K3GEN_DISABLE_JIT=1 and the kernel was not built ahead of time."""


class PageIndexError(K3genError, IndexError):
    """A block/page table holds an id outside [0, num_pages)."""


class CacheError(K3genError):
    """The kernel cache is unusable (not: a corrupt entry, which is rebuilt)."""


class DeviceError(K3genError):
    """A CUDA driver call failed."""


class KernelFaultError(K3genError, IndexError):
    """A kernel met bad index inputs (clamped or skipped on the device, k3gen.runtime.faults).

    `faults` maps each op whose error word is set to the names of its fault kinds."""

    def __init__(self, faults: dict):
        self.faults = {op: list(kinds) for op, kinds in faults.items()}
        super().__init__("kernel input faults: " + "; ".join(
            f"{op}: {', '.join(kinds)}" for op, kinds in sorted(self.faults.items())))
