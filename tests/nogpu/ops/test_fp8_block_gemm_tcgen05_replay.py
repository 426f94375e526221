"""The tcgen05 TMA GEMM's index math (sm103/sm107, variant "tcgen05_tma") replayed on the CPU
against the wgmma kernel's plan: a row-invariant one-wave split, the same K-block
ranges per rank (the wgmma kernel's `rank * KB / split`), TMA boxes at (kb * 128, tile * rows)
zero-filled past N/M/K, the FP32 partial written token-major and summed over ranks in rank order
by the cluster combine's element walk. The replay produces the GEMM and is checked against the FP32
reference, so a wrong coordinate, range or combine index shows up as a wrong output (or an
unwritten NaN), not only as an inequality of formulas. No GPU, no CuTe DSL."""
from __future__ import annotations

import pytest
import torch

from k3gen.errors import SpecError
from k3gen.ir.dtypes import ScaleRecipe
from k3gen.numerics import e4m3_decode
from k3gen.ops.fp8_block_gemm.reference import fp8_block_gemm, quantize_activations, quantize_weights
from k3gen.ops.fp8_block_gemm.spec import (BLOCK, TC_TILE_N, Fp8BlockGemmSpec, cdiv, choose_split_tiles,
                                           k_range)
from k3gen.pipeline.cute import PACKAGE_DIR
from k3gen.targets import FP8_GEMM_TP1, FP8_GEMM_TP8, TARGETS
from tests.numerics import assert_close, poison

THREADS = 288          # the kernel's block (every thread walks the combine)
TC = ("sm103-nvfp4", "sm107-nvfp4")
SMS = (148, 160)       # B300-class SM counts; the plan takes the count from the launcher


def test_the_split_is_row_invariant_and_one_wave():
    # Like the wgmma plan: within M <= 128 the split depends on (N, K) only (decode and verify rows
    # reduce alike, issue 27), and it is the shared rule at the range's worst-case tile count.
    for name in TC:
        for n, k in FP8_GEMM_TP8 + FP8_GEMM_TP1:
            tc = Fp8BlockGemmSpec(target=TARGETS[name], n=n, k=k)
            assert tc.mma == "tcgen05_tma"
            for sms in SMS:
                small = {tc.plan(m, sms).split for m in range(1, 129)}
                assert len(small) == 1, (name, n, k, sms, small)
                worst = cdiv(n, TC_TILE_N) * cdiv(128, tc.bm)
                assert small == {choose_split_tiles(k, worst, tc.bm, sms)}
                for m in (1, 7, 33, 64, 65, 128, 129, 300):
                    p = tc.plan(m, sms)
                    assert p.grid == (p.split, cdiv(m, tc.bm), cdiv(n, TC_TILE_N)) and p.nt == tc.bm
                    assert 1 <= p.split <= min(4, tc.k_blocks)
                    if p.split > 1:
                        assert p.split * p.grid[1] * p.grid[2] <= sms, "a split grid stays one wave"


def test_k_ranges_are_the_wgmma_kernels():
    # The wgmma kernel's own line (a change there must be made in k_range too), and the TMA
    # kernel's use of k_range.
    cuh = (PACKAGE_DIR / "include" / "k3gen" / "gemm" / "fp8_wgmma.cuh").read_text()
    assert "const int kb0 = rank * KB / split, nk = (rank + 1) * KB / split - kb0;" in cuh
    cute = (PACKAGE_DIR / "ops" / "fp8_block_gemm" / "cute_kernel.py").read_text()
    assert "kb_begin, n_kb = k_range(bx, split, self.k_blocks)" in cute
    for kb in range(1, 70):
        for split in range(1, min(8, kb) + 1):
            ranges = [k_range(r, split, kb) for r in range(split)]
            assert ranges[0][0] == 0 and sum(nk for _, nk in ranges) == kb
            assert all(nk >= 1 for _, nk in ranges)
            assert all(a + na == b for (a, na), (b, _) in zip(ranges, ranges[1:]))
            assert ranges == [(r * kb // split, (r + 1) * kb // split - r * kb // split) for r in range(split)]


def test_plan_refuses_what_the_kernel_lacks():
    s = Fp8BlockGemmSpec(target=TARGETS["sm103-nvfp4"], n=256, k=512)
    with pytest.raises(SpecError, match="ctas"):
        s.plan(8, 148, ctas=64)
    with pytest.raises(SpecError, match="split"):
        s.plan(8, 148, split=5)          # more ranks than K blocks
    with pytest.raises(SpecError, match="stages"):
        Fp8BlockGemmSpec(target=TARGETS["sm103-nvfp4"], n=256, k=512, bm=128, stages=3)


def _box(t: torch.Tensor, row0: int, col0: int, rows: int) -> torch.Tensor:
    """A TMA box of rows x 128 at (col0, row0), zero past the tensor (OOB fill)."""
    out = torch.zeros(rows, BLOCK, dtype=t.dtype)
    piece = t[row0:row0 + rows, col0:col0 + BLOCK]
    out[:piece.shape[0], :piece.shape[1]] = piece
    return out


def replay(spec: Fp8BlockGemmSpec, xq, xs, wq, ws, m: int, split: int) -> torch.Tensor:
    """The kernel's walk, CTA by CTA: loads, per-rank K ranges, partials, the combine and stores."""
    ue8m0 = spec.recipe is ScaleRecipe.UE8M0
    dec = (lambda s: torch.exp2(s.double() - 127)) if ue8m0 else (lambda s: s.double())
    xf, wf = e4m3_decode(xq).double(), e4m3_decode(wq).double()
    grid = spec.plan(m, 148, split=split).grid
    out = poison(torch.empty(m, spec.n, dtype=torch.float64))
    written = torch.zeros(m, spec.n, dtype=torch.int32)
    for by in range(grid[1]):
        for bz in range(grid[2]):
            m0, n0 = by * spec.bm, bz * TC_TILE_N
            red = []
            for bx in range(grid[0]):
                kb0, nk = k_range(bx, split, spec.k_blocks)
                acc = torch.zeros(TC_TILE_N, spec.bm, dtype=torch.float64)    # TMEM: rows x tokens
                for kb in range(kb0, kb0 + nk):
                    a = _box(wf, n0, kb * BLOCK, TC_TILE_N)
                    b = _box(xf, m0, kb * BLOCK, spec.bm)
                    xsb = torch.ones(spec.bm, dtype=torch.float64)
                    rows = min(spec.bm, m - m0)
                    xsb[:rows] = dec(xs[m0:m0 + rows, kb])
                    acc += (a @ b.T) * dec(ws[bz, kb]) * xsb[None, :]
                red.append(acc.T.reshape(-1))          # red[token * 128 + row]
            mt = min(m - m0, spec.bm)
            if split == 1:
                for row in range(TC_TILE_N):
                    for col in range(spec.bm):
                        if n0 + row < spec.n and m0 + col < m:
                            out[m0 + col, n0 + row] = acc[row, col]
                            written[m0 + col, n0 + row] += 1
                continue
            for bx in range(split):
                for tid in range(THREADS):
                    for it in range(bx * THREADS + tid, mt * TC_TILE_N, split * THREADS):
                        mm, r = divmod(it, TC_TILE_N)
                        if n0 + r < spec.n:
                            v = 0.0
                            for q in range(split):     # rank order
                                v += float(red[q][it])
                            out[m0 + mm, n0 + r] = v
                            written[m0 + mm, n0 + r] += 1
    assert torch.equal(written, torch.ones_like(written)), "every output written exactly once"
    return out.to(torch.bfloat16)


CASES = [(name, r, n, k, m, bm) for name in TC[:1] for r, bm in ((ScaleRecipe.UE8M0, 64), (ScaleRecipe.FP32, 32))
         for n, k, m in ((200, 272, 5), (256, 640, 70))] + [("sm107-nvfp4", ScaleRecipe.UE8M0, 136, 400, 129, 128)]


@pytest.mark.parametrize("name,recipe,n,k,m,bm", CASES)
def test_replay_matches_the_reference(name, recipe, n, k, m, bm):
    spec = Fp8BlockGemmSpec(target=TARGETS[name], n=n, k=k, recipe=recipe, bm=bm)
    g = torch.Generator().manual_seed(n * 7 + k + m)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g) * 0.05
    xq, xs = quantize_activations(x, recipe)
    wq, ws = quantize_weights(w, recipe)
    ref = fp8_block_gemm(xq, xs, wq, ws, recipe, dtype=torch.float64)
    for split in sorted({1, 2, min(4, spec.k_blocks), spec.plan(m, 148).split}):
        assert_close(replay(spec, xq, xs, wq, ws, m, split), ref, "bf16", what=f"split {split}")
