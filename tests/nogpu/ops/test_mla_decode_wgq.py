"""mla_decode, schedule "wgmma_qm" (query rows on the wgmma M side; sm_90a, BF16 KV), on the CPU: spec
validation and identity, the shared-memory plan, the address arithmetic replayed through the PTX layout
models of k3gen.arch.sm90 (what the Q loader, the producer's cp.async and the softmax's P stores
write against what every QK and PV descriptor reads: V is read N-major across two 64-dim blocks, the
one place the MN-major LBO field is applied), the accumulator fragment naming of the softmax and the
epilogue, and the NVRTC build (no spills, no serialized wgmma)."""
from __future__ import annotations

import pytest

from k3gen.pipeline.build import build_one, lower
from k3gen.errors import SpecError
from k3gen.ir.dtypes import KvDtype
from k3gen.ops.mla_decode.spec import MlaDecodeSpec, choose_splits
from k3gen.ops.mla_decode.variants import SMEM_LIMIT, WG_THREADS
from k3gen.arch.sm90 import (SW128_KMAJOR, blocked_sw128_offset, encode_desc, sw128_mnmajor, tma_sw128_offset,
                                 wgmma_read_addr, wgmma_read_addr_mn)
from k3gen.targets import TARGETS

SM90 = TARGETS["sm90"]
BLK = 64 * 128           # one [64 rows][64 BF16] SW128 block
TILE = 9 * BLK


def elem(rows: int, row: int, d: int) -> int:
    """Byte of BF16 element d (of 576) of `row` as the Q loader and the producer store it (sw_off)."""
    return blocked_sw128_offset(rows, row, d // 8) + (d % 8) * 2


def qm(heads=128, tokens=1, **kw):
    return MlaDecodeSpec(target=SM90, heads=heads, tokens=tokens, schedule="wgmma_qm", **kw)


def geo(heads=128, tokens=1, **kw):
    """The wgmma_qm plan (geometry) of qm(...)."""
    s = qm(heads, tokens, **kw)
    return s.impl.plan(s)


def desc_k(a):
    return encode_desc(a, SW128_KMAJOR)


def desc_v(a):
    return encode_desc(a, sw128_mnmajor(BLK))


# -- spec ---------------------------------------------------------------------------------------------
def test_validation():
    with pytest.raises(SpecError, match="schedule='wgmma_qm'.*BF16 KV"):
        qm(kv=KvDtype.FP8)
    with pytest.raises(SpecError, match="m_tiles=2"):
        qm(m_tiles=2)
    for t in ("sm103-nvfp4", "sm107-nvfp4"):
        with pytest.raises(SpecError, match="schedule='wgmma_qm'.*needs wgmma"):
            MlaDecodeSpec(target=TARGETS[t], heads=128, schedule="wgmma_qm")


@pytest.mark.parametrize("h,t,groups", [(128, 1, 2), (12, 1, 1), (64, 1, 1), (96, 1, 2), (128, 8, 16), (12, 8, 2)])
def test_geometry_and_slug(h, t, groups):
    s, g = qm(h, t), geo(h, t)
    assert (g.rows, s.m_tiles, g.groups, g.threads, g.stages) == (64, 4, groups, WG_THREADS, 2)
    assert s.slug() == f"h{h}-t{t}-bf16-wgmma_qm"
    assert s.digest() != MlaDecodeSpec(target=SM90, heads=h, tokens=t, schedule="mma").digest()
    # The split planner counts 64-row CTAs.
    assert choose_splits(1, 8192, h, 132, t, g.rows) == choose_splits(1, 8192, h, 132, t, 64)


def test_shared_memory_plan():
    p = geo().smem
    assert p["stages"] == 0 and p["q"] == 2 * TILE and p["p"] == p["q"] + 64 * 1152
    assert p["alpha"] == p["p"] + 64 * 128 and p["stats"] == p["alpha"] + 256 and p["bars"] == p["stats"] + 512
    assert p["q"] % 1024 == 0 and p["p"] % 1024 == 0
    assert geo().smem_bytes == p["end"] + 1024 <= SMEM_LIMIT
    assert (geo().smem_bytes + 1024) >> 4 < 1 << 14      # descriptor start-address field


# -- addresses ------------------------------------------------------------------------------------------
def test_qk_operands():
    """S = Q K^T, 36 k16 steps: A = Q at q + (ks / 4) * 8192 + (ks % 4) * 32 holds Q[row][16 ks + k]
    as the loader stored it ([64][576], sw_off(64, ...)); B = the stage at the same offsets holds
    K[token][16 ks + k] as the producer's cp.async put it."""
    p = geo().smem
    for ks in range(36):
        off = (ks >> 2) * BLK + (ks & 3) * 32
        da = desc_k(p["q"] + off)
        for stage in (0, TILE):
            db = desc_k(stage + off)
            for k in range(16):
                for i in range(64):
                    assert wgmma_read_addr(da, i, k, 2) == p["q"] + elem(64, i, 16 * ks + k), (ks, i, k)
                    assert wgmma_read_addr(db, i, k, 2) == stage + elem(64, i, 16 * ks + k), (ks, i, k)


def test_tma_boxes_write_the_blocks_the_descriptors_read():
    """The producer's 9 TMA boxes per tile ([64 rows][128 B] at column 128 kb, SWIZZLE_128B, into stage +
    kb * 8192) put byte j of dims 64 kb .. of token t exactly where elem() (the layout every QK and PV
    descriptor test above reads) says."""
    for kb in range(9):
        for t in range(64):
            for j in range(0, 128, 2):
                assert kb * BLK + tma_sw128_offset(t, j) == elem(64, t, 64 * kb + j // 2)


def test_zero_tail_covers_the_consumers_v_rows():
    """zero_tail(rem, c): thread wt of 128 stores chunks i = wt, wt + 128, ... < (64 - rem) * 32 at
    block 4 c + (i / 8) % 4, row rem + i / 32, chunk i % 8: every 16 bytes of rows rem..63 of the
    consumer's four V blocks once, nothing else (the swizzle only permutes chunks within a row)."""
    for rem in (0, 1, 17, 63):
        for c in (0, 1):
            got = []
            for wt in range(128):
                for i in range(wt, (64 - rem) * 32, 128):
                    row, blk, chunk = rem + (i >> 5), 4 * c + ((i >> 3) & 3), i & 7
                    got.append(blk * BLK + row * 128 + chunk * 16)
            want = [(4 * c + b) * BLK + r * 128 + ch * 16 for b in range(4) for r in range(rem, 64) for ch in range(8)]
            assert sorted(got) == sorted(want)


def p_store(p0: int, lane: int, warp: int, r: int, j: int, e: int) -> int:
    """Byte the softmax stores P[row][token] at: row 16 warp + lane / 4 + 8 r, token 8 j + 2 (lane % 4) + e."""
    row0 = 16 * warp + (lane >> 2)
    return p0 + (row0 >> 3) * 1024 + (row0 & 7) * 128 + 4 * (lane & 3) + r * 1024 + ((j ^ (row0 & 7)) << 4) + 2 * e


def test_pv_operands():
    """O[:, 256 c + 128 h ..] += P V: A = P at p + ks * 32 holds P[row][16 ks + k] where the softmax
    stored it; B = V at stage + (4 c + 2 h) * 8192 + ks * 2048, N-major with LBO = 8192, holds
    V[16 ks + k][256 c + 128 h + n] for all 128 n (the second 64 from the next block)."""
    p = geo().smem
    stored = {}
    for warp in range(4):
        for lane in range(32):
            for r in range(2):
                for j in range(8):
                    for e in range(2):
                        row, tok = 16 * warp + (lane >> 2) + 8 * r, 8 * j + 2 * (lane & 3) + e
                        stored[(row, tok)] = p_store(p["p"], lane, warp, r, j, e)
    assert len(stored) == 64 * 64 and len(set(stored.values())) == 64 * 64
    assert all(p["p"] <= a < p["alpha"] for a in stored.values())
    for ks in range(4):
        da = desc_k(p["p"] + ks * 32)
        for row in range(64):
            for k in range(16):
                assert wgmma_read_addr(da, row, k, 2) == stored[(row, 16 * ks + k)]
    for stage in (0, TILE):
        for c in range(2):
            for h in range(2):
                for ks in range(4):
                    db = desc_v(stage + (4 * c + 2 * h) * BLK + ks * 2048)
                    for n in range(128):
                        for k in range(16):
                            want = stage + elem(64, 16 * ks + k, 256 * c + 128 * h + n)
                            assert wgmma_read_addr_mn(db, n, k) == want, (c, h, ks, n, k)


def test_p_stores_are_bank_conflict_free():
    # One warp's 32 four-byte stores of a (r, j) step hit 32 distinct banks.
    for warp in range(4):
        for r in range(2):
            for j in range(8):
                banks = {(p_store(0, lane, warp, r, j, 0) >> 2) % 32 for lane in range(32)}
                assert len(banks) == 32


def test_fragment_naming():
    """m64nNk16 F32 accumulators: register i of (warp, lane) is row 16 warp + lane / 4 + 8 ((i % 4) / 2),
    column 8 (i / 4) + 2 (lane % 4) + i % 2. The softmax names sc[4 j + 2 r + e] (N = 64) and the epilogue
    o[h][4 j + 2 r + e] (N = 128, column 256 c + 128 h + ...) with r = the row half: every element once;
    a row's columns live in the 4 lanes of a quad (the xor 1, 2 shuffles)."""
    for n in (64, 128):
        seen = set()
        for warp in range(4):
            for lane in range(32):
                for i in range(n // 2):
                    j, r, e = i // 4, (i >> 1) & 1, i & 1
                    row = 16 * warp + lane // 4 + 8 * ((i % 4) // 2)
                    col = 8 * (i // 4) + 2 * (lane % 4) + i % 2
                    assert (row, col) == (16 * warp + (lane >> 2) + 8 * r, 8 * j + 2 * (lane & 3) + e)
                    seen.add((row, col))
        assert len(seen) == 64 * n
    for lane in range(32):
        assert {(lane ^ x) >> 2 for x in (0, 1, 2, 3)} == {lane >> 2}


def test_template_checks_the_encoder_and_the_plan():
    src, g = lower(qm(96, 4)).source, geo(96, 4)
    assert '#include "k3gen/mla/decode_wg_qm.cuh"' in src and "wgq::decode<Config>(p, &kv_map)" in src
    assert "using Geo = k3gen::mla::wgq::QmGeo<Config>;" in src and f"Geo::kSmem == {g.smem_bytes}" in src
    addr, d = g.desc_probe
    assert d == desc_v(addr) and f"({addr}u) == {d}ull" in src


# -- build ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("h,t", [(128, 1), (12, 4)])
def test_compiles_without_spills_or_serialized_wgmma(h, t):
    s = qm(h, t)
    r = build_one(s)
    res = {x["function"]: x for x in r.resources}
    k = res["k3gen_mla_decode"]
    assert k["local"] == 0 and k["stack"] == 0 and k["registers"] <= geo(h, t).max_registers, k
    from k3gen.pipeline.inspect import sass_text
    text = sass_text(r.cubin)
    # QK and the S warpgroup's PV, the O warpgroup's PV; KV tiles by TMA, no cp.async.
    assert text.count("HGMMA.64x64x16.F32.BF16") == 36 and text.count("HGMMA.64x128x16.F32.BF16") == 16
    assert "HMMA" not in k["sass"] and "USETMAXREG" in text and "UTMALDG" in text and "LDGSTS" not in text
    # One wait per GEMM, not one per instruction (when ptxas serializes the wgmmas, C7519, it fences
    # and waits around every one of the 52).
    assert text.count("WARPGROUP.DEPBAR") <= 3 and text.count("WARPGROUP.ARRIVE") <= 3
