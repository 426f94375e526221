"""Dims are positive integer sympy symbols; byte and FLOP estimates are expressions over them."""
from __future__ import annotations

import sympy

from k3gen.errors import SpecError


def sym(name: str) -> sympy.Symbol:
    return sympy.Symbol(name, positive=True, integer=True)


def evaluate(expr, **values) -> int:
    """Evaluate a sympy byte/FLOP expression with concrete dim values."""
    e = sympy.sympify(expr).subs({sym(k): v for k, v in values.items()})
    if e.free_symbols:
        raise SpecError("dims", sorted(str(s) for s in e.free_symbols), "values for every free dim")
    return int(e)
