"""kda_prefill `chunk64_tc` (sm103 / sm107) on the CPU. Nothing here ran on a Blackwell GPU (none exists
in this project). Checked: the selection by target features; the state pass's shared-memory and TMEM
plan; the index math of include/k3gen/kda/prefill_chunk64_tc.cuh replayed against chunk64's
(prefill_chunk64.cuh) on the same records: the bytes prep's RecTc policy writes vs the bytes every UMMA
descriptor reads (and the elements chunk64's mma.sync fragments read from its padded Rec), the TMEM lane
and columns each thread loads and stores, the O addresses, the mbarrier phases of every chunk under
random interleavings; a torch emulation of the tcgen05 state pass through those maps (shared memory and
TMEM as tensors), bitwise equal to reference.chunk64_state_pass on random varlen batches, FP32 and BF16
pools, continuation from a cached state; and the NVRTC build for sm_103a and sm_107a."""
from __future__ import annotations

import functools
import random
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from k3gen.arch.sm100 import DESC_VERSION, umma_desc
from k3gen.arch.sm90 import SW128_KMAJOR, wgmma_read_addr
from k3gen.errors import SpecError
from k3gen.ir.dtypes import SsmDtype
from k3gen.ops.kda_prefill.reference import chunk64_records, chunk64_state_pass
from k3gen.ops.kda_prefill.spec import C64_REC_BYTES, C64TC_REC_BYTES, C64TC_REC_TILES, KdaPrefillSpec, PrefillAlgo
from k3gen.ops.kda_prefill.variants import SMEM_LIMIT, TC_REC, TC_TMEM, TMEM_COLS, kstep, sw128, tc_smem, ut_off
from k3gen.targets import TARGETS, build_specs

K, C = 128, 64
REC, TILES = C64TC_REC_BYTES, C64TC_REC_TILES
EU = REC - TILES
SM = tc_smem()
TC = ("sm103-nvfp4", "sm107-nvfp4")
ROWS = {"w": 64, "qg": 64, "kgt": 128, "aqk": 64, "sb": 128, "vb": 128}   # operand rows (M or N)
STEPS = {"w": 8, "qg": 8, "kgt": 4, "aqk": 4, "sb": 8, "vb": 4}         # k16 steps of their MMAs


def el(rows, row, col):
    """Byte of BF16 element (row, col) in an SW128 operand of `rows` rows (c64tc::sw128_el; tensors too)."""
    return (col >> 6) * rows * 128 + (row >> 3) * 1024 + (row & 7) * 128 + ((((col >> 3) & 7) ^ (row & 7)) << 4) \
        + (col & 7) * 2


# -- selection and plan ---------------------------------------------------------------------------------
def test_auto_picks_chunk64_tc_by_the_tcgen05_feature():
    for name in TC:
        specs = [s for s in build_specs(TARGETS[name]) if s.op == "kda_prefill"]
        assert specs and all(s.algo is PrefillAlgo.CHUNK64_TC for s in specs)
    assert all(s.algo is PrefillAlgo.CHUNK64 for s in build_specs(TARGETS["sm90"]) if s.op == "kda_prefill")
    # A feature, not a name: an sm90 preset given tcgen05 picks it; chunk64 stays selectable on sm103.
    assert KdaPrefillSpec(target=replace(TARGETS["sm90"], name="tc-test", mma="tcgen05"), heads=12).algo \
        is PrefillAlgo.CHUNK64_TC
    assert KdaPrefillSpec(target=TARGETS["sm103-nvfp4"], heads=12, algo=PrefillAlgo.CHUNK64).algo is PrefillAlgo.CHUNK64
    with pytest.raises(SpecError, match="needs tcgen05"):
        KdaPrefillSpec(target=TARGETS["sm90"], heads=12, algo=PrefillAlgo.CHUNK64_TC)


def test_plan_fits_shared_memory_and_tmem():
    spec = KdaPrefillSpec(target=TARGETS["sm107-nvfp4"], heads=96, ssm=SsmDtype.BF16)
    p = spec.impl.plan(spec)
    assert list(p.states) == ["tc"] and p.rec_bytes == spec.rec_bytes == REC
    st = p.states["tc"]
    assert (st.entry, st.threads, st.grid_z, st.tmem_cols) == ("k3gen_kda_prefill_state_tc", 160, 1, 512)
    assert st.smem_bytes == SM["total"] <= SMEM_LIMIT
    # Two such CTAs never share an SM, so the 512-column TMEM allocation never waits for another CTA.
    assert 2 * st.smem_bytes > 228 * 1024
    assert all(SM[k] % 1024 == 0 for k in ("tiles", "sb", "vb")) and SM["eu"] % 16 == 0
    spans = [(0, 2 * TILES), (SM["sb"], SM["sb"] + K * K * 2), (SM["vb"], SM["vb"] + K * C * 2),
             (SM["eu"], SM["eu"] + 2 * EU), (SM["bars"], SM["bars"] + 6 * 8), (SM["tmem"], SM["tmem"] + 4)]
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])) and spans[-1][1] <= SM["end"]
    used: set = set()
    for c0, n in ((TC_TMEM["S"], K), (TC_TMEM["V"], C), (TC_TMEM["O"][0], C), (TC_TMEM["O"][1], C)):
        cols = set(range(c0, c0 + n))
        assert not used & cols
        used |= cols
    assert max(used) < st.tmem_cols <= TMEM_COLS and st.tmem_cols & (st.tmem_cols - 1) == 0
    assert (REC, TILES) == (90624, 57344) and REC % 16 == 0
    assert spec.workspace_bytes(4096, 1) == 65 * 96 * REC + 4096 * 96 * K * 4
    c64 = KdaPrefillSpec(target=TARGETS["sm107-nvfp4"], heads=96, algo=PrefillAlgo.CHUNK64)
    assert c64.workspace_bytes(4096, 1) == 65 * 96 * C64_REC_BYTES + 4096 * 96 * K * 4
    assert spec.smem_bytes == c64.smem_bytes   # the same prep


def test_launcher_takes_the_plans_entry():
    from k3gen.ops.kda_prefill.launcher import KdaPrefill
    tc = KdaPrefill(KdaPrefillSpec(target=TARGETS["sm103-nvfp4"], heads=12))
    assert tc.state_key(1) == tc.state_key(64) == "tc"
    c64 = KdaPrefill(KdaPrefillSpec(target=TARGETS["sm103-nvfp4"], heads=12, algo=PrefillAlgo.CHUNK64))
    c64._sms = 148
    assert (c64.state_key(1), c64.state_key(8)) == (2, 8)


# -- the record: prep's writes vs the descriptors' reads -------------------------------------------------
def rec_writes() -> dict:
    """(tile, row, col) -> (byte offset, size) of every element prep stores through c64tc::RecTc: w / qg
    (t, k), kgt8(c, r8) (k, t = 8 r8 + e), aqk2(t, s even) (t, s; s + 1 at + 2), egl[c], ut4(c, r4) (v, t)."""
    out = {}
    for t in range(C):
        for c in range(K):
            out[("w", t, c)] = (TC_REC["w"][0] + el(C, t, c), 2)
            out[("qg", t, c)] = (TC_REC["qg"][0] + el(C, t, c), 2)
            out[("kgt", c, t)] = (TC_REC["kgt"][0] + sw128(K, c, t >> 3) + (t & 7) * 2, 2)
            out[("ut", c, t)] = (ut_off(c, t >> 2) + (t & 3) * 4, 4)
        for s in range(0, C, 2):
            a = TC_REC["aqk"][0] + sw128(C, t, s >> 3) + (s & 7) * 2
            out[("aqk", t, s)], out[("aqk", t, s + 1)] = (a, 2), (a + 2, 2)
    for c in range(K):
        out[("egl", c)] = (TC_REC["egl"][0] + 4 * c, 4)
    return out


def test_record_bytes_are_written_exactly_once():
    seen = sorted(o + i for o, n in rec_writes().values() for i in range(n))
    assert seen == list(range(REC))


def desc_addrs(name: str, buf: int) -> list[int]:
    """The shared address of each k16 step's descriptor, as mma_loop computes it (c64tc::kstep, which
    the template's static_asserts hold to variants.kstep)."""
    base = SM[name] if name in ("sb", "vb") else buf * TILES + TC_REC[name][0]
    return [base + kstep(ROWS[name], ks) for ks in range(STEPS[name])]


@functools.lru_cache(maxsize=None)
def read_map(name: str, buf: int) -> torch.Tensor:
    """[rows, 16 * steps] shared byte addresses the MMAs read for operand element (row, k), through the
    descriptors (k3gen.arch.sm100.umma_desc: the SM90 encoding + the version bits; the SW128 K-major
    reading of k3gen.arch.sm90.wgmma_read_addr)."""
    out = torch.empty(ROWS[name], 16 * STEPS[name], dtype=torch.int64)
    for ks, a in enumerate(desc_addrs(name, buf)):
        d = umma_desc(a, SW128_KMAJOR)
        assert d & DESC_VERSION
        d &= ~DESC_VERSION
        for r in range(ROWS[name]):
            for k in range(16):
                out[r, 16 * ks + k] = wgmma_read_addr(d, r, k, 2)
    return out


@pytest.mark.parametrize("buf", [0, 1])
def test_descriptors_read_what_prep_and_the_warps_wrote(buf):
    """Record tiles: the bulk copy puts record byte x at buf * kTiles + x; S_b / V_b: thread v's
    put_row_bf16 (chunk k / 8 of row v, element k % 8)."""
    w = rec_writes()
    for name in ("w", "qg", "kgt", "aqk"):
        m = read_map(name, buf)
        for r in range(m.shape[0]):
            assert [int(x) for x in m[r]] == [buf * TILES + w[(name, r, k)][0] for k in range(m.shape[1])], (name, r)
    for name in ("sb", "vb"):
        m = read_map(name, buf)
        rr, kk = torch.meshgrid(torch.arange(m.shape[0]), torch.arange(m.shape[1]), indexing="ij")
        assert torch.equal(m, SM[name] + el(K, rr, kk))


def sm90_b_reads(name: str) -> set:
    """(k16 step, row, col) of chunk64's padded Rec tile that chunk_step's m16n8k16 B fragments read:
    words (8 nt + g) * ld + 8 kk + tq and + 4 (ld = the row stride in 32-bit words), Aqk causal only."""
    ld, nts, steps = {"w": (68, 8, 8), "qg": (68, 8, 8), "aqk": (36, 8, 4), "kgt": (36, 16, 4)}[name]
    out = set()
    for nt in range(nts):
        for kk in range(steps):
            if name == "aqk" and kk > nt // 2:
                continue
            for g in range(8):
                for tq in range(4):
                    for word in ((8 * nt + g) * ld + 8 * kk + tq, (8 * nt + g) * ld + 8 * kk + tq + 4):
                        for e in range(2):
                            out.add((kk, word // ld, 2 * (word % ld) + e))
    return out


def test_mma_steps_read_the_elements_chunk64_reads():
    """Every k16 step of every tcgen05 MMA reads the (row, k) elements chunk64's mma.sync step of the same
    index reads from its padded record; the only extra reads are Aqk's blocks above the diagonal, which
    prep writes as zeros. A operands: step kk of chunk64 packs accumulator tiles 2 kk, 2 kk + 1 (columns
    16 kk .. 16 kk + 15 of S or V_new), as the descriptors of S_b / V_b step kk."""
    inv = {o: key for key, (o, n) in rec_writes().items()}
    for name in ("w", "qg", "kgt", "aqk"):
        m = read_map(name, 0)
        tc = set()
        for r in range(m.shape[0]):
            for k in range(m.shape[1]):
                tile, row, col = inv[int(m[r, k])]
                assert (tile, row, col) == (name, r, k)
                tc.add((k // 16, row, col))
        ref = sm90_b_reads(name)
        assert ref <= tc and all(s > t for _, t, s in tc - ref) and (name == "aqk" or tc == ref), name
    for name, ntiles in (("sb", 16), ("vb", 8)):
        sm90 = {(kt // 2, v, 8 * kt + 2 * tq + e) for kt in range(ntiles) for v in range(K) for tq in range(4)
                for e in range(2)}
        tc = {(k // 16, r, k) for r in range(ROWS[name]) for k in range(16 * STEPS[name])}
        assert tc == sm90, name


def test_tmem_lanes_columns_and_o_addresses():
    """Thread (warp w < 4, lane l) addresses TMEM lane (32 w << 16) >> 16 + l through tcgen05.ld/st 32x32b:
    row v = 32 w + l of every M = 128 accumulator (layout D: row r in lane r). Its columns: S^T k at
    kColS + k, V_new t at kColV + t, O t at kColO + 64 buf + t, each MMA's D (N = 128, 64, 64) exactly
    those. Raw O: the (token, column) addresses chunk64's chunk_step stores, each once."""
    lanes = [((32 * w) << 16 >> 16) + l for w in range(4) for l in range(32)]
    assert lanes == list(range(128))
    ld_cols = {"S": {TC_TMEM["S"] + 32 * j + i for j in range(4) for i in range(32)},
               "V": {TC_TMEM["V"] + 32 * hf + i for hf in range(2) for i in range(32)},
               "O0": {TC_TMEM["O"][0] + 32 * hf + i for hf in range(2) for i in range(32)},
               "O1": {TC_TMEM["O"][1] + 32 * hf + i for hf in range(2) for i in range(32)}}
    mma_cols = {"S": set(range(0, 128)), "V": set(range(128, 192)), "O0": set(range(256, 320)),
                "O1": set(range(320, 384))}
    assert ld_cols == mma_cols
    for n in (1, 17, 63, 64):
        sm90 = []
        for rb in range(8):
            for lane in range(32):
                g, tq = lane >> 2, lane & 3
                for nt in range(8):
                    r = 8 * nt + 2 * tq
                    for dr, dv in ((0, 0), (0, 8), (1, 0), (1, 8)):
                        if r + dr < n:
                            sm90.append((r + dr, 16 * rb + g + dv))
        tc = [(t, v) for v in lanes for hf in range(2) for t in range(32 * hf, 32 * hf + 32) if t < n]
        assert sorted(sm90) == sorted(tc) and len(set(tc)) == len(tc) == n * 128


# -- the state pass emulated through the maps ---------------------------------------------------------------
def record_image(r: dict) -> torch.Tensor:
    """The bytes RecTc stores for one chunk's record (reference.chunk64_records' logical values; rows and
    columns past the chunk's n tokens are zero, as prep writes them)."""
    img = torch.zeros(REC, dtype=torch.uint8)
    h, f = img.view(torch.bfloat16), img.view(torch.float32)
    w = rec_writes()

    def put(name, vals, rows, cols, view, shift):
        vals = F.pad(vals, (0, cols - vals.shape[1], 0, rows - vals.shape[0]))
        idx = torch.tensor([[w[(name, i, j)][0] >> shift for j in range(cols)] for i in range(rows)])
        view[idx] = vals.to(view.dtype)
    put("w", -r["w"], C, K, h, 1)
    put("qg", r["qg"], C, K, h, 1)
    put("kgt", r["kg"].t(), K, C, h, 1)
    put("aqk", r["aqk"], C, C, h, 1)
    put("ut", r["u"].t(), K, C, f, 2)
    f[torch.tensor([w[("egl", c)][0] >> 2 for c in range(K)])] = r["egl"]
    return img


class TcStatePass:
    """prefill_chunk64_tc.cuh's state pass of one (sequence, head): shared memory and TMEM as tensors,
    every access through the header's index math (bulk copies, descriptors, put_row_bf16, put_ut, the
    TMEM columns, the O and pool addresses), the arithmetic at its rounding points, written with
    reference.chunk64_state_pass's torch expressions on the gathered operands (equal inputs, equal
    shapes: equal bits). The tensor core's own FP32 summation order is not modelled (nor is mma.sync's)."""
    LANE = torch.tensor([((32 * w) << 16 >> 16) + l for w in range(4) for l in range(32)])
    V = torch.arange(K)[:, None]

    def __init__(self):
        self.smem = torch.zeros(SM["end"], dtype=torch.uint8)
        self.tmem = torch.zeros(128, TMEM_COLS)

    def gather(self, name, buf):
        return self.smem.view(torch.bfloat16)[read_map(name, buf) >> 1].float()

    def put_rows(self, op, x):   # thread v: its row of x (K index = column) as BF16 into operand `op`
        cols = torch.arange(x.shape[1])[None, :]
        self.smem.view(torch.bfloat16)[(SM[op] + el(K, self.V, cols)) >> 1] = x.to(torch.bfloat16)

    def rescale(self, s, buf):   # S_b = bf16(S); S * e^(G_C) of the chunk in `buf` back to TMEM
        self.put_rows("sb", s)
        egl = self.smem.view(torch.float32)[(SM["eu"] + buf * EU + TC_REC["egl"][0] - TILES) // 4 + torch.arange(K)]
        self.tmem[self.LANE, TC_TMEM["S"]:TC_TMEM["S"] + K] = s * egl[None, :]
        t = torch.arange(C)[None, :]
        ut = SM["eu"] + buf * EU - TILES + ut_off(self.V, t >> 2) + (t & 3) * 4
        self.tmem[self.LANE, TC_TMEM["V"]:TC_TMEM["V"] + C] = self.smem.view(torch.float32)[ut >> 2]

    def run(self, ws, o_ws, pool, cu, slots, resume, b, h, H):
        tok0, length, slot = cu[b], cu[b + 1] - cu[b], slots[b]
        if slot < 0 or slot >= pool.shape[0] or length <= 0:
            return
        recs = (cu[b] // C + b) * H * REC + h * REC      # c64::item_base(b) * H + h
        nc = -(-length // C)

        def issue(buf, c):
            r = recs + c * H * REC
            self.smem[buf * TILES:(buf + 1) * TILES] = ws[r:r + TILES]
            self.smem[SM["eu"] + buf * EU:SM["eu"] + (buf + 1) * EU] = ws[r + TILES:r + REC]
        for c in range(min(2, nc)):
            issue(c, c)
        s0 = pool[slot, h].float() if resume[b] else torch.zeros(K, K)
        self.rescale(s0, 0)
        cols = lambda c0, n: slice(c0, c0 + n)
        for c in range(nc):
            buf, n = c & 1, min(C, length - c * C)
            sb, bw, bq = self.gather("sb", 0), self.gather("w", buf), self.gather("qg", buf)
            u = self.tmem[self.LANE, cols(TC_TMEM["V"], C)].t()
            assert not (bw[n:].any() or bq[n:].any() or u[n:].any()), "rows past the chunk are zero"
            # (1) D_V = U^T + S_b (-W)^T ; D_O = S_b (e^G Q)^T   (as [t][v]: chunk64_state_pass's form)
            vnew = u[:n] + bw[:n] @ sb.t()
            o1 = bq[:n] @ sb.t()
            self.tmem[self.LANE, cols(TC_TMEM["V"], C)] = F.pad(vnew, (0, 0, 0, C - n)).t()
            # (2) V_b = bf16(D_V)
            self.put_rows("vb", self.tmem[self.LANE, cols(TC_TMEM["V"], C)])
            # (3) D_O += V_b Aqk^T ; S^T += V_b (K e^(G_C - G))
            vb, ba, bk = self.gather("vb", 0), self.gather("aqk", buf), self.gather("kgt", buf)
            assert not (vb[:, n:].any() or ba[n:].any() or bk[:, n:].any() or ba.triu(1).any())
            vbt = vb[:, :n].t().contiguous()
            o = o1 + ba[:n, :n].contiguous() @ vbt
            self.tmem[self.LANE, cols(TC_TMEM["O"][buf], C)] = F.pad(o, (0, 0, 0, C - n)).t()
            st = self.tmem[self.LANE, cols(TC_TMEM["S"], K)]
            self.tmem[self.LANE, cols(TC_TMEM["S"], K)] = st + vbt.t() @ bk[:, :n].t().contiguous()
            if c + 2 < nc:
                issue(buf, c + 2)
            # (4) the warps: the next chunk's start, or the final state; then raw O
            s = self.tmem[self.LANE, cols(TC_TMEM["S"], K)]
            if c + 1 < nc:
                self.rescale(s, (c + 1) & 1)
            else:
                pool[slot, h] = s.to(pool.dtype)
            t = torch.arange(n)[None, :]
            o_ws[((tok0 + c * C + t) * H + h) * K + self.V] = self.tmem[self.LANE, cols(TC_TMEM["O"][buf], n)]


def _inputs(T, g0):
    nrm = torch.nn.functional.normalize
    q = nrm(torch.randn(T, K, generator=g0), dim=-1) * K ** -0.5
    k = nrm(torch.randn(T, K, generator=g0), dim=-1)
    v = torch.randn(T, K, generator=g0)
    g = -5 * torch.sigmoid(torch.randn(T, K, generator=g0) * 3)
    return q, k, v, g, torch.sigmoid(torch.randn(T, generator=g0))


def _call(lengths, slots, resume, pool, H, g0):
    """One launch's state pass (records from chunk64_records placed at their items) on the emulation;
    returns (raw O [N, H, K], the (b, h) records) and updates `pool`."""
    cu = [0]
    for x in lengths:
        cu.append(cu[-1] + x)
    N, B = cu[-1], len(lengths)
    ws = torch.zeros((N // C + B) * H * REC, dtype=torch.uint8)
    recs = {}
    for b in range(B):
        for h in range(H):
            recs[b, h] = chunk64_records(*_inputs(lengths[b], g0), bounded=True)
            for c, r in enumerate(recs[b, h]):
                at = ((cu[b] // C + b + c) * H + h) * REC
                ws[at:at + REC] = record_image(r)
    o_ws = torch.full((N * H * K,), float("nan"))
    for b in range(B):
        for h in range(H):
            TcStatePass().run(ws, o_ws, pool, cu, slots, resume, b, h, H)
    return o_ws.view(N, H, K), recs, cu


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_emulated_state_pass_equals_chunk64_bitwise(pool_dtype):
    """Random varlen batch (a padded slot, an empty sequence, partial last chunks, resume and fresh),
    then a second launch continuing two sequences from the states the first left in the pool: outputs
    and final states bitwise equal to reference.chunk64_state_pass on the same records (a BF16 pool:
    the upcast state in, the RN-rounded final state out, as chunk64)."""
    g0 = torch.Generator().manual_seed(30)
    H, S = 2, 6
    pool = (torch.randn(S, H, K, K, generator=g0) * 0.05).to(pool_dtype)
    calls = [([65, 0, 1, 130, 64, 7], [4, 2, -1, 0, 5, 1], [1, 1, 1, 0, 1, 0]),
             ([3, 129], [4, 0], [1, 1])]   # continuation: slots 4 and 0 from the first call's states
    for lengths, slots, resume in calls:
        before = pool.clone()
        o, recs, cu = _call(lengths, slots, resume, pool, H, g0)
        for b, slot in enumerate(slots):
            if slot < 0 or lengths[b] == 0:
                assert torch.isnan(o[cu[b]:cu[b + 1]]).all()
                continue
            for h in range(H):
                s0 = before[slot, h].float() if resume[b] else torch.zeros(K, K)
                ro, rs = chunk64_state_pass(recs[b, h], s0)
                assert torch.equal(o[cu[b]:cu[b + 1], h], ro), (b, h)
                assert torch.equal(pool[slot, h], rs.to(pool_dtype)), (b, h)
        untouched = [i for i in range(S) if i not in [sl for sl, L in zip(slots, lengths) if sl >= 0 and L > 0]]
        assert torch.equal(pool[untouched], before[untouched])


def test_emulation_catches_a_layout_slip():
    """The emulation can fail: the W tile written with the chunk index unswizzled reads back wrong."""
    r = chunk64_records(*_inputs(64, torch.Generator().manual_seed(1)), bounded=True)[0]
    img = record_image(r)
    t, c = torch.arange(C)[:, None], torch.arange(K)[None, :]
    slip = TC_REC["w"][0] + (c >> 6) * C * 128 + (t >> 3) * 1024 + (t & 7) * 128 + (((c >> 3) & 7) << 4) + (c & 7) * 2
    img.view(torch.bfloat16)[slip >> 1] = (-r["w"]).bfloat16()
    p = TcStatePass()
    p.smem[:TILES] = img[:TILES]
    assert not torch.equal(p.gather("w", 0), -r["w"])
    p.smem[:TILES] = record_image(r)[:TILES]
    assert torch.equal(p.gather("w", 0), -r["w"])


# -- the per-chunk order: mbarrier phases under random interleavings ---------------------------------------
class Bar:
    def __init__(self, count):
        self.count, self.pending, self.tx, self.phase = count, count, 0, 0

    def arrive(self, tx=0):
        self.tx += tx
        self.pending -= 1
        self._flip()

    def complete_tx(self, n):
        self.tx -= n
        self._flip()

    def _flip(self):
        if self.pending == 0 and self.tx == 0:
            self.phase, self.pending = self.phase + 1, self.count

    def passed(self, parity):   # mbarrier.try_wait.parity: the phase of that parity has completed
        return (self.phase & 1) != parity


def programs(nc, mutation=None):
    """The header's two threads as event lists: waits with their parities (c & 1 for once-per-chunk
    barriers, (c >> 1) & 1 for a buffer's full barrier), arrivals, MMA batches and commits, copies; each
    MMA or warp access names the resource version it needs (reads) or leaves (writes, with its readers)."""
    def math():
        yield ("wait", ("full", 0), 0)
        yield ("read", ("eu", 0), 0)
        yield from (("write", "sb", ("S", 0), 1), ("write", "s", ("Ss", 0), 1), ("write", "dv", ("U", 0), 1))
        yield ("arrive", "s_ready")
        for c in range(nc):
            yield ("wait", "vo_full", c & 1)
            yield ("read", "dv", ("V", c))
            yield ("write", "vb", c, 1)
            yield ("arrive", "vn_ready")
            yield ("wait", "s_full", c & 1)
            yield ("read", "s", ("S", c + 1))
            if c + 1 < nc:
                nb = (c + 1) & 1
                yield ("wait", ("full", nb), ((c + 1) & 1) if mutation == "full_parity" else ((c + 1) >> 1) & 1)
                yield ("read", ("eu", nb), c + 1)
                yield from (("write", "sb", ("S", c + 1), 1), ("write", "s", ("Ss", c + 1), 1),
                            ("write", "dv", ("U", c + 1), 1))
                yield ("arrive", "s_ready")
            yield ("read", ("do", 0 if mutation == "one_o" else c & 1), ("O", c))

    def mma():
        for c in range(min(2, nc)):
            yield ("copy", c, c)
        for c in range(nc):
            buf, ob = c & 1, 0 if mutation == "one_o" else c & 1
            yield ("wait", ("full", buf), (c >> 1) & 1)
            yield ("wait", "s_ready", c & 1)
            yield ("mma", [("read", ("tiles", buf), c), ("read", "sb", ("S", c)), ("read", "dv", ("U", c)),
                           ("write", "dv", ("V", c), 1), ("write", ("do", ob), ("O1", c), 1)])
            yield ("commit", "vo_full")
            yield ("wait", "vn_ready", c & 1)
            yield ("mma", [("read", "vb", c), ("read", ("tiles", buf), c), ("read", ("do", ob), ("O1", c)),
                           ("write", ("do", ob), ("O", c), 1), ("read", "s", ("Ss", c)),
                           ("write", "s", ("S", c + 1), 1)])
            yield ("commit", "s_full")
            if c + 2 < nc:
                if mutation != "no_refill_wait":
                    yield ("wait", "s_full", c & 1)
                yield ("copy", buf, c + 2)
    return {"math": math(), "mma": mma()}


def simulate(nc, seed, mutation=None):
    rng = random.Random(seed)
    bars = {("full", 0): Bar(1), ("full", 1): Bar(1), "vo_full": Bar(1), "vn_ready": Bar(1), "s_full": Bar(1),
            "s_ready": Bar(1)}
    res: dict = {}
    queues = {"tc": [], "copy": []}

    def access(a):
        if a[0] == "read":
            ver, left = res.get(a[1], (None, 0))
            assert ver == a[2] and left > 0, f"read {a[1]}: holds {ver}, wanted {a[2]}"
            res[a[1]] = (ver, left - 1)
        else:
            ver, left = res.get(a[1], (None, 0))
            assert left == 0, f"write {a[1]} = {a[2]} over {ver}, still {left} reader(s) to come"
            res[a[1]] = (a[2], a[3])
    progs = programs(nc, mutation)
    cur = {k: next(g, None) for k, g in progs.items()}
    while True:
        ready = [k for k, a in cur.items() if a is not None and (a[0] != "wait" or bars[a[1]].passed(a[2]))]
        ready += [q for q in queues if queues[q]]
        if not ready:
            assert all(a is None for a in cur.values()), f"deadlock at {cur}"
            return
        k = rng.choice(ready)
        if k == "tc":
            op = queues["tc"].pop(0)
            if op[0] == "commit":
                bars[op[1]].arrive()
            else:
                for a in op[1]:
                    access(a)
        elif k == "copy":
            buf, c = queues["copy"].pop(0)
            access(("write", ("tiles", buf), c, 2))
            access(("write", ("eu", buf), c, 1))
            bars[("full", buf)].complete_tx(REC)
        else:
            a = cur[k]
            if a[0] == "arrive":
                bars[a[1]].arrive()
            elif a[0] in ("read", "write"):
                access(a)
            elif a[0] in ("mma", "commit"):
                queues["tc"].append((a[0], a[1]))
            elif a[0] == "copy":
                bars[("full", a[1])].arrive(tx=REC)   # arrive.expect_tx, then the copy engine lands it
                queues["copy"].append((a[1], a[2]))
            cur[k] = next(progs[k], None)


@pytest.mark.parametrize("nc", [1, 2, 3, 4, 7])
def test_chunk_order_under_random_interleavings(nc):
    for seed in range(150):
        simulate(nc, seed)


@pytest.mark.parametrize("mutation", ["full_parity", "one_o", "no_refill_wait"])
def test_chunk_order_checker_can_fail(mutation):
    """A wrong full-barrier parity, a single D_O buffer, a refill that does not wait for the MMAs: each
    is caught (a stale read, an overwrite before its reader, or a deadlock) in some interleaving."""
    caught = 0
    for seed in range(200):
        try:
            simulate(5, seed, mutation)
        except AssertionError:
            caught += 1
    assert caught > 0


def test_b300_projection():
    """`python -m bench --op kda_prefill_b300`: H12 T4096 by hand: 64 chunks; bytes = the op's floor plus
    records written and read and raw O written and read at 8 TB/s; the 24 M = 128 MMAs per chunk
    (8 + 8 of N = 64 over K = 128, 4 of N = 64 and 4 of N = 128 over K = 64); the chain at 1/148 of
    the peak; the largest wins; nothing measured."""
    from bench.cases.kda_prefill import PREP_FLOPS, STATE_FLOPS, b300_projection, kda_prefill_b300
    from bench.cases.mla_decode import B300_F16_FLOPS
    spec = KdaPrefillSpec(target=TARGETS["sm103-nvfp4"], heads=12)
    p = b300_projection(spec, [4096])
    assert STATE_FLOPS == 2 * 128 * 16 * (8 * 64 + 8 * 64 + 4 * 64 + 4 * 128)
    assert p["ws_bytes"] == 2 * 64 * 12 * REC + 2 * 4096 * 12 * K * 4
    assert p["mem_us"] == pytest.approx((p["bytes"] + p["ws_bytes"]) / 8e12 * 1e6)
    assert p["mma_us"] == pytest.approx(64 * 12 * (STATE_FLOPS + PREP_FLOPS) / B300_F16_FLOPS * 1e6)
    assert p["chain_us"] == pytest.approx(64 * STATE_FLOPS * 148 / B300_F16_FLOPS * 1e6)
    assert p["proj_us"] == max(p["mem_us"], p["mma_us"], p["chain_us"]) and p["bound"] == "memory"
    rows = kda_prefill_b300(quick=True)
    assert len(rows) == 1 and "not measured" in rows[0]["detail"] and rows[0]["case"].startswith("chunk64_tc ")


# -- the build ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("target,ssm,heads", [("sm103-nvfp4", SsmDtype.FP32, 12), ("sm107-nvfp4", SsmDtype.BF16, 96)])
def test_build_sass(target, ssm, heads):
    """prep (chunk64's code: its 80 HMMA), the tcgen05 state pass (24 UTCHMMA = 8 + 8 + 4 + 4 per chunk
    from one issuing thread, no HMMA, TMEM loads and stores, bulk copies, the commit barriers) and emit
    in one cubin, without spills, shared memory within the plan."""
    from k3gen.pipeline.build import build_one
    from k3gen.pipeline.inspect import cubin_arch, sass_text
    spec = KdaPrefillSpec(target=TARGETS[target], heads=heads, ssm=ssm)
    assert spec.algo is PrefillAlgo.CHUNK64_TC
    r = build_one(spec)
    assert cubin_arch(r.cubin) == spec.target.arch
    by = {x["function"]: x for x in r.resources}
    assert set(by) == {"k3gen_kda_prefill", "k3gen_kda_prefill_state_tc", "k3gen_kda_prefill_emit"}
    assert all(x["local"] == 0 and x["registers"] <= 255 for x in r.resources), r.resources
    text = sass_text(r.cubin)
    assert "STL" not in text and "LDL" not in text, "local-memory traffic"

    def n(f, op):
        return sum(c for k, c in by[f]["sass"].items() if k.split(".")[0] == op)
    st = "k3gen_kda_prefill_state_tc"
    assert n(st, "UTCHMMA") == 24 and n(st, "HMMA") == 0
    assert min(n(st, "LDTM"), n(st, "STTM"), n(st, "UBLKCP"), n(st, "UTCBAR")) > 0
    assert n("k3gen_kda_prefill", "HMMA") == 80 and n("k3gen_kda_prefill", "UTCHMMA") == 0
    assert spec.impl.plan(spec).states["tc"].smem_bytes <= SMEM_LIMIT
