"""mla_decode, wgmma schedule over FP8 KV (mla/decode_wg_fp8.cuh), on the CPU: spec rules and the
shared-memory plan, then the kernel's address arithmetic replayed against the PTX layout models of
k3gen.arch.sm90 and the register fragment of an E4M3 register-A wgmma (CuTe's ALayout_64x32:
row 16 w + lane / 4 + 8 (r % 2), k 4 (lane % 4) + byte + 16 (r / 2) for register r). The PV test
runs the whole V^T P^T product through those maps on random bytes, so a wrong chunk, swizzle,
token permutation or output-dim map fails here rather than as garbage on the GPU. Also the NVRTC
build (no spills, E4M3 QGMMA)."""
from __future__ import annotations

import numpy as np
import pytest

from k3gen.pipeline.build import build_one
from k3gen.errors import SpecError
from k3gen.ir.dtypes import Fp8ScaleGranularity, KvDtype
from k3gen.ops.mla_decode.spec import MlaDecodeSpec
from k3gen.ops.mla_decode.variants import SMEM_LIMIT
from k3gen.arch.sm90 import SW128_KMAJOR, encode_desc, wgmma_read_addr
from k3gen.targets import TARGETS

SM90 = TARGETS["sm90"]
BLK = 64 * 128             # one [64 rows][128 bytes] SW128 block
CODE_BYTES = 5 * BLK       # a stage: 576 code bytes per token = 4.5 blocks
N = 16


def wg8(heads=12, tokens=1, **kw):
    return MlaDecodeSpec(target=SM90, heads=heads, tokens=tokens, kv=KvDtype.FP8, schedule="wgmma", **kw)


def geo(heads=12, tokens=1, **kw):
    """The wgmma plan (geometry) of wg8(...)."""
    s = wg8(heads, tokens, **kw)
    return s.impl.plan(s)


def sw_off(rows: int, row: int, c: int) -> int:
    """wg::sw_off: 16-byte chunk c of `row` in a [rows][...] SW128 K-major operand."""
    return (c >> 3) * rows * 128 + (row >> 3) * 1024 + (row & 7) * 128 + (((c & 7) ^ (row & 7)) << 4)


def desc(a: int) -> int:
    return encode_desc(a, SW128_KMAJOR)


def test_desc_words_match_the_encoder():
    """The kernel builds descriptors as (kDescHi << 32) | desc_lo(addr) and moves them by adding
    bytes / 16 to the low word; both equal encode_desc for every address of the plan."""
    hi = (1024 >> 4) | (1 << 30)
    for a in range(0, SMEM_LIMIT, 16):
        lo = ((a & 0x3FFFF) >> 4) | (1 << 16)
        assert (hi << 32) | lo == desc(a)
        assert (hi << 32) | (desc(0) & 0xFFFFFFFF) + a // 16 == desc(a)


# -- spec --------------------------------------------------------------------------------------------
def test_spec_rules_and_plan():
    for scales in Fp8ScaleGranularity:
        s = geo(fp8_scales=scales)
        assert wg8(fp8_scales=scales).m_tiles == 1 and s.rows == 16 and s.threads == 384 and s.stages == 4
        p = s.smem
        assert p["scales"] == 4 * CODE_BYTES and p["q"] % 1024 == 0 and p["p"] % 1024 == 0
        assert p["p"] - p["q"] == 5 * 32 * 128 and p["red"] - p["p"] == 2 * 4 * 16 * 128
        assert s.smem_bytes == p["total"] <= SMEM_LIMIT
        assert 16 * (512 + 4) * 4 <= p["scales"], "the merge buffer reuses the stages"
    # 16 query rows per CTA: more rows become more CTAs (groups), never a wider CTA.
    assert wg8(12, 4).m_tiles == 1 and geo(12, 4).groups == 3 and geo(128, 1).groups == 8
    with pytest.raises(SpecError, match="m_tiles=2"):
        wg8(12, 2, m_tiles=2)
    assert wg8().slug() == "h12-t1-fp8-tok128-wgmma"


# -- the producer and QK ----------------------------------------------------------------------------
def producer_writes(wt: int):
    """(token, chunk, shared offset) of every code chunk thread wt copies (load_tile)."""
    t0, c = wt >> 5, wt & 31
    d0 = (c >> 3) * BLK + t0 * 128 + (((c & 7) ^ t0) << 4)
    d1 = (c >> 3) * BLK + (t0 + 4) * 128 + (((c & 7) ^ (t0 + 4)) << 4)
    for k in range(16):
        yield t0 + 4 * k, c, (d1 if k & 1 else d0) + (k >> 1) * 1024
    t, c = wt >> 2, wt & 3
    d = 4 * BLK + (t >> 3) * 1024 + (t & 7) * 128 + ((c ^ (t & 7)) << 4)
    for k in range(2):
        yield t + 32 * k, 32 + c, d + k * 4096


def test_producer_covers_the_tile_as_qk_reads_it():
    seen = {}
    for wt in range(128):
        for tok, c, off in producer_writes(wt):
            assert (tok, c) not in seen
            seen[(tok, c)] = off
            assert off == sw_off(64, tok, c)
    assert set(seen) == {(t, c) for t in range(64) for c in range(36)}
    # QK's A: k32 step ks reads bytes 32 ks .. of each token row at stage + (ks/4) 8192 + (ks%4) 32.
    for stage in (0, 3 * CODE_BYTES):
        for ks in range(18):
            da = desc(stage + (ks >> 2) * BLK + (ks & 3) * 32)
            for tok in range(0, 64, 3):
                for k in range(32):
                    byte = 32 * ks + k
                    assert wgmma_read_addr(da, tok, k) == stage + seen[(tok, byte // 16)] + byte % 16


def test_q_hi_lo_rows_as_qk_reads_them():
    """stage_q stores hi row r at sw_off(32, r, c), lo at sw_off(32, 16 + r, c); QK's B for step
    ks (q + (ks/4) 4096 + (ks%4) 32) reads column j < 16 as hi row j and j >= 16 as lo row j - 16."""
    q = geo().smem["q"]
    for ks in range(18):
        db = desc(q + (ks >> 2) * 2 * N * 128 + (ks & 3) * 32)
        for j in range(32):
            for k in range(32):
                byte = 32 * ks + k
                assert wgmma_read_addr(db, j, k) == q + sw_off(32, j, byte // 16) + byte % 16


# -- PV, end to end on random bytes -------------------------------------------------------------------
def prmt(a: int, b: int, sel: int) -> int:
    src = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    return sum(src[(sel >> (4 * i)) & 7] << (8 * i) for i in range(4))


def pv_a_fragment(smem: np.ndarray, stage: int, ks: int, warp: int, lane: int) -> list[list[int]]:
    """a[mb][r] exactly as the kernel's PV loop builds them (4-byte loads, byte transposes)."""
    g8, cq = lane >> 2, lane & 3
    a = [[0] * 4 for _ in range(8)]
    for h in range(2):
        for g in range(4):
            w = []
            for qq in range(4):
                tok = 32 * ks + 16 * h + 2 * cq + (qq >> 1) + 8 * (qq & 1)
                off = (stage + g * BLK + (tok >> 3) * 1024 + (tok & 7) * 128
                       + (((2 * warp + (g8 >> 2)) ^ (tok & 7)) << 4) + 4 * (g8 & 3))
                w.append(int.from_bytes(smem[off:off + 4].tobytes(), "little"))
            t0, t1 = prmt(w[0], w[1], 0x5140), prmt(w[0], w[1], 0x7362)
            t2, t3 = prmt(w[2], w[3], 0x5140), prmt(w[2], w[3], 0x7362)
            a[2 * g][2 * h], a[2 * g][2 * h + 1] = prmt(t0, t2, 0x5410), prmt(t0, t2, 0x7632)
            a[2 * g + 1][2 * h], a[2 * g + 1][2 * h + 1] = prmt(t1, t3, 0x5410), prmt(t1, t3, 0x7632)
    return a


def p_store(col: int, warp: int, lane: int, group: int, lo: bool) -> int:
    """Offset (from the consumer's P base) of the 16-bit store of (tokens tk0, tk0 + 8, column col)."""
    rowp = (col >> 3) * 1024 + (col & 7) * 128 + 2 * (lane >> 2)
    return rowp + group * N * 128 + ((((4 if lo else 0) + warp) ^ (col & 7)) << 4)


def o_dim(mb: int, i: int, warp: int, lane: int) -> int:
    return 128 * (mb >> 1) + 4 * (8 * warp + (lane >> 2)) + 2 * (mb & 1) + ((i & 3) >> 1)


def test_pv_product_through_the_fragment_maps():
    """Random code bytes in a stage (placed by the producer) and random P bytes (stored by the
    softmax's per-thread stores) give, through the kernel's A fragments, the wgmma B reads and the
    epilogue's dim map, exactly sum_tok P_g[col][tok] V[tok][dim] for both hi and lo halves."""
    rng = np.random.default_rng(0)
    V = rng.integers(0, 256, (64, 576), dtype=np.int64)
    P = rng.integers(0, 256, (2, 4, N, 64), dtype=np.int64)   # [hi/lo][group][col][tok]
    stage = 2 * CODE_BYTES
    pbase = 5 * CODE_BYTES
    smem = np.zeros(pbase + 4 * N * 128, dtype=np.uint8)
    for wt in range(128):
        for tok, c, off in producer_writes(wt):
            smem[stage + off:stage + off + 16] = V[tok, 16 * c:16 * c + 16]
    for warp in range(4):
        for lane in range(32):
            tk0 = 16 * warp + (lane >> 2)
            for col in range(N):
                for g in range(4):
                    for lo in (0, 1):
                        off = pbase + p_store(col, warp, lane, g, bool(lo))
                        smem[off], smem[off + 1] = P[lo, g, col, tk0], P[lo, g, col, tk0 + 8]
    # The A matrix of each (ks, mb) from all 128 threads' registers (ALayout_64x32), B through the
    # descriptor's reads, D = A B accumulated over ks and hi/lo; o[mb][i] of a thread is D[row][col]
    # at row 16 w + lane / 4 + 8 ((i % 4) / 2), col 8 (i / 4) + 2 (lane % 4) + i % 2.
    D = np.zeros((8, 64, N), dtype=np.int64)
    for ks in range(2):
        A = np.zeros((8, 64, 32), dtype=np.int64)
        for warp in range(4):
            for lane in range(32):
                a = pv_a_fragment(smem, stage, ks, warp, lane)
                for mb in range(8):
                    for r in range(4):
                        for byte in range(4):
                            A[mb, 16 * warp + (lane >> 2) + 8 * (r % 2), 4 * (lane & 3) + byte + 16 * (r // 2)] = \
                                (a[mb][r] >> (8 * byte)) & 0xFF
        for mb in range(8):
            for lo in (0, 1):
                db = desc(pbase + (mb >> 1) * N * 128 + ks * 32 + 64 * lo)
                B = np.array([[smem[wgmma_read_addr(db, col, k)] for col in range(N)] for k in range(32)],
                             dtype=np.int64)
                D[mb] += A[mb] @ B
    out = np.full((512, N), -1, dtype=np.int64)
    for warp in range(4):
        for lane in range(32):
            for mb in range(8):
                for i in range(8):
                    row = 16 * warp + (lane >> 2) + 8 * ((i & 3) >> 1)
                    col = 8 * (i >> 2) + 2 * (lane & 3) + (i & 1)
                    out[o_dim(mb, i, warp, lane), col] = D[mb, row, col]
    want = np.zeros((512, N), dtype=np.int64)
    for d in range(512):
        want[d] = (P[:, d // 128] * V[:, d][None, None, :]).sum(axis=(0, 2))
    np.testing.assert_array_equal(out, want)


# -- build -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("scales", list(Fp8ScaleGranularity), ids=str)
def test_compiles_to_e4m3_wgmma_without_spills(scales):
    r = build_one(wg8(fp8_scales=scales))
    main = next(x for x in r.resources if x["function"] == "k3gen_mla_decode")
    assert main["local"] == 0 and main["stack"] == 0 and main["registers"] <= 168, main
    # One copy of the tile loop per consumer: 18 m64n32k32 QK + 2 x 8 x 2 m64n16k32 PV each.
    assert main["sass"].get("QGMMA", 0) == 2 * (18 + 32)
    assert main["sass"].get("WARPGROUP", 0) <= 2 * 6, "register-A wgmma serialized by ptxas"
    assert "HMMA" not in main["sass"] and main["sass"].get("LDGSTS", 0) > 0
