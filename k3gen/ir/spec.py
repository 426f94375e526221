"""OpSpec: the frozen, keyword-only description of one fused operator; `register_op` records its class."""
from __future__ import annotations

import enum
import hashlib
import json
from dataclasses import dataclass, fields
from typing import ClassVar

from k3gen.errors import SpecError
from k3gen.ir.target import Target

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


def registered() -> dict[str, type["OpSpec"]]:
    """The spec classes registered so far (k3gen.ops.registry() imports every op first)."""
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

    `variants` (set by the op's variants.py) lists the kernels that can implement the op; when
    `variant_field` names a field, "auto" there is resolved to the first variant that can, before
    `validate()` runs, and an explicit name is checked with that variant's `can_implement`.
    """
    target: Target
    op: ClassVar[str] = ""
    variants: ClassVar[object] = None        # a k3gen.ir.variant.VariantTable
    variant_field: ClassVar[str | None] = None

    def __post_init__(self):
        if not isinstance(self.target, Target):
            raise SpecError("target", self.target, "a k3gen Target (see k3gen.targets)")
        self.resolve()
        if self.variant_field is not None and self.variants is not None:
            name = getattr(self, self.variant_field)
            object.__setattr__(self, self.variant_field,
                               type(name)(self.variants.choose(self, str(getattr(name, "value", name))).name))
        self.validate()

    def resolve(self) -> None:
        """Fill defaults that depend on the target (runs before the variant is chosen)."""

    def validate(self) -> None:
        """Reject illegal field combinations with SpecError(field, value, allowed)."""

    @property
    def impl(self):
        """The Variant that implements this spec."""
        if self.variants is None:
            raise SpecError("variants", None, "a VariantTable", f"op {self.op} declares none")
        name = getattr(self, self.variant_field) if self.variant_field else "auto"
        return self.variants.choose(self, str(getattr(name, "value", name)))

    @property
    def lowering(self) -> str:
        """"nvrtc" (ops/<op>/template.cu.j2) or "cute" (ops/<op>/cute_kernel.py)."""
        return self.impl.lowering

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
