"""fp8_block_gemm on the H200 (sm_90a cubin via NVRTC: the wgmma + TMA variant) against the FP32
reference and a float64 product of the dequantized operands: both scale recipes, M in {1, 2, 7, 8,
33, 128} plus every token-tile variant and M > 128, N and K not multiples of 128, every split, a
ring that wraps many times, CUDA-graph replay, poisoned outputs."""
from __future__ import annotations

import functools

import pytest
import torch

from k3gen.errors import SpecError
from k3gen.ir.dtypes import ScaleRecipe
from k3gen.ops.fp8_block_gemm.spec import Fp8BlockGemmSpec
from k3gen.ops.fp8_block_gemm.reference import dequantize_activations, dequantize_weights
from k3gen.ops.fp8_block_gemm.launcher import Fp8BlockGemm
from k3gen.targets import TARGETS
from helpers import fp8_gemm_close, fp8_gemm_graph_replay, fp8_gemm_inputs as _inputs, poisoned_bf16 as _poisoned

pytestmark = pytest.mark.gpu

SM90 = TARGETS["sm90"]
RECIPES = tuple(ScaleRecipe)
MS = (1, 2, 7, 8, 13, 32, 33, 128, 200)   # nt = 8, 16, 32, 64, 128; M > 128 takes two token tiles
SHAPES = ((2304, 1536), (200, 272), (7168, 1536), (1536, 7168))   # q_b TP8, ragged, o_proj TP8, q_a
BF16_REL_RMS = 1e-2            # BF16 output rounding plus FP32 accumulation order
RING = (200, 7168)             # split 1 streams 56 K blocks through the ring
TINY = ((64, 96), (8, 16))     # smaller than one 128 x 128 tile in N and K (boxes clipped by TMA)
SPECS = {(n, k, r, bm): Fp8BlockGemmSpec(target=SM90, n=n, k=k, recipe=r, bm=bm)
         for n, k in SHAPES + (RING,) + TINY for r in RECIPES for bm in (64,)}
# bm is a field of the tcgen05 variant only: on sm90 it must not change the kernel's results.
SPECS.update({(200, 272, r, 16): Fp8BlockGemmSpec(target=SM90, n=200, k=272, recipe=r, bm=16) for r in RECIPES})


@functools.lru_cache(maxsize=None)
def _op(n, k, recipe, bm=64) -> Fp8BlockGemm:
    op = Fp8BlockGemm(SPECS[(n, k, recipe, bm)]).load()
    assert op.meta["arch"] == "sm_90a" and op.spec.mma == "wgmma"
    return op


def _check(out, xc, xs, wc, ws, recipe):
    got, ref64 = fp8_gemm_close(out, xc, xs, wc, ws, recipe, BF16_REL_RMS)
    # Every element within BF16 rounding of the exact value plus the tensor cores' accumulation
    # error. Hopper's FP8 MMA keeps about 14 bits in its accumulator (DeepSeek-V3 report, sec.
    # 3.3.2), which is why the kernel promotes every 128-K block into FP32: within a block the error
    # is bounded by a few 2^-13 roundings of partial sums, i.e. by ~2^-10 of sum_k |x_k w_k|. A wrong
    # tile, scale or fragment is off by O(1) of that sum and still fails.
    xa = dequantize_activations(xc.cpu(), xs.cpu(), recipe, torch.float64).abs()
    wa = dequantize_weights(wc.cpu(), ws.cpu(), recipe, torch.float64).abs()
    tol = ref64.abs() * 2 ** -7 + (xa @ wa.T) * 2 ** -10
    err = (got - ref64).abs()
    assert (err <= tol).all(), f"{int((err > tol).sum())} elements off, worst {float((err / tol).max()):.2f}x tol"


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.value)
@pytest.mark.parametrize("n,k", SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize("m", MS)
def test_matches_reference(m, n, k, recipe):
    op = _op(n, k, recipe)
    xc, xs, wc, ws = _inputs(m, n, k, recipe, seed=m * 7919 + n + k)
    out = _poisoned(m, n)
    op(xc, xs, wc, ws, out)
    torch.cuda.synchronize()
    _check(out, xc, xs, wc, ws, recipe)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.value)
@pytest.mark.parametrize("m", (1, 37, 128))
def test_ring_wraps_many_times(m, recipe):
    """split = 1 over K = 7168: 56 K blocks through a 6-8 stage ring, so the empty/full barrier
    phases flip many times; also split 8 (7 blocks per CTA) and split 5 (uneven K ranges)."""
    n, k = RING
    xc, xs, wc, ws = _inputs(m, n, k, recipe, seed=100 + m)
    for split in (1, 5, 8):
        out = _poisoned(m, n)
        _op(n, k, recipe)(xc, xs, wc, ws, out, split=split)
        torch.cuda.synchronize()
        _check(out, xc, xs, wc, ws, recipe)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.value)
@pytest.mark.parametrize("n,k", (RING, (7168, 1536), (200, 272)), ids=str)
@pytest.mark.parametrize("m", (1, 8, 37, 128, 200))
def test_streaming_mode_every_cta_count(m, n, k, recipe):
    """Streaming (persistent) mode forced at CTA counts that put range boundaries everywhere: one
    CTA walking every tile (ring wraps across tiles), a few CTAs (tiles split 2-3 ways, segments of
    uneven length), one per SM (segments of 1-5 blocks); M > 128 walks two token tiles. The result
    is bitwise the same on a second launch (fixed-order reduction, counters reset by the kernel)."""
    op = _op(n, k, recipe)
    xc, xs, wc, ws = _inputs(m, n, k, recipe, seed=300 + m + n)
    for ctas in (1, 3, 7, 50, op.sm_count):
        out = _poisoned(m, n)
        op(xc, xs, wc, ws, out, ctas=ctas)
        torch.cuda.synchronize()
        _check(out, xc, xs, wc, ws, recipe)
        again = _poisoned(m, n)
        op(xc, xs, wc, ws, again, ctas=ctas)
        torch.cuda.synchronize()
        assert torch.equal(out, again), ctas
    assert int(op._workspace(out.device.index)[1].abs().sum()) == 0   # every counter back at zero


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.value)
@pytest.mark.parametrize("n,k", TINY, ids=str)
def test_tiny_shapes_smaller_than_one_tile(n, k, recipe):
    for m in (1, 3, 20):
        xc, xs, wc, ws = _inputs(m, n, k, recipe, seed=300 + m + n)
        out = _poisoned(m, n)
        _op(n, k, recipe)(xc, xs, wc, ws, out)
        torch.cuda.synchronize()
        _check(out, xc, xs, wc, ws, recipe)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.value)
def test_new_activation_buffers_of_other_sizes(recipe):
    """Tensor maps are cached by pointer and shape: a new M at a reused address must not replay a
    stale map (rows past the old M would be zero-filled or read out of bounds)."""
    n, k = 200, 272
    op = _op(n, k, recipe)
    for m in (5, 40, 5, 130, 1):
        xc, xs, wc, ws = _inputs(m, n, k, recipe, seed=200 + m)
        out = _poisoned(m, n)
        op(xc, xs, wc, ws, out)
        torch.cuda.synchronize()
        _check(out, xc, xs, wc, ws, recipe)
        del xc, xs, out


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.value)
def test_every_split_and_small_tile_agree(recipe):
    n, k, m = 200, 272, 33
    xc, xs, wc, ws = _inputs(m, n, k, recipe, seed=5)
    outs = []
    for split in (1, 2, 3):
        out = _poisoned(m, n)
        _op(n, k, recipe)(xc, xs, wc, ws, out, split=split)
        outs.append(out)
    out16 = _poisoned(m, n)
    _op(n, k, recipe, 16)(xc, xs, wc, ws, out16)
    torch.cuda.synchronize()
    for o in outs + [out16]:
        _check(o, xc, xs, wc, ws, recipe)
    # Split-K reduces in rank order inside the cluster: deterministic run to run.
    again = _poisoned(m, n)
    _op(n, k, recipe)(xc, xs, wc, ws, again, split=3)
    torch.cuda.synchronize()
    assert torch.equal(again, outs[2])


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.value)
@pytest.mark.parametrize("n,k", SHAPES, ids=lambda v: str(v))
def test_rows_are_invariant_to_the_batch_within_one_token_tile(n, k, recipe):
    """A row's bits do not depend on the other rows of the launch for M <= 128 (every token tile
    width, the planned split): decode (M = B) and verify (M = B (1 + drafts)) agree bit for bit."""
    xc, xs, wc, ws = _inputs(128, n, k, recipe, seed=n + 3 * k)
    full = _poisoned(128, n)
    _op(n, k, recipe)(xc, xs, wc, ws, full)
    for m in (1, 2, 4, 8, 13, 16, 32, 33, 64, 100):
        out = _poisoned(m, n)
        _op(n, k, recipe)(xc[:m].contiguous(), xs[:m].contiguous(), wc, ws, out)
        torch.cuda.synchronize()
        assert torch.equal(out, full[:m]), f"M={m}: rows differ from the same rows at M=128"


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.value)
@pytest.mark.parametrize("streaming", (False, True), ids=("cluster", "streaming"))
@pytest.mark.parametrize("n,k,m", [(2304, 1536, 8), (200, 272, 1), (7168, 1536, 128), (1536, 7168, 1)], ids=str)
def test_graph_replay(n, k, m, recipe, streaming):
    """Cluster split-K (the default plan) and the opt-in streaming mode: q_b, one K block per CTA
    ragged (M = 1), nt = 128 (o_proj TP8) and nt = 8 (q_a: 12 tiles over 132 streaming CTAs, every
    tile reduced by counters)."""
    op = _op(n, k, recipe)
    kw = {"ctas": op.sm_count} if streaming else {}
    assert (op.plan_for(m, **kw).ctas > 0) == streaming
    xc, xs, wc, ws = _inputs(m, n, k, recipe, seed=11)
    out = _poisoned(m, n)
    fp8_gemm_graph_replay(lambda: op(xc, xs, wc, ws, out, **kw), out, xc, xs,
                          lambda: _inputs(m, n, k, recipe, seed=12)[:2],
                          lambda o: _check(o, xc, xs, wc, ws, recipe))


@pytest.mark.parametrize("recipe", tuple(ScaleRecipe), ids=lambda r: r.value)
def test_l2_prefetch_changes_nothing(recipe):
    """Plan.pf only adds L2 prefetches: bitwise the same output in both modes, also when the
    prefetch distance runs past the CTA's K range and the tensor (ragged N/K, M = 33)."""
    m, (n, k) = 33, RING
    xc, xs, wc, ws = _inputs(m, n, k, recipe, seed=71)
    op = _op(n, k, recipe)
    for kw in ({}, {"split": 1}, {"split": 3}, {"ctas": 7}):
        ref = _poisoned(m, n)
        op(xc, xs, wc, ws, ref, **kw)
        _check(ref, xc, xs, wc, ws, recipe)
        for pf in (1, 12, 64):
            out = _poisoned(m, n)
            op(xc, xs, wc, ws, out, pf=pf, **kw)
            torch.cuda.synchronize()
            assert torch.equal(out, ref), (kw, pf)


@pytest.mark.parametrize("recipe", tuple(ScaleRecipe), ids=lambda r: r.value)
@pytest.mark.parametrize("n,k", (RING, (200, 272), (7168, 1536)), ids=str)
def test_pretiled_weights_give_the_same_bits(n, k, recipe):
    """W pre-tiled into contiguous, pre-swizzled 16 KB tiles (zero-padded at ragged N / K), loaded
    by one bulk copy per stage, lands in shared memory as the TMA boxes of the row-major W do:
    bitwise the same output, every split and M (a wrong swizzle permutes K within rows)."""
    op = _op(n, k, recipe)
    for m in (1, 8, 33, 128):
        xc, xs, wc, ws = _inputs(m, n, k, recipe, seed=81 + m)
        wt = op.tile_weights(wc)
        for split in (None, 1, 2):
            ref, out = _poisoned(m, n), _poisoned(m, n)
            op(xc, xs, wc, ws, ref, split=split)
            op(xc, xs, wt, ws, out, split=split, w_tiled=True)
            torch.cuda.synchronize()
            _check(ref, xc, xs, wc, ws, recipe)
            assert torch.equal(out, ref), (m, split)
    with pytest.raises(SpecError):
        op(xc, xs, wc, ws, out, w_tiled=True)           # row-major codes where tiles are expected
    with pytest.raises(SpecError):
        op(xc, xs, wt, ws, out, w_tiled=True, ctas=4)   # the streaming mode reads row-major W only


def test_recipe_mismatch_and_shape_checks():
    op = _op(2304, 1536, ScaleRecipe.FP32)
    xc, xs, wc, ws = _inputs(4, 2304, 1536, ScaleRecipe.UE8M0, seed=3)
    out = _poisoned(4, 2304)
    with pytest.raises(SpecError, match="x_scales.dtype"):
        op(xc, xs, wc, ws, out)
    xc, xs, wc, ws = _inputs(4, 2304, 1536, ScaleRecipe.FP32, seed=3)
    with pytest.raises(SpecError, match="out"):
        op(xc, xs, wc, ws, out[:, :2296])
    with pytest.raises(SpecError, match="split"):
        op(xc, xs, wc, ws, out, split=9)
    with pytest.raises(SpecError, match="ctas"):
        op(xc, xs, wc, ws, out, ctas=op.sm_count + 1)
    with pytest.raises(SpecError, match="ctas"):
        op(xc, xs, wc, ws, out, split=2, ctas=4)
    with pytest.raises(SpecError, match="x_codes"):
        buf = torch.zeros(4 * 1536 + 16, dtype=torch.uint8, device="cuda")
        op(buf[1:1 + 4 * 1536].view(4, 1536), xs, wc, ws, out)   # TMA needs 16-byte-aligned rows
    with pytest.raises(SpecError, match="w_codes"):
        op(xc, xs, wc[:, :1520], ws, out)


def test_empty_batch_launches_nothing():
    op = _op(200, 272, ScaleRecipe.FP32)
    xc, xs, wc, ws = _inputs(1, 200, 272, ScaleRecipe.FP32, seed=1)
    op(xc[:0], xs[:0], wc, ws, torch.empty(0, 200, dtype=torch.bfloat16, device="cuda"))
    torch.cuda.synchronize()


def test_sanitize_small_ragged_case():
    """Small enough for `compute-sanitizer --tool memcheck pytest -k sanitize` (racecheck too):
    ragged N and K, a partial token tile, a 3-CTA cluster."""
    for recipe in RECIPES:
        xc, xs, wc, ws = _inputs(3, 200, 272, recipe, seed=9)
        out = _poisoned(3, 200)
        _op(200, 272, recipe)(xc, xs, wc, ws, out, split=3)
        torch.cuda.synchronize()
        _check(out, xc, xs, wc, ws, recipe)
