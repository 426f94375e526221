"""FP32 reference of moe_route (the contract is the docstring of k3gen.ops.moe_route.spec).

Bit for bit what the kernel writes, with plain torch operations:

- scores: 1 / (1 + e) in FP32 with e = FP32(exp(-x)) computed in float64 and rounded once (the
  kernel evaluates the same exp in FP64; both are within 1 ulp of float64, far below FP32's
  rounding, where two FP32 exp libraries differ in the last bit).
- the ranking is a stable ascending sort of -choice: equal choices keep index order, so ties go to
  the lower expert index (and the lower group index for groups). model/arch.route ranks with
  torch.topk, which leaves ties unspecified, and takes torch's FP32 sigmoid (within an ulp of
  these scores): without ties both pick the same experts in the same order.
- the renormalizing sum runs in slot order, one FP32 addition at a time.
- the grouped order sorts the flat slot indices by (expert, flat index): within an expert by token.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Routing:
    """What moe_route writes for T tokens (int32 / FP32 CPU tensors)."""
    ids: torch.Tensor        # [T, k] int32, slot j = the j-th pick
    weights: torch.Tensor    # [T, k] FP32
    counts: torch.Tensor     # [E] int32
    offsets: torch.Tensor    # [E + 1] int32
    perm: torch.Tensor       # [T * k] int32: grouped position -> flat slot t * k + j
    inv: torch.Tensor        # [T * k] int32: flat slot -> grouped position


def sigmoid_scores(logits: torch.Tensor) -> torch.Tensor:
    e = torch.exp(-logits.double()).float()
    d = 1 + e
    return torch.div(torch.ones_like(d), d)     # tensor / tensor: IEEE division, no reciprocal


def _ranked(values: torch.Tensor) -> torch.Tensor:
    """Indices of `values` (last dim) from the largest down, equal values in index order."""
    return torch.sort(-values, dim=-1, stable=True).indices


def select(logits: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int = 1,
           topk_group: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [T, k] int64 in pick order, unbiased scores [T, E] FP32)."""
    s = sigmoid_scores(logits.cpu())
    choice = s + bias.cpu().float()
    T, E = choice.shape
    if n_group > 1:
        G = E // n_group
        grouped = choice.view(T, n_group, G)
        top = torch.sort(grouped, dim=-1, descending=True).values
        gscore = top[..., 0] + top[..., 1] if G >= 2 else top[..., 0]
        kept = _ranked(gscore)[:, :topk_group]
        keep = torch.zeros(T, n_group, dtype=torch.bool).scatter(1, kept, True)
        choice = choice.masked_fill(~keep.repeat_interleave(G, dim=1), float("-inf"))
    return _ranked(choice)[:, :top_k], s


def combine_weights(picked: torch.Tensor, renormalize: bool, routed_scale: float) -> torch.Tensor:
    """Weights of the picked unbiased scores [T, k]: the renormalizing sum in slot order."""
    w = picked.float()
    if renormalize:
        total = torch.zeros(w.shape[0], dtype=torch.float32)
        for j in range(w.shape[1]):
            total = total + w[:, j]
        w = w / (total + 1e-20)[:, None]
    return w * torch.tensor(routed_scale, dtype=torch.float32)


def grouped_order(ids: torch.Tensor, experts: int):
    """(counts [E], offsets [E + 1], perm [T k], inv [T k]) as int32 of ids [T, k]."""
    flat = ids.reshape(-1).long()
    n = flat.numel()
    counts = torch.bincount(flat, minlength=experts)
    offsets = torch.zeros(experts + 1, dtype=torch.long)
    offsets[1:] = torch.cumsum(counts, 0)
    perm = torch.argsort(flat * max(n, 1) + torch.arange(n))   # unique keys: no tie to break
    inv = torch.empty(n, dtype=torch.long)
    inv[perm] = torch.arange(n)
    return counts.int(), offsets.int(), perm.int(), inv.int()


def moe_route(logits: torch.Tensor, bias: torch.Tensor, *, top_k: int, n_group: int = 1,
              topk_group: int = 1, renormalize: bool = True, routed_scale: float = 1.0) -> Routing:
    """Router logits [T, E] FP32 and bias [E] -> Routing (CPU tensors)."""
    ids, s = select(logits, bias, top_k, n_group, topk_group)
    w = combine_weights(s.gather(1, ids), renormalize, routed_scale)
    counts, offsets, perm, inv = grouped_order(ids, logits.shape[1])
    return Routing(ids.int(), w, counts, offsets, perm, inv)


def route_spec(spec, logits: torch.Tensor, bias: torch.Tensor) -> Routing:
    """moe_route with the fields of a MoeRouteSpec."""
    return moe_route(logits, bias, top_k=spec.top_k, n_group=spec.n_group, topk_group=spec.topk_group,
                     renormalize=spec.renormalize, routed_scale=spec.routed_scale)
