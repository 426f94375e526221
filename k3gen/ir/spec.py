"""OpSpec: the frozen, keyword-only description of one fused operator, and the op registry."""
from __future__ import annotations

import enum
import hashlib
import json
from dataclasses import dataclass, fields
from typing import ClassVar

from ..errors import SpecError
from .target import Target

_REGISTRY: dict[str, type["OpSpec"]] = {}


def register_op(name: str):
    """Class decorator: register an OpSpec subclass under its op name (the file stem)."""
    def deco(cls):
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise SpecError("op", name, "a name not registered yet")
        cls.op = name
        _REGISTRY[name] = cls
        return cls
    return deco


def registry() -> dict[str, type["OpSpec"]]:
    from . import ops  # noqa: F401  (importing registers every op)
    return dict(_REGISTRY)


def _plain(v):
    if isinstance(v, enum.Enum):
        return v.value
    if isinstance(v, Target):
        return v.canonical()
    if hasattr(v, "canonical"):
        return v.canonical()
    if isinstance(v, (tuple, list)):
        return [_plain(x) for x in v]
    return v


@dataclass(frozen=True, kw_only=True)
class OpSpec:
    """Base of all op specs. Subclasses are `@dataclass(frozen=True, kw_only=True)`.

    `lowering` says which path makes the kernel: "nvrtc" (a Jinja2 template under templates/)
    or "cute" (a module under k3gen/cute/).
    """
    target: Target
    op: ClassVar[str] = ""
    lowering: ClassVar[str] = "nvrtc"

    def __post_init__(self):
        if not isinstance(self.target, Target):
            raise SpecError("target", self.target, "a k3gen Target (see k3gen.targets)")
        self.validate()

    def validate(self) -> None:
        """Reject illegal field combinations with SpecError(field, value, allowed)."""

    # -- identity ---------------------------------------------------------------------------
    def canonical(self) -> str:
        d = {"op": self.op}
        for f in fields(self):
            d[f.name] = _plain(getattr(self, f.name))
        return json.dumps(d, sort_keys=True, separators=(",", ":"))

    def digest(self) -> str:
        return hashlib.sha256(self.canonical().encode()).hexdigest()

    def slug(self) -> str:
        """Readable, filename-safe summary of the fields that tell variants apart."""
        raise NotImplementedError

    @property
    def kernel_name(self) -> str:
        """Python identifier of the launch wrapper in generated/<target>/kernels.py."""
        return f"{self.op}_{self.slug().replace('-', '_')}"

    @property
    def file_stem(self) -> str:
        return f"{self.op}__{self.slug()}__{self.digest()[:8]}"

    @property
    def entry(self) -> str:
        """extern "C" symbol of the kernel."""
        return f"k3gen_{self.op}"

    # -- estimates (sympy) ------------------------------------------------------------------
    def bytes_moved(self):
        """Fewest bytes through device memory per launch, as a sympy expression."""
        raise NotImplementedError

    def flops(self):
        raise NotImplementedError


def spec_from_canonical(text: str, target: Target) -> OpSpec:
    """Rebuild a spec from canonical JSON using the field types of its class."""
    import typing
    d = json.loads(text)
    cls = registry()[d.pop("op")]
    d.pop("target")
    hints = typing.get_type_hints(cls)
    kw = {}
    for k, v in d.items():
        t = hints.get(k)
        if v is not None and typing.get_args(t):  # Optional[X] / X | None: the non-None member
            t = next((a for a in typing.get_args(t) if a is not type(None)), t)
        if isinstance(t, type) and issubclass(t, enum.Enum):
            v = t(v)
        elif hasattr(t, "from_canonical"):
            v = t.from_canonical(v)
        kw[k] = v
    return cls(target=target, **kw)
