"""Dims are sympy symbols with explicit contracts.

A static dim has a value fixed at build time (a `constexpr` in the kernel); a dynamic one is a
kernel argument with an optional divisibility contract the launcher checks.
"""
from __future__ import annotations

from dataclasses import dataclass

import sympy

from k3gen.errors import SpecError


@dataclass(frozen=True)
class Dim:
    name: str
    static: int | None = None
    divisible_by: int = 1

    def __post_init__(self):
        if self.divisible_by < 1:
            raise SpecError(f"{self.name}.divisible_by", self.divisible_by, ">= 1")
        if self.static is not None:
            if self.static < 1:
                raise SpecError(self.name, self.static, "a positive size")
            if self.static % self.divisible_by:
                raise SpecError(self.name, self.static, f"multiples of {self.divisible_by}")

    @property
    def sym(self) -> sympy.Expr:
        """The static value as a number, or a positive integer symbol."""
        if self.static is not None:
            return sympy.Integer(self.static)
        return sympy.Symbol(self.name, positive=True, integer=True)

    @property
    def is_static(self) -> bool:
        return self.static is not None

    def check(self, value: int) -> int:
        """Validate a run-time value against the contract."""
        if self.static is not None and value != self.static:
            raise SpecError(self.name, value, [self.static], "static dim")
        if value % self.divisible_by:
            raise SpecError(self.name, value, f"multiples of {self.divisible_by}")
        return value


def sym(name: str) -> sympy.Symbol:
    return sympy.Symbol(name, positive=True, integer=True)


def evaluate(expr, **values) -> int:
    """Evaluate a sympy byte/FLOP expression with concrete dim values."""
    e = sympy.sympify(expr).subs({sym(k): v for k, v in values.items()})
    if e.free_symbols:
        raise SpecError("dims", sorted(str(s) for s in e.free_symbols), "values for every free dim")
    return int(e)
