"""mla_decode's tcgen05 kernels on the CPU (nothing runs on a GPU): the tile decode of decode_tc.cuh
(shared by decode_tm.cuh), the Q staging rule, and an emulation of decode_tm.cuh's tile loop with
the kernel's rounding points (tests/nogpu/ops/test_mla_decode_tcgen05*.py).

The emulation follows the kernel's order where it decides a rounding: f16 / BF16 operands, FP32
scores scaled and masked as load_scores does, the column maximum, alpha and the subtracted max of
the column thread, P rounded once, the per-token-slot denominators (lp = lp alpha + p) reduced by
half_reduce16's butterfly and then warps ((0 + 1) + 2) + 3, O^T rescaled by alpha, the epilogue's
1 / l (NVFP4: / G). The MMAs are FP32 matmuls (the tensor core's summation order is not modelled).
"""
from __future__ import annotations

import math

import torch

from k3gen import numerics as Q
from k3gen.ir.dtypes import Fp8ScaleGranularity, KvDtype

BLK = 64 * 128
LOG2E = 1.4426950408889634
NEG_INF = float("-inf")


def f32(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)


def sw_off(row: int, c: int, rows: int = 64) -> int:
    """decode_tc.cuh tc::sw_rows<rows>: 16-byte chunk c of `row` in a [rows][576] SW128 operand."""
    return (c >> 3) * rows * 128 + (row >> 3) * 1024 + (row & 7) * 128 + (((c & 7) ^ (row & 7)) << 4)


def swz_scale(pr: int, c: int) -> int:
    """decode_tc.cuh tc::swz_scale: the byte of (page row, 16-dim group) in the page's scale matrix."""
    return (c & 3) + (c >> 2) * 512 + (pr & 31) * 16 + ((pr & 127) >> 5) * 4


def tile_page(bt, num_pages, page, tile):
    j = tile * 64 // page
    if j >= len(bt):
        return -1
    pg = bt[j]
    return pg if 0 <= pg < num_pages else -1


def f16(x):
    return x.to(torch.float16).float()


def bf16(x):
    return x.to(torch.bfloat16).float()


def decode_tile_tc(layout, cache, bt, num_pages, tile, length, G, ring_slot):
    """decode_tc.cuh decode_tile on the CPU: the f16 operand rows of one tile (logical [64][576])."""
    page = layout.page
    pg = tile_page(bt, num_pages, page, tile)
    slot0 = tile * 64 % page
    live = length // 16 * 16 if layout.kv is KvDtype.NVFP4 else length
    out = torch.zeros(64, 576)
    for t in range(64):
        pos = tile * 64 + t
        if pg >= 0 and pos < live:
            if layout.kv is KvDtype.NVFP4:
                codes = cache["kv_codes"][pg].reshape(-1)[(slot0 + t) * 288:(slot0 + t + 1) * 288]
                vals = Q.e2m1_decode(Q.unpack_e2m1(codes))
                sc = cache["scales"][pg]
                s = Q.e4m3_decode(torch.stack([sc[swz_scale(slot0 + t, g)] for g in range(36)]))
                out[t] = f16(vals * s.repeat_interleave(16))            # exact in f16
            else:
                codes = cache["kv_codes"][pg, slot0 + t]
                v = Q.e4m3_decode(codes)
                if layout.fp8_scales is Fp8ScaleGranularity.PER_TENSOR:
                    out[t] = f16(v)                                     # codes exactly
                else:
                    s = cache["kv_scales"][pg, slot0 + t]
                    out[t] = f16(v * s[torch.arange(576) // 128])
        elif layout.kv is KvDtype.NVFP4 and pos < length:
            out[t] = f16(cache["hp_tail"][ring_slot, pos % layout.ring].float() * G)
    return out


def bf16_tile(cache, bt, num_pages, page, tile):
    """What the 9 TMA boxes of a BF16 tile land: the page's 64 rows as stored (past the sequence end
    too: stale), zeros for a bad page (the box reads past the map's end)."""
    pg = tile_page(bt, num_pages, page, tile)
    if pg < 0:
        return torch.zeros(64, 576)
    slot0 = tile * 64 % page
    return cache["kv"][pg, slot0:slot0 + 64].float()


def stage_q(rows: torch.Tensor, R: int, ht_rows: int, f16_kv: bool):
    """decode_tc.cuh stage_q: rows [n <= R, 576] BF16 values -> (operand [R, 576], 2^-E). FP8 /
    NVFP4: f16 of q 2^E, E putting the max |q| in [2^14, 2^15) (clamped to +-100)."""
    qop = torch.zeros(R, 576)
    qop[:ht_rows] = rows[:ht_rows].float()
    if not f16_kv:
        return qop, 1.0
    mx = float(qop.abs().max())
    e = 14 - (math.frexp(mx)[1] - 1) if mx > 0 else 0
    e = min(max(e, -100), 100)
    return f16(qop * 2.0 ** e), 2.0 ** -e


def half_reduce16(v: torch.Tensor, op) -> torch.Tensor:
    """decode_tm.cuh half_reduce16 over one 16-lane half: v [16 lanes, 16 columns] -> [16]: lane t's
    result (column t). Each step: own value op the partner's (lane ^ o), o = 8, 4, 2, 1; a lane
    keeps the half of its columns its bit o selects."""
    vals = {t: list(v[t]) for t in range(16)}   # lane -> the columns it holds, in order
    cols = {t: list(range(16)) for t in range(16)}
    for o in (8, 4, 2, 1):
        new_v, new_c = {}, {}
        for t in range(16):
            h = len(vals[t]) // 2
            up = bool(t & o)
            keep = vals[t][h:] if up else vals[t][:h]
            part = vals[t ^ o][h:] if up else vals[t ^ o][:h]   # the partner sends the half we keep
            new_v[t] = [op(a, b) for a, b in zip(keep, part)]
            new_c[t] = cols[t][h:] if up else cols[t][:h]
        vals, cols = new_v, new_c
    assert all(cols[t] == [t] for t in range(16))
    return torch.stack([vals[t][0] for t in range(16)])


def visible(pos: int, L: int, T: int, H: int, rows: range) -> torch.Tensor:
    """load_scores' mask: d = pos - (L - T); column j (query row rb + j) sees pos iff d <= 0 or
    min(j, HT - 1 - rb) >= d H - rb."""
    d, HT, rb = pos - (L - T), T * H, rows.start
    if d <= 0:
        return torch.ones(len(rows), dtype=torch.bool)
    return torch.tensor([min(j, HT - 1 - rb) >= d * H - rb for j in range(len(rows))])


def emulate_cta(tiles, qop, qk_scale, L, T, H, r0, R, t_begin, n, f16_p):
    """One CTA's tile loop: tiles(t) -> [64, 576] operand rows. Returns (O^T [512, R] FP32, m [R],
    lp [64, R]) after n tiles from t_begin."""
    rnd = f16 if f16_p else bf16
    m = torch.full((R,), NEG_INF)
    lp = torch.zeros(64, R)
    o = torch.zeros(512, R)
    for it in range(n):
        kt = tiles(t_begin + it)
        s = (kt @ qop.T).float()                                   # S^T [64 tok, R]
        x = torch.empty(64, R)
        for tok in range(64):
            vis = visible((t_begin + it) * 64 + tok, L, T, H, range(r0, r0 + R))
            x[tok] = torch.where(vis, s[tok] * qk_scale, f32(NEG_INF))
        tmax = x.max(0).values
        m_new = torch.maximum(m, tmax)
        alpha = torch.where(m_new == NEG_INF, f32(1.0), torch.exp2(m - m_new))
        msub = torch.where(m_new == NEG_INF, f32(0.0), m_new)
        p = rnd(torch.exp2(x - msub))
        lp = p if it == 0 else lp * alpha + p
        if it > 0 and bool((alpha != 1).any()):
            o = o * alpha
        v = kt[:, :512]
        if t_begin * 64 + it * 64 + 64 > L:                        # the owners zero V rows past the end
            v = v.clone()
            v[max(0, L - (t_begin + it) * 64):] = 0
        o = o + v.T @ p
        m = m_new
    return o, m, lp


def denominators(lp: torch.Tensor) -> torch.Tensor:
    """The epilogue's l per column: each warp's 16 token slots by half_reduce16, then ((0 + 1) + 2) + 3."""
    R = lp.shape[1]
    per_warp = []
    for w in range(4):
        sums = []
        for c in range(R // 16):
            sums.append(half_reduce16(lp[16 * w:16 * w + 16, 16 * c:16 * c + 16], lambda a, b: a + b))
        per_warp.append(torch.cat(sums))
    return ((per_warp[0] + per_warp[1]) + per_warp[2]) + per_warp[3]


def emulate_tm(spec, cache, q, bt, lengths, *, ring_slot=None, G: float = 1.0, splits: int = 1) -> torch.Tensor:
    """decode_tm.cuh on the CPU for B sequences: q [B, T, H, 576] BF16 -> [B, T, H, 512] FP32 (the
    BF16 output when splits == 1; with splits, the FP32 partials merged by log-sum-exp in FP64)."""
    layout, kv = spec.layout, spec.kv
    H, T = spec.heads, spec.tokens
    HT, R = H * T, spec.impl.plan(spec).rows
    num_pages = next(iter(cache.values())).shape[0]
    B = q.shape[0]
    out = torch.zeros(B, HT, 512)
    g32 = f32(G)
    for b in range(B):
        L = int(lengths[b])
        ntiles = -(-L // 64)
        per = -(-ntiles // splits)
        rows_bt = [int(x) for x in bt[b]]
        if kv is KvDtype.BF16:
            tiles = lambda t: bf16_tile(cache, rows_bt, num_pages, layout.page, t)   # noqa: E731
        else:
            tiles = lambda t: decode_tile_tc(layout, cache, rows_bt, num_pages, t, L, G, ring_slot[b])  # noqa: E731
        for r0 in range(0, HT, R):
            nrows = min(R, HT - r0)
            qop, qmul = stage_q(q[b].reshape(HT, 576)[r0:r0 + nrows].float(), R, nrows, kv is not KvDtype.BF16)
            qk_scale = f32(spec.softmax_scale) * f32(LOG2E) * f32(qmul)
            if kv is KvDtype.FP8 and layout.fp8_scales is Fp8ScaleGranularity.PER_TENSOR:
                qk_scale = qk_scale * g32
            if kv is KvDtype.NVFP4:
                qk_scale = qk_scale / g32
            parts = []
            for s in range(splits):
                t_begin = min(ntiles, s * per)
                n = min(ntiles, t_begin + per) - t_begin
                o, m, lp = emulate_cta(tiles, qop, qk_scale, L, T, H, r0, R, t_begin, n, kv is not KvDtype.BF16)
                l = denominators(lp) if n else torch.zeros(R)
                w = torch.where(l > 0, 1 / l, f32(0.0))
                if kv is KvDtype.FP8 and layout.fp8_scales is Fp8ScaleGranularity.PER_TENSOR:
                    w = w * g32
                if kv is KvDtype.NVFP4:
                    w = w / g32
                ob = (o * w).T[:nrows] if n else torch.zeros(nrows, 512)
                lse = torch.where(l > 0, m + torch.log2(l), f32(NEG_INF))[:nrows]
                parts.append((ob, lse))
            if splits == 1:
                out[b, r0:r0 + nrows] = bf16(parts[0][0])
            else:
                lse = torch.stack([p[1] for p in parts]).double()
                mx = lse.max(0).values
                wts = torch.where(lse == NEG_INF, torch.zeros_like(lse), torch.exp2(lse - mx))
                acc = sum(wts[i, :, None] * parts[i][0].double() for i in range(splits))
                tot = wts.sum(0)
                out[b, r0:r0 + nrows] = bf16((acc / torch.where(tot > 0, tot, 1)[:, None]).float())
    return out.reshape(B, T, H, 512)
