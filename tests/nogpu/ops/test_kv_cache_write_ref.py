"""CPU tests of the FP32 reference of kv_cache_write (k3gen.ops.kv_cache_write.reference)."""
from __future__ import annotations

import random

import pytest
import torch

from k3gen.errors import PageIndexError
from k3gen.ir.dtypes import Fp8ScaleGranularity, KvDtype, ScaleLayout
from k3gen.ir.layouts import MLA_ROW, PAGE_TOKENS, KvLayout, swizzle_128x4_offset
from k3gen import numerics as Q
from k3gen.ops.kv_cache_write.reference import (POISON_BYTE, alloc_cache, gather_rows, kv_cache_write,
                                            poison_cache)
from helpers import random_block_tables

G = 2688 / 30
FP8_TENSOR_SCALE = 0.05

LAYOUTS = {
    "bf16": KvLayout(kv=KvDtype.BF16, page=64),
    "fp8-tok128": KvLayout(kv=KvDtype.FP8, page=64),
    "fp8-tensor": KvLayout(kv=KvDtype.FP8, page=64, fp8_scales=Fp8ScaleGranularity.PER_TENSOR),
    **{f"nvfp4-{sl.value}-m{m}": KvLayout(kv=KvDtype.NVFP4, page=128, scale_layout=sl, max_drafts=m)
       for sl in ScaleLayout for m in (0, 3, 7)},
}
NVFP4 = [k for k in LAYOUTS if k.startswith("nvfp4")]


def scale_of(lay: KvLayout) -> float:
    return FP8_TENSOR_SCALE if lay.kv is KvDtype.FP8 else G


class Sim:
    """A batch of sequences with random non-contiguous block tables and a mirror of every row."""

    def __init__(self, lay: KvLayout, num_seqs: int, max_len: int, seed: int, poison=True):
        self.lay, self.rng = lay, random.Random(seed)
        self.gen = torch.Generator().manual_seed(seed)
        self.num_pages, self.bt, self.ring_slot = random_block_tables(
            self.rng, num_seqs, -(-max_len // lay.page), 3, num_seqs + 2)
        self.cache = alloc_cache(lay, self.num_pages, num_seqs + 2)
        if poison:
            poison_cache(self.cache)
        self.hist = [torch.zeros(0, MLA_ROW, dtype=torch.bfloat16) for _ in range(num_seqs)]

    def rows(self, n: int, kind: str = "randn") -> torch.Tensor:
        x = torch.randn(n, MLA_ROW, generator=self.gen)
        if kind == "wide":  # per-row magnitudes over many octaves
            x = x * torch.exp(torch.empty(n, 1).uniform_(-6, 4, generator=self.gen))
        return x.bfloat16()

    def step(self, counts, starts=None, kind="randn"):
        starts = [len(h) for h in self.hist] if starts is None else starts
        new = [self.rows(n, kind) for n in counts]
        cu = [0]
        for n in counts:
            cu.append(cu[-1] + n)
        kv_cache_write(self.lay, self.cache, torch.cat(new), cu, starts, self.bt, self.ring_slot,
                       scale_of(self.lay))
        for b, (s, x) in enumerate(zip(starts, new)):
            if counts[b]:
                self.hist[b] = torch.cat([self.hist[b][:s], x])
        return new

    def gather(self, b: int, use_tail=True) -> torch.Tensor:
        return gather_rows(self.lay, self.cache, self.bt[b], len(self.hist[b]),
                           ring_slot=int(self.ring_slot[b]), scale=scale_of(self.lay),
                           use_tail=use_tail)


def check_round_trip(sim: Sim, b: int):
    lay, x = sim.lay, sim.hist[b].float()
    y = sim.gather(b)
    assert not torch.isnan(y).any()
    if lay.kv is KvDtype.BF16:
        assert torch.equal(y, x)
        return
    if lay.kv is KvDtype.FP8:
        if lay.fp8_scales is Fp8ScaleGranularity.PER_TENSOR:
            step = torch.full_like(x, FP8_TENSOR_SCALE)
            x = x.clamp(-448 * FP8_TENSOR_SCALE, 448 * FP8_TENSOR_SCALE)  # a static scale clips
        else:
            g = torch.cat([torch.arange(512) // 128, torch.full((64,), 4)])
            amax = torch.stack([x[:, :512].reshape(-1, 4, 128).abs().amax(2).T[i] for i in range(4)]
                               + [x[:, 512:].abs().amax(1)], 1)
            step = (amax / 448)[:, g]
        # E4M3: 3 mantissa bits -> relative error <= 2^-4; the subnormal floor is step * 2^-10.
        assert torch.all((y - x).abs() <= x.abs() * 2 ** -4 + step * 2 ** -10 + 1e-30)
        return
    n = len(x)
    live = n // 16 * 16
    assert torch.equal(y[live:], x[live:]), "live tile must come back exact from the ring"
    y2 = sim.gather(b, use_tail=False)
    assert torch.equal(y2[:live], y[:live])
    # Each value within one E2M1 step d of its block: the widest grid gap is 2 d, and the rounded
    # scale may clip amax by < 1/16 of it.
    lat_d, rope_d = tile_steps(x[:live])
    d = torch.cat([lat_d, rope_d], 1)
    xc = torch.maximum(torch.minimum(x[:live], 6 * d), -6 * d)  # a saturated scale (448) clips
    err = (y2[:live] - xc).abs()
    assert torch.all(err[:, :512] <= lat_d + 1e-30)
    assert torch.all(err[:, 512:] <= rope_d + 1e-30)


def tile_steps(x: torch.Tensor):
    """Independent dequant steps of complete tiles: latent per 16x16 tile, rope per token."""
    k = len(x)
    lat = x[:, :512].reshape(k // 16, 16, 32, 16).abs().amax(dim=(1, 3))
    _, lat_d = Q.nvfp4_scale(lat, G)
    _, rope_d = Q.nvfp4_scale(x[:, 512:].reshape(k, 4, 16).abs().amax(2), G)
    return lat_d.repeat_interleave(16, 0).repeat_interleave(16, 1), rope_d.repeat_interleave(16, 1)


# -- round trips over ragged batches ---------------------------------------------------------------
@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.parametrize("seed", [0, 1])
def test_round_trip_ragged(name, seed):
    lay = LAYOUTS[name]
    sim = Sim(lay, num_seqs=5, max_len=3 * lay.page + 40, seed=seed)
    rng = random.Random(seed)
    # prefill of ragged lengths straddling tile and page edges, then decode and multi-row steps
    pre = [rng.choice([1, 15, 16, 17, lay.page - 1, lay.page, lay.page + 1, 2 * lay.page + 17])
           for _ in range(5)]
    sim.step(pre, kind="wide")
    for _ in range(20):
        sim.step([1] * 5)
    sim.step([rng.choice([0, 1, 2, 5, 16, 33]) for _ in range(5)])
    for b in range(5):
        check_round_trip(sim, b)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_one_call_equals_token_by_token(name):
    lay = LAYOUTS[name]
    a = Sim(lay, 3, 2 * lay.page + 50, seed=7)
    b = Sim(lay, 3, 2 * lay.page + 50, seed=7)
    lens = [lay.page + 21, 16, 2 * lay.page + 3]
    rows = [a.rows(n) for n in lens]
    cu = [0, lens[0], lens[0] + lens[1], sum(lens)]
    kv_cache_write(lay, a.cache, torch.cat(rows), cu, [0, 0, 0], a.bt, a.ring_slot, scale_of(lay))
    for p in range(max(lens)):
        live = [i for i in range(3) if p < lens[i]]
        step_rows = torch.stack([rows[i][p] for i in live])
        kv_cache_write(lay, b.cache, step_rows, list(range(len(live) + 1)), [p] * len(live),
                       b.bt[live], b.ring_slot[live], scale_of(lay))
    for k in a.cache:
        assert torch.equal(a.cache[k], b.cache[k]), k


@pytest.mark.parametrize("name", NVFP4)
def test_complete_tiles_match_blockwise_quantizer(name):
    """Complete tiles in the cache equal nvfp4_quantize of each 16x16 block (and rope rows)."""
    lay = LAYOUTS[name]
    sim = Sim(lay, 2, 300, seed=3)
    sim.step([37, 130], kind="wide")
    sim.step([5, 2])
    for b in range(2):
        x = sim.hist[b].float()
        for t in range(len(x) // 16):
            tile = x[16 * t:16 * t + 16]
            blocks = tile[:, :512].reshape(16, 32, 16).transpose(0, 1).reshape(32, 256)
            codes, sc = Q.nvfp4_quantize(blocks, G, block=256)
            want_lat = Q.unpack_e2m1(codes).reshape(32, 16, 16).transpose(0, 1).reshape(16, 512)
            rope_codes, rope_sc = Q.nvfp4_quantize(tile[:, 512:], G)
            pos = torch.arange(16 * t, 16 * t + 16)
            pg = sim.bt[b, pos // lay.page].long()
            slot = pos % lay.page
            got = Q.unpack_e2m1(sim.cache["kv_codes"][pg, slot])
            assert torch.equal(got[:, :512], want_lat)
            assert torch.equal(got[:, 512:], Q.unpack_e2m1(rope_codes))
            lat_sc, r_sc = read_scales(lay, sim.cache, pg, slot)
            assert torch.equal(lat_sc, sc.reshape(1, 32).expand(16, 32))
            assert torch.equal(r_sc, rope_sc)


def read_scales(lay, cache, pg, slot):
    """Per-row (latent tile scale [n, 32], rope scales [n, 4]) of either layout."""
    if lay.scale_layout is ScaleLayout.LINEAR:
        return cache["tile_scales"][pg, slot // 16], cache["rope_scales"][pg, slot]
    off = swizzle_128x4_offset(slot[:, None], torch.arange(36)[None, :], 36)
    sc = torch.gather(cache["scales"][pg], 1, off)
    return sc[:, :32], sc[:, 32:]


# -- rewinds ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("m", [3, 7])
@pytest.mark.parametrize("sl", list(ScaleLayout))
@pytest.mark.parametrize("prefix", [16, 29, 120, 126, 127, 128, 135])
def test_rewind_by_drafts(m, sl, prefix):
    """Drafts written then partly rejected: state equals never having written the rejects."""
    lay = LAYOUTS[f"nvfp4-{sl.value}-m{m}"]
    for accepted in sorted({0, 1, m // 2, m}):
        a = Sim(lay, 1, 400, seed=prefix)
        b = Sim(lay, 1, 400, seed=prefix)
        x = a.rows(prefix + m + 9)
        drafts = a.rows(m)
        write = lambda sim, rows, s: kv_cache_write(lay, sim.cache, rows, [0, len(rows)], [s],
                                                    sim.bt, sim.ring_slot, G)
        write(a, x[:prefix], 0)
        write(a, torch.cat([x[prefix:prefix + 1], drafts]), prefix)      # 1 real + m drafts
        end = prefix + 1 + accepted
        good = torch.cat([x[:prefix + 1], drafts[:accepted], x[prefix + 1:prefix + 9]])
        write(a, good[end:], end)                                        # rewind by m - accepted
        write(b, good, 0)
        n = len(good)
        for use_tail in (True, False):
            ga = gather_rows(lay, a.cache, a.bt[0], n, ring_slot=a.ring_slot[0], scale=G, use_tail=use_tail)
            gb = gather_rows(lay, b.cache, b.bt[0], n, ring_slot=b.ring_slot[0], scale=G, use_tail=use_tail)
            assert torch.equal(ga, gb), (accepted, use_tail)
            if use_tail:
                assert torch.equal(ga[n // 16 * 16:], good[n // 16 * 16:].float())
        ring_a = a.cache["hp_tail"][a.ring_slot[0]]
        ring_b = b.cache["hp_tail"][b.ring_slot[0]]
        for p in range(max(0, n - lay.ring), n):
            assert torch.equal(ring_a[p % lay.ring], ring_b[p % lay.ring])


# -- layouts hold the same values --------------------------------------------------------------------
@pytest.mark.parametrize("m", [0, 7])
def test_linear_and_swizzled_hold_the_same_values(m):
    lin = Sim(LAYOUTS[f"nvfp4-linear-m{m}"], 4, 400, seed=11, poison=False)
    swz = Sim(LAYOUTS[f"nvfp4-swz128x4-m{m}"], 4, 400, seed=11, poison=False)
    for counts in ([130, 17, 1, 255], [1, 1, 1, 1], [3, 0, 16, 2], [1, 5, 1, 1]):
        lin.step(counts)
        swz.step(counts)
    assert torch.equal(lin.cache["kv_codes"], swz.cache["kv_codes"])
    assert torch.equal(lin.cache["hp_tail"], swz.cache["hp_tail"])
    for b in range(4):
        n = len(lin.hist[b])
        pos = torch.arange(n)
        pg, slot = lin.bt[b, pos // 128].long(), pos % 128
        la, ra = read_scales(lin.lay, lin.cache, pg, slot)
        lb, rb = read_scales(swz.lay, swz.cache, pg, slot)
        assert torch.equal(la, lb) and torch.equal(ra, rb)
        # the swizzled latent scale is uniform over all 16 rows of a written tile
        tiles = torch.arange(0, -(-n // 16) * 16)
        lt, _ = read_scales(swz.lay, swz.cache, lin.bt[b, tiles // 128].long(), tiles % 128)
        assert torch.equal(lt.view(-1, 16, 32), lt.view(-1, 16, 32)[:, :1].expand(-1, 16, 32))
        assert torch.equal(lin.gather(b), swz.gather(b))


def test_swizzle_padding_untouched_and_page_bytes():
    lay = LAYOUTS["nvfp4-swz128x4-m3"]
    sim = Sim(lay, 1, 128, seed=5, poison=False)
    sim.step([128])
    pg = int(sim.bt[0, 0])
    assert sim.cache["scales"].shape[1] == 128 * 36 == 4608
    written = sim.cache["scales"][pg]
    # 128 rows x 36 cols cover the page exactly; other pages stay zero
    others = torch.cat([sim.cache["scales"][:pg], sim.cache["scales"][pg + 1:]])
    assert not others.any() and written.numel() == 4608


# -- edge values -----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_no_nan_for_zero_huge_and_subnormal_rows(name):
    lay = LAYOUTS[name]
    sim = Sim(lay, 1, 200, seed=2)
    rows = torch.zeros(40, MLA_ROW)
    rows[16:20] = 3.0e38 * torch.sign(torch.randn(4, MLA_ROW))
    rows[20:24] = 1e-39
    rows[24:26, :8] = -0.0
    rows[30:32] = torch.randn(2, MLA_ROW) * 1e-20
    kv_cache_write(lay, sim.cache, rows.bfloat16(), [0, 40], [0], sim.bt, sim.ring_slot, scale_of(lay))
    sim.hist[0] = rows.bfloat16()
    y = sim.gather(0, use_tail=False)
    assert not torch.isnan(y).any()
    for k, t in sim.cache.items():
        if t.dtype == torch.float32:
            assert torch.isfinite(t).all(), k
    if lay.kv is KvDtype.NVFP4:
        pg = sim.bt[0, 0].long()
        lat, rope = read_scales(lay, sim.cache, pg.expand(40), torch.arange(40))
        for s in (lat, rope):
            assert not torch.isnan(Q.e4m3_decode(s)).any()
        assert torch.equal(y[:16], torch.zeros(16, MLA_ROW))  # all-zero tile -> zero codes


# -- pages -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["bf16", "fp8-tok128", "nvfp4-linear-m3", "nvfp4-swz128x4-m3"])
def test_bad_page_ids(name):
    lay = LAYOUTS[name]
    sim = Sim(lay, 2, 2 * lay.page, seed=4)
    before = {k: v.clone() for k, v in sim.cache.items()}
    bt = sim.bt.clone()
    bt[1, 1] = sim.num_pages  # out of range, reached by sequence 1 only
    rows = sim.rows(3 * lay.page)
    cu = [0, lay.page, 3 * lay.page]
    with pytest.raises(PageIndexError):
        kv_cache_write(lay, sim.cache, rows, cu, [0, 0], bt, sim.ring_slot, scale_of(lay))
    for k in sim.cache:  # all or nothing
        assert torch.equal(sim.cache[k], before[k])
    bt[1, 1] = -1
    kv_cache_write(lay, sim.cache, rows, cu, [0, 0], bt, sim.ring_slot, scale_of(lay),
                   check_pages=False)
    sim.hist = [rows[:lay.page], rows[lay.page:]]
    check_round_trip(sim, 0)
    # sequence 1: its first page was written, the bad one skipped (nothing else changed)
    n1 = lay.page
    y = gather_rows(lay, sim.cache, sim.bt[1], n1, ring_slot=int(sim.ring_slot[1]),
                    scale=scale_of(lay))
    if lay.kv is KvDtype.BF16:
        assert torch.equal(y, rows[lay.page:2 * lay.page].float())
    paged = [k for k in sim.cache if k != "hp_tail"]
    good_pages = torch.cat([sim.bt[0], sim.bt[1, :1]]).long()
    mask = torch.ones(sim.num_pages, dtype=torch.bool)
    mask[good_pages] = False
    for k in paged:
        assert torch.equal(sim.cache[k][mask], before[k][mask]), k


def test_zero_rows_touch_nothing():
    lay = LAYOUTS["nvfp4-linear-m3"]
    sim = Sim(lay, 3, 256, seed=9)
    before = {k: v.clone() for k, v in sim.cache.items()}
    kv_cache_write(lay, sim.cache, torch.zeros(0, MLA_ROW, dtype=torch.bfloat16), [0, 0, 0, 0],
                   [5, 17, 0], sim.bt, sim.ring_slot, G)
    for k in sim.cache:
        assert torch.equal(sim.cache[k], before[k])


# -- helpers ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_alloc_and_poison(name):
    lay = LAYOUTS[name]
    c = alloc_cache(lay, 3, 2)
    assert list(c) == list(lay.tensors())
    for k, ts in lay.tensors().items():
        assert tuple(c[k].shape) == ts.concrete_shape(num_pages=3, num_slots=2)
        assert c[k].dtype == {"bf16": torch.bfloat16, "fp32": torch.float32}.get(ts.dtype.name, torch.uint8)
        assert not c[k].any()
    poison_cache(c)
    for t in c.values():
        assert (t.view(torch.uint8) == POISON_BYTE).all()
        assert not torch.isnan(t.float()).any() if t.is_floating_point() else True
    assert PAGE_TOKENS[lay.kv] == lay.page


# -- the kernel's race-free ring schedule ----------------------------------------------------------
@pytest.mark.parametrize("m", [0, 3, 7])
def test_kernel_ring_ownership_rule(m):
    """The kernel writes a new row into the ring from its own tile's CTA unless the slot holds an
    old row the first tile still reads; those the first CTA writes after reading. Check, for all
    small (start, count), that no other CTA ever writes a slot the first CTA reads, and that the
    writes are exactly the reference's (positions >= end - ring, each once)."""
    R = 16 + m
    for s in range(0, 64):
        for n in range(1, 80):
            e, ts0 = s + n, s // 16 * 16
            read = {q % R for q in range(ts0, s)}
            own = [p for p in range(max(s, e - R), e) if (p - ts0) % R >= s - ts0]
            base = e - R
            deleg = [base + ((q - base) % R) for q in range(ts0, s)]
            deleg = [p for p in deleg if p >= s]
            assert not read & {p % R for p in own if p // 16 != s // 16}
            assert sorted(own + deleg) == list(range(max(s, e - R), e))
