"""kv_cache_write kernels vs the FP32 reference, BITWISE (codes, scales, HP ring, untouched bytes).

Every run starts from identically poisoned caches; the kernel updates the GPU copy, the reference
a CPU copy, and after each step every byte of every cache tensor must agree.
"""
from __future__ import annotations

import functools
import random

import ml_dtypes
import numpy as np
import pytest
import torch

from k3gen.errors import PageIndexError
from k3gen.ir.dtypes import Fp8ScaleGranularity, KvDtype, ScaleLayout
from k3gen.ir.layouts import MLA_ROW
from k3gen.ops.kv_cache_write.spec import KvCacheWriteSpec
from k3gen.ops.kv_cache_write.reference import alloc_cache, kv_cache_write, poison_cache
from k3gen.runtime.graphs import capture
from k3gen.targets import get_target
from helpers import random_block_tables

pytestmark = pytest.mark.gpu

G = 2688 / 30
FP8_TENSOR_SCALE = 0.02


def _specs():
    t = get_target("sm90")
    out = {
        "bf16": KvCacheWriteSpec(target=t, kv=KvDtype.BF16),
        "bf16-t64": KvCacheWriteSpec(target=t, kv=KvDtype.BF16, threads=64),
        "fp8-tok128": KvCacheWriteSpec(target=t, kv=KvDtype.FP8),
        "fp8-tok128-t256": KvCacheWriteSpec(target=t, kv=KvDtype.FP8, threads=256),
        "fp8-tensor": KvCacheWriteSpec(target=t, kv=KvDtype.FP8, fp8_scales=Fp8ScaleGranularity.PER_TENSOR),
    }
    for sl in ScaleLayout:
        for m in (0, 3, 7):
            out[f"nvfp4-{sl.value}-m{m}"] = KvCacheWriteSpec(target=t, kv=KvDtype.NVFP4, max_drafts=m,
                                                             scale_layout=sl)
    out["nvfp4-linear-m3-t64"] = KvCacheWriteSpec(target=t, kv=KvDtype.NVFP4, max_drafts=3, threads=64)
    out["nvfp4-swz128x4-m7-t256"] = KvCacheWriteSpec(target=t, kv=KvDtype.NVFP4, max_drafts=7, threads=256,
                                                      scale_layout=ScaleLayout.SWIZZLE_128X4)
    return out


SPECS = _specs()
NVFP4 = [k for k in SPECS if k.startswith("nvfp4")]


@functools.lru_cache(maxsize=None)
def op_for(name: str):
    from k3gen.ops.kv_cache_write.launcher import KvCacheWrite
    return KvCacheWrite(SPECS[name]).load()


def scale_of(spec, g: float = G) -> float:
    return FP8_TENSOR_SCALE if spec.kv is KvDtype.FP8 else g


class Pair:
    """The same batch of sequences in a GPU cache (kernel) and a CPU cache (reference)."""

    def __init__(self, name: str, num_seqs: int, max_len: int, seed: int, g: float = G):
        self.name, self.spec = name, SPECS[name]
        self.scale = scale_of(self.spec, g)
        self.lay = self.spec.layout
        self.rng = random.Random(seed)
        self.gen = torch.Generator().manual_seed(seed)
        self.num_pages, self.bt, self.ring_slot = random_block_tables(
            self.rng, num_seqs, -(-max_len // self.lay.page) + 1, 5, num_seqs + 3)
        self.ref = poison_cache(alloc_cache(self.lay, self.num_pages, num_seqs + 3))
        self.gpu = {k: v.cuda() for k, v in self.ref.items()}
        self.lens = [0] * num_seqs
        self.steps = 0

    def rows(self, n: int) -> torch.Tensor:
        x = torch.randn(n, MLA_ROW, generator=self.gen)
        mag = torch.exp(torch.empty(n, 1).uniform_(-5, 4, generator=self.gen))
        x = x * mag
        if n and self.rng.random() < 0.2:  # edge rows: zeros, huge, subnormal, ties of E2M1
            i = self.rng.randrange(n)
            x[i] = self.rng.choice([0.0, 3.0e38, 1e-39, -0.0])
        return x.bfloat16()

    def step(self, counts, starts=None, *, check_pages=True, new=None):
        starts = list(self.lens) if starts is None else list(starts)
        new = self.rows(sum(counts)) if new is None else new
        cu = [0]
        for n in counts:
            cu.append(cu[-1] + n)
        kv_cache_write(self.lay, self.ref, new, cu, starts, self.bt,
                       self.ring_slot if self.spec.kv is KvDtype.NVFP4 else None, self.scale,
                       check_pages=check_pages)
        self.launch(new, cu, starts, max(counts) if counts else 0)
        for b, n in enumerate(counts):
            if n:
                self.lens[b] = starts[b] + n
        self.steps += 1
        self.compare()

    def launch(self, new, cu, starts, max_rows, cache=None):
        i32 = dict(dtype=torch.int32, device="cuda")
        ring = self.ring_slot.cuda() if self.spec.kv is KvDtype.NVFP4 else None
        op_for(self.name)(new.cuda(), torch.tensor(cu, **i32), torch.tensor(starts, **i32), self.bt.cuda(),
                          self.gpu if cache is None else cache, ring_slot=ring,
                          scale=self.scale, max_rows_per_seq=max_rows)

    def compare(self):
        torch.cuda.synchronize()
        for k, want in self.ref.items():
            got = self.gpu[k].cpu()
            a, b = got.view(torch.uint8).flatten(), want.view(torch.uint8).flatten()
            if not torch.equal(a, b):
                bad = (a != b).nonzero().flatten()
                raise AssertionError(
                    f"{self.name}: step {self.steps}: {k} differs in {len(bad)} bytes, first at byte "
                    f"{int(bad[0])} (kernel {int(a[bad[0]]):#04x}, reference {int(b[bad[0]]):#04x}); "
                    f"lens {self.lens}")


def ragged(rng: random.Random, page: int) -> int:
    return rng.choice([0, 1, 2, 15, 16, 17, 31, 33, page - 1, page, page + 1, 2 * page + 7, 300])


# -- random batches ----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("seed", range(3))
def test_random_batches(name, seed):
    rng = random.Random(100 + seed)
    B = rng.randint(1, 9)
    p = Pair(name, B, max_len=1400, seed=seed)
    p.step([ragged(rng, p.lay.page) for _ in range(B)])          # prefill, ragged
    for _ in range(12):                                          # decode, 1 row per sequence
        p.step([1] * B)
    for _ in range(4):                                           # multi-row appends, some idle
        p.step([rng.choice([0, 1, 2, 4, 8, 16, 17, 40]) for _ in range(B)])
    p.step([ragged(rng, p.lay.page) for _ in range(B)])


@pytest.mark.parametrize("name", NVFP4 + ["fp8-tok128", "bf16"])
def test_long_appends_from_mid_tile(name):
    """Runs much longer than the ring, starting mid-tile: the first tile reads old ring rows
    while later tiles write the ring (the kernel's ring-ownership rule)."""
    p = Pair(name, 4, max_len=1400, seed=5)
    p.step([7, 1, 16, 23])
    p.step([300, 129, 1, 257])
    p.step([5, 600, 3, 40])


@pytest.mark.parametrize("name", NVFP4)
@pytest.mark.parametrize("seed", range(2))
def test_rewinds(name, seed):
    """Speculative steps: write 1 + M rows, then restart up to M positions back (rejected drafts)."""
    rng = random.Random(seed)
    M = SPECS[name].max_drafts
    B = 5
    p = Pair(name, B, max_len=900, seed=seed)
    p.step([rng.choice([1, 16, 30, 127, 128, 140]) for _ in range(B)])
    for _ in range(25):
        prev = list(p.lens)
        p.step([1 + M] * B)
        back = [rng.randint(0, M) for _ in range(B)]
        p.lens = [e - r for e, r in zip(p.lens, back)]
        assert all(l >= q for l, q in zip(p.lens, prev))


@pytest.mark.parametrize("name", ["bf16", "fp8-tok128", "nvfp4-linear-m3", "nvfp4-swz128x4-m3"])
def test_repeated_decode_steps(name):
    p = Pair(name, 16, max_len=400, seed=9)
    p.step([p.rng.randint(0, 200) for _ in range(16)])
    for _ in range(60):
        p.step([1] * 16)


# -- rounding edges: values where a change of operation order changes the bits ----------------------
_BF16 = (np.arange(1 << 16, dtype=np.uint32) << 16).view(np.float32)
_BF16 = _BF16[np.isfinite(_BF16)]


def _e4m3(x):
    return np.clip(x, -448, 448).astype(ml_dtypes.float8_e4m3fn)


def _e2m1(x):
    return np.clip(x, -6, 6).astype(ml_dtypes.float4_e2m1fn).view(np.uint8)


@functools.lru_cache(maxsize=None)
def sensitive_blocks(kind: str, g: float) -> list[tuple[float, np.ndarray]]:
    """(amax A, values |x| <= A) pairs, BF16-exact, for which the stored scale or a code would
    differ under another FP32 operation order: (A * G) / 6 or A * (G / 6) for the NVFP4 scale,
    x * (1 / d) for x / d. Found by brute force over all BF16 values with numpy + ml_dtypes."""
    g32, six, one = np.float32(g), np.float32(6), np.float32(1)
    pos = _BF16[(_BF16 > 1e-3) & (_BF16 < 1e3)]
    out = []
    with np.errstate(all="ignore"):
        if kind == "nvfp4":
            ref = _e4m3((pos / six) * g32).view(np.uint8)
            bad = (ref != _e4m3((pos * g32) / six).view(np.uint8)) | \
                  (ref != _e4m3(pos * (g32 / six)).view(np.uint8))
            out += [(float(a), np.zeros(0, np.float32)) for a in pos[bad]]
        for a in pos[::29]:
            if kind == "nvfp4":
                d = _e4m3((a / six) * g32).astype(np.float32) / g32
                xs = _BF16[np.abs(_BF16) <= a]
                xs = xs[_e2m1(xs / d) != _e2m1(xs * (one / d))]
            else:
                s = a / np.float32(448)
                xs = _BF16[np.abs(_BF16) <= a]
                xs = xs[_e4m3(xs / s).view(np.uint8) != _e4m3(xs * (one / s)).view(np.uint8)]
            if len(xs):
                out.append((float(a), xs))
    return out


def crafted_rows(kind: str, g: float, n: int, rng: random.Random) -> torch.Tensor:
    """n rows (n % 16 == 0) whose scale blocks (NVFP4: 16x16 latent tiles and per-row rope
    blocks; FP8: per-row 128/64 groups) each hold one sensitive (A, xs) pair."""
    pairs = sensitive_blocks(kind, g)
    assert pairs, "no sensitive values found: the test would prove nothing"
    x = np.zeros((n, MLA_ROW), np.float32)

    def fill(block: np.ndarray):
        a, xs = rng.choice(pairs)
        flat = block.reshape(-1)
        flat[:] = np.float32(a) * np.array([rng.uniform(-0.9, 0.9) for _ in flat], np.float32)
        idx = rng.sample(range(flat.size), flat.size)
        flat[idx[0]] = a if rng.random() < 0.5 else -a
        for j, v in zip(idx[1:], rng.sample(list(xs), min(len(xs), flat.size - 1))):
            flat[j] = v
        block[...] = flat.reshape(block.shape)

    if kind == "nvfp4":
        for t in range(0, n, 16):
            for c in range(0, 512, 16):
                fill(x[t:t + 16, c:c + 16])
            for r in range(t, t + 16):
                for c in range(512, MLA_ROW, 16):
                    fill(x[r:r + 1, c:c + 16])
    else:
        for r in range(n):
            for c0, c1 in ((0, 128), (128, 256), (256, 384), (384, 512), (512, MLA_ROW)):
                fill(x[r:r + 1, c0:c1])
    return torch.from_numpy(x).bfloat16()  # values are BF16-exact: no rounding here


@pytest.mark.parametrize("name,g", [(n, g) for n in NVFP4 for g in (1.2, 4.8)] +
                         [("fp8-tok128", G), ("fp8-tok128-t256", G)])
def test_rounding_edges(name, g):
    kind = "nvfp4" if name.startswith("nvfp4") else "fp8"
    rng = random.Random(23)
    p = Pair(name, 3, max_len=500, seed=23, g=g)
    p.step([48, 16, 32], new=crafted_rows(kind, g, 96, rng))
    for _ in range(3):  # decode steps keep re-quantizing the live tile with edge rows
        p.step([1, 1, 1], new=crafted_rows(kind, g, 16, rng)[:3])
    p.step([16, 32, 16], starts=[64, 19, 50], new=crafted_rows(kind, g, 64, rng))


# -- CUDA graphs ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["bf16", "fp8-tok128", "fp8-tensor", "nvfp4-linear-m7", "nvfp4-swz128x4-m3"])
def test_cuda_graph_replay_equals_eager(name):
    B, T = 6, 4
    p = Pair(name, B, max_len=600, seed=13)
    p.step([p.rng.randint(1, 150) for _ in range(B)])
    i32 = dict(dtype=torch.int32, device="cuda")
    rows = torch.zeros(B * T, MLA_ROW, dtype=torch.bfloat16, device="cuda")
    cu = torch.zeros(B + 1, **i32)
    starts = torch.zeros(B, **i32)
    bt = p.bt.cuda()
    ring = p.ring_slot.cuda() if p.spec.kv is KvDtype.NVFP4 else None
    op = op_for(name)
    eager = {k: v.clone() for k, v in p.gpu.items()}
    graph_cache = p.gpu

    def call(cache):
        op(rows, cu, starts, bt, cache, ring_slot=ring, scale=p.scale, max_rows_per_seq=T)

    g = capture(lambda: call(graph_cache))
    lens = list(p.lens)
    for it in range(8):
        counts = [p.rng.randint(0, T) for _ in range(B)]
        new = p.rows(sum(counts))
        c = [0]
        for n in counts:
            c.append(c[-1] + n)
        rows[:len(new)].copy_(new.cuda())
        cu.copy_(torch.tensor(c, dtype=torch.int32))
        starts.copy_(torch.tensor(lens, dtype=torch.int32))
        g.replay()
        call(eager)
        kv_cache_write(p.lay, p.ref, new, c, lens, p.bt, p.ring_slot if ring is not None else None,
                       p.scale)
        lens = [l + n for l, n in zip(lens, counts)]
        torch.cuda.synchronize()
        for k in eager:
            assert torch.equal(graph_cache[k].view(torch.uint8), eager[k].view(torch.uint8)), (it, k)
        p.compare()


# -- bad page ids --------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["bf16", "fp8-tok128", "nvfp4-linear-m3", "nvfp4-swz128x4-m3"])
def test_bad_page_ids_raise_with_validation(name, monkeypatch):
    monkeypatch.setenv("K3GEN_VALIDATE", "1")
    p = Pair(name, 3, max_len=300, seed=17)
    p.step([40, 1, 2 * p.lay.page - 3])
    before = {k: v.clone() for k, v in p.gpu.items()}
    for bad in (p.num_pages, -1, 1 << 30):
        p.bt[2, 1] = bad
        with pytest.raises(PageIndexError):
            p.launch(p.rows(10), [0, 1, 1, 10], p.lens, 9)
        torch.cuda.synchronize()
        for k in before:
            assert torch.equal(p.gpu[k], before[k]), k


@pytest.mark.parametrize("name", ["bf16", "fp8-tok128", "nvfp4-linear-m3", "nvfp4-swz128x4-m7"])
def test_bad_page_ids_are_skipped_without_validation(name, monkeypatch):
    monkeypatch.delenv("K3GEN_VALIDATE", raising=False)
    p = Pair(name, 3, max_len=300, seed=19)
    p.step([40, 1, p.lay.page - 3])
    p.bt[2, 1] = p.num_pages + 7
    p.bt[0, 0] = -5
    p.step([4, 1, 10], check_pages=False)


@pytest.mark.parametrize("name", ["bf16", "fp8-tok128", "fp8-tensor", "nvfp4-linear-m3", "nvfp4-swz128x4-m7"])
def test_sanitize_reduced_matrix(name):
    """A reduced matrix small enough for compute-sanitizer memcheck (tools/h200.sh runs `sanitize`)."""
    rng = random.Random(7)
    p = Pair(name, 3, max_len=400, seed=7)
    p.step([ragged(rng, p.lay.page) for _ in range(3)])
    for _ in range(3):
        p.step([1, 0, 1])
    p.step([17, 2, 0])
