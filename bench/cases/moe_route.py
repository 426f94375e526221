"""moe_route: the noaux_tc router + grouped token order at K3 TP8 shapes vs torch (`python -m bench --op moe_route`)."""
from __future__ import annotations

from bench.harness import case, make_row, sets_for, time_graph
from k3gen.ir.dims import evaluate


def torch_route(logits, bias, k: int, experts: int):
    """The same outputs in torch (sigmoid + bias, topk, renormalized weights, a stable sort for the
    grouped order, a scatter-add histogram): capturable, no host sync."""
    import torch
    s = torch.sigmoid(logits)
    ids = (s + bias).topk(k, dim=-1).indices
    w = s.gather(1, ids)
    w = w / (w.sum(-1, keepdim=True) + 1e-20)
    flat = ids.reshape(-1)
    perm = torch.sort(flat, stable=True).indices
    counts = torch.zeros(experts, dtype=torch.int64, device=logits.device).index_add_(
        0, flat, torch.ones_like(flat))
    offsets = torch.cumsum(counts, 0)
    inv = torch.empty_like(perm).scatter_(0, perm, torch.arange(flat.numel(), device=logits.device))
    return ids, w, perm, inv, offsets


@case
def moe_route(ceiling: float, quick: bool = False) -> list:
    """MoE routing (sigmoid + bias, top-16 of 896, renormalize, grouped order) at K3 TP8 shapes,
    T = 1..512, against torch topk + sort in the same run."""
    import torch

    from k3gen.ops.moe_route.launcher import MoeRoute
    from k3gen.ops.moe_route.spec import MoeRouteSpec
    from k3gen.targets import get_target

    spec = MoeRouteSpec(target=get_target("sm90"), experts=896, top_k=16)
    op = MoeRoute(spec).load()
    E, k = spec.experts, spec.top_k
    rows, same = [], {}
    g = torch.Generator(device="cuda").manual_seed(0)
    for T in (1, 64, 512) if quick else (1, 2, 8, 16, 64, 128, 256, 512):
        nbytes = evaluate(spec.bytes_moved(), T=T)
        sets = []
        for _ in range(sets_for(nbytes)):
            logits = torch.randn(T, E, device="cuda", generator=g) * 2
            bias = torch.randn(E, device="cuda", generator=g) * 0.1
            sets.append((logits, bias, op.workspace(T)))
        us = time_graph([lambda s=s: op(*s) for s in sets])
        peer_us = time_graph([lambda s=s: torch_route(s[0], s[1], k, E) for s in sets])
        rows.append(make_row("moe_route", f"e{E}-k{k} T{T}", us, nbytes, ceiling, same,
                             peer="torch topk+sort", peer_us=peer_us))
        del sets
    return rows
