"""MLA attention over the paged latent KV cache, absorbed form, in PyTorch: the attention of the
reference path (RefOps). The kernel path (KernelOps) runs the generated `mla_decode` instead.
It dequantizes the pages of each sequence with vectorized tensor ops (no host sync, static shapes)
and matches k3gen's `reference.kv_cache_write.gather_rows` value for value
(tests/nogpu/modeling/test_model_attention.py).

Multi-token queries (verify: 1 + M tokens per sequence) are bottom-right causal: query t of a
sequence whose step starts at position p sees positions < p + t + 1. With NVFP4 KV each query reads
the cache as it stood at its own length: rows of complete 16-token tiles from the FP4 pages, the
rows of its incomplete tile exact from the BF16 HP tail ring (which keeps 16 + M rows for this).

A continued prefill (model/layers.py mla_prefill) reads its sequences' cached prefix through the
same dequantization (`cached_prefix`); its attention is k3gen's mla_prefill (reference or kernel).
"""
from __future__ import annotations

import math

import torch

from k3gen.errors import SpecError
from k3gen.ir.dtypes import Fp8ScaleGranularity, KvDtype, ScaleLayout
from k3gen.ir.layouts import MLA_LATENT, MLA_ROW, NVFP4_BLOCK, NVFP4_TILE_TOKENS, KvLayout, swizzle_128x4_offset
from k3gen import numerics as Q
SOFTMAX_SCALE = 1.0 / math.sqrt(192.0)


def dequant_pages(layout: KvLayout, cache: dict, pages: torch.Tensor, scale: float) -> torch.Tensor:
    """FP32 rows of the pages `pages` [B, P] (int) -> [B, P * page, 576]."""
    B, P = pages.shape
    pg = layout.page
    pl = pages.long()
    if layout.kv is KvDtype.BF16:
        return cache["kv"][pl].float().reshape(B, P * pg, MLA_ROW)
    if layout.kv is KvDtype.FP8:
        v = Q.e4m3_decode(cache["kv_codes"][pl])
        if layout.fp8_scales is Fp8ScaleGranularity.PER_TENSOR:
            v = v * float(Q._f32(torch.tensor(scale, dtype=torch.float32)))   # a host scalar: no copy in capture
        else:
            sc = cache["kv_scales"][pl]                                          # [B, P, pg, 5]
            grp = torch.cat([torch.arange(MLA_LATENT, device=v.device) // 128,
                             torch.full((MLA_ROW - MLA_LATENT,), MLA_LATENT // 128, device=v.device)])
            v = v * sc[..., grp]
        return v.reshape(B, P * pg, MLA_ROW)
    v = Q.e2m1_decode(Q.unpack_e2m1(cache["kv_codes"][pl]))                      # [B, P, pg, 576]
    if layout.scale_layout is ScaleLayout.LINEAR:
        lat = cache["tile_scales"][pl].repeat_interleave(NVFP4_TILE_TOKENS, dim=2)  # [B, P, pg, 32]
        sc = torch.cat([lat, cache["rope_scales"][pl]], dim=-1)
    else:
        cols = layout.nvfp4_scale_cols
        r = torch.arange(pg, device=v.device)[:, None]
        c = torch.arange(cols, device=v.device)[None, :]
        off = swizzle_128x4_offset(r, c, cols)                                     # [pg, 36]
        sc = cache["scales"][pl][..., off.reshape(-1)].reshape(B, P, pg, cols)
    d = Q._div(Q.e4m3_decode(sc), float(scale))
    v = (v.reshape(B, P, pg, -1, NVFP4_BLOCK) * d[..., None]).reshape(B, P * pg, MLA_ROW)
    return v


def query_rows(layout: KvLayout, cache: dict, block_table: torch.Tensor, start: torch.Tensor, T: int,
               ring_slot: torch.Tensor | None, scale: float) -> torch.Tensor:
    """Rows each query sees: [B, T, L, 576] FP32 with L = pages * page (positions past a query's
    length hold values that the caller masks)."""
    rows = dequant_pages(layout, cache, block_table, scale)                      # [B, L, 576]
    B, L = rows.shape[0], rows.shape[1]
    if layout.kv is not KvDtype.NVFP4:
        return rows[:, None].expand(B, T, L, MLA_ROW)
    R = layout.ring
    pos = torch.arange(L, device=rows.device)
    ring = cache["hp_tail"][ring_slot.long()][:, pos % R].float()                # [B, L, 576]
    length = start.long()[:, None] + torch.arange(1, T + 1, device=rows.device)[None, :]  # [B, T]
    tile0 = length // NVFP4_TILE_TOKENS * NVFP4_TILE_TOKENS
    tail = (pos[None, None, :] >= tile0[..., None]) & (pos[None, None, :] < length[..., None])
    return torch.where(tail[..., None], ring[:, None], rows[:, None])


def paged_mla_attention(layout: KvLayout, q: torch.Tensor, cache: dict, block_table: torch.Tensor,
                        start: torch.Tensor, ring_slot: torch.Tensor | None, scale: float) -> torch.Tensor:
    """q [B, T, H, 576] (latent 512 | rope 64); block_table [B, P]; start [B] position of each
    sequence's first query. Returns o_lat [B, T, H, 512] FP32 (softmax and sums in FP32)."""
    T = q.shape[1]
    rows = query_rows(layout, cache, block_table, start, T, ring_slot, scale)    # [B, T, L, 576]
    L = rows.shape[2]
    s = torch.einsum("bthc,btlc->bthl", q.double(), rows.double()).float() * SOFTMAX_SCALE
    length = start.long()[:, None] + torch.arange(1, T + 1, device=q.device)[None, :]
    live = torch.arange(L, device=q.device)[None, None, :] < length[..., None]     # [B, T, L]
    s = s.masked_fill(~live[:, :, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1)
    return torch.einsum("bthl,btlc->bthc", p.double(), rows[..., :MLA_LATENT].double()).float()


def cached_prefix(layout: KvLayout, cache: dict, block_table: torch.Tensor, lengths: list[int],
                  scale: float) -> torch.Tensor:
    """FP32 rows [sum(lengths), 576] of positions 0 .. lengths[b] - 1 of each sequence b (block_table
    [B, P]), dequantized as decode reads them (`dequant_pages`): what a continued prefill's keys
    expand. BF16 and FP8 KV only (NVFP4 KV has no chunked prefill: SPEC.md section 5)."""
    if layout.kv is KvDtype.NVFP4:
        raise SpecError("kv", layout.kv.value, ["bf16", "fp8"], "chunked prefill is disabled with NVFP4 KV "
                        "(SPEC.md section 5)")
    P = max(1, max(-(-n // layout.page) for n in lengths))
    rows = dequant_pages(layout, cache, block_table[:, :P], scale)               # [B, P * page, 576]
    return torch.cat([rows[b, :n] for b, n in enumerate(lengths)])
