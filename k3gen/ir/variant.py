"""Variants: the kernels that can implement an op's spec, tried in a declared order.

A variant says in words why it cannot implement a spec (`can_implement` returns the reason, or None
when it can), reading only the spec's fields and its target's features, never the target's name.
`auto` is the first variant of the table that can. An op whose spec carries the choice in a field
(`OpSpec.variant_field`, e.g. mla_decode's `schedule`) has it resolved when the spec is built, so
the canonical spec (and the file name) names the kernel it gets.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from k3gen.errors import SpecError

AUTO = "auto"


@dataclass(frozen=True)
class Variant:
    """One kernel for an op. `requires` is a predicate on the spec with the reason it fails."""
    name: str
    lowering: str = "nvrtc"                   # "nvrtc": template.cu.j2; "cute": cute_kernel.py
    doc: str = ""
    checks: tuple[tuple[Callable[[object], bool], str], ...] = field(default=(), compare=False)

    def can_implement(self, spec) -> str | None:
        """None if this variant can implement `spec`, else why not (a sentence)."""
        for ok, why in self.checks:
            if not ok(spec):
                return why
        return None


class VariantTable:
    """The variants of one op in their declared order (the order `auto` tries them)."""

    def __init__(self, op: str, variants: Sequence[Variant]):
        names = [v.name for v in variants]
        if len(set(names)) != len(names) or AUTO in names:
            raise SpecError("variants", names, "distinct names, none called 'auto'")
        self.op = op
        self.variants = tuple(variants)

    def names(self) -> tuple[str, ...]:
        return tuple(v.name for v in self.variants)

    def reasons(self, spec) -> dict[str, str | None]:
        return {v.name: v.can_implement(spec) for v in self.variants}

    def get(self, name: str) -> Variant:
        for v in self.variants:
            if v.name == name:
                return v
        raise SpecError("variant", name, [AUTO, *self.names()], f"op {self.op}")

    def choose(self, spec, name: str = AUTO) -> Variant:
        """The named variant if it can implement the spec, or the first that can for `auto`."""
        field = getattr(spec, "variant_field", None) or "variant"   # errors name the spec's field
        if name != AUTO:
            if name not in self.names():
                raise SpecError(field, name, [AUTO, *self.names()], f"op {self.op}")
            v = self.get(name)
            why = v.can_implement(spec)
            if why is not None:
                raise SpecError(field, name, [n for n, r in self.reasons(spec).items() if r is None],
                                f"{self.op} {name}: {why}")
            return v
        for v in self.variants:
            if v.can_implement(spec) is None:
                return v
        detail = "; ".join(f"{n}: {r}" for n, r in self.reasons(spec).items())
        raise SpecError(field, AUTO, [], f"no {self.op} kernel can implement this spec ({detail})")
