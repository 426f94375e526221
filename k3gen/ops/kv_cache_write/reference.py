"""FP32 reference of kv_cache_write (the contract is the docstring of k3gen.ops.kv_cache_write.spec).

`kv_cache_write` updates a dict of cache tensors in place, bit for bit what the kernel writes;
`gather_rows` reads a sequence back as FP32 rows. Both work on CPU tensors (and on CUDA ones).

NVFP4 details that the kernel shares:
- A touched tile is quantized over its present rows `tile_start .. end-1` (end = start_pos + n):
  rows older than this call come from the HP ring, the others from `rows`. Codes (and rope scales)
  of those rows are rewritten; page rows at or beyond `end` keep their codes.
- SWIZZLE_128X4 stores the latent tile scale in all 16 rows of the tile (the scale matrix stays
  uniform per tile); rope scales only for present rows.
- The ring receives every new row with position >= end - ring; other ring rows are untouched.
- Page ids outside [0, num_pages) raise PageIndexError, or with `check_pages=False` are skipped
  exactly like the kernel skips them (the ring is still written: it is not paged).
"""
from __future__ import annotations

import torch

from k3gen.errors import PageIndexError
from k3gen.ir.dtypes import Fp8ScaleGranularity, KvDtype, ScaleLayout
from k3gen.ir.layouts import (MLA_LATENT, MLA_ROW, NVFP4_BLOCK, NVFP4_TILE_TOKENS, KvLayout,
                          swizzle_128x4_offset)
from k3gen import numerics as Q
TILE = NVFP4_TILE_TOKENS
_TORCH = {"bf16": torch.bfloat16, "fp32": torch.float32, "e4m3": torch.uint8, "e2m1": torch.uint8,
          "int32": torch.int32}
POISON_BYTE = 0xA5   # finite in every dtype used here (bf16 / fp32 / e4m3), so poison never NaNs


def alloc_cache(layout: KvLayout, num_pages: int, num_slots: int = 1, device="cpu") -> dict:
    """Zero tensors named and shaped as `layout.tensors()`; E4M3/E2M1 bytes are uint8."""
    out = {}
    for name, ts in layout.tensors().items():
        shape = ts.concrete_shape(num_pages=num_pages, num_slots=num_slots)
        out[name] = torch.zeros(shape, dtype=_TORCH[ts.dtype.name], device=device)
    return out


def poison_cache(cache: dict, byte: int = POISON_BYTE) -> dict:
    for t in cache.values():
        t.view(torch.uint8).fill_(byte)
    return cache


def _ints(t) -> list[int]:
    return [int(v) for v in (t.tolist() if isinstance(t, torch.Tensor) else t)]


def _scale_cols(layout: KvLayout) -> int:
    return layout.nvfp4_scale_cols  # 36: 32 latent tile blocks + 4 rope blocks


def kv_cache_write(layout: KvLayout, cache: dict, rows, cu_rows, start_pos, block_table,
                   ring_slot=None, scale: float = 1.0, *, check_pages: bool = True) -> None:
    """Append `rows` (BF16 [N, 576]) of each sequence to the paged cache, in place.

    `scale` is the FP8 per-tensor scale or the NVFP4 global scale G (FP32).
    """
    cu, sp = _ints(cu_rows), _ints(start_pos)
    bt = block_table.cpu() if isinstance(block_table, torch.Tensor) else torch.tensor(block_table)
    slots = _ints(ring_slot) if ring_slot is not None else None
    num_pages = next(iter(cache.values())).shape[0]
    scale32 = float(torch.tensor(scale, dtype=torch.float32))
    if check_pages:  # all or nothing: validate every touched page before writing
        for b in range(len(sp)):
            for j in range(sp[b] // layout.page, (sp[b] + cu[b + 1] - cu[b] - 1) // layout.page + 1):
                pg = int(bt[b, j]) if j < bt.shape[1] else -1
                if cu[b + 1] > cu[b] and not 0 <= pg < num_pages:
                    raise PageIndexError(f"sequence {b}: block_table[{b}, {j}] = {pg} is outside "
                                         f"[0, {num_pages})")
    for b in range(len(sp)):
        n = cu[b + 1] - cu[b]
        if n <= 0:
            continue
        s = sp[b]
        new = rows[cu[b]:cu[b + 1]]

        def page_of(p: int) -> int | None:
            j = p // layout.page
            pg = int(bt[b, j]) if j < bt.shape[1] else -1
            return pg if 0 <= pg < num_pages else None

        if layout.kv is KvDtype.NVFP4:
            if slots is None:
                raise ValueError("NVFP4 KV needs ring_slot")
            _write_nvfp4(layout, cache, new, s, page_of, slots[b], scale32)
        else:
            _write_rows(layout, cache, new, s, page_of, scale32)


# -- BF16 / FP8: independent rows ------------------------------------------------------------------
def quantize_fp8_rows(x: torch.Tensor, layout: KvLayout, scale: float):
    """FP32 rows [n, 576] -> (E4M3 codes [n, 576], FP32 scales [n, 5] or None)."""
    if layout.fp8_scales is Fp8ScaleGranularity.PER_TENSOR:
        return Q.fp8_quantize_with_scale(x, torch.tensor(scale, dtype=torch.float32)), None
    lat_c, lat_s = Q.fp8_group_quantize(x[:, :MLA_LATENT], 128)
    rope_c, rope_s = Q.fp8_group_quantize(x[:, MLA_LATENT:], MLA_ROW - MLA_LATENT)
    return torch.cat([lat_c, rope_c], 1), torch.cat([lat_s, rope_s], 1)


def _write_rows(layout, cache, new, s, page_of, scale):
    n = new.shape[0]
    pages = torch.tensor([-1 if pg is None else pg for pg in map(page_of, range(s, s + n))],
                         dtype=torch.long)
    keep = pages >= 0
    slots = (torch.arange(s, s + n) % layout.page)[keep]
    pages = pages[keep]
    if layout.kv is KvDtype.BF16:
        dst = cache["kv"]
        dst[pages.to(dst.device), slots.to(dst.device)] = new[keep.to(new.device)].to(dst.device)
        return
    codes, scales = quantize_fp8_rows(new.float().cpu(), layout, scale)
    dst = cache["kv_codes"]
    dst[pages.to(dst.device), slots.to(dst.device)] = codes[keep].to(dst.device)
    if scales is not None:
        dst = cache["kv_scales"]
        dst[pages.to(dst.device), slots.to(dst.device)] = scales[keep].to(dst.device)


# -- NVFP4: 16-token tiles re-quantized from the ring -----------------------------------------------
def quantize_nvfp4_tile(x: torch.Tensor, G: float):
    """Present rows [k <= 16, 576] FP32 of one tile -> (packed codes [k, 288],
    latent tile scale codes [32], rope scale codes [k, 4])."""
    k = x.shape[0]
    lat = x[:, :MLA_LATENT].reshape(k, MLA_LATENT // NVFP4_BLOCK, NVFP4_BLOCK)
    rope = x[:, MLA_LATENT:].reshape(k, -1, NVFP4_BLOCK)
    lat_sc, lat_d = Q.nvfp4_scale(lat.abs().amax(dim=(0, 2)), G)
    rope_sc, rope_d = Q.nvfp4_scale(rope.abs().amax(dim=2), G)
    lat_q = Q.e2m1_quantize_step(lat, lat_d[None, :, None]).reshape(k, MLA_LATENT)
    rope_q = Q.e2m1_quantize_step(rope, rope_d[:, :, None]).reshape(k, -1)
    return Q.pack_e2m1(torch.cat([lat_q, rope_q], 1)), lat_sc, rope_sc


def _store_nvfp4_scales(layout, cache, pg, tile_slot0, k, lat_sc, rope_sc):
    dev = next(iter(cache.values())).device
    if layout.scale_layout is ScaleLayout.LINEAR:
        cache["tile_scales"][pg, tile_slot0 // TILE] = lat_sc.to(dev)
        cache["rope_scales"][pg, tile_slot0:tile_slot0 + k] = rope_sc.to(dev)
        return
    cols = _scale_cols(layout)
    nlat = MLA_LATENT // NVFP4_BLOCK
    r = torch.arange(tile_slot0, tile_slot0 + TILE)
    c = torch.arange(nlat)
    off = swizzle_128x4_offset(r[:, None], c[None, :], cols)
    cache["scales"][pg, off.reshape(-1).to(dev)] = lat_sc.repeat(TILE).to(dev)
    rr = r[:k, None]
    cc = torch.arange(nlat, cols)[None, :]
    off = swizzle_128x4_offset(rr, cc, cols)
    cache["scales"][pg, off.reshape(-1).to(dev)] = rope_sc.reshape(-1).to(dev)


def _write_nvfp4(layout, cache, new, s, page_of, slot, G):
    ring_t = cache["hp_tail"][slot]
    R = layout.ring
    n = new.shape[0]
    e = s + n
    x_new = new.float().cpu()
    ring_rows = ring_t.float().cpu()  # read before any ring write of this call
    for t in range(s // TILE, (e - 1) // TILE + 1):
        ts = t * TILE
        hi = min(ts + TILE, e)
        tile = torch.stack([ring_rows[p % R] if p < s else x_new[p - s] for p in range(ts, hi)])
        pg = page_of(ts)
        if pg is None:
            continue
        codes, lat_sc, rope_sc = quantize_nvfp4_tile(tile, G)
        slot0 = ts % layout.page
        cache["kv_codes"][pg, slot0:slot0 + hi - ts] = codes.to(cache["kv_codes"].device)
        _store_nvfp4_scales(layout, cache, pg, slot0, hi - ts, lat_sc, rope_sc)
    for p in range(max(s, e - R), e):
        ring_t[p % R] = new[p - s].to(ring_t.device, torch.bfloat16)


# -- read back -------------------------------------------------------------------------------------
def gather_rows(layout: KvLayout, cache: dict, block_table_row, length: int, *, ring_slot=None,
                scale: float = 1.0, use_tail: bool = True) -> torch.Tensor:
    """Dequantize positions 0..length-1 of one sequence -> FP32 [length, 576] (on the CPU).

    NVFP4 with `use_tail`: the rows of the live incomplete tile come from the BF16 ring, exact.
    """
    bt = _ints(block_table_row)
    pos = torch.arange(length)
    pages = torch.tensor([bt[p // layout.page] for p in range(length)], dtype=torch.long)
    slot = pos % layout.page
    c = {k: v.cpu() for k, v in cache.items()}
    if layout.kv is KvDtype.BF16:
        return c["kv"][pages, slot].float()
    if layout.kv is KvDtype.FP8:
        v = Q.e4m3_decode(c["kv_codes"][pages, slot])
        if layout.fp8_scales is Fp8ScaleGranularity.PER_TENSOR:
            return v * Q._f32(torch.tensor(scale, dtype=torch.float32))
        sc = c["kv_scales"][pages, slot]
        g = torch.cat([torch.arange(MLA_LATENT) // 128,
                       torch.full((MLA_ROW - MLA_LATENT,), MLA_LATENT // 128)])
        return v * sc[:, g]
    G = float(torch.tensor(scale, dtype=torch.float32))
    v = Q.e2m1_decode(Q.unpack_e2m1(c["kv_codes"][pages, slot]))
    nlat = MLA_LATENT // NVFP4_BLOCK
    if layout.scale_layout is ScaleLayout.LINEAR:
        lat_sc = c["tile_scales"][pages, slot // TILE]
        rope_sc = c["rope_scales"][pages, slot]
    else:
        cols = _scale_cols(layout)
        off = swizzle_128x4_offset(slot[:, None], torch.arange(cols)[None, :], cols)
        sc = torch.gather(c["scales"][pages], 1, off)
        lat_sc, rope_sc = sc[:, :nlat], sc[:, nlat:]
    d = Q._div(Q.e4m3_decode(torch.cat([lat_sc, rope_sc], 1)), G)
    out = (v.reshape(length, -1, NVFP4_BLOCK) * d[:, :, None]).reshape(length, MLA_ROW)
    if use_tail and length % TILE:
        if ring_slot is None:
            raise ValueError("use_tail needs ring_slot")
        live = range(length // TILE * TILE, length)
        ring_t = c["hp_tail"][int(ring_slot)]
        out[live.start:] = torch.stack([ring_t[p % layout.ring].float() for p in live])
    return out
