"""fp8_block_gemm, wgmma variant (sm_90a), on the CPU: the shared-memory addressing the GPU cannot
show us before it runs (TMA's 128B swizzle against what a wgmma descriptor reads, for every tile
and K step the kernel uses), the accumulator fragment mapping of the epilogue, the launch plan,
and the compile with resource and SASS checks."""
from __future__ import annotations

import re

import pytest

from k3gen.pipeline.build import build_one, lower
from k3gen.ir.dtypes import ScaleRecipe
from k3gen.ops.fp8_block_gemm.spec import (ALIGN90, BLOCK, BN90, MAX_SPLIT, NT_CHOICES, SPLIT90_MAX, THREADS90,
                                         Fp8BlockGemmSpec, choose_split90, nt_for, stream_owner, stream_ranges,
                                         stream_segments, work_items)
from k3gen.arch.sm90 import SW128_KMAJOR, decode_desc, encode_desc, wgmma_read_addr
from k3gen.targets import FP8_GEMM_TP1, FP8_GEMM_TP8, TARGETS

SM90 = TARGETS["sm90"]
SMS = 132
SMEM_CAP = 227 * 1024          # sm_90 opt-in dynamic shared memory per CTA


def tma_box_byte(row: int, kbyte: int) -> int:
    """Where TMA's SWIZZLE_128B puts byte `kbyte` of box row `row` (box rows of 128 bytes, box
    base 1024-byte aligned), written the way the CUDA guide states it: 16-byte chunk i of row r
    goes to chunk i XOR (r mod 8) of that row. Independent of k3gen.arch.sm90.swizzle128 on purpose."""
    chunk, inner = divmod(kbyte, 16)
    return row * 128 + ((chunk ^ (row % 8)) * 16) + inner


def stage_layout(spec: Fp8BlockGemmSpec, nt: int, raw_base: int):
    """The kernel's stage tiles: (base of W rows of warpgroup wg, base of the token tile) per stage,
    from the aligned dynamic shared-memory base; mirrors gemm/fp8_wgmma.cuh."""
    base = (raw_base + ALIGN90 - 1) & ~(ALIGN90 - 1)
    stage = BN90 * BLOCK + nt * BLOCK
    out = []
    for s in range(spec.stages_nt(nt)):
        st = base + s * stage
        out.append(([st + wg * 64 * BLOCK for wg in range(2)], st + BN90 * BLOCK))
    return base, out


@pytest.mark.parametrize("nt", NT_CHOICES)
def test_wgmma_reads_exactly_what_tma_wrote(nt):
    """For every stage, both operands, all four k32 steps, every row and byte of K: the descriptor
    the kernel builds (desc(tile) + 2 * ks) makes wgmma read the byte TMA stored for that element."""
    spec = Fp8BlockGemmSpec(target=SM90, n=256, k=512)
    for raw in (0, 16, 400):   # wherever the dynamic window starts, the kernel aligns it up
        base, stages = stage_layout(spec, nt, raw)
        assert base % 1024 == 0
        for a_bases, b_base in stages:
            for tile, rows in [(a, 64) for a in a_bases] + [(b_base, nt)]:
                assert tile % 1024 == 0
                d0 = encode_desc(tile)
                for ks in range(4):
                    d = d0 + 2 * ks                       # what the kernel passes to wgmma
                    assert d == encode_desc(tile + 32 * ks), "no carry out of the start-address field"
                    for r in range(rows):
                        for k in range(32):
                            got = wgmma_read_addr(d, r, k)
                            assert got == tile + tma_box_byte(r, 32 * ks + k), (nt, tile, ks, r, k)


def test_swizzled_tile_is_a_permutation_within_each_row():
    for r in range(16):
        got = sorted(tma_box_byte(r, k) for k in range(128))
        assert got == list(range(r * 128, r * 128 + 128))


@pytest.mark.parametrize("n,k", [(200, 272), (256, 128)])
def test_pretiled_weights_are_what_tma_would_write(n, k):
    """Fp8BlockGemm.tile_weights (w_tiled=True, one 16 KB bulk copy per stage): byte (n, k) of W
    sits in tile (n // 128, k // 128) at the offset TMA's SWIZZLE_128B gives it in a box of
    row-major W (tma_box_byte), so the stage reads the same; everything else is zero padding."""
    import torch

    from k3gen.ops.fp8_block_gemm.launcher import Fp8BlockGemm
    op = Fp8BlockGemm(Fp8BlockGemmSpec(target=SM90, n=n, k=k))
    g = torch.Generator().manual_seed(n + k)
    w = torch.randint(1, 256, (n, k), dtype=torch.uint8, generator=g)   # no zero codes: padding is visible
    flat = op.tile_weights(w).flatten()
    kb = -(-k // BLOCK)
    assert flat.numel() == -(-n // BLOCK) * kb * BLOCK * BLOCK
    rows = torch.arange(n)[:, None]
    cols = torch.arange(k)[None, :]
    chunk, inner = (cols % BLOCK) // 16, cols % 16
    off = ((rows // BLOCK) * kb + cols // BLOCK) * BLOCK * BLOCK + (rows % BLOCK) * BLOCK \
        + ((chunk ^ (rows % 8)) * 16) + inner
    assert off[0, 17] == tma_box_byte(0, 17) and off[9, 40] == tma_box_byte(9, 40)   # the helper's rule
    assert torch.equal(flat[off.flatten()], w.flatten())
    pad = torch.ones_like(flat, dtype=torch.bool)
    pad[off.flatten()] = False
    assert int(pad.sum()) == flat.numel() - n * k and not flat[pad].any()


def test_descriptor_bits_follow_the_ptx_format():
    d = encode_desc(0x1C420)
    assert d & 0x3FFF == 0x1C420 >> 4                 # start address >> 4, bits 0-13
    assert (d >> 16) & 0x3FFF == 1                    # LBO 16 B (ignored by swizzled K-major)
    assert (d >> 32) & 0x3FFF == 1024 >> 4            # SBO: 8 rows of 128 bytes
    assert (d >> 49) & 7 == 0                         # base offset: atoms are 1024-aligned
    assert d >> 62 == 1                               # 128B swizzle
    assert (d >> 14) & 3 == 0 and (d >> 30) & 3 == 0 and (d >> 46) & 7 == 0 and (d >> 52) & 0x3FF == 0
    assert decode_desc(d) == (0x1C420, 16, 1024, 0, 1)
    spec = Fp8BlockGemmSpec(target=SM90, n=256, k=512)
    assert spec.desc_fields == SW128_KMAJOR and spec.desc_probe_value == d
    # The largest shared address the kernel can form still fits the 14-bit field.
    assert (max(spec.smem_bytes_nt(nt) for nt in NT_CHOICES) + 1024) >> 4 < 1 << 14


def test_the_kernel_checks_its_descriptor_encoder_against_the_probe():
    src = lower(Fp8BlockGemmSpec(target=SM90, n=200, k=272)).source
    m = re.search(r"wgmma_desc<[^>]*>\((\d+)u\) ==\s*(\d+)ull", src)
    assert m, "the template must static_assert the encoder"
    assert int(m.group(2)) == encode_desc(int(m.group(1)))


@pytest.mark.parametrize("nt", NT_CHOICES)
def test_epilogue_fragment_mapping_is_the_ptx_accumulator_layout(nt):
    """The kernel writes d[4j + e] (e < 2) of thread (wg, warp, lane) to row wg*64 + (warp%4)*16 +
    lane/4 (+8 for d[4j + 2 + e]), token column 8j + 2(lane%4) + e, and scales it with xs[2j + e]
    loaded for that token: every (row, token) of the 128 x nt tile exactly once, as PTX lays out
    the m64nNk32 F32 accumulator (row 16*warp + lane/4 + 8*((i%4)//2), col 8*(i//4) + 2*(lane%4) + i%2)."""
    seen = {}
    for wg in range(2):
        for w in range(4):
            for lane in range(32):
                g, t4 = lane >> 2, lane & 3
                for i in range(nt // 2):
                    j, e, hi = i // 4, i % 2, (i % 4) // 2
                    row = wg * 64 + w * 16 + g + 8 * hi
                    col = 8 * j + 2 * t4 + e
                    ptx_row = 16 * w + lane // 4 + 8 * ((i % 4) // 2)
                    ptx_col = 8 * (i // 4) + 2 * (lane % 4) + i % 2
                    assert (row - wg * 64, col) == (ptx_row, ptx_col)
                    q = 2 * j + e                           # the scale register used for d[i]
                    assert 8 * (q >> 1) + 2 * t4 + (q & 1) == col
                    assert (row, col) not in seen
                    seen[(row, col)] = (wg, w, lane, i)
    assert len(seen) == 128 * nt


def test_token_tile_choice():
    assert [nt_for(m) for m in (1, 2, 7, 8, 9, 16, 17, 32, 33, 64, 65, 128, 129, 4096)] == \
        [8, 8, 8, 8, 16, 16, 32, 32, 64, 64, 128, 128, 128, 128]


@pytest.mark.parametrize("nt", NT_CHOICES)
def test_ring_and_reduction_fit(nt):
    s = Fp8BlockGemmSpec(target=SM90, n=256, k=512)
    st = s.stages_nt(nt)
    stage = BN90 * BLOCK + nt * BLOCK
    assert 4 <= st <= 8 and stage % 1024 == 0
    assert s.smem_bytes_nt(nt) <= SMEM_CAP
    assert nt * (BN90 + 4) * 4 <= st * stage          # the red[token][row] tile reuses the ring
    assert s.max_smem_bytes() == max(s.smem_bytes_nt(v) for v in NT_CHOICES)


def test_tma_box_geometry_is_legal():
    for n, k in FP8_GEMM_TP8 + FP8_GEMM_TP1 + ((200, 272), (64, 16), (8, 7168)):
        s = Fp8BlockGemmSpec(target=SM90, n=n, k=k)
        for m in (1, 2, 7, 13, 33, 128, 130, 1000):
            b = s.tma_boxes(m, nt_for(m))
            for g in b.values():
                assert g["box"][0] == 128            # inner box = the 128-byte swizzle span
                assert 1 <= g["box"][1] <= min(256, g["dims"][1])   # never more rows than the tensor
                assert all(v % 16 == 0 and v < 2 ** 40 for v in g["strides"])
                assert all(1 <= v <= 2 ** 32 for v in g["dims"])
            assert b["w"]["dims"] == (k, n) and b["x"]["dims"] == (k, m)
            # The kernel's tx count: min(N, 128) + min(M, nt) rows of 128 bytes per stage.
            assert b["w"]["box"][1] == min(n, 128) and b["x"]["box"][1] == min(m, nt_for(m))


def test_split_plan_for_the_k3_shapes():
    # Cluster split never exceeds a portable cluster or the K blocks, and the plan is pure arithmetic.
    for n, k in FP8_GEMM_TP8 + FP8_GEMM_TP1:
        for m in (1, 8, 32, 128):
            s = Fp8BlockGemmSpec(target=SM90, n=n, k=k)
            p = s.plan(m, SMS, ctas=0)
            assert 1 <= p.split <= min(MAX_SPLIT, s.k_blocks) and p.ctas == 0
            assert p.grid == (p.split, -(-m // p.nt), -(-n // BN90)) and p.smem == s.smem_bytes_nt(p.nt)
            assert s.plan(m, SMS, split=3).split == 3 and s.plan(m, SMS, split=3).ctas == 0
    # One wave, split <= SPLIT90_MAX (the H200 sweep's fastest plans).
    assert choose_split90(7168, 12288, 1, SMS) == 2         # o_proj TP1: 56 tiles x 2 = 112
    assert choose_split90(6144, 7168, 8, SMS) == 2          # kda_qkvg TP8: 48 x 2
    assert choose_split90(2304, 1536, 1, SMS) == SPLIT90_MAX  # q_b TP8: 18 tiles x 4
    assert choose_split90(1536, 7168, 1, SMS) == SPLIT90_MAX  # q_a: 12 tiles
    assert choose_split90(7168, 1536, 32, SMS) == 1         # o_proj TP8: 12 K blocks, 56 tiles: unsplit
    assert choose_split90(7168, 1536, 1, SMS) == 1
    assert choose_split90(2304, 1536, 8, SMS) == SPLIT90_MAX  # q_b TP8 at nt = 8
    assert choose_split90(2304, 1536, 32, SMS) == SPLIT90_MAX  # one token tile: the split of M = 1
    assert choose_split90(2304, 1536, 256, SMS) == 2        # two 128-token tiles: the short-K rule
    assert choose_split90(1536, 7168, 128, SMS) == SPLIT90_MAX  # q_a: 56 K blocks, the one-wave rule
    assert choose_split90(49152, 7168, 128, SMS) == 1       # 384 tiles: more than a wave already
    assert choose_split90(64, 16, 1, SMS) == 1              # one K block
    # Row-invariant within one token tile: decode (M = B) and verify (M = B (1 + drafts)) rows reduce alike.
    for n, k in FP8_GEMM_TP8 + FP8_GEMM_TP1:
        assert {choose_split90(n, k, m, SMS) for m in range(1, 129)} == {choose_split90(n, k, 1, SMS)}, (n, k)
    for n, k in FP8_GEMM_TP8 + FP8_GEMM_TP1:
        for m in (1, 8, 32, 128):
            s = choose_split90(n, k, m, SMS)
            tiles = -(-n // BN90) * -(-m // nt_for(m))
            assert s == 1 or tiles * s <= SMS


@pytest.mark.parametrize("recipe", tuple(ScaleRecipe), ids=lambda r: r.value)
def test_compiles_to_fp8_wgmma_and_tma_without_spills(recipe):
    spec = Fp8BlockGemmSpec(target=SM90, n=200, k=272, recipe=recipe)
    assert spec.mma == "wgmma" and spec.threads == THREADS90
    r = build_one(spec)
    (res,) = r.resources
    assert res["local"] == 0 and res["stack"] == 0, res
    assert res["registers"] <= 168, res                  # 384 threads, one CTA per SM
    sass = res["sass"]
    # Four k32 steps per K block for each of the five token-tile variants of both modes (cluster
    # split-K and streaming), E4M3 in FP32 out; the streaming mode's arrival counter is one atomic.
    # (ptxas may unroll or peel the K loop when the K blocks are few: at least, in groups of four.)
    assert sass.get("QGMMA", 0) >= 2 * 4 * len(NT_CHOICES) and sass["QGMMA"] % 4 == 0, sass
    assert sass.get("UTMALDG", 0) >= 2 * 2 * len(NT_CHOICES), sass
    assert sass.get("ATOMG", 0) == len(NT_CHOICES), sass
    assert "HMMA" not in sass and "LDGSTS" not in sass, sass
    # The L2 prefetch knob (Plan.pf): one bulk tensor prefetch per mode and token tile.
    assert sass.get("UTMAPF", 0) >= 2 * len(NT_CHOICES), sass
    # ptxas kept the wgmma groups unserialized (C7518/C7514 would put a wait after every wgmma):
    # one warpgroup arrive and one wait per group of four k32 steps.
    assert sass.get("WARPGROUP", 0) * 2 == sass["QGMMA"], sass
    from k3gen.pipeline.inspect import sass_text
    text = sass_text(r.cubin)
    for nt in NT_CHOICES:
        assert re.search(rf"QGMMA\.64x{nt}x32\.F32\.E4M3\.E4M3", text), nt
    assert "F2FP.F16.E4M3" not in text                   # no software FP8 conversion left


def test_variants_by_target():
    s = Fp8BlockGemmSpec(target=SM90, n=256, k=256)
    assert s.mma == "wgmma" and s.lowering == "nvrtc" and s.threads == THREADS90
    assert '#include "k3gen/gemm/fp8_wgmma.cuh"' in lower(s).source
    for t in ("sm103-nvfp4", "sm107-nvfp4"):
        assert Fp8BlockGemmSpec(target=TARGETS[t], n=256, k=256).mma == "tcgen05_tma"


def test_streaming_plan_is_opt_in():
    # The default plan is the cluster mode; `ctas` asks for streaming (capped at the work items).
    for n, k in FP8_GEMM_TP8 + FP8_GEMM_TP1:
        for m in (1, 8, 32, 128, 200):
            s = Fp8BlockGemmSpec(target=SM90, n=n, k=k)
            p = s.plan(m, SMS)
            items = work_items(n, k, m)
            assert items == -(-m // nt_for(m)) * -(-n // BN90) * -(-k // 128)
            assert p.ctas == 0 and p.grid[0] == p.split == choose_split90(n, k, m, SMS)
            assert p.smem == s.smem_bytes_nt(p.nt)
            q = s.plan(m, SMS, ctas=SMS)
            assert q.ctas == min(SMS, items) and q.grid == (q.ctas, 1, 1) and q.split == 1
            assert s.plan(m, SMS, ctas=7).grid == (7, 1, 1)


@pytest.mark.parametrize("items,ctas,kb", [(5376, 132, 96), (672, 132, 12), (216, 132, 12), (7, 7, 7),
                                           (13, 5, 1), (96 * 3, 2, 96), (1000, 1, 10), (56 * 164, 131, 56)])
def test_stream_segments_cover_every_block_once(items, ctas, kb):
    segs = stream_segments(items, ctas, kb)
    # Every (tile, K block) exactly once, and the walk order is the work-list order.
    flat = [s["tile"] * kb + s["kb0"] + j for s in segs for j in range(s["nk"])]
    assert flat == list(range(items))
    # Ranges are balanced to one block and contiguous.
    sizes = [b - a for a, b in stream_ranges(items, ctas)]
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == items
    for x in range(items):
        c = stream_owner(x, items, ctas)
        a, b = stream_ranges(items, ctas)[c]
        assert a <= x < b
    by_tile: dict = {}
    for s in segs:
        by_tile.setdefault(s["tile"], []).append(s)
    used_slots, used_counters = set(), {}
    for tile, ss in by_tile.items():
        assert [s["cta"] for s in ss] == sorted(s["cta"] for s in ss)   # k order = CTA order
        assert sum(s["nk"] for s in ss) == kb
        for s in ss:
            assert s["nseg"] == len(ss)
        if len(ss) == 1:
            assert ss[0]["slot"] is None and ss[0]["nk"] == kb   # stored straight from registers
            continue
        # The kernel's reader derives each CTA's slot from its range start alone.
        for s in ss:
            q = s["cta"]
            assert s["slot"] == 2 * q + (0 if stream_ranges(items, ctas)[q][0] >= tile * kb else 1)
            assert s["slot"] not in used_slots and 0 <= s["slot"] < 2 * ctas
            used_slots.add(s["slot"])
            assert s["counter"] == ss[0]["cta"]
        # One counter per split tile: two tiles in flight never share one.
        assert ss[0]["counter"] not in used_counters
        used_counters[ss[0]["counter"]] = tile
    assert len(used_counters) <= ctas


def test_stream_workspace_covers_the_largest_plan():
    s = Fp8BlockGemmSpec(target=SM90, n=7168, k=12288)
    assert s.workspace_floats(SMS) == 2 * SMS * 128 * BN90
    assert s.workspace_counters(SMS) == SMS


def test_prefetch_knob_is_a_validated_plan_field():
    from k3gen.errors import SpecError
    s = Fp8BlockGemmSpec(target=SM90, n=7168, k=12288)
    assert s.plan(1, SMS).pf == 0 and s.plan(1, SMS, pf=12).pf == 12
    assert s.plan(1, SMS, pf=12).grid == s.plan(1, SMS).grid       # prefetch changes no geometry
    assert s.plan(8, SMS, ctas=SMS, pf=4).ctas == SMS
    for bad in (-1, 65, True, 2.0):
        with pytest.raises(SpecError, match="pf"):
            s.plan(1, SMS, pf=bad)


def test_scale_slots_follow_the_barriers():
    # smem = slack + per stage (W tile + token tile + full/empty barriers + nt FP32 scales); the
    # template static_asserts the same number against the header.
    s = Fp8BlockGemmSpec(target=SM90, n=256, k=512)
    for nt in NT_CHOICES:
        st = s.stages_nt(nt)
        assert s.smem_bytes_nt(nt) == ALIGN90 + st * (BN90 * BLOCK + nt * BLOCK) + 16 * st + 4 * nt * st
