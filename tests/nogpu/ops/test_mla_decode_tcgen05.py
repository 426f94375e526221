"""mla_decode, schedule "tcgen05" (sm103 / sm107), on the CPU. Nothing here runs on a Blackwell GPU
(none exists in this project): the selection by target features, the shared-memory plan, the index
math of include/k3gen/mla/decode_tc.cuh replayed against the SM90 kernels' on the same inputs (the
operand tile written by TMA / the decoders vs what every tcgen05 descriptor reads, the NVFP4 128x4
scale bytes vs the SM90 mma kernel's half-page copy, the decode of random FP8 / NVFP4 pages vs
reference.gather_rows, the TMEM lane of each softmax thread), and the NVRTC build: UTCHMMA (kind::f16),
the hardware E2M1 conversion, UTMALDG / UBLKCP loads, TMEM loads, no mma.sync, no spills, shared
memory within the limit."""
from __future__ import annotations

import re

import pytest
import torch

from k3gen.arch.sm100 import DESC_VERSION, idesc_f16, tmem_lane_m64, umma_desc
from k3gen.arch.sm90 import (SW128_KMAJOR, blocked_sw128_offset, sw128_mnmajor, tma_sw128_offset,
                             wgmma_read_addr, wgmma_read_addr_mn)
from k3gen.errors import SpecError
from k3gen.ir.dtypes import Fp8ScaleGranularity, KvDtype, ScaleLayout
from k3gen.ir.layouts import KvLayout, swizzle_128x4_offset
from k3gen.ops.kv_cache_write.reference import alloc_cache, gather_rows
from k3gen.ops.mla_decode.spec import MlaDecodeSpec
from k3gen.ops.mla_decode.variants import SMEM_LIMIT, tc_raw_bytes
from k3gen.targets import TARGETS, build_specs
from mla_tc_emul import BLK, decode_tile_tc, sw_off, swz_scale

TC = ("sm103-nvfp4", "sm107-nvfp4")
TILE = 9 * BLK


def tc(target="sm103-nvfp4", heads=12, tokens=1, kv=KvDtype.BF16, **kw):
    if kv is KvDtype.NVFP4:
        kw.setdefault("max_drafts", 3)
    kw.setdefault("schedule", "tcgen05")
    return MlaDecodeSpec(target=TARGETS[target], heads=heads, tokens=tokens, kv=kv, **kw)


# -- selection ----------------------------------------------------------------------------------------
def test_selectable_on_blackwell_only():
    # `auto` takes tcgen05_tm there (test_mla_decode_tcgen05_tm.py); this schedule stays selectable.
    for name in TC:
        for kv in (KvDtype.BF16, KvDtype.FP8, KvDtype.NVFP4):
            assert tc(name, 12, 1, kv, schedule="tcgen05").schedule == "tcgen05"
    assert not [s for s in build_specs(TARGETS["sm90"]) if s.op == "mla_decode" and s.schedule == "tcgen05"]
    with pytest.raises(SpecError, match="needs tcgen05"):
        MlaDecodeSpec(target=TARGETS["sm90"], heads=12, schedule="tcgen05")
    with pytest.raises(SpecError, match="128x4 swizzle only"):
        tc(kv=KvDtype.NVFP4, scale_layout=ScaleLayout.LINEAR, schedule="tcgen05")
    with pytest.raises(SpecError, match="m_tiles"):
        tc(m_tiles=1)


@pytest.mark.parametrize("kv,fp8,stages,threads", [(KvDtype.BF16, None, 2, 192), (KvDtype.FP8, "per_token_128", 1, 320),
                                                   (KvDtype.FP8, "per_tensor", 2, 320), (KvDtype.NVFP4, None, 3, 320)])
def test_plan(kv, fp8, stages, threads):
    kw = {"fp8_scales": Fp8ScaleGranularity(fp8)} if fp8 else {}
    s = tc(kv=kv, heads=96, **kw)
    p = s.impl.plan(s)
    assert (p.stages, p.threads, p.rows, p.groups) == (stages, threads, 64, 4)
    assert p.smem_bytes <= SMEM_LIMIT and p.kv_map == (kv is KvDtype.BF16)
    assert all(p.smem[k] % 1024 == 0 for k in ("op", "q", "p")) and p.smem["raw"] % 16 == 0
    # One more stage would not fit: the plan takes the deepest ring the per-block limit allows.
    if kv is not KvDtype.BF16:
        assert p.smem_bytes + tc_raw_bytes(s) > SMEM_LIMIT


# -- tile -> address, swizzle --------------------------------------------------------------------------
def strip(d: int) -> int:
    assert d & DESC_VERSION
    return d & ~DESC_VERSION


def test_operand_tile_matches_sm90_layout_and_tma():
    # The decoders and the Q loader write what TMA writes for wgmma_qm (and what SM90's sw_off writes).
    for row in range(64):
        for c in range(72):
            assert sw_off(row, c) == blocked_sw128_offset(64, row, c)
            assert sw_off(row, c) + 5 == (c >> 3) * BLK + tma_sw128_offset(row, (c & 7) * 16 + 5)


@pytest.mark.parametrize("stage", [0, 1])
def test_qk_descriptors_read_the_elements(stage):
    """Every k16 step of QK (Q rows as A, K tokens as B, both K-major) reads element (row, dim) where
    the loaders stored it; the descriptors are the SM90 ones plus the version bit."""
    aQ, aKV = 2 * TILE, stage * TILE   # the plan: Q right after the two BF16 stages
    for ks in range(36):
        da = umma_desc(aQ + (ks >> 2) * BLK + (ks & 3) * 32, SW128_KMAJOR)
        db = umma_desc(aKV + (ks >> 2) * BLK + (ks & 3) * 32, SW128_KMAJOR)
        for r in range(0, 64, 5):
            for k in range(16):
                d = 16 * ks + k
                want = sw_off(r, d // 8) + (d % 8) * 2
                assert wgmma_read_addr(strip(da), r, k, 2) == aQ + want
                assert wgmma_read_addr(strip(db), r, k, 2) == aKV + want


@pytest.mark.parametrize("half", [0, 1])
def test_pv_descriptors_read_v_and_p(half):
    """O[:, 256 half ..] += P V: V MN-major over 4 dim blocks (LBO = the block stride), P K-major as
    the softmax stores it (row r, token chunk j at (j ^ r % 8) * 16)."""
    aKV, aP = TILE, 3 * TILE
    for ks in range(4):
        dv = umma_desc(aKV + 4 * half * BLK + ks * 2048, sw128_mnmajor(BLK))
        dp = umma_desc(aP + ks * 32, SW128_KMAJOR)
        for n in range(0, 256, 7):
            for k in range(16):
                tok, dim = 16 * ks + k, 256 * half + n
                assert wgmma_read_addr_mn(strip(dv), n, k) == aKV + sw_off(tok, dim // 8) + (dim % 8) * 2
        for r in range(64):
            for k in range(16):
                tok = 16 * ks + k
                stored = (r >> 3) * 1024 + (r & 7) * 128 + (((tok // 8) ^ (r & 7)) << 4) + (tok % 8) * 2
                assert wgmma_read_addr(strip(dp), r, k, 2) == aP + stored


@pytest.mark.parametrize("half", [0, 1])
def test_bf16_rows_past_the_end_zeroed_where_pv_reads_them(half):
    """BF16, the sequence's last tile with `valid` rows: the softmax threads zero chunks
    sw_off(valid + i / 32, 32 half + i % 32), i < (64 - valid) 32: exactly the bytes this half's PV
    descriptors read for the tokens past the end (the TMA box copies those page rows as stored)."""
    for valid in (1, 17, 63):
        zeroed = set()
        for tid in range(128):
            for i in range(tid, (64 - valid) * 32, 128):
                a = sw_off(valid + i // 32, 32 * half + i % 32)
                zeroed |= set(range(a, a + 16))
        read = set()
        for ks in range(4):
            dv = umma_desc(4 * half * BLK + ks * 2048, sw128_mnmajor(BLK))
            for n in range(256):
                for k in range(16):
                    if 16 * ks + k >= valid:
                        a = wgmma_read_addr_mn(strip(dv), n, k)
                        read |= {a, a + 1}
        assert read == zeroed


def test_instruction_descriptors():
    # Field positions of the kind::f16 descriptor (PTX ISA, tcgen05 instruction descriptor table).
    d = idesc_f16(bf16=True, m=64, n=256, b_mn=True)
    assert (d >> 4) & 3 == 1 and (d >> 7) & 7 == 1 and (d >> 10) & 7 == 1 and (d >> 16) & 1 == 1
    assert (d >> 17) & 63 == 32 and (d >> 24) & 31 == 4 and (d >> 15) & 1 == 0
    assert idesc_f16(bf16=False, m=64, n=64) == (1 << 4) | (8 << 17) | (4 << 24)
    with pytest.raises(ValueError):
        idesc_f16(bf16=True, m=64, n=260)


def test_tmem_rows_of_the_softmax_threads():
    """Softmax warp w, lane t < 16 reads TMEM lane 32 w + t (tcgen05.ld 32x32b): every accumulator row
    once, row 16 w + t (layout F)."""
    owners = {}
    for w in range(4):
        for t in range(16):
            owners[32 * w + t] = 16 * w + t
    assert sorted(owners.values()) == list(range(64))
    assert all(tmem_lane_m64(r) == lane for lane, r in owners.items())


# -- page walk and KV decode vs the SM90 kernels on the same inputs -------------------------------------
def test_nvfp4_scale_bytes_match_the_mma_kernels_half_page_copy():
    """SM90/mma (decode.cuh) copies 8 of every 16 bytes of the half page (slot0 / 64) and indexes
    ((c >> 2) * 32 + (t & 31)) * 8 + (t >> 5) * 4 + (c & 3); tcgen05 copies the whole page. Same byte."""
    for slot0 in (0, 64):
        for t in range(64):
            for c in range(36):
                i = ((c >> 2) * 32 + (t & 31)) * 8 + (t >> 5) * 4 + (c & 3)
                global_byte = (i // 8) * 16 + (slot0 // 64) * 8 + i % 8
                assert swz_scale(slot0 + t, c) == global_byte == swizzle_128x4_offset(slot0 + t, c, 36)


@pytest.mark.parametrize("kv", [KvDtype.NVFP4, KvDtype.FP8])
def test_decoded_tiles_equal_the_reference_rows(kv):
    """Random pages (a shuffled block table, a bad id past the sequence), random lengths: the decoded
    operand rows are reference.gather_rows (NVFP4 times G, exactly; FP8 and the live ring rows within
    one f16 rounding), and rows past the end are zero."""
    g = torch.Generator().manual_seed(7)
    lay = KvLayout(kv=kv, page=128 if kv is KvDtype.NVFP4 else 64,
                   scale_layout=ScaleLayout.SWIZZLE_128X4 if kv is KvDtype.NVFP4 else None,
                   max_drafts=3 if kv is KvDtype.NVFP4 else 0)
    num_pages = 6
    cache = alloc_cache(lay, num_pages, num_slots=2)
    if kv is KvDtype.NVFP4:
        cache["kv_codes"].copy_(torch.randint(0, 256, cache["kv_codes"].shape, generator=g, dtype=torch.uint8))
        cache["scales"].copy_(torch.randint(0x08, 0x70, cache["scales"].shape, generator=g, dtype=torch.uint8))
        cache["hp_tail"].copy_(torch.randn(cache["hp_tail"].shape, generator=g).to(torch.bfloat16))
    else:
        codes = torch.randint(0, 256, cache["kv_codes"].shape, generator=g, dtype=torch.uint8)
        codes[(codes & 0x7F) == 0x7F] = 0x00   # no NaN codes
        cache["kv_codes"].copy_(codes)
        cache["kv_scales"].copy_(torch.rand(cache["kv_scales"].shape, generator=g) * 0.01 + 1e-4)
    G = 37.5
    for length in (1, 77, 200, 257):
        bt = torch.randperm(num_pages, generator=g).tolist() + [99]
        ref = gather_rows(lay, cache, bt, length, ring_slot=1, scale=G)
        for tile in range(-(-length // 64)):
            got = decode_tile_tc(lay, cache, bt, num_pages, tile, length, G, 1)
            n = min(64, length - tile * 64)
            want = ref[tile * 64:tile * 64 + n]
            if kv is KvDtype.NVFP4:
                want = want * G
                live = max(0, length // 16 * 16 - tile * 64)
                torch.testing.assert_close(got[:min(live, n)], want[:min(live, n)], rtol=1e-6, atol=0)
                torch.testing.assert_close(got[live:n], want[live:], rtol=2 ** -11, atol=2 ** -24 * G)
            else:
                torch.testing.assert_close(got[:n], want, rtol=2 ** -11, atol=2 ** -24)
            assert not got[n:].any()


def test_split_schedule_matches_sm90():
    """t_begin / n of (split, length): the SM90 kernels' formula (decode.cuh), every tile once."""
    for length in (1, 64, 65, 4000):
        for splits in (1, 3, 7):
            ntiles = -(-length // 64)
            per = -(-ntiles // splits)
            seen = []
            for s in range(splits):
                t0 = min(ntiles, s * per)
                seen += range(t0, min(ntiles, t0 + per))
            assert seen == list(range(ntiles))


# -- the build -------------------------------------------------------------------------------------------
CASES = [("sm103-nvfp4", KvDtype.BF16, 12, 1), ("sm103-nvfp4", KvDtype.FP8, 96, 4),
         ("sm103-nvfp4", KvDtype.NVFP4, 12, 1), ("sm107-nvfp4", KvDtype.NVFP4, 96, 1),
         ("sm107-nvfp4", KvDtype.BF16, 96, 4)]


@pytest.mark.parametrize("target,kv,h,t", CASES)
def test_sass(target, kv, h, t):
    from k3gen.pipeline.build import build_one
    from k3gen.pipeline.inspect import sass_text
    spec = tc(target, h, t, kv)
    r = build_one(spec)
    res = {x.function if hasattr(x, "function") else x["function"]: x for x in r.resources}
    main = res["k3gen_mla_decode"]
    get = (lambda k: getattr(main, k)) if hasattr(main, "function") else main.__getitem__
    assert get("local") == 0, "spills"
    assert spec.impl.plan(spec).smem_bytes <= SMEM_LIMIT
    sass = sass_text(r.cubin)
    body = sass[sass.index("k3gen_mla_decode"):]
    body = body[:body.index("k3gen_mla_decode_combine")] if "k3gen_mla_decode_combine" in body else body
    ops = re.findall(r"\b(UTCHMMA|UTCQMMA|UTCOMMA|HMMA|UTMALDG|UBLKCP|LDTM|STTM|F2FP\.F16\.E2M1\S*|UTCBAR)\b", sass)
    assert "UTCHMMA" in ops and "HMMA" not in ops, "kind::f16 tcgen05 MMA, no mma.sync"
    assert "LDTM" in ops and "UTCBAR" in ops
    if kv is KvDtype.BF16:
        assert ops.count("UTMALDG") == 9 and "UBLKCP" not in ops    # one TMA box per 64-dim block
    else:
        assert "UBLKCP" in ops                                       # bulk copies of codes and scales
    assert (kv is KvDtype.NVFP4) == any(o.startswith("F2FP.F16.E2M1") for o in ops), "hardware E2M1 -> f16"


# -- the two tcgen05 hazards of 7c32c26 (tests/tc_hazards.py) -------------------------------------------
def test_tmem_loads_pinned_in_the_source():
    from pathlib import Path
    from tc_hazards import unpinned_async_loads
    inc = Path(__file__).resolve().parents[3] / "k3gen" / "include" / "k3gen"
    for hdr in ("mla/decode_tc.cuh", "common/sm100_tc.cuh"):
        assert unpinned_async_loads((inc / hdr).read_text()) == [], hdr


@pytest.mark.parametrize("kv", [KvDtype.BF16, KvDtype.FP8, KvDtype.NVFP4])
def test_tmem_hazards_in_ptx_and_sass(kv):
    """(a) no tcgen05.ld destination named before its tcgen05.wait::ld (PTX); (b) the closing
    barrier after the lane-0 producer / MMA roles is reached converged: bar.warp.sync in its block
    (PTX) and WARPSYNC right before the BAR.SYNC with no branch landing past it (SASS)."""
    from k3gen.pipeline.inspect import sass_text
    from k3gen.pipeline.nvrtc import compile_program
    from k3gen.pipeline.render import render
    import tc_hazards as hz
    spec = tc("sm103-nvfp4", 12, 1, kv)
    c = compile_program(render(spec), spec.file_stem, spec.target, want_ptx=True)
    lines = hz.ptx_entry(c.ptx, "k3gen_mla_decode")
    assert hz.ld_count(lines) >= 3 and hz.ld_uses_before_wait(lines) == []
    assert hz.closing_barrier_converged_ptx(lines)
    assert hz.closing_barrier_converged_sass(hz.sass_function(sass_text(c.cubin), "k3gen_mla_decode"))
