"""fp8_block_gemm's tcgen05 kernel (CuTe DSL, sm103/sm107 cubins) on a Blackwell/Rubin GPU against
the FP32 reference and a float64 product of the dequantized operands: both scale recipes, M in
{1, 2, 7, 8, 33, 128}, ragged N and K, CUDA-graph replay, poisoned outputs, typed errors.

Skipped unless the device's compute capability matches a tcgen05 target (10.3 or 10.7): the cubins
are arch-specific (sm_103a / sm_107a) and nothing here runs on the H200."""
from __future__ import annotations

import functools

import pytest
import torch

from k3gen.errors import SpecError
from k3gen.ir.dtypes import ScaleRecipe
from k3gen.ops.fp8_block_gemm.spec import Fp8BlockGemmSpec
from k3gen.ops.fp8_block_gemm.launcher import Fp8BlockGemm
from k3gen.targets import TARGETS
from helpers import fp8_gemm_close, fp8_gemm_graph_replay, fp8_gemm_inputs as _inputs, poisoned_bf16 as _poisoned

pytestmark = pytest.mark.gpu

TARGET_BY_CC = {(10, 3): TARGETS["sm103-nvfp4"], (10, 7): TARGETS["sm107-nvfp4"]}
MS = (1, 2, 7, 8, 33, 128)
SHAPES = ((2304, 1536), (200, 272), (7168, 1536))   # q_b TP8, ragged edges, o_proj TP8
TILE = {ScaleRecipe.UE8M0: (64, 128), ScaleRecipe.FP32: (32, 64)}
BF16_REL_RMS = 1e-2


def _target():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    cc = torch.cuda.get_device_capability()
    if cc not in TARGET_BY_CC:
        pytest.skip(f"compute capability {cc}: the tcgen05 cubins are for sm_103a / sm_107a")
    return TARGET_BY_CC[cc]


@functools.lru_cache(maxsize=None)
def _op(n, k, recipe, bm) -> Fp8BlockGemm:
    target = _target()
    op = Fp8BlockGemm(Fp8BlockGemmSpec(target=target, n=n, k=k, recipe=recipe, bm=bm)).load()
    assert op.spec.lowering == "cute" and op.meta["params"]["arch"] == target.arch
    return op


def _check(out, xc, xs, wc, ws, recipe):
    got, ref64 = fp8_gemm_close(out, xc, xs, wc, ws, recipe, BF16_REL_RMS)
    tol = ref64.abs() * 2 ** -7 + ref64.abs().amax(dim=1, keepdim=True) * 1e-4
    assert ((got - ref64).abs() <= tol).all()


@pytest.mark.parametrize("recipe", tuple(ScaleRecipe), ids=lambda r: r.value)
@pytest.mark.parametrize("n,k", SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize("m", MS)
def test_tcgen05_matches_reference(m, n, k, recipe):
    for bm in TILE[recipe]:
        xc, xs, wc, ws = _inputs(m, n, k, recipe, seed=m * 7919 + n + k + bm)
        out = _poisoned(m, n)
        _op(n, k, recipe, bm)(xc, xs, wc, ws, out)
        torch.cuda.synchronize()
        _check(out, xc, xs, wc, ws, recipe)


@pytest.mark.parametrize("recipe", tuple(ScaleRecipe), ids=lambda r: r.value)
def test_tcgen05_graph_replay(recipe):
    n, k, m = 2304, 1536, 8
    op = _op(n, k, recipe, TILE[recipe][0])
    xc, xs, wc, ws = _inputs(m, n, k, recipe, seed=11)
    out = _poisoned(m, n)
    fp8_gemm_graph_replay(lambda: op(xc, xs, wc, ws, out), out, xc, xs,
                          lambda: _inputs(m, n, k, recipe, seed=12)[:2],
                          lambda o: _check(o, xc, xs, wc, ws, recipe))


def test_tcgen05_typed_errors():
    op = _op(2304, 1536, ScaleRecipe.UE8M0, 64)
    xc, xs, wc, ws = _inputs(4, 2304, 1536, ScaleRecipe.FP32, seed=3)
    out = _poisoned(4, 2304)
    with pytest.raises(SpecError, match="x_scales.dtype"):
        op(xc, xs, wc, ws, out)
    xc, xs, wc, ws = _inputs(4, 2304, 1536, ScaleRecipe.UE8M0, seed=3)
    with pytest.raises(SpecError, match="out"):
        op(xc, xs, wc, ws, out[:, :2296])
    with pytest.raises(SpecError, match="split"):
        op(xc, xs, wc, ws, out, split=2)


def test_tcgen05_empty_batch_launches_nothing():
    op = _op(200, 272, ScaleRecipe.UE8M0, 64)
    xc, xs, wc, ws = _inputs(1, 200, 272, ScaleRecipe.UE8M0, seed=1)
    op(xc[:0], xs[:0], wc, ws, torch.empty(0, 200, dtype=torch.bfloat16, device="cuda"))
    torch.cuda.synchronize()
