"""moe_experts, variant "tcgen05" (sm103 / sm107), on the CPU. Nothing here runs on a Blackwell GPU (none
exists in this project): the selection by target features, the shared-memory / TMEM plan, the index
math of include/k3gen/moe/experts_tc.cuh replayed against the SM90 kernel's (experts.cuh) on the same
inputs (the item lookup vs ItemList::pick, the weight and scale bytes each tile row and K value comes
from, what the TMA boxes, bulk copies and decoders write vs what every UMMA descriptor reads, the
accumulator rows each epilogue thread stores), and the NVRTC build for sm_103a / sm_107a: UTCHMMA
(kind::f16), the hardware E2M1 -> BF16 conversion, TMA and bulk copies, TMEM loads, no mma.sync, no
spills, shared memory within the limit. test_moe_experts_tcgen05_emulation.py holds the arithmetic."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from k3gen.arch.sm100 import DESC_VERSION, idesc_f16, tmem_lane_m64, umma_desc
from k3gen.arch.sm90 import SW128_KMAJOR, blocked_sw128_offset, wgmma_read_addr
from k3gen.errors import SpecError
from k3gen.ir.dtypes import ScaleRecipe
from k3gen.ops.moe_experts.spec import ActFormat, GluAct, MoeExpertsSpec, WeightFormat
from k3gen.ops.moe_experts.variants import (SMEM_LIMIT, TC_MAX_RAW, TC_ROWS, TC_THREADS, TcPlan, plans,
                                            tc_layout)
from k3gen.ops.moe_route.reference import grouped_order
from k3gen.targets import TARGETS, build_specs, has_expert_kernel, model_specs
from test_moe_experts_spec import K3_EP8, K3_TP8, items_of

TC = ("sm103-nvfp4", "sm107-nvfp4")
HEADER = Path(__file__).resolve().parents[3] / "k3gen/include/k3gen/moe/experts_tc.cuh"


def tc(target="sm103-nvfp4", **kw) -> MoeExpertsSpec:
    kw.setdefault("weights", WeightFormat.MXFP4)
    return MoeExpertsSpec(target=TARGETS[target], **kw)


# -- selection -----------------------------------------------------------------------------------------
def test_auto_picks_tcgen05_on_the_sm100_family_by_features():
    for name in TC:
        t = TARGETS[name]
        assert has_expert_kernel(t)
        moe = [s for s in build_specs(t) if s.op == "moe_experts"]
        assert {s.weights for s in moe} == set(WeightFormat) and {s.inter for s in moe} == {384, 3072}
        assert all(s.impl.name == "tcgen05" for s in moe)
        assert {s.impl.name for s in model_specs(t, "small") if s.op == "moe_experts"} == {"tcgen05"}
        for w in WeightFormat:   # both activation formats the target allows (its recipe: UE8M0)
            assert tc(name, weights=w, act=ActFormat.FP8, **K3_EP8).impl.name == "tcgen05"
    assert all(s.impl.name == "mma_swapab" for s in build_specs(TARGETS["sm90"]) if s.op == "moe_experts")
    assert not has_expert_kernel(TARGETS["sm100-mxfp4"])   # frozen menu
    # Features decide, never the name: a renamed preset gets the same kernel.
    renamed = dataclasses.replace(TARGETS["sm103-nvfp4"], name="renamed")
    assert MoeExpertsSpec(target=renamed, weights=WeightFormat.NVFP4, **K3_TP8).impl.name == "tcgen05"
    no_tma = dataclasses.replace(renamed, tma=False)
    with pytest.raises(SpecError, match="needs tcgen05, TMA"):
        MoeExpertsSpec(target=no_tma, weights=WeightFormat.NVFP4, **K3_TP8)


@pytest.mark.parametrize("kw,why", [
    (dict(K3_TP8, act=ActFormat.FP8, recipe=ScaleRecipe.FP32), "UE8M0 scales"),
    (dict(hidden=3584 + 32, inter=384, experts=8, top_k=2), "multiple of 64"),
])
def test_refusals_name_their_reason(kw, why):
    with pytest.raises(SpecError) as e:
        tc(**kw)
    assert why in str(e.value) and "mma_swapab" in str(e.value) and "tcgen05" in str(e.value)


# -- the plan --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n_tiles", [1, 2, 4])
@pytest.mark.parametrize("shape", [K3_TP8, K3_EP8])
@pytest.mark.parametrize("weights", list(WeightFormat))
def test_plan_fits_and_is_the_deepest_ring(weights, shape, n_tiles):
    s = tc(weights=weights, n_tiles=n_tiles, **shape)
    for p, rows, k in zip(plans(s), (2 * s.inter, s.hidden), (s.hidden, s.inter)):
        assert (p.rows, p.k, p.nb) == (rows, k, 8 * n_tiles) and p.threads == TC_THREADS == 448
        assert p.kstage == min(256, k) and p.stages * p.kstage >= k > (p.stages - 1) * p.kstage
        assert p.mtiles * TC_ROWS == rows
        assert p.smem_bytes + TcPlan.static_smem() <= SMEM_LIMIT and p.raw_stages >= 2
        assert p.smem["op"] % 1024 == 0 and p.op_bytes % 1024 == 0 and p.smem["raw"] % 1024 == 0
        assert p.smem["scl"] % 16 == 0 and p.smem["bar"] % 8 == 0
        assert p.tmem_cols in (32, 64, 128) and p.tmem_cols >= 2 * p.nb      # two accumulators of N columns
        deeper = tc_layout({**dataclasses.asdict(p), "raw_stages": p.raw_stages + 1})
        assert p.raw_stages == TC_MAX_RAW or deeper["total"] + TcPlan.static_smem() > SMEM_LIMIT
        # the producer runs ahead by min(raw stages, scale buffers x stages per item) >= 2 items or the ring
        assert min(p.raw_stages, p.scale_bufs * p.stages) >= min(p.raw_stages, 2 * p.stages)


def test_k3_plans():
    tp8, ep8 = plans(tc(**K3_TP8)), plans(tc(**K3_EP8))
    assert [(p.mtiles, p.stages) for p in tp8] == [(12, 14), (56, 2)]
    assert [(p.mtiles, p.stages) for p in ep8] == [(96, 14), (56, 12)]
    # T = 1: 16 items; one CTA per SM (148 on a B300): 12 of 16 item rows resident for the gate_up
    assert tp8[0].item_rows(16, 148) == 12 and tp8[1].item_rows(16, 148) == 2 and tp8[0].item_rows(16, None) == 16
    assert tp8[0].item_rows(900, 1) == 1


def test_instruction_descriptor_of_the_header():
    """kind::f16, BF16 A and B, both K-major, F32 D, M 64, N = 8 n_tiles (arch.sm100 field layout)."""
    text = HEADER.read_text()
    assert "sm100::idesc<true, false, kTileRows, kNB>()" in text and "kTileRows = 64" in text
    for nb in (8, 16, 32):
        d = idesc_f16(bf16=True, m=64, n=nb)
        assert (d >> 7) & 7 == 1 and (d >> 10) & 7 == 1 and (d >> 15) & 3 == 0 and (d >> 17) & 63 == nb // 8
        assert (d >> 24) & 31 == 4 and (d >> 4) & 3 == 1
    assert "sm100::desc<16, 1024>" in text and (SW128_KMAJOR.lbo, SW128_KMAJOR.sbo) == (16, 1024)


# -- the item list: find_item (no CTA barrier) vs the SM90 kernel's ItemList::pick ----------------------
def scan(offsets, base, experts, nslots, nb, threads=TC_THREADS):
    """ItemList::scan: per scan thread its first item and count (kPer experts each)."""
    per = -(-experts // threads)
    counts = []
    for t in range(threads):
        c = 0
        for i in range(per):
            e = t * per + i
            if e < experts:
                lo = min(max(offsets[base + e], 0), nslots)
                c += -(-(min(max(offsets[base + e + 1], lo), nslots) - lo) // nb)
        counts.append(c)
    first = np.concatenate([[0], np.cumsum(counts)[:-1]]).tolist()
    return first, counts, per


def find_item(first, per, offsets, base, experts, nslots, nb, it, threads=TC_THREADS):
    """experts_tc.cuh find_item: binary search of the owner, then its experts walked."""
    lo, hi = 0, threads - 1
    while lo < hi:
        mid = (lo + hi + 1) >> 1
        if first[mid] <= it:
            lo = mid
        else:
            hi = mid - 1
    acc, r = first[lo], None
    for i in range(per):
        e = lo * per + i
        if e < experts:
            a = min(max(offsets[base + e], 0), nslots)
            cnt = min(max(offsets[base + e + 1], a), nslots) - a
        else:
            a, cnt = 0, 0
        ni = -(-cnt // nb)
        if acc <= it < acc + ni:
            b = (it - acc) * nb
            r = (e, a + b, min(nb, cnt - b))
        acc += ni
    return r


@pytest.mark.parametrize("T,skew,base", [(1, False, 0), (8, True, 336), (64, False, 0), (64, True, 784)])
def test_find_item_is_the_sm90_item_list(T, skew, base):
    s = tc(**K3_EP8)
    g = torch.Generator().manual_seed(T + base)
    scores = torch.rand(T, s.route_experts, generator=g)
    if skew:
        scores[:, base + 5] = 2.0
    _, offsets, _, _ = grouped_order(scores.topk(s.top_k, dim=1).indices, s.route_experts)
    offs, nslots, nb = offsets.tolist(), T * s.top_k, s.tokens_per_item
    want = items_of(offs, base, s.experts, nslots, nb)
    first, counts, per = scan(offs, base, s.experts, nslots, nb)
    assert sum(counts) == len(want) <= s.max_items(T)
    assert [find_item(first, per, offs, base, s.experts, nslots, nb, it) for it in range(len(want))] == want


def test_find_item_on_garbage_offsets_stays_in_range():
    offs = [5, -7, 10 ** 9, 3, 2 ** 31 - 1]
    first, counts, per = scan(offs, 0, 4, 12, 8)
    got = [find_item(first, per, offs, 0, 4, 12, 8, it) for it in range(sum(counts))]
    assert got == items_of(offs, 0, 4, 12, 8) and all(0 <= p0 and p0 + n <= 12 for _, p0, n in got)


# -- weight bytes, tiles and descriptors vs the SM90 kernel --------------------------------------------
def header_sw128():
    """experts_tc.cuh sw128's expression, evaluated as written (a C++ expression that is also Python)."""
    body = re.search(r"constexpr int sw128\(int r, int c\) \{ return (.+?); \}", HEADER.read_text()).group(1)
    return eval(f"lambda r, c: {body}")   # noqa: S307  (the repository's own header)


def tile_rows(p: TcPlan, inter: int, e: int, mt: int) -> tuple[int, int]:
    """experts_tc.cuh tile_rows: global weight rows of the tile's two 32-row halves."""
    r0 = e * p.rows + (32 * mt if p.gate_up else 64 * mt)
    return r0, (r0 + inter if p.gate_up else r0 + 32)


def tc_weight_row(p: TcPlan, inter: int, mt: int, m: int) -> int:
    """Weight row (of the expert) at MMA row m of tile mt: box 0 -> rows 0-31, box 1 -> 32-63."""
    r0, r1 = tile_rows(p, inter, 0, mt)
    return r0 + m if m < 32 else r1 + m - 32


def sm90_weight_row(spec, gate_up: bool, mt16: int, g: int, hi: bool) -> int:
    """experts.cuh expert_gemm: A rows g / g + 8 of SM90 m-tile mt16 (gate_up: gate / up of column mt16*8+g)."""
    if gate_up:
        return spec.inter + mt16 * 8 + g if hi else mt16 * 8 + g
    return mt16 * 16 + 8 + g if hi else mt16 * 16 + g


@pytest.mark.parametrize("shape", [K3_TP8, K3_EP8])
def test_each_weight_row_is_one_mma_row_and_its_output_index_matches_sm90(shape):
    """Every weight row of an expert is read by exactly one (tile, MMA row) of the tcgen05 kernel, and
    the output it feeds (gate_up: h column i of gate row i / up row I + i; down: y column) is the one
    the SM90 kernel writes for that row: gate_up pairs gate i with up I + i in the same epilogue step."""
    s = tc(**shape)
    for p in plans(s):
        tc_rows = {tc_weight_row(p, s.inter, mt, m): (mt, m) for mt in range(p.mtiles) for m in range(64)}
        assert sorted(tc_rows) == list(range(p.rows))
        if p.gate_up:
            sm90 = {(sm90_weight_row(s, True, t, g, hi)) for t in range(s.gate_up.mtiles) for g in range(8)
                    for hi in (0, 1)}
            assert sm90 == set(tc_rows)
            for i in range(s.inter):          # gate i at row m < 32, up I + i at m + 32, same tile
                mt, m = tc_rows[i]
                assert tc_rows[s.inter + i] == (mt, m + 32) and 32 * mt + m == i   # h column written
        else:
            for r, (mt, m) in tc_rows.items():
                assert 64 * mt + m == r       # y column written (SM90: mt16 * 16 + g (+ 8))


@pytest.mark.parametrize("weights", list(WeightFormat))
@pytest.mark.parametrize("gate_up,stage", [(True, 0), (True, 13), (False, 1)])
def test_tma_boxes_scale_copies_and_decoders_fill_what_the_descriptors_read(weights, gate_up, stage):
    """One stage of the K3 TP8 plan byte for byte: the TMA boxes ([32 rows][kKS/2 B] at (s kKS/2, row),
    zero past K/2) and the scale bulk copies (32 K/g-byte rows per half) bring, for MMA row m and K value
    k, code byte (e rows + R) K/2 + k/2 and scale byte (e rows + R) K/g + k/g with R the weight row -- the
    SM90 kernel's addresses (w0 + kseg/2, s0 + kseg/g); the decoder thread writing (m, k) puts it where
    the UMMA descriptor of k16 step k // 16 reads element (m, k % 16)."""
    s = tc(weights=weights, **K3_TP8)
    p = plans(s)[0 if gate_up else 1]
    e, g = 5, s.group
    sw = header_sw128()
    kb = p.kstage // 2
    written = {}   # A-tile byte offset -> (m, k)
    for dt in range(256):                                       # decode_stage's thread mapping
        for j in range(-(-64 * p.kstage // 32 // 256)):
            seg = dt + 256 * j
            if seg >= 64 * p.kstage // 32:
                break
            row, c = divmod(seg, p.kstage // 32)
            kseg = stage * p.kstage + 32 * c
            if kseg >= p.k:
                continue
            R = tc_weight_row(p, s.inter, 1, row) + e * p.rows
            raw_byte = row * kb + 16 * c                        # raw stage: box 0 rows 0-31, box 1 32-63
            box, brow = divmod(row, 32)
            g_row = tile_rows(p, s.inter, e, 1)[box] + brow     # TMA box row -> global row
            assert g_row * (p.k // 2) + stage * kb + (raw_byte - row * kb) == R * (p.k // 2) + kseg // 2
            scl = row * p.scale_row + kseg // g                 # the decoder's srow[kseg / g] ...
            half, at = divmod(scl, 32 * p.scale_row)            # ... filled by bulk copy `half`
            assert tile_rows(p, s.inter, e, 1)[half] * p.scale_row + at == R * p.scale_row + kseg // g
            for w in range(4):
                off = (c >> 1) * 64 * 128 + sw(row, (c & 1) * 4 + w)
                assert off == blocked_sw128_offset(64, row, (c >> 1) * 8 + (c & 1) * 4 + w)
                for v in range(8):
                    assert off + 2 * v not in written
                    written[off + 2 * v] = (row, (kseg % p.kstage) + 8 * w + v)
    ksteps = min(p.kstage, p.k - stage * p.kstage) // 16
    for ks in range(ksteps):
        d = umma_desc((ks >> 2) * 64 * 128 + (ks & 3) * 32, SW128_KMAJOR)
        assert d & DESC_VERSION
        for m in range(0, 64, 3):
            for k in range(16):
                assert written[wgmma_read_addr(d & ~DESC_VERSION, m, k, 2)] == (m, 16 * ks + k)
    assert len(written) == 64 * 16 * ksteps   # exactly the elements the MMAs read


@pytest.mark.parametrize("nb", [8, 32])
def test_b_tile_chunks_land_where_the_b_descriptor_reads(nb):
    """BChunks: decoder thread dt, chunk q -> (column n, 8 K values); stored at atom ch / 8, sw128(n, ch % 8)
    of the B tile, which the B descriptor (atom stride nb * 128) reads as element (n, k)."""
    sw = header_sw128()
    kstage, written = 256, {}
    for dt in range(256):
        for q in range(-(-nb * 32 // 256)):
            i = dt + 256 * q
            n, ch = divmod(i, kstage // 8)
            if n >= nb:
                continue
            off = (ch >> 3) * nb * 128 + sw(n, ch & 7)
            for v in range(8):
                written[off + 2 * v] = (n, 8 * ch + v)
    for ks in range(16):
        d = umma_desc((ks >> 2) * nb * 128 + (ks & 3) * 32, SW128_KMAJOR) & ~DESC_VERSION
        for n in range(nb):
            for k in range(16):
                assert written[wgmma_read_addr(d, n, k, 2)] == (n, 16 * ks + k)


def test_epilogue_threads_own_each_accumulator_row_once():
    """Epilogue warp w (w % 4 = q), lane t < 16 reads TMEM lane 32 q + t: MMA row 16 q + t (layout F);
    gate_up: quarters 2-3 (up rows 32-63) hand row r to quarter (r - 32) // 16's lane of the same t."""
    owner = {}
    for w in range(8, 12):
        q = w & 3
        for t in range(16):
            r = 16 * q + t
            assert tmem_lane_m64(r) == 32 * q + t
            owner[r] = (w, t)
    assert sorted(owner) == list(range(64))
    for r in range(32, 64):
        assert owner[r - 32] == (8 + (r - 32) // 16, owner[r][1])   # the xch partner: same lane


# -- the build -------------------------------------------------------------------------------------------
CASES = [("sm103-nvfp4", WeightFormat.MXFP4, ActFormat.BF16, K3_TP8),
         ("sm103-nvfp4", WeightFormat.NVFP4, ActFormat.FP8, K3_EP8),
         ("sm107-nvfp4", WeightFormat.NVFP4, ActFormat.BF16, K3_TP8),
         ("sm107-nvfp4", WeightFormat.MXFP4, ActFormat.FP8, dict(hidden=512, inter=96, experts=32, top_k=4,
                                                                  glu=GluAct.SILU, n_tiles=1))]
ENTRIES = {"k3gen_moe_experts", "k3gen_moe_experts_down", "k3gen_moe_experts_combine", "k3gen_moe_experts_dequant"}


@pytest.mark.parametrize("target,weights,act,shape", CASES)
def test_sass(target, weights, act, shape):
    from k3gen.pipeline.build import build_one
    from k3gen.pipeline.inspect import sass_text
    kw = dict(shape, act=act)
    if act is ActFormat.FP8:
        kw["recipe"] = ScaleRecipe.UE8M0
    spec = tc(target, weights=weights, **kw)
    r = build_one(spec)
    res = {x["function"]: x for x in r.resources}
    assert set(res) == ENTRIES
    sass = sass_text(r.cubin)
    funcs = dict(re.findall(r"Function : (\w+)\n(.*?)(?=\n\s*Function : |\Z)", sass, re.S))
    for name, plan in (("k3gen_moe_experts", plans(spec)[0]), ("k3gen_moe_experts_down", plans(spec)[1])):
        x, body = res[name], funcs[name]
        assert x["local"] == 0 and x["stack"] == 0 and not re.search(r"\b(LDL|STL)\b", body), "spills"
        assert x["registers"] <= 65536 // TC_THREADS
        # the static ItemList (padded to the dynamic window's 1024 alignment, + 1 KB the system reserves)
        assert x["shared"] - 1024 <= -(-TcPlan.static_smem() // 1024) * 1024
        assert x["shared"] - 1024 + plan.smem_bytes <= SMEM_LIMIT
        ops = re.findall(r"\b(UTCHMMA|UTCQMMA|UTCOMMA|HMMA|UTMALDG\S*|UBLKCP\S*|LDTM\S*|UTCBAR|F2FP\.BF16\.E2M1\S*|"
                         r"F2FP\.BF16\.E4M3\S*|PRMT)\b", body)
        assert "UTCHMMA" in ops and "HMMA" not in ops and "UTCQMMA" not in ops, "kind::f16 tcgen05, no mma.sync"
        assert ops.count("UTMALDG.2D") >= 2 and any(o.startswith("UBLKCP") for o in ops), "TMA codes, bulk scales"
        assert any(o.startswith("LDTM") for o in ops) and "UTCBAR" in ops
        assert any(o.startswith("F2FP.BF16.E2M1") for o in ops), "hardware E2M1 -> BF16"
        fp8_in = name == "k3gen_moe_experts" and act is ActFormat.FP8
        assert fp8_in == any(o.startswith("F2FP.BF16.E4M3") for o in ops), "E4M3 activations -> BF16"
    comb = res["k3gen_moe_experts_combine"]["sass"]   # the SM90 combine: ordered, no float atomics
    assert not any(op.startswith("ATOM") for op in comb) and comb.get("REDG", 0) <= 1
    assert "F2FP.BF16.E2M1" in funcs["k3gen_moe_experts_dequant"]   # the probe decodes as the GEMMs do


# -- the launcher (recorded launches, no driver) ----------------------------------------------------------
class Recorder:
    def __init__(self, name, calls, nargs):
        self.name, self.calls, self.nargs = name, calls, nargs

    def launch_ex(self, grid, block, cluster, args, types_, device, stream, smem=0, pdl=False):
        import ctypes
        if isinstance(args, int):   # a packed void** array: read each parameter's bytes now
            argv = (ctypes.c_void_p * self.nargs).from_address(args)
            args = (ctypes.string_at(argv[0], 88), ctypes.string_at(argv[1], 128))
        self.calls.append((self.name, grid, block, smem, args))

    def __getattr__(self, name):
        return lambda *a, **k: 0


@pytest.mark.parametrize("weights", list(WeightFormat))
def test_launcher_packs_args_and_map_with_the_plans_geometry(weights, monkeypatch):
    """Same call as on SM90; the GEMM launches carry ExpertArgs (the error word inside) and the codes'
    TMA map, 448 threads, the plan's dynamic shared memory and grid (mtiles, item rows); scale tensors
    must be 16-byte aligned (bulk copies)."""
    import types

    import k3gen.ops.moe_experts.launcher as ml
    from k3gen.runtime import faults
    s = tc(weights=weights, hidden=512, inter=128, experts=8, top_k=2)
    L = ml.MoeExperts(s)
    T, E, W, I, g = 3, 8, 512, 128, s.group
    u8 = dict(dtype=torch.uint8)
    args = dict(x=torch.zeros(T, W, dtype=torch.bfloat16), w13=torch.zeros(E, 2 * I, W // 2, **u8),
                s13=torch.zeros(E, 2 * I, W // g, **u8), w2=torch.zeros(E, W, I // 2, **u8),
                s2=torch.zeros(E, W, I // g, **u8),
                route={"ids": torch.zeros(T, 2, dtype=torch.int32), "weights": torch.zeros(T, 2),
                       "offsets": torch.zeros(E + 1, dtype=torch.int32), "perm": torch.zeros(2 * T, dtype=torch.int32)},
                out=torch.zeros(T, W, dtype=torch.bfloat16))
    kw = dict(gs13=torch.ones(E, 2), gs2=torch.ones(E, 1)) if weights is WeightFormat.NVFP4 else {}
    monkeypatch.setattr(ml, "check_one_device", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: types.SimpleNamespace(cuda_stream=0))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    buf = torch.zeros(faults.WORDS, dtype=torch.int32)
    monkeypatch.setattr(faults, "_buffers", {torch.device("cpu"): buf, torch.device("cuda", 0): buf})
    maps = []
    monkeypatch.setattr(ml.MoeExperts, "_wmap", lambda self, w, p: maps.append((w.shape, p.kstage)) or bytes([len(maps)]) * 128)
    L.__dict__["sm_count"], L.__dict__["device_index"] = 148, 0
    calls = []
    for attr, name in (("_kernel", "k3gen_moe_experts"), ("_down", "k3gen_moe_experts_down"),
                       ("_combine", "k3gen_moe_experts_combine")):
        setattr(L, attr, Recorder(name, calls, 2))
    L(*args.values(), **kw)
    p13, p2 = plans(s)
    word = faults.word("moe_experts", torch.device("cpu"))
    assert [c[0] for c in calls] == ["k3gen_moe_experts", "k3gen_moe_experts_down", "k3gen_moe_experts_combine"]
    for (name, grid, block, smem, packed), p, mapbyte in zip(calls, (p13, p2), (1, 2)):
        assert grid == (p.mtiles, p.item_rows(s.max_items(T), 148), 1) and block == (448, 1, 1)
        assert smem == p.smem_bytes and packed[1] == bytes([mapbyte]) * 128
        st = ml.ExpertArgs.from_buffer_copy(packed[0])
        assert st.err == word and st.num_tokens == T and st.nslots == 2 * T
    assert maps == [(args["w13"].shape, p13.kstage), (args["w2"].shape, p2.kstage)]
    assert calls[2][4][-1] == word and calls[2][1] == s.combine_grid(T)
    bad = torch.zeros(E * 2 * I * (W // g) + 8, **u8)[8:].view(E, 2 * I, W // g)   # 8-byte aligned only
    with pytest.raises(SpecError, match="16-byte aligned"):
        L(*{**args, "s13": bad}.values(), **kw)


def test_b300_projection_counts():
    """`k3gen bench --op moe_experts_b300`: bytes counted by hand at 8 TB/s, the padded MMA work at the
    assumed BF16 rate, the decode's issue slots; the largest wins; nothing measured."""
    from bench.cases.mla_decode import B300_F16_FLOPS
    from bench.cases.moe_experts import b300_moe_projection, moe_experts_b300, touched_experts
    s = tc(**K3_TP8)
    assert touched_experts(s, 1) == pytest.approx(16) and round(touched_experts(s, 8)) == 120
    assert round(touched_experts(s, 64)) == 613 and touched_experts(tc(**K3_EP8), 1) == pytest.approx(2)
    p = b300_moe_projection(s, 1)
    per_expert = 3 * 3584 * 384 // 2 + 3 * 3584 * 384 // 32                   # codes + UE8M0 scales
    nbytes = 16 * per_expert + 3584 * 2 + 16 * (2 * 384 * 2 + 2 * 3584 * 4) + 3584 * 2
    assert p["weight_bytes"] == pytest.approx(16 * per_expert) and p["bytes"] == pytest.approx(nbytes)
    assert p["mem_us"] == pytest.approx(nbytes / 8e12 * 1e6)
    flops = 16 * 2 * 32 * (2 * 384 * 3584 + 3584 * 384)                          # 16 items, N = 32
    assert p["mma_us"] == pytest.approx(flops / B300_F16_FLOPS * 1e6)
    assert p["proj_us"] == max(p["mem_us"], p["mma_us"], p["decode_us"]) and p["bound"] == "memory"
    nv = b300_moe_projection(tc(weights=WeightFormat.NVFP4, **K3_TP8), 1)
    assert nv["weight_bytes"] == pytest.approx(16 * (3 * 3584 * 384 // 2 + 3 * 3584 * 384 // 16 + 12))
    rows = moe_experts_b300(quick=True)
    assert len(rows) == 2 * 3 and all("not measured" in r["detail"] for r in rows)


def test_code_maps_are_the_boxes_the_producer_loads(monkeypatch):
    """_wmap: w [E, rows, K/2] as uint8 rows [E rows][K/2] (innermost first), box [kstage/2 bytes][32
    rows], no swizzle (the decoders read raw rows), zero fill past K/2; one encoding per tensor."""
    import k3gen.runtime.tma as tma
    from k3gen.ops.moe_experts.launcher import MoeExperts
    got = []
    monkeypatch.setattr(tma, "encode_tma", lambda *a, **k: got.append((a, k)) or b"\0" * 128)
    s = tc(**K3_TP8)
    L = MoeExperts(s)
    p13, p2 = plans(s)
    w13 = torch.zeros(4, 2 * s.inter, s.hidden // 2, dtype=torch.uint8)
    w2 = torch.zeros(4, s.hidden, s.inter // 2, dtype=torch.uint8)
    for _ in range(2):
        L._wmap(w13, p13), L._wmap(w2, p2)
    assert [a[1:] for a, _ in got] == [((1792, 4 * 768), (1792,), (128, 32)), ((192, 4 * 3584), (192,), (128, 32))]
    assert all(k == {"swizzle": 0} for _, k in got)   # encode_tma's defaults: uint8, zero OOB fill
