"""FP32 reference of mla_decode (the contract is the docstring of k3gen.ops.mla_decode.spec).

Rows are gathered and dequantized through `reference.kv_cache_write.gather_rows` (the inverse of
the KV write op; NVFP4 reads the live tile from the HP tail ring), then plain attention in FP32.
"""
from __future__ import annotations

import torch

from k3gen.ir.layouts import MLA_LATENT, KvLayout
from k3gen.ops.mla_decode.spec import SOFTMAX_SCALE
from k3gen.ops.kv_cache_write.reference import gather_rows


def attend(q: torch.Tensor, rows: torch.Tensor, scale: float = SOFTMAX_SCALE) -> torch.Tensor:
    """One sequence: q [T, H, 576], rows [L, 576] (FP32, L >= T) -> o_lat [T, H, 512] FP32.
    Bottom-right causal: token t sees rows 0 .. L - T + t."""
    T, H, _ = q.shape
    L = rows.shape[0]
    qf, rf = q.float(), rows.float().to(q.device)
    s = torch.einsum("thd,ld->thl", qf, rf) * scale
    pos = torch.arange(L, device=q.device)
    limit = L - T + torch.arange(T, device=q.device)
    s = s.masked_fill(pos[None, None, :] > limit[:, None, None], float("-inf"))
    p = torch.softmax(s, dim=-1)
    return torch.einsum("thl,ld->thd", p, rf[:, :MLA_LATENT])


def gather_batch(layout: KvLayout, cache: dict, block_table, lengths, *, ring_slot=None,
                 scale: float = 1.0) -> list[torch.Tensor]:
    """The FP32 rows [L_b, 576] of every sequence, as the kernel must read them."""
    lens = [int(x) for x in (lengths.tolist() if isinstance(lengths, torch.Tensor) else lengths)]
    bt = block_table.cpu()
    rs = None if ring_slot is None else [int(x) for x in ring_slot.tolist()]
    return [gather_rows(layout, cache, bt[b], L, ring_slot=None if rs is None else rs[b], scale=scale)
            for b, L in enumerate(lens)]


def mla_decode(layout: KvLayout, cache: dict, q: torch.Tensor, block_table, lengths, *, ring_slot=None,
               scale: float = 1.0, device=None) -> torch.Tensor:
    """q [B, T, H, 576] -> o_lat [B, T, H, 512] FP32 (computed on `device`, default q's)."""
    dev = q.device if device is None else torch.device(device)
    rows = gather_batch(layout, cache, block_table, lengths, ring_slot=ring_slot, scale=scale)
    return torch.stack([attend(q[b].to(dev), r.to(dev)) for b, r in enumerate(rows)])
