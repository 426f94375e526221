"""The routed experts in PyTorch behind `Ops.moe_experts` (model/ffn_ops.py): the reference path's,
and the kernel path's for BF16 experts (a plain save_pretrained checkpoint), which the grouped FP4
GEMM (k3gen/ops/moe_experts) does not read. The router logits of both paths.

Every expert is computed for every token on weights dequantized here from their packed form and
masked by the routing weights, so the step has static shapes (graph-safe) and no host sync. BF16
rounding points: the latent input, the expert hidden (into w2); the weighted sum is FP32.

FP64 products rounded to FP32: cuBLAS picks its FP32 reduction order by the number of rows, so an
FP32 row of a verify step (B*T rows) could differ in its last bits from the same row of a decode
step (B rows), and a random model amplifies that into different tokens. FP64 products rounded to
FP32 are row-invariant but for values within ~1e-16 of a rounding edge (the 2026-11-30 H200 run:
speculative == greedy fails with FP32 stand-ins, holds with row-by-row ones;
tools/diag_spec_greedy.py). The generated kernels are row-invariant by construction.
"""
from __future__ import annotations

import torch

BF16 = torch.bfloat16


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.double() @ b.double()).float()


def _ein(eq: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.einsum(eq, a.double(), b.double()).float()


def router_logits(x: torch.Tensor, router: torch.Tensor) -> torch.Tensor:
    """FP32 router logits [M, E] of BF16 rows x [M, hidden] (FP64 products: row-invariant)."""
    return _mm(x.float(), router.T)


def experts(xl: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w, act, n_experts: int,
            mine: slice | None = None) -> torch.Tensor:
    """sum_j weights[:, j] expert_{ids[:, j]}(xl) over this rank's experts `mine` (None: all), FP32
    [M, W]. xl [M, W] BF16; ids [M, k] (any int dtype, global expert ids); w the packed
    ExpertWeights of the rank's experts."""
    M = xl.shape[0]
    dense = torch.zeros(M, n_experts, dtype=torch.float32, device=xl.device).scatter(1, ids.long(), weights.float())
    x = xl.float()
    w13, w2 = w.dequant()                                                             # [E, 2I, W], [E, W, I]
    I = w13.shape[1] // 2
    gu = _ein("mw,ejw->mej", x, w13)
    h = act(gu[..., :I], gu[..., I:])
    ye = _ein("mei,ewi->mew", h.to(BF16), w2)
    return _ein("me,mew->mw", dense if mine is None else dense[:, mine], ye)
