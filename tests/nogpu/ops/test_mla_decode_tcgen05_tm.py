"""mla_decode, schedule "tcgen05_tm" (sm103 / sm107: KV tokens on the MMA M side), on the CPU. Nothing
here runs on a Blackwell GPU (none exists in this project): selection, the shared-memory / TMEM plan,
the index math of include/k3gen/mla/decode_tm.cuh replayed against the SM90 kernels' on the same
inputs (what TMA / the decoders / stage_q / the softmax threads write vs what every tcgen05
descriptor reads, the TMEM lanes and columns each thread reads, the softmax's cross-lane reduction
order vs the SM90 mma kernel's), an emulation of the tile loop with the kernel's rounding points
against reference.py (tests/mla_tc_emul.py), the NVRTC build for sm_103a / sm_107a and the B300
projection that chose the schedule (bench/cases/mla_decode_b300.py)."""
from __future__ import annotations

import re

import pytest
import torch

from k3gen.arch.sm100 import DESC_VERSION, idesc_f16, tmem_lane_m64, tmem_lane_m128, umma_desc
from k3gen.arch.sm90 import (SW128_KMAJOR, blocked_sw128_offset, encode_desc, sw128_mnmajor, wgmma_read_addr,
                             wgmma_read_addr_mn)
from k3gen.errors import SpecError
from k3gen.ir.dtypes import Fp8ScaleGranularity, KvDtype, ScaleLayout
from k3gen.ops.kv_cache_write.reference import alloc_cache
from k3gen.ops.mla_decode import reference
from k3gen.ops.mla_decode.spec import MlaDecodeSpec
from k3gen.ops.mla_decode.variants import SMEM_LIMIT, tc_raw_bytes, tm_default_rows, tm_smem, tm_tmem_cols
from k3gen.targets import TARGETS, build_specs
from mla_tc_emul import BLK, bf16, denominators, emulate_tm, f16, half_reduce16, sw_off, visible

TC = ("sm103-nvfp4", "sm107-nvfp4")
TILE = 9 * BLK
KVS = [(KvDtype.BF16, {}), (KvDtype.FP8, {}), (KvDtype.FP8, {"fp8_scales": Fp8ScaleGranularity.PER_TENSOR}),
       (KvDtype.NVFP4, {"max_drafts": 3})]


def tm(target="sm103-nvfp4", heads=12, tokens=1, kv=KvDtype.BF16, **kw):
    if kv is KvDtype.NVFP4:
        kw.setdefault("max_drafts", 3)
    return MlaDecodeSpec(target=TARGETS[target], heads=heads, tokens=tokens, kv=kv, **kw)


def strip(d: int) -> int:
    assert d & DESC_VERSION
    return d & ~DESC_VERSION


# -- selection and plan ----------------------------------------------------------------------------------
def test_auto_picks_tcgen05_tm_on_blackwell_only():
    """bench/cases/mla_decode_b300.py prices tcgen05_tm at >= 1.3x tcgen05 at every K3 H * T (every
    KV dtype), so `auto` takes it on the tcgen05 targets whatever H * T; `tcgen05` stays selectable."""
    for name in TC:
        mla = [s for s in build_specs(TARGETS[name]) if s.op == "mla_decode"]
        assert {s.kv for s in mla} == {KvDtype.BF16, KvDtype.FP8, KvDtype.NVFP4}
        assert all(s.schedule == "tcgen05_tm" for s in mla)
        assert tm(name, 96, 4, schedule="tcgen05").schedule == "tcgen05"
    assert not [s for s in build_specs(TARGETS["sm90"]) if s.op == "mla_decode" and s.schedule.startswith("tcgen05")]
    with pytest.raises(SpecError, match="needs tcgen05"):
        MlaDecodeSpec(target=TARGETS["sm90"], heads=12, schedule="tcgen05_tm")
    with pytest.raises(SpecError, match="128x4 swizzle only"):
        tm(kv=KvDtype.NVFP4, scale_layout=ScaleLayout.LINEAR, schedule="tcgen05_tm")
    with pytest.raises(SpecError, match="m_tiles"):
        tm(m_tiles=5)


def test_row_groups_are_balanced_and_padded_to_16():
    from bench.cases.mla_decode_b300 import tm_rows
    for ht in range(1, 129 * 8):
        r = tm_default_rows(ht)
        groups = -(-ht // r)
        assert r == tm_rows(ht) and r % 16 == 0 and 16 <= r <= 64
        assert groups == -(-ht // 64) and r - -(-ht // groups) < 16   # fewest groups, < 16 padded rows each
    for h, t, rows in ((12, 1, 16), (12, 4, 48), (12, 8, 48), (96, 1, 48), (128, 1, 64), (20, 4, 48)):
        s = tm(heads=h, tokens=t)
        p = s.impl.plan(s)
        assert (s.m_tiles * 16, p.rows, p.groups) == (rows, rows, -(-h * t // rows)) and "-mt" not in s.slug()


@pytest.mark.parametrize("kv,kw", KVS, ids=lambda x: getattr(x, "value", str(x)))
def test_plan_within_limits(kv, kw):
    for h in (1, 6, 12, 24, 48, 96, 128):
        for t in (1, 2, 4, 8):
            for mt in (1, 2, 3, 4):
                s = tm(heads=h, tokens=t, kv=kv, m_tiles=mt, **kw)
                p, R = s.impl.plan(s), 16 * mt
                op, cols = p.desc_probe
                assert p.smem_bytes <= SMEM_LIMIT and p.threads == (192 if kv is KvDtype.BF16 else 320)
                assert all(p.smem[k] % 1024 == 0 for k in ("op", "q", "p")) and p.smem["raw"] % 16 == 0
                assert 7 * R <= cols <= 512 and cols & (cols - 1) == 0   # S x 2, O^T x 4, denominators
                if kv is KvDtype.BF16:
                    assert op == p.stages >= 2   # QK of the next tile under this one's softmax
                else:
                    assert op in (1, 2) and p.stages >= 1
                    # The deepest raw ring the per-block limit allows with those operand tiles.
                    assert tm_smem(s, R, op, p.stages + 1)["total"] > SMEM_LIMIT or p.stages == 4
                    assert p.stage_bytes == tc_raw_bytes(s)


# -- operands: what is written vs what each descriptor reads, against the SM90 kernels ---------------------
@pytest.mark.parametrize("R", [16, 32, 48, 64])
def test_q_operand_is_the_sm90_kernels_layout(R):
    """stage_q<R> writes row r chunk c at sw_rows<R>(r, c): the SM90 wgmma kernels' [rows][576] SW128
    K-major Q (decode_wg.cuh sw_off(rows, ..), k3gen.arch.sm90.blocked_sw128_offset)."""
    for r in range(R):
        for c in range(72):
            assert sw_off(r, c, R) == blocked_sw128_offset(R, r, c)


@pytest.mark.parametrize("R,stage", [(16, 0), (48, 1), (64, 1)])
def test_qk_descriptors_read_the_tile_and_q(R, stage):
    """QK k16 step ks: A = the tile's 64 tokens (K-major, where TMA / the decoders put them; the same
    descriptor as SM90 wgmma_qm's K operand, plus the version bit), B = Q's R rows as stage_q wrote them."""
    aKV, aQ = stage * TILE, 2 * TILE
    for ks in range(36):
        a_addr = aKV + (ks >> 2) * BLK + (ks & 3) * 32
        da, db = umma_desc(a_addr, SW128_KMAJOR), umma_desc(aQ + (ks >> 2) * R * 128 + (ks & 3) * 32, SW128_KMAJOR)
        assert strip(da) == encode_desc(a_addr, SW128_KMAJOR)   # wgmma_qm: wg::desc_k(aKV + ..)
        for k in range(16):
            d = 16 * ks + k
            for tok in range(0, 64, 3):
                assert wgmma_read_addr(strip(da), tok, k, 2) == aKV + sw_off(tok, d // 8) + (d % 8) * 2
            for r in range(0, R, 5):
                assert wgmma_read_addr(strip(db), r, k, 2) == aQ + sw_off(r, d // 8, R) + (d % 8) * 2


def p_store(R: int, row: int, tok: int) -> int:
    """decode_tm.cuh: the softmax lane owning token `tok` stores P^T[row][tok] (2 bytes) here."""
    return (tok & 7) * 2 + (row >> 3) * 1024 + (row & 7) * 128 + (((tok >> 3) ^ (row & 7)) << 4)


@pytest.mark.parametrize("R", [16, 48, 64])
def test_pv_descriptors_read_v_and_p(R):
    """PV block mb, k16 step ks: A = V^T, the tile read MN-major over dims 128 mb .. (the very
    descriptor SM90 wgmma_qm uses for the same 128 dims as its B, plus the version bit); B = P^T
    K-major where the owner of each token stored it, every element once."""
    aKV, aP = TILE, 2 * TILE + R * 1152
    for mb in range(4):
        for ks in range(4):
            addr = aKV + 2 * mb * BLK + ks * 2048
            dv = umma_desc(addr, sw128_mnmajor(BLK))
            c, h = divmod(mb, 2)
            assert strip(dv) == encode_desc(aKV + (4 * c + 2 * h) * BLK + ks * 2048, sw128_mnmajor(BLK))
            for m in range(0, 128, 3):
                for k in range(16):
                    tok, dim = 16 * ks + k, 128 * mb + m
                    assert wgmma_read_addr_mn(strip(dv), m, k) == aKV + sw_off(tok, dim // 8) + (dim % 8) * 2
    seen = set()
    for ks in range(4):
        dp = umma_desc(aP + ks * 32, SW128_KMAJOR)
        for r in range(R):
            for k in range(16):
                a = wgmma_read_addr(strip(dp), r, k, 2)
                assert a == aP + p_store(R, r, 16 * ks + k)
                seen.add(a)
    assert len(seen) == R * 64 and max(seen) < aP + R * 128


def test_bf16_rows_past_the_end_are_zeroed_where_pv_reads_them():
    """A BF16 token past the sequence end: its owner zeroes chunks sw_off(tok, c), c < 64 - exactly
    the bytes of the tile PV's A descriptors read for that token (the QK-only rope block stays)."""
    for tok in range(64):
        zeroed = {sw_off(tok, c) + b for c in range(64) for b in range(16)}
        read = set()
        for mb in range(4):
            for ks in range(4):
                dv = umma_desc(2 * mb * BLK + ks * 2048, sw128_mnmajor(BLK))
                if 16 * ks <= tok < 16 * ks + 16:
                    for m in range(128):
                        a = wgmma_read_addr_mn(strip(dv), m, tok - 16 * ks)
                        read |= {a, a + 1}
        assert read == zeroed


def test_instruction_descriptors():
    d = idesc_f16(bf16=True, m=128, n=48, a_mn=True)
    assert (d >> 15) & 1 == 1 and (d >> 16) & 1 == 0 and (d >> 17) & 63 == 6 and (d >> 24) & 31 == 8
    assert idesc_f16(bf16=False, m=64, n=16) == (1 << 4) | (2 << 17) | (4 << 24)


@pytest.mark.parametrize("R", [16, 32, 48, 64])
def test_tmem_lanes_and_columns(R):
    """S^T (M = 64, layout F): softmax lane t < 16 of warp w reads lane 32 w + t = token 16 w + t,
    columns R (it & 1) + j = query row j; O^T (M = 128, layout D): lane t of warp w reads lane
    32 w + t = dim 128 mb + 32 w + t at columns 2R + R mb + j; the denominators at 6R + j. Every
    (token, row) and (dim, row) once, the regions disjoint, inside the allocation."""
    toks = {32 * w + t: 16 * w + t for w in range(4) for t in range(16)}
    assert sorted(toks.values()) == list(range(64)) and all(tmem_lane_m64(v) == k for k, v in toks.items())
    assert all(tmem_lane_m128(32 * w + t) == 32 * w + t for w in range(4) for t in range(32))
    cols = tm_tmem_cols(R)
    s = {(b, R * b + j) for b in (0, 1) for j in range(R)}
    o = {(mb, 2 * R + R * mb + j) for mb in range(4) for j in range(R)}
    lcol = {6 * R + j for j in range(R)}
    used = [c for _, c in s] + [c for _, c in o] + sorted(lcol)
    assert len(used) == len(set(used)) == 7 * R and max(used) < cols


# -- the softmax: masks and cross-lane order --------------------------------------------------------------
def test_mask_is_the_contracts_causal_rule():
    """load_scores' min(j, HT - 1 - rb) >= d H - rb equals pos <= L - T + t(row) (rows past H * T: the
    last token), for every group offset rb."""
    for H in (1, 3, 12, 16):
        for T in (1, 2, 4, 8):
            HT, L = H * T, 300
            for rb in range(0, HT, 16):
                rows = range(rb, rb + 16)
                for pos in range(L - T - 2, L + 3):
                    want = [pos <= L - T + (min(r, HT - 1) // H) for r in rows]
                    assert visible(pos, L, T, H, rows).tolist() == want, (H, T, rb, pos)


def test_half_reduce_keeps_column_t_in_lane_t():
    g = torch.Generator().manual_seed(3)
    v = torch.randn(16, 16, generator=g)
    assert torch.equal(half_reduce16(v, torch.maximum), v.max(0).values)
    s = half_reduce16(v, lambda a, b: a + b)
    torch.testing.assert_close(s.double(), v.double().sum(0), rtol=1e-6, atol=1e-6)
    # The order: the butterfly tree (own + partner at xor 8, 4, 2, 1), bit for bit; a running sum
    # over the lanes differs on these inputs.
    for col in range(16):
        a = [v[t, col] for t in range(16)]
        for o in (8, 4, 2, 1):
            a = [a[t] + a[t ^ o] for t in range(16)]
        assert torch.equal(s[col], a[0])
    x = torch.zeros(16, 16)
    x[0, 0], x[1:, 0] = 1.0, 2.0 ** -24
    run = torch.tensor(0.0)
    for t in range(16):
        run = run + x[t, 0]
    assert not torch.equal(half_reduce16(x, lambda a, b: a + b)[0], run)


@pytest.mark.parametrize("f16_p", [False, True])
def test_softmax_stats_match_the_sm90_kernel(f16_p):
    """One tile's scores (R rows x 64 tokens, some masked): tcgen05_tm's column reduction (butterfly
    per 16 columns, then 4 warps; per-token-slot denominators) and the SM90 mma kernel's row softmax
    (decode.cuh: 16 lanes x 4 columns per row, shuffles xor 8 .. 1) give the same max and the same
    rounded P bit for bit, and denominators within FP32 summation order."""
    g = torch.Generator().manual_seed(5)
    R = 32
    s = torch.randn(R, 64, generator=g) * 8
    s[3, 40:] = float("-inf")
    s[7] = float("-inf")
    rnd = f16 if f16_p else bf16
    # tcgen05_tm: x[tok][row]; per warp w, 16 lanes (tokens 16 w ..) butterfly each 16-column chunk.
    x = s.T.contiguous()
    wmax = [torch.cat([half_reduce16(x[16 * w:16 * w + 16, 16 * c:16 * c + 16], torch.maximum)
                       for c in range(R // 16)]) for w in range(4)]
    m_tm = torch.maximum(torch.maximum(wmax[0], wmax[1]), torch.maximum(wmax[2], wmax[3]))
    msub = torch.where(m_tm == float("-inf"), 0.0, m_tm)
    p_tm = rnd(torch.exp2(x - msub))
    l_tm = denominators(p_tm)
    # SM90 mma: row r, lane hl holds columns 4 hl .. 4 hl + 3.
    for r in range(R):
        s4 = s[r].reshape(16, 4)
        mx = torch.maximum(torch.maximum(s4[:, 0], s4[:, 1]), torch.maximum(s4[:, 2], s4[:, 3]))
        for off in (8, 4, 2, 1):
            mx = torch.maximum(mx, mx[torch.arange(16) ^ off])
        assert torch.equal(mx[0], m_tm[r])
        sub = 0.0 if mx[0] == float("-inf") else mx[0]
        p = torch.exp2(s4 - sub)
        assert torch.equal(rnd(p).reshape(-1), p_tm[:, r])
        q = p if f16_p else rnd(p)   # FP8/NVFP4: FP32 p in the SM90 sum; BF16: the rounded values
        sm = (q[:, 0] + q[:, 1]) + (q[:, 2] + q[:, 3])
        for off in (8, 4, 2, 1):
            sm = sm + sm[torch.arange(16) ^ off]
        torch.testing.assert_close(l_tm[r], sm[0], rtol=2e-3 if f16_p else 1e-6, atol=0)


# -- the tile loop with the kernel's rounding points vs reference.py --------------------------------------
def cache_for(spec, lengths, g, stale_nan=True):
    lay = spec.layout
    pages_per = -(-max(lengths) // lay.page) + 1
    num_pages = len(lengths) * pages_per + 1
    cache = alloc_cache(lay, num_pages, num_slots=len(lengths))
    if spec.kv is KvDtype.BF16:
        cache["kv"].copy_(torch.randn(cache["kv"].shape, generator=g).to(torch.bfloat16))
    elif spec.kv is KvDtype.FP8:
        codes = torch.randint(0, 256, cache["kv_codes"].shape, generator=g, dtype=torch.uint8)
        codes[(codes & 0x7F) == 0x7F] = 0
        cache["kv_codes"].copy_(codes)
        if "kv_scales" in cache:
            cache["kv_scales"].copy_(torch.rand(cache["kv_scales"].shape, generator=g) * 0.02 + 1e-3)
    else:
        cache["kv_codes"].copy_(torch.randint(0, 256, cache["kv_codes"].shape, generator=g, dtype=torch.uint8))
        cache["scales"].copy_(torch.randint(0x28, 0x48, cache["scales"].shape, generator=g, dtype=torch.uint8))
        cache["hp_tail"].copy_((torch.randn(cache["hp_tail"].shape, generator=g) * 0.3).to(torch.bfloat16))
    perm = torch.randperm(num_pages - 1, generator=g).view(len(lengths), pages_per)
    if stale_nan and spec.kv is KvDtype.BF16:   # rows past each sequence's end hold NaN (never written)
        for b, L in enumerate(lengths):
            for pos in range(L, pages_per * lay.page):
                cache["kv"][perm[b, pos // lay.page], pos % lay.page] = float("nan")
    return cache, perm.to(torch.int32)


EMUL = [(KvDtype.BF16, {}, 12, 1, 1), (KvDtype.BF16, {}, 12, 4, 3), (KvDtype.FP8, {}, 12, 4, 1),
        (KvDtype.FP8, {"fp8_scales": Fp8ScaleGranularity.PER_TENSOR}, 20, 4, 2), (KvDtype.NVFP4, {}, 12, 1, 2),
        (KvDtype.NVFP4, {}, 12, 8, 1)]


@pytest.mark.parametrize("kv,kw,H,T,splits", EMUL, ids=lambda x: getattr(x, "value", str(x)))
def test_emulated_tile_loop_matches_the_reference(kv, kw, H, T, splits):
    """Ragged lengths (a page edge, one token past it, NVFP4 live tiles of 1..15 rows), T > 1 causal,
    several row groups (H = 20, T = 4: two of 48 rows), split partials merged; BF16 rows past the
    end are NaN in the cache (the owners zero them). Reference: reference.mla_decode in FP32."""
    g = torch.Generator().manual_seed(11 + H + T)
    spec = tm(heads=H, tokens=T, kv=kv, **kw)
    lengths = [T + 1, 64, 129, 200] if kv is not KvDtype.NVFP4 else [T + 3, 128, 135, 201]
    cache, bt = cache_for(spec, lengths, g)
    q = (torch.randn(len(lengths), T, H, 576, generator=g) * 0.5).to(torch.bfloat16)
    G = 37.5 if kv is KvDtype.NVFP4 else (0.03 if kw else 1.0)
    ring = torch.arange(len(lengths), dtype=torch.int32)
    got = emulate_tm(spec, cache, q, bt, lengths, ring_slot=ring, G=G, splits=splits)
    clean, _ = cache_for(spec, lengths, torch.Generator().manual_seed(11 + H + T), stale_nan=False)
    want = reference.mla_decode(spec.layout, clean, q, bt, torch.tensor(lengths), ring_slot=ring, scale=G)
    assert torch.isfinite(got).all()
    err = (got - want).abs().amax(-1) / want.abs().amax(-1).clamp_min(1e-6)
    assert float(err.max()) < 0.01, float(err.max())   # BF16 output: ~0.004


# -- the build ---------------------------------------------------------------------------------------------
BUILDS = [("sm103-nvfp4", KvDtype.BF16, 12, 1), ("sm103-nvfp4", KvDtype.FP8, 12, 4),
          ("sm103-nvfp4", KvDtype.NVFP4, 12, 1), ("sm103-nvfp4", KvDtype.NVFP4, 128, 1),
          ("sm107-nvfp4", KvDtype.NVFP4, 12, 8), ("sm107-nvfp4", KvDtype.BF16, 128, 4),
          ("sm107-nvfp4", KvDtype.FP8, 96, 1)]


@pytest.mark.parametrize("target,kv,h,t", BUILDS)
def test_sass(target, kv, h, t):
    from k3gen.pipeline.build import build_one
    from k3gen.pipeline.inspect import sass_text
    spec = tm(target, h, t, kv)
    r = build_one(spec)
    main = next(x for x in r.resources if x["function"] == "k3gen_mla_decode")
    assert main["local"] == 0 and main["stack"] == 0, "spills"
    assert spec.impl.plan(spec).smem_bytes <= SMEM_LIMIT
    sass = sass_text(r.cubin)
    body = sass[sass.index("Function : k3gen_mla_decode\n"):]
    ops = re.findall(r"\b(UTCHMMA|UTCQMMA|HGMMA|HMMA|UTMALDG|UBLKCP|LDTM|STTM|F2FP\.F16\.E2M1\S*|UTCBAR)\b", body)
    assert ops.count("UTCHMMA") >= 36 + 16 and "HMMA" not in ops and "HGMMA" not in ops
    assert "LDTM" in ops and "STTM" in ops and "UTCBAR" in ops
    if kv is KvDtype.BF16:
        assert ops.count("UTMALDG") == 9 and "UBLKCP" not in ops
    else:
        assert "UBLKCP" in ops and "UTMALDG" not in ops
    assert (kv is KvDtype.NVFP4) == any(o.startswith("F2FP.F16.E2M1") for o in ops)


@pytest.mark.parametrize("kv", [KvDtype.BF16, KvDtype.FP8, KvDtype.NVFP4])
def test_tmem_hazards(kv):
    """tests/tc_hazards.py: TMEM loads used only after their wait (PTX, source), the closing barrier
    reached converged (PTX, SASS)."""
    from pathlib import Path

    import tc_hazards as hz
    from k3gen.pipeline.inspect import sass_text
    from k3gen.pipeline.nvrtc import compile_program
    from k3gen.pipeline.render import render
    spec = tm("sm103-nvfp4", 12, 4, kv)
    c = compile_program(render(spec), spec.file_stem, spec.target, want_ptx=True)
    lines = hz.ptx_entry(c.ptx, "k3gen_mla_decode")
    assert hz.ld_count(lines) >= 6 and hz.ld_uses_before_wait(lines) == []
    assert hz.closing_barrier_converged_ptx(lines)
    assert hz.closing_barrier_converged_sass(hz.sass_function(sass_text(c.cubin), "k3gen_mla_decode"))
    hdr = Path(__file__).resolve().parents[3] / "k3gen/include/k3gen/mla/decode_tm.cuh"
    assert hz.unpinned_async_loads(hdr.read_text()) == []


# -- the projection that chose the schedule ----------------------------------------------------------------
def test_b300_projection():
    from bench.cases.mla_decode_b300 import b300_projection, b300_specs, mma_flops
    # Counted as executed: M = 64 as M = 128, N padded to its step.
    assert mma_flops([(1, 64, 12, 16)]) == 2 * 128 * 16 * 16
    assert mma_flops([(1, 64, 12, 16)], m64_full_rate=True) == 2 * 64 * 16 * 16
    # The README's former model (M = 64 at its own size) is the m64_full_rate MMA term: FP8 H12 B128 L8K.
    fp8 = tm(heads=12, kv=KvDtype.FP8)
    old = b300_projection(fp8, 128, 8192, "tcgen05", m64_full_rate=True)
    assert round(old["mma_us"], 1) == 99.3
    for spec in b300_specs():
        cur, new = (b300_projection(spec, 128, 8192, s) for s in ("tcgen05", "tcgen05_tm"))
        assert new["rows"] == spec.impl.plan(spec).rows
        assert cur["proj_us"] / new["proj_us"] >= 1.3, (spec.slug(), cur, new)
