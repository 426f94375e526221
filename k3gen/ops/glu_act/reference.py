"""FP32 reference of glu_act (the contract is the docstring of k3gen.ops.glu_act.spec).

The activation in float64 with plain torch operations in the contract's order (torch rounds every
float64 operation once on the CPU), rounded to FP32 and then BF16, then act_quant_fp8's own
reference on those BF16 values: so a GPU result can be checked bit for bit.
"""
from __future__ import annotations

import torch

from k3gen.ir.dtypes import ScaleRecipe
from k3gen.ops.act_quant_fp8.reference import act_quant_fp8


def _d(v: float, like: torch.Tensor) -> torch.Tensor:
    return torch.full_like(like, float(v), dtype=torch.float64)


def hidden(gu: torch.Tensor, inter: int, act: str = "situ", beta: float = 4.0,
           linear_beta: float = 25.0) -> torch.Tensor:
    """BF16 h [M, I] of gu [M, 2I] (gate | up)."""
    g = gu[:, :inter].double()
    u = gu[:, inter:2 * inter].double()
    one = torch.ones_like(g)
    s = torch.div(one, one + torch.exp(-g))
    if str(act) == "situ":
        a = _d(beta, g) * torch.tanh(torch.div(g, _d(beta, g)))
        b = _d(linear_beta, u) * torch.tanh(torch.div(u, _d(linear_beta, u)))
        h = (a * s) * b
    else:
        h = (g * s) * u
    return h.float().to(torch.bfloat16)


def glu_act(gu: torch.Tensor, inter: int, act: str = "situ", beta: float = 4.0, linear_beta: float = 25.0,
            recipe: ScaleRecipe = ScaleRecipe.FP32):
    """(codes uint8 [M, I], scales [M, I/128]) of gu [M, 2I] BF16."""
    return act_quant_fp8(hidden(gu, inter, act, beta, linear_beta), recipe)


def glu_act_spec(spec, gu: torch.Tensor):
    """glu_act with the fields of a GluActSpec."""
    return glu_act(gu, spec.inter, spec.act.value, spec.beta, spec.linear_beta, spec.recipe)
