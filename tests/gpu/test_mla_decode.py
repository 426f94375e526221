"""mla_decode on the H200 against the FP32 reference computed on the same dequantized KV.

Caches are filled by the kv_cache_write kernel (bit-exact with its reference, tests/gpu/
test_kv_cache_write.py): the context rows, then the T rows of this step, so NVFP4's live tile sits
in the HP ring exactly as in serving. Block tables are random permutations of a larger pool, ring
slots are shuffled, lengths are ragged around the 16-token tile and the 64/128-token page edges,
outputs are NaN-poisoned before every run.
"""
from __future__ import annotations

import functools
import random

import pytest
import torch

from k3gen.errors import PageIndexError, SpecError
from k3gen.ir.dtypes import Fp8ScaleGranularity, KvDtype, ScaleLayout
from k3gen.ir.layouts import MLA_LATENT, MLA_ROW
from k3gen.ops.kv_cache_write.spec import KvCacheWriteSpec
from k3gen.ops.mla_decode.spec import MlaDecodeSpec
from k3gen.ops.kv_cache_write.reference import alloc_cache, poison_cache
from k3gen.ops.mla_decode.reference import mla_decode as mla_ref
from k3gen.runtime.graphs import capture
from k3gen.targets import get_target
from numerics import rel_rms

pytestmark = pytest.mark.gpu

SM90 = get_target("sm90")
G = 2688 / 30
FP8_TENSOR_SCALE = 0.02
Q_STD = (1 / 3) ** 0.5          # unit-variance scores over 576 dims at scale 1/sqrt(192)
REL_RMS, MAX_ABS_FRAC = 1e-2, 3e-2   # BF16 output tolerance (rel RMS; max-abs as a fraction of max |ref|)

# KV formats: write-op fields shared by the cache writer and the attention spec.
FORMATS = {
    "bf16": dict(kv=KvDtype.BF16),
    "fp8-tok128": dict(kv=KvDtype.FP8),
    "fp8-tensor": dict(kv=KvDtype.FP8, fp8_scales=Fp8ScaleGranularity.PER_TENSOR),
    "nvfp4-linear-m3": dict(kv=KvDtype.NVFP4, max_drafts=3, scale_layout=ScaleLayout.LINEAR),
    # The SM100-family scale layout, run here through the same kernel source.
    "nvfp4-swz128x4-m7": dict(kv=KvDtype.NVFP4, max_drafts=7, scale_layout=ScaleLayout.SWIZZLE_128X4),
}
SHAPES = [(12, 1), (12, 2), (12, 4), (12, 8), (6, 1), (96, 1), (96, 4), (128, 1)]
QUICK_SHAPES = [(12, 1), (12, 4), (96, 1), (16, 8)]
# The wgmma_qm schedule (BF16 KV, 64 query rows per CTA on the wgmma M side): padded groups (12, 40,
# 96, 6 x 4, 16 x 1, 16 x 2), whole ones (64, 128), many groups (128 x 4, 128 x 8), mixed T.
QM_SHAPES = [(12, 1), (6, 1), (12, 4), (40, 1), (64, 1), (96, 1), (128, 1), (128, 2), (16, 8), (128, 8),
             (16, 1), (16, 2), (128, 4)]
# The FP8 wgmma schedule (16 query rows per CTA, so H * T <= 16): both scale granularities.
WG8_SHAPES = [(12, 1), (6, 1), (16, 1), (4, 4), (8, 2), (2, 8)]
FP8_FORMATS = ("fp8-tok128", "fp8-tensor")
# The NVFP4 wgmma schedule (linear scales; 16 query rows per CTA): the FP8 shapes plus wide ones.
WG4_SHAPES = WG8_SHAPES + [(12, 4), (96, 1)]
NV = "nvfp4-linear-m3"


def _write_spec(fmt: str) -> KvCacheWriteSpec:
    return KvCacheWriteSpec(target=SM90, **FORMATS[fmt])


def _attn_spec(fmt: str, heads: int, tokens: int, sched: str = "mma") -> MlaDecodeSpec:
    return MlaDecodeSpec(target=SM90, heads=heads, tokens=tokens, schedule=sched, **FORMATS[fmt])


WRITE_SPECS = {f: _write_spec(f) for f in FORMATS}
ATTN_SPECS = {(f, h, t, "mma"): _attn_spec(f, h, t) for f in FORMATS
              for h, t in (SHAPES if f == "bf16" else QUICK_SHAPES)}
ATTN_SPECS.update({(f, h, t, sched): _attn_spec(f, h, t, sched)
                   for f in FP8_FORMATS for h, t in WG8_SHAPES for sched in ("mma", "wgmma")})
ATTN_SPECS.update({(NV, h, t, sched): _attn_spec(NV, h, t, sched) for h, t in WG4_SHAPES for sched in ("mma", "wgmma")})
ATTN_SPECS.update({("bf16", h, t, sched): _attn_spec("bf16", h, t, sched)
                   for h, t in QM_SHAPES for sched in ("mma", "wgmma_qm")})
# (fmt, schedule) pairs for the tests that run every format: each also through its wgmma kernel.
FMT_SCHED = ([(f, "mma") for f in FORMATS] + [("bf16", "wgmma_qm")]
             + [(f, "wgmma") for f in FP8_FORMATS] + [(NV, "wgmma")])


def heads_for(fmt: str, sched: str, T: int, H: int = 12) -> int:
    """H of a test shape; the FP8/NVFP4 wgmma tests take H * T <= 16 (12 at T = 1, else 16 // T):
    one CTA per sequence and split, as the shapes built for them."""
    return H if fmt == "bf16" or sched != "wgmma" or H * T <= 16 else 16 // T


@functools.lru_cache(maxsize=None)
def writer(fmt: str):
    from k3gen.ops.kv_cache_write.launcher import KvCacheWrite
    return KvCacheWrite(WRITE_SPECS[fmt]).load()


@functools.lru_cache(maxsize=None)
def attn(fmt: str, heads: int, tokens: int, sched: str = "mma"):
    from k3gen.ops.mla_decode.launcher import MlaDecode
    return MlaDecode(ATTN_SPECS[(fmt, heads, tokens, sched)]).load()


def scale_of(fmt: str) -> float:
    return FP8_TENSOR_SCALE if fmt == "fp8-tensor" else G


class Batch:
    """B sequences in a paged cache of format `fmt`, written by the kv_cache_write kernel."""

    def __init__(self, fmt: str, lens: list[int], T: int, seed: int, rows: list | None = None, extra_pages: int = 7,
                 scale: float | None = None):
        self.fmt, self.T, self.lens = fmt, T, list(lens)
        self.wspec = WRITE_SPECS[fmt]
        self.lay = self.wspec.layout
        self.scale = scale_of(fmt) if scale is None else scale
        rng = random.Random(seed)
        self.gen = torch.Generator(device="cuda").manual_seed(seed)
        B = len(lens)
        per = max(-(-L // self.lay.page) for L in lens) + 1
        self.num_pages = B * per + extra_pages
        ids = list(range(self.num_pages))
        rng.shuffle(ids)
        self.bt = torch.tensor(ids[:B * per], dtype=torch.int32, device="cuda").view(B, per)
        slots = list(range(B + 2))
        rng.shuffle(slots)
        self.ring = torch.tensor(slots[:B], dtype=torch.int32, device="cuda")
        self.cache = poison_cache(alloc_cache(self.lay, self.num_pages, B + 2, "cuda"))
        self.rows = rows if rows is not None else [
            torch.randn(L, MLA_ROW, device="cuda", generator=self.gen).bfloat16() for L in lens]
        # Context, then the step's T rows (the live NVFP4 tile is re-quantized from the ring).
        for part in (0, 1):
            counts = [max(L - T, 0) if part == 0 else min(T, L) for L in lens]
            starts = [0] * B if part == 0 else [max(L - T, 0) for L in lens]
            new = torch.cat([r[:c] if part == 0 else r[s:] for r, c, s in zip(self.rows, counts, starts)])
            cu = torch.tensor([0] + [int(x) for x in torch.tensor(counts).cumsum(0)], dtype=torch.int32,
                              device="cuda")
            writer(fmt)(new.contiguous(), cu, torch.tensor(starts, dtype=torch.int32, device="cuda"), self.bt,
                        self.cache, ring_slot=self.ring if self.lay.kv is KvDtype.NVFP4 else None,
                        scale=self.scale, max_rows_per_seq=max(counts))
        self.lengths = torch.tensor(lens, dtype=torch.int32, device="cuda")

    def query(self, H: int, seed: int) -> torch.Tensor:
        g = torch.Generator(device="cuda").manual_seed(seed)
        return (torch.randn(len(self.lens), self.T, H, MLA_ROW, device="cuda", generator=g) * Q_STD).bfloat16()

    def reference(self, q: torch.Tensor) -> torch.Tensor:
        cpu = {k: v.cpu() for k, v in self.cache.items()}
        ring = self.ring.cpu() if self.lay.kv is KvDtype.NVFP4 else None
        return mla_ref(self.lay, cpu, q, self.bt.cpu(), self.lens, ring_slot=ring, scale=self.scale, device="cuda")

    def run(self, op, q, *, plan=None, lengths=None, out=None):
        out = out if out is not None else torch.empty(len(self.lens), self.T, op.spec.heads, MLA_LATENT,
                                                      dtype=torch.bfloat16, device="cuda")
        out.fill_(float("nan"))
        op(q, self.cache, self.bt, self.lengths if lengths is None else lengths, out,
           ring_slot=self.ring if self.lay.kv is KvDtype.NVFP4 else None, scale=self.scale, plan=plan)
        return out


def assert_close(got, ref, what=""):
    torch.cuda.synchronize()
    assert not torch.isnan(got).any(), f"{what}: NaN in the output"
    err = rel_rms(got, ref)
    assert err <= REL_RMS, f"{what}: rel RMS {err:.3g}"
    mx = float((got.double() - ref.double()).abs().max())
    assert mx <= MAX_ABS_FRAC * float(ref.abs().max()) + 1e-3, f"{what}: max abs {mx:.3g}"


EDGES = [1, 2, 3, 4, 8, 15, 16, 17, 31, 33, 63, 64, 65, 127, 128, 129, 191, 255, 256, 257, 1000, 4097]


def ragged(rng: random.Random, B: int, T: int) -> list[int]:
    return [max(T, rng.choice(EDGES) + rng.choice([0, 0, rng.randint(0, 300)])) for _ in range(B)]


# -- numerics ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("key", list(ATTN_SPECS), ids=lambda k: f"{k[0]}-H{k[1]}-T{k[2]}-{k[3]}")
@pytest.mark.parametrize("seed", range(2))
def test_random_batches(key, seed):
    fmt, H, T, sched = key
    rng = random.Random(1000 * seed + H + T)
    b = Batch(fmt, ragged(rng, rng.randint(1, 6), T), T, seed)
    op = attn(fmt, H, T, sched)
    q = b.query(H, seed)
    ref = b.reference(q)
    for splits in (None, 1, 5):
        plan = op.plan(len(b.lens), max(b.lens), splits=splits)
        assert_close(b.run(op, q, plan=plan), ref, f"{key} splits={plan.splits} lens={b.lens}")


@pytest.mark.parametrize("sched,H,T", [("wgmma_qm", h, t) for h, t in QM_SHAPES], ids=lambda v: str(v))
def test_wgmma_schedule_matches_mma_schedule(sched, H, T):
    """Same inputs through a wgmma BF16 schedule and mma.sync: both within the reference tolerance
    and close to each other (they round the same BF16 probabilities; only FP32 summation orders
    differ)."""
    rng = random.Random(77 + H * T)
    b = Batch("bf16", ragged(rng, 5, T) + [T, 64, 65], T, seed=12)
    q = b.query(H, 12)
    ref = b.reference(q)
    for splits in (1, 4):
        got = {}
        for sc in ("mma", sched):
            op = attn("bf16", H, T, sc)
            got[sc] = b.run(op, q, plan=op.plan(len(b.lens), max(b.lens), splits=splits)).clone()
            assert_close(got[sc], ref, f"{sc} H{H} T{T} s{splits} lens={b.lens}")
        assert rel_rms(got[sched], got["mma"]) < 4e-3


@pytest.mark.parametrize("fmt,sched", FMT_SCHED, ids=lambda v: str(v))
@pytest.mark.parametrize("T", [1, 4])
def test_long_sequences(fmt, sched, T):
    """Lengths up to 64K (many splits for a small batch; one split per CTA beyond that)."""
    H = heads_for(fmt, sched, T)
    b = Batch(fmt, [65536, 40000 + 7, 129], T, seed=3)
    op = attn(fmt, H, T, sched)
    q = b.query(H, 3)
    assert_close(b.run(op, q), b.reference(q), f"{fmt} T{T} long")


@pytest.mark.parametrize("fmt,sched", [("bf16", "mma"), ("bf16", "wgmma_qm"),
                                       ("fp8-tok128", "wgmma"), ("fp8-tensor", "wgmma")], ids=lambda v: str(v))
def test_nan_past_the_sequence_end_is_never_read(fmt, sched):
    """Rows past a sequence's length in its last page hold NaN codes and scales (a recycled page may
    hold anything): masked scores and zero probabilities must keep them out of the output (the TMA
    schedules load whole pages, so their consumers zero those rows)."""
    T = 2
    H = 128 if sched == "wgmma_qm" else heads_for(fmt, sched, T)
    b = Batch(fmt, [65, 130, 64, 5, 200], T, seed=13)
    for i, L in enumerate(b.lens):
        pg = int(b.bt[i, -(-L // 64) - 1])
        for name, t in b.cache.items():
            t[pg, L % 64 or 64:].view(torch.uint8).fill_(0xFF)   # NaN in BF16, E4M3 and FP32
    q = b.query(H, 13)
    ref = b.reference(q)
    op = attn(fmt, H, T, sched)
    for splits in (1, 3):
        assert_close(b.run(op, q, plan=op.plan(len(b.lens), max(b.lens), splits=splits)), ref,
                     f"{fmt} {sched} s{splits}")


@pytest.mark.parametrize("sched", ["mma", "wgmma_qm"])
def test_split_counts_agree(sched):
    b = Batch("bf16", [3000, 17, 640], 1, seed=4)
    op = attn("bf16", 12, 1, sched)
    q = b.query(12, 4)
    ref = b.reference(q)
    outs = []
    for s in (1, 2, 3, 16, 47, 132):
        outs.append(b.run(op, q, plan=op.plan(3, 3000, splits=s)).clone())
        assert_close(outs[-1], ref, f"splits={s}")
    # Splits with no tiles (47, 132 > tiles of a 17-token sequence) merge to the same answer.
    assert all(rel_rms(o, outs[0]) < 4e-3 for o in outs[1:])


def assert_schedules_agree(b, q, fmt, H, T):
    """The mma and wgmma schedules on one batch, at 1 and 4 splits: each within the reference
    tolerance, and close to each other."""
    ref = b.reference(q)
    for splits in (1, 4):
        got = {}
        for sched in ("mma", "wgmma"):
            op = attn(fmt, H, T, sched)
            got[sched] = b.run(op, q, plan=op.plan(len(b.lens), max(b.lens), splits=splits)).clone()
            assert_close(got[sched], ref, f"{fmt} {sched} H{H} T{T} s{splits} lens={b.lens}")
        assert rel_rms(got["wgmma"], got["mma"]) < 4e-3


@pytest.mark.parametrize("fmt", FP8_FORMATS)
@pytest.mark.parametrize("H,T", [(12, 1), (4, 4)], ids=str)
def test_fp8_wgmma_schedule_matches_mma_schedule(fmt, H, T):
    """Same FP8 cache and queries through both schedules: both within the reference tolerance and
    close to each other (exact codes and scales in both; they differ in the query and probability
    operands: f16 in mma.sync, E4M3 hi + lo in wgmma)."""
    rng = random.Random(91 + H * T)
    b = Batch(fmt, ragged(rng, 5, T) + [T, 64, 65, 3000], T, seed=13)
    q = b.query(H, 13)
    assert_schedules_agree(b, q, fmt, H, T)


def test_fp8_wgmma_scale_range():
    """Per-token scales spread over 2^-12 .. 2^4 within and across tiles (the wgmma schedule's
    power-of-two F grows over the sequence and rescales the running output): still the reference."""
    lens, T, H = [3000, 700, 129], 1, 12
    g = torch.Generator(device="cuda").manual_seed(14)
    rows = []
    for L in lens:
        r = torch.randn(L, MLA_ROW, device="cuda", generator=g)
        r *= torch.exp2(torch.randint(-12, 5, (L, 1), device="cuda", generator=g).float())
        rows.append(r.bfloat16())
    b = Batch("fp8-tok128", lens, T, seed=14, rows=rows)
    q = b.query(H, 14)
    ref = b.reference(q)
    for sched in ("mma", "wgmma"):
        assert_close(b.run(attn("fp8-tok128", H, T, sched), q), ref, f"scale range {sched}")


@pytest.mark.parametrize("H,T", [(12, 1), (4, 4), (12, 4)], ids=str)
def test_nvfp4_wgmma_schedule_matches_mma_schedule(H, T):
    """Same NVFP4 cache (live tiles from the ring included) through both schedules: both within the
    reference tolerance and close to each other (exact decoded codes in both, f16 operands against
    f16 Q * 2^E; the live rows in FP32 on CUDA cores in both)."""
    rng = random.Random(93 + H * T)
    b = Batch(NV, ragged(rng, 5, T) + [T, 16, 17, 64, 65, 3000, 3001], T, seed=15)
    q = b.query(H, 15)
    assert_schedules_agree(b, q, NV, H, T)


def test_nvfp4_wgmma_scale_range_and_g():
    """Tile scales over many binades (rows scaled by 2^-12 .. 2^4) and two global scales G: the
    wgmma schedule's f16 products (subnormal ones included) still give the reference."""
    lens, T, H = [3000, 701, 129, 30], 1, 12
    g = torch.Generator(device="cuda").manual_seed(16)
    rows = []
    for L in lens:
        r = torch.randn(L, MLA_ROW, device="cuda", generator=g)
        r *= torch.exp2(torch.randint(-12, 5, (L, 1), device="cuda", generator=g).float())
        rows.append(r.bfloat16())
    for gs in (G, 2.0):
        b = Batch(NV, lens, T, seed=16, rows=rows, scale=gs)
        q = b.query(H, 16)
        ref = b.reference(q)
        for sched in ("mma", "wgmma"):
            assert_close(b.run(attn(NV, H, T, sched), q), ref, f"G={gs} {sched}")


def test_quantized_kv_error_vs_bf16():
    """Same rows (unit-variance latents, unit-variance scores) in every format: FP8 KV within 0.05
    and NVFP4 KV within 0.15 relative RMS of the BF16-KV kernel's output."""
    lens, T, H = [4096, 1000, 130, 64], 1, 12
    g = torch.Generator(device="cuda").manual_seed(5)
    rows = [torch.randn(L, MLA_ROW, device="cuda", generator=g).bfloat16() for L in lens]
    base = Batch("bf16", lens, T, seed=5, rows=rows)
    q = base.query(H, 5)
    want = base.run(attn("bf16", H, T), q).clone()
    errs = {}
    for fmt, bound in (("fp8-tok128", 0.05), ("nvfp4-linear-m3", 0.15), ("nvfp4-swz128x4-m7", 0.15)):
        b = Batch(fmt, lens, T, seed=5, rows=rows)
        errs[fmt] = rel_rms(b.run(attn(fmt, H, T), q), want)
        assert errs[fmt] <= bound, errs
    print(f"\nrel RMS vs BF16 KV: {errs}")


# -- CUDA graphs ----------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt,sched", [("bf16", "mma"), ("fp8-tok128", "mma"), ("nvfp4-linear-m3", "mma"),
                                       ("bf16", "wgmma_qm"), ("fp8-tok128", "wgmma"), (NV, "wgmma")],
                         ids=lambda v: str(v))
@pytest.mark.parametrize("B", [1, 5])
def test_cuda_graph_replay_with_changed_lengths(fmt, sched, B):
    """Capture once with a plan for the largest length; replays with other lengths (and other
    queries) equal eager calls and the reference."""
    T = 4
    H = heads_for(fmt, sched, T)
    rng = random.Random(B)
    maxlen = 2500
    b = Batch(fmt, [maxlen] * B, T, seed=6)
    op = attn(fmt, H, T, sched)
    plan = op.plan(B, maxlen)
    q = b.query(H, 6)
    lengths = torch.empty(B, dtype=torch.int32, device="cuda")
    out = torch.empty(B, T, H, MLA_LATENT, dtype=torch.bfloat16, device="cuda")
    lengths.copy_(b.lengths)
    b.run(op, q, plan=plan, lengths=lengths, out=out)     # warm-up outside the capture
    graph = capture(lambda: op(q, b.cache, b.bt, lengths, out,
                               ring_slot=b.ring if b.lay.kv is KvDtype.NVFP4 else None, scale=b.scale, plan=plan))
    for it in range(4):
        # Shorter views of the same cache: the first L rows of each sequence are its rows 0..L-1,
        # and for NVFP4 the rows past a shorter length's live tile are the quantized ones.
        lens = [max(T, rng.choice(EDGES + [maxlen])) for _ in range(B)]
        if b.lay.kv is KvDtype.NVFP4:
            lens = [L if L == maxlen else L // 16 * 16 or 16 for L in lens]
        lengths.copy_(torch.tensor(lens, dtype=torch.int32))
        q.copy_(b.query(H, 100 + it))
        out.fill_(float("nan"))
        graph.replay()
        got = out.clone()
        eager = b.run(op, q, plan=plan, lengths=lengths)
        torch.cuda.synchronize()
        assert torch.equal(got, eager), (it, lens)
        view = Batch.__new__(Batch)
        view.__dict__.update(b.__dict__)
        view.lens = lens
        assert_close(got, view.reference(q), f"replay {it} lens={lens}")


# -- bad input ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt,sched", [("bf16", "mma"), ("fp8-tok128", "mma"), ("nvfp4-linear-m3", "mma"),
                                       ("bf16", "wgmma_qm"), ("fp8-tok128", "wgmma"), (NV, "wgmma")],
                         ids=lambda v: str(v))
def test_bad_page_ids_raise_with_validation(fmt, sched, monkeypatch):
    monkeypatch.setenv("K3GEN_VALIDATE", "1")
    b = Batch(fmt, [300, 40], 1, seed=8)
    op = attn(fmt, 12, 1, sched)
    q = b.query(12, 8)
    b.run(op, q)   # valid
    for bad in (b.num_pages, -1, 1 << 30):
        saved = int(b.bt[0, 1])
        b.bt[0, 1] = bad
        with pytest.raises(PageIndexError):
            b.run(op, q)
        b.bt[0, 1] = saved
    b.lengths[1] = b.bt.shape[1] * b.lay.page + 1   # needs a page past the table
    with pytest.raises(PageIndexError):
        b.run(op, q)
    b.lengths[1] = 0
    with pytest.raises(SpecError, match="lengths"):
        b.run(op, q)


@pytest.mark.parametrize("fmt,sched", [("bf16", "mma"), ("bf16", "wgmma_qm"),
                                       ("fp8-tok128", "wgmma"), (NV, "wgmma")], ids=lambda v: str(v))
def test_bad_page_ids_without_validation_read_zeros(fmt, sched, monkeypatch):
    """Out-of-range ids are not dereferenced: those rows read as zeros (no fault, no NaN)."""
    monkeypatch.delenv("K3GEN_VALIDATE", raising=False)
    b = Batch(fmt, [300, 200], 1, seed=9)
    op = attn(fmt, 12, 1, sched)
    q = b.query(12, 9)
    b.bt[0, 2] = b.num_pages + 5
    b.bt[1, 0] = -3
    got = b.run(op, q)
    cpu = {k: v.cpu().clone() for k, v in b.cache.items()}
    bt = b.bt.cpu().clone()
    zero_page = b.num_pages   # an extra all-zero page stands in for the bad ids
    for name in b.lay.paged_tensors():
        cpu[name] = torch.cat([cpu[name], torch.zeros_like(cpu[name][:1])])
    bt[0, 2], bt[1, 0] = zero_page, zero_page
    ring = b.ring.cpu() if b.lay.kv is KvDtype.NVFP4 else None
    ref = mla_ref(b.lay, cpu, q, bt, b.lens, ring_slot=ring, scale=b.scale, device="cuda")
    assert_close(got, ref, "bad pages as zeros")


@pytest.mark.parametrize("sched", ["mma", "wgmma_qm"])
def test_typed_errors(sched):
    b = Batch("bf16", [70], 1, seed=10)
    op = attn("bf16", 12, 1, sched)
    q = b.query(12, 10)
    out = torch.empty(1, 1, 12, MLA_LATENT, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(SpecError, match="q"):
        op(q.float(), b.cache, b.bt, b.lengths, out)
    with pytest.raises(SpecError, match="out"):
        op(q, b.cache, b.bt, b.lengths, out[:, :, :6])
    with pytest.raises(SpecError, match="cache"):
        op(q, {}, b.bt, b.lengths, out)
    with pytest.raises(SpecError, match="lengths"):
        op(q, b.cache, b.bt, b.lengths.long(), out)
    nv = Batch("nvfp4-linear-m3", [70], 1, seed=10)
    with pytest.raises(SpecError, match="ring_slot"):
        attn("nvfp4-linear-m3", 12, 1)(q, nv.cache, nv.bt, nv.lengths, out, scale=G)


# -- compute-sanitizer (tools/h200.sh runs `-k sanitize` under memcheck) ----------------------------
# wgmma_qm: a padded group, whole groups, a group half padding.
SANITIZE_SHAPES = {"mma": [(12, 4)], "wgmma_qm": [(12, 4), (128, 1), (40, 1)],
                   "wgmma-fp8": [(12, 1), (4, 4)], "wgmma-nvfp4": [(12, 1), (4, 4)]}


@pytest.mark.parametrize("fmt,sched", FMT_SCHED, ids=lambda v: str(v))
def test_sanitize_reduced_matrix(fmt, sched):
    kind = "" if sched == "mma" or fmt == "bf16" else "-" + fmt.split("-")[0]
    for H, T in SANITIZE_SHAPES[sched + kind]:
        b = Batch(fmt, [4, 17, 130, 257], T, seed=11)
        op = attn(fmt, H, T, sched)
        q = b.query(H, 11)
        ref = b.reference(q)
        for splits in (1, 3):
            assert_close(b.run(op, q, plan=op.plan(4, 257, splits=splits)), ref, f"sanitize {fmt} H{H} T{T} s{splits}")
