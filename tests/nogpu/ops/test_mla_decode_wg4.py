"""mla_decode, wgmma schedule over NVFP4 KV (mla/decode_wg_nvfp4.cuh), on the CPU: spec rules and the
shared-memory plan, then the kernel's lane maps replayed on random codes and scales. The producer's
chunk placement, the consumer's decode (which stage bytes a lane reads, which nibble becomes which
register-A fragment element), the query's k order, the V-tile stores, the P^T stores and the
epilogue's dim map are written out here as the kernel computes them; the products go through the
wgmma read models of k3gen.arch.sm90. A wrong chunk, swizzle, permutation or dim map fails
here rather than as garbage on the GPU. Also the NVRTC build (no spills, no serialized wgmma)."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from k3gen.pipeline.build import build_one
from k3gen.errors import SpecError
from k3gen.ir.dtypes import KvDtype, ScaleLayout
from k3gen.ops.mla_decode.spec import MlaDecodeSpec
from k3gen.ops.mla_decode.variants import SMEM_LIMIT
from k3gen.arch.sm90 import SW128_KMAJOR, SW128_MNMAJOR_1BLOCK, encode_desc, wgmma_read_addr, wgmma_read_addr_mn
from k3gen.targets import TARGETS

SM90 = TARGETS["sm90"]
N = 16
LAT_B, ROPE_OFF, TS_OFF, RS_OFF, STAGE = 256, 64 * 256, 64 * 256 + 64 * 32, 64 * 256 + 64 * 32 + 128, 18816
BLK = 64 * 128
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6])


def wg4(heads=12, tokens=1, **kw):
    kw.setdefault("scale_layout", ScaleLayout.LINEAR)
    return MlaDecodeSpec(target=SM90, heads=heads, tokens=tokens, kv=KvDtype.NVFP4, max_drafts=3,
                         schedule="wgmma", **kw)


# -- spec --------------------------------------------------------------------------------------------
def test_spec_rules_and_plan():
    spec = wg4()
    s = spec.impl.plan(spec)
    assert spec.m_tiles == 1 and s.rows == 16 and s.threads == 384 and s.stages == 3
    p = s.smem
    assert p["ring"] == 3 * STAGE and p["v"] % 1024 == 0 and p["q"] - p["v"] == 2 * 8 * BLK
    assert p["p"] - p["q"] == 9 * N * 128 and p["red"] - p["p"] == 2 * N * 128
    assert s.smem_bytes == p["total"] <= SMEM_LIMIT
    assert [spec.impl.plan(x).groups for x in (wg4(12, 4), wg4(128, 1))] == [3, 8]
    assert spec.slug() == "h12-t1-nvfp4-linear-m3-wgmma"
    with pytest.raises(SpecError, match="m_tiles=2"):
        wg4(12, 2, m_tiles=2)
    with pytest.raises(SpecError, match="schedule='wgmma'.*linear layout"):
        wg4(scale_layout=ScaleLayout.SWIZZLE_128X4)


# -- the kernel's maps, in Python ----------------------------------------------------------------------
def qk_dim(ks: int, c: int, hi: int, e: int) -> int:
    base = 128 * (ks >> 3) + 32 * c + 8 * ((ks & 7) >> 1) if ks < 32 else 512 + 16 * c + 8 * ((ks - 32) >> 1)
    return base + 2 * (ks & 1) + hi + 4 * e


def pv_dim(vb: int, m: int) -> int:
    return 128 * (vb >> 1) + 32 * (m >> 4) + 8 * (2 * (vb & 1) + ((m >> 3) & 1)) + ((m & 7) >> 1) + 4 * (m & 1)


def sw_off(rows: int, row: int, c: int) -> int:
    return (c >> 3) * rows * 128 + (row >> 3) * 1024 + (row & 7) * 128 + (((c & 7) ^ (row & 7)) << 4)


def producer_stage(codes: np.ndarray, ts: np.ndarray, rs: np.ndarray) -> np.ndarray:
    """load_tile's copies: codes [64][288], tile scales [4][32], rope scales [64][4] (bytes)."""
    st = np.full(STAGE, 0xEE, dtype=np.uint8)
    for wt in range(128):
        for k in range(8):
            i = wt + 128 * k
            t, ch = i >> 4, i & 15
            d = t * LAT_B + ((ch ^ ((t & 1) << 2)) << 4)
            st[d:d + 16] = codes[t, 16 * ch:16 * ch + 16]
        t, ch = wt >> 1, wt & 1
        st[ROPE_OFF + t * 32 + ch * 16:][:16] = codes[t, 256 + 16 * ch:256 + 16 * ch + 16]
        if wt < 8:
            st[TS_OFF + wt * 16:][:16] = ts.reshape(-1)[wt * 16:wt * 16 + 16]
        elif wt < 24:
            k = wt - 8
            st[RS_OFF + k * 16:][:16] = rs.reshape(-1)[k * 16:k * 16 + 16]
    return st


def e4m3(b: int) -> float:
    return float(np.array([b], dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)[0])


def nib(word: int, j: int) -> float:
    x = (word >> (4 * j)) & 15
    return (-1 if x & 8 else 1) * E2M1[x & 7]


def consumer_fragments(st: np.ndarray, warp: int, lane: int) -> dict:
    """A[ks][reg] = (lo, hi) values the lane decodes for k-step ks (the kernel's QK loop): decode8
    pairs nibbles (i, i + 4) of a word, in units of 2^-8 (scale codes times 64, e2m1 times 2^-14)."""
    g8, cq = lane >> 2, lane & 3
    tk0 = 16 * warp + g8
    A = {}
    for blk in range(5):
        for r in range(2):
            tt = tk0 + 8 * r
            if blk < 4:
                off = tt * LAT_B + (((4 * blk + cq) ^ ((tt & 1) << 2)) << 4)
                u = st[off:off + 16]
                s0 = e4m3(st[TS_OFF + warp * 32 + 8 * blk + 2 * cq])
                s1 = e4m3(st[TS_OFF + warp * 32 + 8 * blk + 2 * cq + 1])
                words, scales = [int.from_bytes(u[4 * i:4 * i + 4].tobytes(), "little") for i in range(4)], [s0, s0, s1, s1]
            else:
                off = ROPE_OFF + tt * 32 + cq * 8
                u = st[off:off + 8]
                s = e4m3(st[RS_OFF + tt * 4 + cq])
                words, scales = [int.from_bytes(u[4 * i:4 * i + 4].tobytes(), "little") for i in range(2)], [s, s]
            for i, (w, s) in enumerate(zip(words, scales)):
                d = [(nib(w, q) * s / 256, nib(w, q + 4) * s / 256) for q in range(4)]
                ks0 = 8 * blk + 2 * i
                A.setdefault((ks0, r), d[0]); A.setdefault((ks0, 2 + r), d[1])
                A.setdefault((ks0 + 1, r), d[2]); A.setdefault((ks0 + 1, 2 + r), d[3])
    return A


def frag_pos(warp: int, lane: int, reg: int, h: int) -> tuple[int, int]:
    """(row, k) of half h of register reg (the mma.sync m16n8k16 A fragment, warp w rows 16 w ..)."""
    return 16 * warp + (lane >> 2) + 8 * (reg % 2), 2 * (lane & 3) + h + 8 * (reg // 2)


def random_tile(rng):
    codes = rng.integers(0, 256, (64, 288), dtype=np.uint8)
    ts = rng.integers(0x20, 0x60, (4, 32), dtype=np.uint8)      # finite positive E4M3 scales
    rs = rng.integers(0x20, 0x60, (64, 4), dtype=np.uint8)
    K = np.zeros((64, 576))
    for t in range(64):
        for d in range(576):
            x = (codes[t, d // 2] >> (4 * (d % 2))) & 15
            v = (-1 if x & 8 else 1) * E2M1[x & 7]
            K[t, d] = v * e4m3(ts[t // 16, d // 16] if d < 512 else rs[t, (d - 512) // 16])
    return codes, ts, rs, K


def test_qk_product_through_the_fragment_maps():
    """S^T = K_tile Q^T through the producer placement, the lanes' decode into register-A fragments
    and the B reads of the staged query equals the direct product of the decoded tile."""
    rng = np.random.default_rng(1)
    codes, ts, rs, K = random_tile(rng)
    st = producer_stage(codes, ts, rs)
    q = rng.integers(-8, 9, (N, 576)).astype(np.float64)
    # stage_q: logical chunk ch of row r = k-step ch / 2, fragment half ch % 2, 4 dim pairs.
    qs = {}
    for r in range(N):
        for ch in range(72):
            for c in range(4):
                for e in range(2):
                    qs[sw_off(N, r, ch) + 4 * c + 2 * e] = q[r, qk_dim(ch >> 1, c, ch & 1, e)]
    S = np.zeros((64, N))
    frags = {(w, l): consumer_fragments(st, w, l) for w in range(4) for l in range(32)}
    for ks in range(36):
        A = np.full((64, 16), np.nan)
        for (w, l), fr in frags.items():
            for reg in range(4):
                for h in range(2):
                    row, k = frag_pos(w, l, reg, h)
                    A[row, k] = fr[(ks, reg)][h]
        db = encode_desc((ks >> 2) * N * 128 + (ks & 3) * 32, SW128_KMAJOR)
        B = np.array([[qs[wgmma_read_addr(db, n, k, elem_bytes=2)] for n in range(N)] for k in range(16)])
        S += A @ B
    np.testing.assert_array_equal(S, K @ q.T / 256)


def test_pv_product_through_the_v_tile():
    """O^T = V^T P^T through the V-tile stores of the decoded registers, the MN-major reads, the P^T
    stores of the softmax lanes and the epilogue's dim map equals the direct product."""
    rng = np.random.default_rng(2)
    codes, ts, rs, K = random_tile(rng)
    st = producer_stage(codes, ts, rs)
    P = rng.integers(0, 5, (N, 64)).astype(np.float64)
    vs, ps = {}, {}
    for w in range(4):
        for lane in range(32):
            g8, cq = lane >> 2, lane & 3
            tk0 = 16 * w + g8
            fr = consumer_fragments(st, w, lane)
            for blk in range(4):
                for r in range(2):
                    tt = tk0 + 8 * r
                    for i in range(4):
                        vb, ch = 2 * blk + (i >> 1), 2 * cq + (i & 1)
                        base = vb * BLK + (tt >> 3) * 1024 + (tt & 7) * 128 + ((ch ^ (tt & 7)) << 4)
                        vals = [*fr[(8 * blk + 2 * i, r)], *fr[(8 * blk + 2 * i, 2 + r)],
                                *fr[(8 * blk + 2 * i + 1, r)], *fr[(8 * blk + 2 * i + 1, 2 + r)]]
                        for e, v in enumerate(vals):
                            vs[base + 2 * e] = v
            for col in range(N):
                rowp = (col >> 3) * 1024 + (col & 7) * 128 + (tk0 & 7) * 2
                ps[rowp + (((tk0 >> 3) ^ (col & 7)) << 4)] = P[col, tk0]
                ps[rowp + ((((tk0 >> 3) + 1) ^ (col & 7)) << 4)] = P[col, tk0 + 8]
    D = np.zeros((8, 64, N))
    for mb in range(8):
        for ks in range(4):
            da = encode_desc(mb * BLK + ks * 2048, SW128_MNMAJOR_1BLOCK)
            A = np.array([[vs[wgmma_read_addr_mn(da, m, k)] for k in range(16)] for m in range(64)])
            db = encode_desc(ks * 32, SW128_KMAJOR)
            B = np.array([[ps[wgmma_read_addr(db, n, k, elem_bytes=2)] for n in range(N)] for k in range(16)])
            D[mb] += A @ B
    out = np.full((512, N), np.nan)
    for mb in range(8):
        for m in range(64):
            out[pv_dim(mb, m)] = D[mb, m]
    np.testing.assert_array_equal(out, (P @ K[:, :512]).T / 256)


# -- build -------------------------------------------------------------------------------------------
def test_compiles_to_f16_wgmma_without_spills():
    r = build_one(wg4())
    main = next(x for x in r.resources if x["function"] == "k3gen_mla_decode")
    assert main["local"] == 0 and main["stack"] == 0 and main["registers"] <= 168, main
    # Per consumer: a loop over two pairs of 128-dim blocks (2 x 8 register-A m64n16k16), the
    # rope's 4, then 8 x 4 m64n16k16 (PV).
    assert main["sass"].get("HGMMA", 0) == 2 * (16 + 4 + 32)
    # Per consumer: 2 + 1 + 1 fences (QK commit groups, PV) and 2 + 1 + 1 + 1 waits; more would be
    # ptxas serializing the register-A wgmmas (C7519).
    assert main["sass"].get("WARPGROUP", 0) <= 2 * 9, "register-A wgmma serialized by ptxas"
    assert "HMMA" not in main["sass"] and main["sass"].get("LDGSTS", 0) > 0
