"""mla_decode, wgmma schedule (sm_90a, BF16 KV), on the CPU: spec validation and identity, the
shared-memory plan, the address arithmetic the GPU cannot show before it runs (what the producer's
cp.async and the softmax's P stores write against what each wgmma descriptor reads, replayed
through the PTX layout models of k3gen.arch.sm90), the accumulator fragment mappings of the
softmax and the epilogue, and the NVRTC build (no spills, HGMMA, no HMMA)."""
from __future__ import annotations

import re

import pytest

from k3gen.pipeline.build import build_one, lower
from k3gen.errors import SpecError, TargetError
from k3gen.ir.dtypes import KvDtype, ScaleLayout
from k3gen.ops.mla_decode.spec import SMEM_LIMIT, WG_THREADS, MlaDecodeSpec
from k3gen.arch.sm90 import (SW128_KMAJOR, SW128_MNMAJOR_1BLOCK, blocked_sw128_offset, encode_desc, swizzle128,
                                 wgmma_read_addr, wgmma_read_addr_mn)
from k3gen.targets import TARGETS

SM90 = TARGETS["sm90"]
BLK = 64 * 128           # one [64 rows][64 BF16] SW128 block
TILE = 9 * BLK


def wg(heads=12, tokens=1, **kw):
    return MlaDecodeSpec(target=SM90, heads=heads, tokens=tokens, schedule="wgmma", **kw)


# -- spec ---------------------------------------------------------------------------------------------
def test_validation():
    with pytest.raises(SpecError, match="schedule='tiles'"):
        MlaDecodeSpec(target=SM90, heads=12, schedule="tiles")
    # FP8 and NVFP4 wgmma: test_mla_decode_wg8.py / test_mla_decode_wg4.py
    for t in ("sm103-nvfp4", "sm107-nvfp4"):
        with pytest.raises(TargetError, match="schedule='wgmma'"):
            MlaDecodeSpec(target=TARGETS[t], heads=12, schedule="wgmma")
    with pytest.raises(SpecError, match="m_tiles=3"):
        wg(m_tiles=3)
    with pytest.raises(SpecError, match="m_tiles=4"):     # 64 rows per CTA: the wgmma schedule only
        MlaDecodeSpec(target=SM90, heads=128, m_tiles=4, schedule="mma")


def test_default_schedule_and_slug():
    base = MlaDecodeSpec(target=SM90, heads=12, schedule="mma")
    assert base.threads == 256
    for h, t in ((12, 1), (12, 4), (128, 1), (16, 8)):
        a, b = MlaDecodeSpec(target=SM90, heads=h, tokens=t, schedule="mma"), wg(h, t)
        assert b.slug() == a.slug() + "-wgmma" and b.digest() != a.digest()
        assert b.threads == WG_THREADS
    # Query rows per CTA and per consumer (the wgmma N) by H * T.
    for h, t, mt, rows, cols, groups in ((6, 1, 1, 16, 16, 1), (16, 1, 1, 16, 16, 1), (12, 2, 2, 32, 32, 1),
                                         (16, 2, 2, 32, 32, 1), (33, 1, 4, 64, 32, 1), (64, 1, 4, 64, 32, 1),
                                         (96, 1, 4, 64, 32, 2), (128, 1, 4, 64, 32, 2), (128, 8, 4, 64, 32, 16),
                                         (12, 8, 4, 64, 32, 2)):
        s = wg(h, t)
        assert (s.m_tiles, s.rows, s.wg_cols, s.groups, s.wg_split_rows) == (mt, rows, cols, groups, mt == 4), (h, t)
        assert "-mt" not in s.slug()
    assert wg(128, 1, m_tiles=2).slug() == "h128-t1-bf16-mt2-wgmma"     # the N = 32 plan stays reachable
    assert wg(128, 1, m_tiles=2).groups == 4


@pytest.mark.parametrize("h,t,mt", [(6, 1, None), (12, 1, None), (16, 1, None), (12, 2, None), (12, 8, None),
                                    (96, 4, None), (128, 1, None), (128, 8, None), (128, 1, 2), (40, 1, None)])
def test_shared_memory_plan(h, t, mt):
    s = wg(h, t, m_tiles=mt)
    p = s.wg_smem()
    n, nc = s.rows, s.wg_cols
    assert s.stages == 2 and s.raw_stage_bytes == TILE
    assert p["q"] == 2 * TILE and p["p"] == p["q"] + n * 1152 and p["red"] == p["p"] + 2 * nc * 128
    assert p["stats"] == p["red"] + 2 * 4 * nc * 4
    assert p["bars"] == p["stats"] + (0 if s.wg_split_rows else 2 * 2 * n * 4)
    for k in ("stages", "q", "p"):
        assert p[k] % 1024 == 0, k                       # SW128 atoms
    assert (nc * 128) % 1024 == 0                        # the second consumer's P tile and Q rows
    # 227 KB is the opt-in maximum of dynamic shared memory per block on SM90 (the 1 KB the
    # system reserves per block comes on top of it); the N = 64 plan leaves 992 bytes.
    assert s.smem_bytes == p["end"] + 1024 <= SMEM_LIMIT
    if not s.wg_split_rows:
        assert s.smem_bytes <= SMEM_LIMIT - 1024
    assert n * (512 + 4) * 4 <= 2 * TILE                 # merge/output buffer in the stages
    assert (s.smem_bytes + 1024) >> 4 < 1 << 14          # descriptor start-address field


# -- addresses -----------------------------------------------------------------------------------------
def elem(rows: int, row: int, d: int) -> int:
    """Byte of element d (of 576) of `row`, as the kernel's stores place it (mla/decode_wg.cuh's sw_off)."""
    return blocked_sw128_offset(rows, row, d // 8) + (d % 8) * 2


def test_sw_off_is_the_sw128_kmajor_layout():
    # Each block is the TMA/PTX SW128 picture of [rows][64 BF16]: swizzle128 of the linear offset.
    for rows in (16, 32, 64):
        seen = set()
        for r in range(rows):
            for d in range(576):
                blk, kb = divmod(d * 2, 128)
                lin = blk * rows * 128 + r * 128 + kb
                assert elem(rows, r, d) == swizzle128(lin)
                seen.add(elem(rows, r, d))
        assert seen == set(range(0, rows * 1152, 2))


def desc_k(a):
    return encode_desc(a, SW128_KMAJOR)


def desc_mn(a):
    return encode_desc(a, SW128_MNMAJOR_1BLOCK)


SPECS_BY_N = {16: (12, 1), 32: (12, 2), 64: (128, 1)}    # CTA rows -> (H, T)


@pytest.mark.parametrize("n", [16, 32, 64])
def test_qk_operands(n):
    """S^T = K_tile Q^T: for both stages and all 36 k16 steps, the descriptors the kernel passes
    (K tile: stage + (ks / 4) * 8192 + (ks % 4) * 32; Q: q + (ks / 4) * N * 128 + c0 * 128 +
    (ks % 4) * 32, c0 = the consumer's first row) read the bytes holding K[token][16 ks + k] and
    Q[c0 + row][16 ks + k] as the Q staging loop stored them ([N][576], sw_off(N, ...))."""
    s = wg(*SPECS_BY_N[n])
    assert s.rows == n
    p = s.wg_smem()
    nc = s.wg_cols
    for stage in (0, TILE):
        for ks in range(36):
            da = desc_k(stage + (ks >> 2) * BLK + (ks & 3) * 32)
            for k in range(16):
                for tok in range(64):
                    assert wgmma_read_addr(da, tok, k, 2) == stage + elem(64, tok, 16 * ks + k), (ks, tok, k)
    for cons in range(2):
        c0 = cons * nc if s.wg_split_rows else 0
        for ks in range(36):
            db = desc_k(p["q"] + (ks >> 2) * n * 128 + c0 * 128 + (ks & 3) * 32)
            for k in range(16):
                for r in range(nc):
                    assert wgmma_read_addr(db, r, k, 2) == p["q"] + elem(n, c0 + r, 16 * ks + k), (ks, r, k)


@pytest.mark.parametrize("n", [16, 32, 64])
def test_pv_operands(n):
    """O^T += V^T P^T: A = the same KV tile read MN-major (stage + mb * 8192 + ks * 2048) holds
    V[16 ks + k][64 mb + m]; B = P at p + c * NC * 128 + ks * 32 holds P[col][16 ks + k] where the
    softmax stored it; the two consumers' P tiles do not overlap and end before red."""
    s = wg(*SPECS_BY_N[n])
    p = s.wg_smem()
    n = s.wg_cols
    for stage in (0, TILE):
        for mb in range(8):
            for ks in range(4):
                da = desc_mn(stage + mb * BLK + ks * 2048)
                for m in range(64):
                    for k in range(16):
                        assert wgmma_read_addr_mn(da, m, k) == stage + elem(64, 16 * ks + k, 64 * mb + m)
    for cons in (0, 1):
        ap = p["p"] + cons * n * 128
        for ks in range(4):
            db = desc_k(ap + ks * 32)
            for col in range(n):
                for k in range(16):
                    tok = 16 * ks + k
                    # the kernel's store: rowp = (col / 8) * 1024 + (col % 8) * 128 + (tok % 8) * 2,
                    # plus ((tok / 8) ^ (col % 8)) * 16
                    st = ap + (col >> 3) * 1024 + (col & 7) * 128 + (tok & 7) * 2 + (((tok >> 3) ^ (col & 7)) << 4)
                    assert wgmma_read_addr(db, col, k, 2) == st
                    assert p["p"] + cons * n * 128 <= st < p["p"] + (cons + 1) * n * 128 <= p["red"]


def test_mn_major_reading_does_not_depend_on_lbo():
    # M = 64 BF16 is one 128-byte row: the M-block stride (LBO) is never applied.
    for lbo in (16, 1024, 8192):
        d = encode_desc(4096, SW128_MNMAJOR_1BLOCK._replace(lbo=lbo))
        assert [wgmma_read_addr_mn(d, m, k) for m in range(64) for k in range(16)] == \
            [wgmma_read_addr_mn(desc_mn(4096), m, k) for m in range(64) for k in range(16)]


def test_template_checks_the_encoder_and_the_plan():
    s = wg(96, 4)
    src = lower(s).source
    m = re.search(r"wgmma_desc<1024, 1024, 1>\((\d+)u\) == (\d+)ull", src)
    assert m and int(m.group(2)) == desc_mn(int(m.group(1)))
    assert '#include "k3gen/mla/decode_wg.cuh"' in src and "wg::decode<Config>" in src
    assert f"WgGeo::kSmem == {s.smem_bytes}" in src
    plain = lower(MlaDecodeSpec(target=SM90, heads=96, tokens=4, schedule="mma")).source
    assert "mla/decode_wg.cuh" not in plain and "k3gen::mla::decode<Config>" in plain


# -- fragments -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [16, 32])
def test_fragment_mappings(n):
    """PTX m64nNk16 F32 accumulator: register i of thread (warp, lane) is row 16 warp + lane / 4 +
    8 ((i % 4) / 2), column 8 (i / 4) + 2 (lane % 4) + i % 2. The softmax names sc[4 j + e] as token
    16 warp + lane / 4, column 8 j + 2 (lane % 4) + e (and sc[4 j + 2 + e] eight tokens down); the
    epilogue names o[mb][i] dim 64 mb + row. Every element exactly once; the 8 lanes sharing a
    column are the shuffle group xor 4, 8, 16; lanes 0..3 hold every column."""
    seen_s, seen_o = set(), set()
    for w in range(4):
        for lane in range(32):
            for i in range(n // 2):
                row = 16 * w + lane // 4 + 8 * ((i % 4) // 2)
                col = 8 * (i // 4) + 2 * (lane % 4) + i % 2
                j, e, hi = i // 4, i % 2, (i % 4) // 2
                assert (16 * w + lane // 4 + 8 * hi, 8 * j + 2 * (lane % 4) + e) == (row, col)
                seen_s.add((row, col))
                for mb in range(8):
                    seen_o.add((64 * mb + row, col))
            group = {lane ^ x for x in (0, 4, 8, 12, 16, 20, 24, 28)}
            assert {g % 4 for g in group} == {lane % 4} and len(group) == 8
    assert len(seen_s) == 64 * n and len(seen_o) == 512 * n
    assert {8 * j + 2 * lane + e for j in range(n // 8) for lane in range(4) for e in range(2)} == set(range(n))


# -- build ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("h,t,mt,n", [(12, 1, None, 16), (16, 2, None, 32), (128, 1, None, 32), (16, 8, None, 32),
                                      (96, 1, None, 32), (128, 1, 2, 32)])
def test_compiles_to_bf16_wgmma_without_spills(h, t, mt, n):
    s = wg(h, t, m_tiles=mt)
    assert s.wg_cols == n
    r = build_one(s)
    res = {x["function"]: x for x in r.resources}
    assert set(res) == {"k3gen_mla_decode", "k3gen_mla_decode_combine"}
    k = res["k3gen_mla_decode"]
    assert k["local"] == 0 and k["stack"] == 0 and k["registers"] <= s.max_registers, k
    sass = k["sass"]
    assert sass.get("HGMMA", 0) == 36 + 32, sass        # QK 36 k16 steps, PV 8 x 4
    assert "HMMA" not in sass and sass.get("LDGSTS", 0) > 0, sass
    from k3gen.pipeline.inspect import sass_text
    text = sass_text(r.cubin)
    assert len(re.findall(rf"HGMMA\.64x{n}x16\.F32\.BF16", text)) == 68
    assert "USETMAXREG" in text
    # The MMAs are issued back to back: one wait per GEMM, not one per instruction.
    assert text.count("WARPGROUP.DEPBAR") <= 4


# -- schedule="auto" -------------------------------------------------------------------------------------
def test_auto_schedule_resolves_by_target_and_kv():
    for h, t in ((6, 1), (12, 1), (16, 1), (8, 2), (12, 2), (32, 1), (96, 1), (128, 8)):
        a = MlaDecodeSpec(target=SM90, heads=h, tokens=t, schedule="auto")
        want = "wgmma_qm"   # BF16 KV on sm_90a at every H * T (measured: ir/ops/mla_decode.py)
        assert a.schedule == want and a.rows == 64, (h, t)
        # Resolved at construction: the same kernel (slug, digest) as the explicit schedule.
        assert a == MlaDecodeSpec(target=SM90, heads=h, tokens=t, schedule=want)
        assert a.digest() == MlaDecodeSpec(target=SM90, heads=h, tokens=t, schedule=want).digest()
    # NVFP4: wgmma with the sm90 default linear scales (16 rows per CTA), mma.sync with the swizzle.
    for h, t in ((12, 1), (128, 1), (12, 4)):
        a = MlaDecodeSpec(target=SM90, heads=h, tokens=t, kv=KvDtype.NVFP4)
        assert (a.schedule, a.m_tiles) == ("wgmma", 1), (h, t)
    assert MlaDecodeSpec(target=SM90, heads=12, kv=KvDtype.NVFP4,
                         scale_layout=ScaleLayout.SWIZZLE_128X4).schedule == "mma"
    for h, t in ((12, 1), (128, 1), (12, 4)):   # FP8: wgmma at every H * T, 16 rows per CTA
        a = MlaDecodeSpec(target=SM90, heads=h, tokens=t, kv=KvDtype.FP8)
        assert (a.schedule, a.m_tiles) == ("wgmma", 1), (h, t)
    for t in ("sm103-nvfp4", "sm107-nvfp4"):
        assert MlaDecodeSpec(target=TARGETS[t], heads=12, kv=KvDtype.FP8).schedule == "mma"
        assert MlaDecodeSpec(target=TARGETS[t], heads=12, kv=KvDtype.NVFP4).schedule == "mma"
    for t in ("sm103-nvfp4", "sm107-nvfp4"):
        assert MlaDecodeSpec(target=TARGETS[t], heads=128, schedule="auto").schedule == "mma"
    # "auto" is the default.
    assert MlaDecodeSpec(target=SM90, heads=128).schedule == "wgmma_qm"
    assert MlaDecodeSpec(target=SM90, heads=12).schedule == "wgmma_qm"


def test_heads_sweep_bench_specs():
    from bench import cases as bench_cases
    from bench.cases.mla_decode import HEADS_SWEEP, heads_sweep_specs
    assert callable(bench_cases.mla_decode_heads)
    full = heads_sweep_specs()
    assert [(s.heads, s.schedule) for s in full] == [(h, s) for h in HEADS_SWEEP
                                                     for s in ("mma", "wgmma", "wgmma_qm")]
    assert {s.rows for s in full if s.schedule == "wgmma"} == {16, 32, 64}
    assert len(heads_sweep_specs(quick=True)) == 9
    assert {s.rows for s in full if s.schedule == "wgmma_qm"} == {64}
