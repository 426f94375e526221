"""mla_prefill, variant "tcgen05" (sm103 / sm107), on the CPU. Nothing here runs on a Blackwell GPU
(none exists in this project). What is checked:

- selection by target features (auto = tcgen05 where the target has tcgen05, wgmma on sm_90a), the
  model's enumeration of it on sm103/sm107 for every KV dtype, the shared-memory and TMEM plan;
- the header's index math (include/k3gen/mla/prefill_tc.cuh) equals variants.py's Python model: the
  template's static_asserts compare fingerprints of every index function over its whole domain, and
  a wrong model fails to compile (test_probes_bind_the_model_to_the_header);
- a byte-level replay of one CTA's shared memory for the SM90 kernel (mla/prefill.cuh) and the
  tcgen05 kernel on the same varlen + prefix inputs: what the Q loader, the TMA boxes and the tail
  tile's zero-filling V copy write, read back through every MMA descriptor (k3gen.arch.sm90's model
  of the K-major / MN-major SW128 layouts), gives the same Q, K and V operands in both, per tile;
  the visibility mask of every written row and tile is the same in both and the reference's rule;
- the TMEM lane and columns of each softmax thread;
- an emulation of the tcgen05 tile loop (that replay, S and P V in FP32, the SM90 softmax rules with
  P rounded to BF16 once) against reference.py, a neighbour's NaN rows not leaking;
- the NVRTC build for sm_103a and sm_107a: UTCHMMA, UTMALDG, TMEM loads/stores, no HMMA/HGMMA, no
  spills, shared memory within the limit; and the B300 projection (bench mla_prefill_b300).
"""
from __future__ import annotations

import dataclasses
import functools
import re

import numpy as np
import pytest
import torch

from k3gen.arch.sm100 import DESC_VERSION, idesc_f16, tmem_addr, tmem_lane_m128, umma_desc
from k3gen.arch.sm90 import SW128_KMAJOR, encode_desc, sw128_mnmajor, swizzle128, wgmma_read_addr, wgmma_read_addr_mn
from k3gen.errors import CompileError, SpecError
from k3gen.ir.dtypes import KvDtype
from k3gen.ops.mla_prefill import variants as V
from k3gen.ops.mla_prefill.reference import mla_prefill as reference
from k3gen.ops.mla_prefill.spec import SMEM_BYTES, SOFTMAX_SCALE, MlaPrefillSpec, OutDtype, PrefillKernel
from k3gen.targets import TARGETS, ServingOptions, check_serving, has_prefill_kernel, model_specs
from numerics import assert_close

TC = ("sm103-nvfp4", "sm107-nvfp4")
BLK = V.BLK
BF = torch.bfloat16


# -- selection and plan --------------------------------------------------------------------------------
def test_auto_picks_tcgen05_by_the_target_feature():
    for name in TC:
        s = MlaPrefillSpec(target=TARGETS[name], heads=12)
        assert s.kernel is PrefillKernel.TCGEN05 and s.slug() == "h12-fp32-tcgen05" and s.threads == 224
        assert has_prefill_kernel(TARGETS[name])
    assert MlaPrefillSpec(target=TARGETS["sm90"], heads=12).kernel is PrefillKernel.WGMMA_PP
    # Features, not names: the sm90 preset given tcgen05 gets it, sm103 given wgmma gets wgmma.
    assert MlaPrefillSpec(target=dataclasses.replace(TARGETS["sm90"], mma="tcgen05"), heads=12).kernel \
        is PrefillKernel.TCGEN05
    assert MlaPrefillSpec(target=dataclasses.replace(TARGETS["sm103-nvfp4"], mma="wgmma"), heads=12).kernel \
        is PrefillKernel.WGMMA_PP
    with pytest.raises(SpecError, match="needs tcgen05"):
        MlaPrefillSpec(target=TARGETS["sm90"], heads=12, kernel=PrefillKernel.TCGEN05)
    assert not has_prefill_kernel(TARGETS["sm100-mxfp4"])   # the frozen target's menu has no mla_prefill


@pytest.mark.parametrize("target", TC)
@pytest.mark.parametrize("kv", [KvDtype.BF16, KvDtype.FP8, KvDtype.NVFP4])
def test_the_model_enumerates_it(target, kv):
    """`k3gen build --arch sm103|sm107 --kv ... --model small|k3` lists the tcgen05 prefill (FP32 out,
    the model's); NVFP4 KV still refuses chunked prefill."""
    t = TARGETS[target]
    for model, tp in (("small", 1), ("k3", 8)):
        pf = [s for s in model_specs(t, model, tp, serving=ServingOptions(kv=kv)) if s.op == "mla_prefill"]
        assert len(pf) == 1 and pf[0].kernel is PrefillKernel.TCGEN05 and pf[0].out_dtype is OutDtype.FP32
    if kv is KvDtype.NVFP4:
        with pytest.raises(SpecError, match="chunked_prefill"):
            check_serving(t, ServingOptions(kv=kv, chunked_prefill=True))


def test_plan_fits_and_regions_are_disjoint():
    for name in TC:
        for h, od in ((6, OutDtype.FP32), (96, OutDtype.BF16)):
            s = MlaPrefillSpec(target=TARGETS[name], heads=h, out_dtype=od)
            assert s.impl.plan(s).smem_bytes == s.smem_bytes <= V.SMEM_LIMIT == 232448
    sm = V.tc_smem()
    sizes = {"q": 3 * BLK, "k": V.TC_K_STAGES * 3 * BLK, "v": 2 * BLK, "p": 2 * BLK, "bars": 8 * V.TC_BARS,
             "tmem": 16}
    spans = sorted((sm[k], sm[k] + n) for k, n in sizes.items())
    assert spans[0][0] == 0 and all(a[1] == b[0] for a, b in zip(spans, spans[1:])) and spans[-1][1] == sm["end"]
    assert all(sm[k] % 1024 == 0 for k in ("q", "k", "v", "p")) and sm["total"] == sm["end"] + 1024
    # Why V has one stage: a second one (32 KB) does not fit beside the K ring and P.
    assert sm["total"] + 2 * BLK > V.SMEM_LIMIT
    # TMEM: S ping-pong and O, 128 FP32 columns each, disjoint inside the allocation.
    cols = [set(range(V.TC_S_COL + 128 * b, V.TC_S_COL + 128 * b + 128)) for b in (0, 1)]
    cols.append(set(range(V.TC_O_COL, V.TC_O_COL + 128)))
    assert sum(map(len, cols)) == len(set().union(*cols)) == 384 and max(set().union(*cols)) < V.TC_TMEM_COLS
    s90 = MlaPrefillSpec(target=TARGETS["sm90"], heads=12)   # the wgmma plan is unchanged
    assert (s90.smem_bytes, s90.threads) == (SMEM_BYTES, 384)


def test_tmem_lanes_and_columns_of_the_softmax_threads():
    """Softmax thread t (warp w = t // 32) reads with tcgen05.ld 32x32b from lane_addr = tmem +
    (32 w << 16): lane 32 w + t % 32 = accumulator row t (layout D), S buffer b columns 128 b + 32 c
    .. + 31 for c < 4, O columns 256 + 32 c ..; every (row, column) is read by exactly one thread."""
    seen_s, seen_o = set(), set()
    for t in range(128):
        w, lane = divmod(t, 32)
        assert tmem_lane_m128(t) == 32 * w + lane       # the quarter warp w may access, thread's lane
        for c in range(4):
            for j in range(32):
                for b in (0, 1):
                    a = tmem_addr(32 * w, V.TC_S_COL + 128 * b + 32 * c) + (lane << 16) + j
                    seen_s.add((b, a >> 16, (a & 0xFFFF) - V.TC_S_COL - 128 * b))
                a = tmem_addr(32 * w, V.TC_O_COL + 32 * c) + (lane << 16) + j
                seen_o.add((a >> 16, (a & 0xFFFF) - V.TC_O_COL))
    assert seen_s == {(b, r, k) for b in (0, 1) for r in range(128) for k in range(128)}
    assert seen_o == {(r, d) for r in range(128) for d in range(128)}


def test_instruction_and_matrix_descriptors():
    """M128 N128 kind::f16 BF16 (PTX instruction descriptor table: N >> 3 at 17, M >> 4 at 24), B
    MN-major for P V; the shared-memory descriptors are SM90's plus the version bit."""
    d = idesc_f16(bf16=True, m=128, n=128, b_mn=True)
    assert (d >> 17) & 63 == 16 and (d >> 24) & 31 == 8 and (d >> 16) & 1 == 1 and (d >> 7) & 7 == 1
    for a in (V.tc_qk_a(5), V.tc_pv_b(7)):
        assert umma_desc(a, SW128_KMAJOR) == encode_desc(a, SW128_KMAJOR) | DESC_VERSION


# -- the header is the model: static_asserts of the template --------------------------------------------
def _probe(conds):
    from k3gen.pipeline.nvrtc import compile_program
    src = '#include <cuda_bf16.h>\n#include "k3gen/mla/prefill_tc.cuh"\n' + "".join(
        f'static_assert({c}, "{m}");\n' for c, m in conds) + 'extern "C" __global__ void k3gen_probe() {}\n'
    compile_program(src, "probe.cu", TARGETS["sm103-nvfp4"])


def test_probes_bind_the_model_to_the_header(monkeypatch):
    _probe(V.tc_probes())
    # A model whose P store forgets the swizzle inside a block: NVRTC refuses the fingerprint.
    monkeypatch.setattr(V, "tc_p_off", lambda r, ch: V.tc_smem()["p"] + (ch >> 3) * BLK + (r >> 3) * 1024
                        + (r & 7) * 128 + ((ch & 7) << 4))
    with pytest.raises(CompileError, match="POff"):
        _probe(V.tc_probes())


# -- shared-memory replay ----------------------------------------------------------------------------
def _bytes(t: torch.Tensor) -> np.ndarray:
    """BF16 rows as bytes: [..., 2 * width] uint8."""
    return t.contiguous().view(torch.int16).numpy().view(np.uint8).reshape(*t.shape[:-1], -1)


def _box(img, dst: int, rows: np.ndarray):
    """One TMA box of [128 rows][128 bytes] with SWIZZLE_128B into the 1024-aligned `dst`."""
    r, b = np.arange(rows.shape[0])[:, None], np.arange(128)[None, :]
    img[dst + swizzle128(r * 128 + b)] = rows


def _chunks(img, addr: np.ndarray, data: np.ndarray):
    """16-byte copies (cp.async): data [..., 16] to the byte addresses `addr` [...]."""
    img[addr[..., None] + np.arange(16)] = data


def _strip(d: int) -> int:
    assert d & DESC_VERSION
    return d & ~DESC_VERSION


@functools.lru_cache(maxsize=None)
def _kmajor_map(starts: tuple, rows: int, tc: bool) -> np.ndarray:
    """[rows, 16 * len(starts)] byte addresses a K-major SW128 operand is read from, one descriptor
    per K16 step (tcgen05: umma_desc; SM90: the wgmma descriptor)."""
    out = np.zeros((rows, 16 * len(starts)), np.int64)
    for ks, a in enumerate(starts):
        d = _strip(umma_desc(a, SW128_KMAJOR)) if tc else encode_desc(a, SW128_KMAJOR)
        for r in range(rows):
            for k in range(16):
                out[r, 16 * ks + k] = wgmma_read_addr(d, r, k, 2)
    return out


@functools.lru_cache(maxsize=None)
def _mn_map(starts: tuple, lbo: int, tc: bool) -> np.ndarray:
    """[16 * len(starts) keys, 128 dims] addresses of V as the MN-major B operand."""
    out = np.zeros((16 * len(starts), 128), np.int64)
    for ks, a in enumerate(starts):
        d = _strip(umma_desc(a, sw128_mnmajor(lbo))) if tc else encode_desc(a, sw128_mnmajor(lbo))
        for k in range(16):
            for n in range(128):
                out[16 * ks + k, n] = wgmma_read_addr_mn(d, n, k)
    return out


def _read(img, amap: np.ndarray) -> torch.Tensor:
    u = img[amap].astype(np.uint16) | (img[amap + 1].astype(np.uint16) << 8)
    return torch.from_numpy(u.view(np.int16)).view(BF).float()


@dataclasses.dataclass
class Case:
    q: torch.Tensor
    kn: torch.Tensor
    kp: torch.Tensor
    v: torch.Tensor
    cq: list
    ck: list


def _case(H, cq, ck, seed, nq=None, nk=None):
    g = torch.Generator().manual_seed(seed)
    nq, nk = nq or cq[-1], nk or ck[-1]
    kv = torch.randn(nk, H, 256, generator=g).to(BF)
    rows = torch.randn(nk, 576, generator=g).to(BF)
    return Case(torch.randn(nq, H, 192, generator=g).to(BF), kv[..., :128], rows[:, 512:], kv[..., 128:], cq, ck)


def _seq(c: Case, b: int):
    """prefill_common.cuh seq_of: the offsets clamped to the tensors."""
    nq, nk = c.q.shape[0], c.kn.shape[0]
    q0 = min(max(c.cq[b], 0), nq)
    k0 = min(max(c.ck[b], 0), nk)
    return q0, min(max(c.cq[b + 1], q0), nq) - q0, k0, min(max(c.ck[b + 1], k0), nk) - k0


def _tiles(lq, lk, i0):
    """prefill_common.cuh work_of: key tiles of the q-block at row i0."""
    kend = max(0, min(lk, lk - lq + min(i0 + 128, lq)))
    return -(-kend // 128)


def _key_boxes(c: Case, h, row0):
    """The rows tma_k / tma_v bring (zero past the tensor: the map's OOB fill)."""
    nk = c.kn.shape[0]
    rows = np.arange(row0, row0 + 128)
    ok = rows < nk
    idx = torch.from_numpy(np.minimum(rows, nk - 1))
    kn, kp, v = _bytes(c.kn[idx, h]), _bytes(c.kp[idx]), _bytes(c.v[idx, h])
    for x in (kn, kp, v):
        x[~ok] = 0
    return [kn[:, :128], kn[:, 128:], kp], [v[:, :128], v[:, 128:]]


def _tail_v(img, c: Case, h, k0, kv0, lk, a_v):
    """load_v: chunk c (8 dims) of key `key` at aV + (c >> 3) * kKBlk + sw128(key, c & 7), zero past lk."""
    key, ch = np.arange(128)[:, None], np.arange(16)[None, :]
    rows = np.minimum(k0 + kv0 + np.arange(128), c.v.shape[0] - 1)
    data = _bytes(c.v[torch.from_numpy(rows), h]).reshape(128, 16, 16)
    data[kv0 + np.arange(128) >= lk] = 0
    _chunks(img, a_v + (ch >> 3) * BLK + V.sw128(key, ch & 7), data)


def _q_rows(c: Case, h, q0, lq, i0):
    rows = np.minimum(q0 + i0 + np.arange(128), c.q.shape[0] - 1)
    data = _bytes(c.q[torch.from_numpy(rows), h]).reshape(128, 24, 16)
    data[i0 + np.arange(128) >= lq] = 0
    return data


def operands(c: Case, b, h, i0, tc: bool):
    """One CTA's operands as the MMAs read them, tile by tile: (Q [128, 192], [(K [128, 192], V [128,
    128])]). tcgen05: variants.py's model of prefill_tc.cuh; SM90: prefill.cuh's layout (Q per 64-row
    consumer, stages of K + V at 49152 + 81920 st)."""
    q0, lq, k0, lk = _seq(c, b)
    img = np.zeros(V.tc_smem()["total"] if tc else SMEM_BYTES, np.uint8)
    r, ch = np.arange(128)[:, None], np.arange(24)[None, :]
    if tc:
        _chunks(img, V.tc_q_off(r, ch), _q_rows(c, h, q0, lq, i0))
        Q = _read(img, _kmajor_map(tuple(V.tc_qk_a(ks) for ks in range(12)), 128, True))
    else:   # prefill.cuh load_q and the consumers' desc_k
        _chunks(img, (r >> 6) * 3 * 8192 + (ch >> 3) * 8192 + V.sw128(r & 63, ch & 7), _q_rows(c, h, q0, lq, i0))
        Q = torch.cat([_read(img, _kmajor_map(tuple(cc * 3 * 8192 + (ks >> 2) * 8192 + (ks & 3) * 32
                                                     for ks in range(12)), 64, False)) for cc in (0, 1)])
    tiles = []
    for it in range(_tiles(lq, lk, i0)):
        st, kv0 = it & 1, it * 128
        a_k = V.tc_smem()["k"] + st * 3 * BLK if tc else 49152 + st * 81920
        a_v = V.tc_smem()["v"] if tc else a_k + 3 * BLK
        kb, vb = _key_boxes(c, h, k0 + kv0)
        for j, box in enumerate(kb):
            _box(img, a_k + j * BLK, box)
        if kv0 + 128 <= lk:
            for j, box in enumerate(vb):
                _box(img, a_v + j * BLK, box)
        else:
            _tail_v(img, c, h, k0, kv0, lk, a_v)
        kst = tuple(V.tc_qk_b(st, ks) for ks in range(12)) if tc else \
            tuple(a_k + (ks >> 2) * BLK + (ks & 3) * 32 for ks in range(12))
        vst = tuple(V.tc_pv_b(ks) for ks in range(8)) if tc else tuple(a_v + ks * 2048 for ks in range(8))
        tiles.append((_read(img, _kmajor_map(kst, 128, tc)), _read(img, _mn_map(vst, BLK, tc))))
    return Q, tiles


def visible(lq, lk, i0, it, tc: bool) -> np.ndarray:
    """[128 rows, 128 keys] visibility in tile `it`: masked at col <= lim unless the tile is free for
    the row's group (SM90: the consumer warpgroup's first row, 64 rows; tcgen05: the warp's, 32)."""
    pre, grp = lk - lq, 32 if tc else 64
    vis = np.zeros((128, 128), bool)
    for r in range(128):
        i = i0 + r
        lim = min(pre + i, lk - 1) if i < lq else -1
        free = it * 128 + 127 <= pre + i0 + grp * (r // grp)
        vis[r] = True if free else it * 128 + np.arange(128) <= lim
    return vis


CASES = [  # (H, cu_seqlens_q, cu_seqlens_k): prefixes, empty queries, two q-blocks, tail tiles, len_k < len_q
    (2, [0, 5, 5, 205, 275], [0, 5, 12, 342, 412]),
    (1, [0, 128, 138, 268], [0, 256, 262, 392]),
    (1, [0, 300], [0, 300]),
]


@pytest.mark.parametrize("H,cq,ck", CASES)
def test_operands_and_masks_equal_the_sm90_kernels(H, cq, ck):
    c = _case(H, cq, ck, seed=len(cq))
    for b in range(len(cq) - 1):
        q0, lq, k0, lk = _seq(c, b)
        for h in range(H):
            for i0 in range(0, lq, 128):
                (qa, ta), (qb, tb) = operands(c, b, h, i0, True), operands(c, b, h, i0, False)
                assert torch.equal(qa, qb) and len(ta) == len(tb) == _tiles(lq, lk, i0)
                rows = torch.from_numpy(np.minimum(q0 + i0 + np.arange(128), c.q.shape[0] - 1))
                live = torch.from_numpy(i0 + np.arange(128) < lq)
                assert torch.equal(qa[live], c.q[rows, h].float()[live]) and not qa[~live].any()
                for it, ((ka, va), (kb, vb)) in enumerate(zip(ta, tb)):
                    assert torch.equal(ka, kb) and torch.equal(va, vb)
                    keys = k0 + it * 128 + np.arange(128)
                    ink = torch.from_numpy(keys < c.kn.shape[0])
                    idx = torch.from_numpy(np.minimum(keys, c.kn.shape[0] - 1))
                    want_k = torch.cat([c.kn[idx, h], c.kp[idx]], -1).float() * ink[:, None]
                    assert torch.equal(ka, want_k)
                    inseq = torch.from_numpy(it * 128 + np.arange(128) < lk)
                    assert torch.equal(va, c.v[idx, h].float() * inseq[:, None])   # past the sequence: 0
                    vt, v9 = visible(lq, lk, i0, it, True), visible(lq, lk, i0, it, False)
                    w = (i0 + np.arange(128)) < lq
                    j = it * 128 + np.arange(128)[None, :]
                    rule = j <= (lk - lq) + (i0 + np.arange(128))[:, None]   # reference.py's rule
                    assert (vt[w] == v9[w]).all() and (vt[w] == rule[w]).all()


def test_chunk_writes_equal_the_tma_swizzle():
    """The loaders' sw128 chunk address is where TMA's SWIZZLE_128B puts the same bytes."""
    for r in range(128):
        for ch in range(8):
            assert V.sw128(r, ch) + 5 == swizzle128(r * 128 + ch * 16 + 5)


# -- emulation of the tile loop against the reference ---------------------------------------------------
def emulate(c: Case, out_dtype=OutDtype.FP32) -> torch.Tensor:
    """prefill_tc.cuh's tile loop on its replayed operands: S and P V in FP32, the SM90 softmax rules
    (log2 domain, the scale folded into one FMA per score, P rounded to BF16 once, l sums the rounded values pairwise in key order, O and l
    rescaled by exp2(m - m_new)), P through the softmax's shared-memory stores and PV's descriptor;
    rows never written stay NaN."""
    H = c.q.shape[1]
    out = torch.full((c.q.shape[0], H, 128), float("nan"))
    scale = torch.tensor(SOFTMAX_SCALE, dtype=torch.float32) * torch.tensor(1.4426950408889634, dtype=torch.float32)
    p_map = _kmajor_map(tuple(V.tc_pv_a(ks) for ks in range(8)), 128, True)
    r, ch = np.arange(128)[:, None], np.arange(16)[None, :]
    for b in range(len(c.cq) - 1):
        q0, lq, k0, lk = _seq(c, b)
        for h in range(H):
            for i0 in range(0, lq, 128):
                Q, tiles = operands(c, b, h, i0, True)
                m = torch.full((128,), float("-inf"))
                l, O = torch.zeros(128), torch.zeros(128, 128)
                for it, (K, Vt) in enumerate(tiles):
                    x = (Q.double() @ K.double().T).float()
                    x = torch.where(torch.from_numpy(visible(lq, lk, i0, it, True)), x, torch.tensor(float("-inf")))
                    m_new = torch.maximum(m, x.max(1).values * scale)
                    dead = m_new == float("-inf")
                    a = torch.where(dead, torch.ones(()), torch.exp2(m - m_new))
                    # fma(x, scale, -m_new): the product exact in FP64, one rounding to FP32 after the sum
                    arg = (x.double() * scale.double() - torch.where(dead, torch.zeros(()), m_new).double()[:, None])
                    P = torch.exp2(arg.float()).to(BF)
                    Pf = P.float()
                    s = torch.zeros(128)
                    for j in range(64):
                        s = s + (Pf[:, 2 * j] + Pf[:, 2 * j + 1])
                    l, m = l * a + s, m_new
                    img = np.zeros(V.tc_smem()["total"], np.uint8)
                    _chunks(img, V.tc_p_off(r, ch), _bytes(P).reshape(128, 16, 16))
                    O = O * a[:, None] + (_read(img, p_map).double() @ Vt.double()).float()
                inv = torch.where(l > 0, 1 / l, torch.zeros(()))
                n = min(128, lq - i0)
                o = (O * inv[:, None])[:n]
                out[q0 + i0:q0 + i0 + n, h] = o.to(BF).float() if out_dtype is OutDtype.BF16 else o
    return out


EMU = [  # varlen + prefixes (one of 130 keys: a tail tile), an empty sequence, two q-blocks, len_k < len_q
    (2, [0, 5, 5, 205, 215], [0, 5, 12, 342, 346]),
    (1, [0, 77, 333], [0, 200, 456]),
]


@pytest.mark.parametrize("H,cq,ck", EMU)
@pytest.mark.parametrize("out_dtype", list(OutDtype))
def test_emulated_tile_loop_matches_the_reference(H, cq, ck, out_dtype):
    c = _case(H, cq, ck, seed=7, nq=cq[-1] + 3)   # 3 rows past the last sequence: never written
    got = emulate(c, out_dtype)
    want = reference(c.q, c.kn, c.kp, c.v, cq, ck)
    assert torch.isnan(got[cq[-1]:]).all()
    assert_close(got[:cq[-1]], want[:cq[-1]], BF, what=f"tcgen05 emulation {out_dtype.value}")
    short = [b for b in range(len(cq) - 1) if ck[b + 1] - ck[b] < cq[b + 1] - cq[b]]
    for b in short:   # the first rows see no key: zeros, as the SM90 kernel writes them
        dead = (cq[b + 1] - cq[b]) - (ck[b + 1] - ck[b])
        assert not got[cq[b]:cq[b] + dead].any()


def test_a_neighbours_nan_rows_do_not_leak():
    """Sequence 0's tail tile covers sequence 1's keys: NaN there reaches neither its scores (masked
    by a select) nor its P V (the tail V is copied zero-filled)."""
    cq, ck = [0, 50, 60], [0, 70, 200]
    c = _case(1, cq, ck, seed=3)
    c.kn[70:], c.v[70:] = float("nan"), float("nan")
    got = emulate(c)
    assert torch.isfinite(got[:50]).all()
    assert_close(got[:50], reference(c.q[:50], c.kn[:70], c.kp[:70], c.v[:70], [0, 50], [0, 70]), BF)


# -- the build -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("target,h,out_dtype", [("sm103-nvfp4", 12, OutDtype.FP32), ("sm103-nvfp4", 96, OutDtype.BF16),
                                                ("sm107-nvfp4", 96, OutDtype.FP32), ("sm107-nvfp4", 6, OutDtype.BF16)])
def test_sass(target, h, out_dtype):
    from k3gen.pipeline.build import build_one
    from k3gen.pipeline.inspect import sass_text
    spec = MlaPrefillSpec(target=TARGETS[target], heads=h, out_dtype=out_dtype)
    r = build_one(spec)
    (k,) = r.resources
    assert k["function"] == "k3gen_mla_prefill" and k["local"] == 0 and k["stack"] == 0, k
    assert spec.smem_bytes <= V.SMEM_LIMIT and k["shared"] + spec.smem_bytes <= 233472   # + the 1 KB reserve, per SM
    sass = sass_text(r.cubin)
    assert f"sm_{TARGETS[target].sm}" in sass
    ops = re.findall(r"\b(UTCHMMA|UTCQMMA|HMMA|HGMMA|UTMALDG|LDGSTS|LDTM|STTM|UTCBAR)\b", sass)
    # 12 K16 steps of QK (issued for tile 0 and in the loop) and 8 of PV: kind::f16 tcgen05, no mma.sync.
    assert ops.count("UTCHMMA") == 2 * 12 + 8 and not {"HMMA", "HGMMA", "UTCQMMA"} & set(ops)
    assert "UTMALDG" in ops and "LDGSTS" in ops            # K/V boxes; Q and the tail tile's V copies
    assert {"LDTM", "STTM", "UTCBAR"} <= set(ops)          # S/O loads, the O rescale, the commits


# -- B300 projection ---------------------------------------------------------------------------------
def test_b300_projection():
    """`k3gen bench --op mla_prefill_b300`: bytes counted by hand at 8 TB/s, the whole 128 x 128 tiles
    the kernel issues at 2.25 PFLOP/s."""
    from bench.cases.mla_prefill import b300_prefill_projection, mla_prefill_b300
    s = MlaPrefillSpec(target=TARGETS["sm103-nvfp4"], heads=96, out_dtype=OutDtype.BF16)
    p = b300_prefill_projection(s, 1, 4096)
    nbytes = 4096 * 96 * (192 + 128 + 128) * 2 + 4096 * 64 * 2 + 4096 * 96 * 128 * 2
    tiles = 96 * sum(range(1, 33))                       # q-block qb sees qb + 1 key tiles
    assert p["bytes"] == nbytes and p["tiles"] == tiles
    assert p["mma_us"] == pytest.approx(tiles * 2 * 128 * 128 * 320 / 2.25e15 * 1e6)
    assert p["mem_us"] == pytest.approx(nbytes / 8e12 * 1e6) and p["proj_us"] == p["mma_us"] and p["bound"] == "MMA"
    assert p["useful_flops"] < p["mma_flops"]            # the diagonal tiles count whole
    ragged = b300_prefill_projection(s, 1, 200)          # a partial q-block: 1 + 2 tiles
    assert ragged["tiles"] == 96 * 3
    rows = mla_prefill_b300(quick=True)
    assert len(rows) == 4 and all("not measured" in r["detail"] for r in rows)
