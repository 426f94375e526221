"""fp8_block_gemm on the CPU: spec validation and recipe pairing, the UE8M0 conversion against an
independent construction, the weight quantizer, and the reference against a float64 product and
the unquantized matmul. The kernels' plans and compiles: test_fp8_gemm_wgmma.py (sm90) and
test_fp8_block_gemm_tcgen05_spec.py (sm103/sm107)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from k3gen.errors import SpecError
from k3gen.ir.dtypes import ScaleRecipe
from k3gen.ops.act_quant_fp8.spec import ActQuantFp8Spec
from k3gen.ops.fp8_block_gemm.spec import Fp8BlockGemmSpec
from k3gen.ops.fp8_block_gemm.reference import (dequantize_weights, fp8_block_gemm, quantize_activations,
                                            quantize_weights)
from k3gen.numerics import ue8m0_decode, ue8m0_encode
from k3gen.ops.fp8_block_gemm.launcher import Fp8BlockGemm
from k3gen.targets import TARGETS

SM90, SM103 = TARGETS["sm90"], TARGETS["sm103-nvfp4"]
RECIPES = tuple(ScaleRecipe)


def test_recipe_defaults_to_the_target():
    assert Fp8BlockGemmSpec(target=SM90, n=256, k=256).recipe is ScaleRecipe.FP32
    assert Fp8BlockGemmSpec(target=SM103, n=256, k=256).recipe is ScaleRecipe.UE8M0


@pytest.mark.parametrize("field,value", [("n", 0), ("n", 100), ("k", 8), ("k", 1000), ("bm", 128), ("stages", 2),
                                         ("recipe", "fp16")])
def test_illegal_fields(field, value):
    kw = dict(n=256, k=256)
    kw[field] = value
    with pytest.raises(SpecError, match=f"{field}="):
        Fp8BlockGemmSpec(target=SM90, **kw)


def test_edges_not_multiples_of_128_are_legal():
    s = Fp8BlockGemmSpec(target=SM90, n=200, k=272)
    assert (s.n_blocks, s.k_blocks) == (2, 3)


@pytest.mark.parametrize("gemm_recipe", RECIPES, ids=lambda r: r.value)
def test_recipe_mismatch_is_a_spec_error(gemm_recipe):
    other = next(r for r in RECIPES if r is not gemm_recipe)
    g = Fp8BlockGemmSpec(target=SM90, n=256, k=1536, recipe=gemm_recipe)
    g.check_activations(ActQuantFp8Spec(target=SM90, k=1536, recipe=gemm_recipe))
    with pytest.raises(SpecError, match="act.recipe"):
        g.check_activations(ActQuantFp8Spec(target=SM90, k=1536, recipe=other))
    with pytest.raises(SpecError, match="act.k"):
        g.check_activations(ActQuantFp8Spec(target=SM90, k=7168, recipe=gemm_recipe))
    # The launcher rejects scale tensors of the other recipe before touching any device.
    op = Fp8BlockGemm(g)
    x = torch.randn(3, 1536)
    w = torch.randn(256, 1536)
    xc, xs = quantize_activations(x, other)
    wc, ws = quantize_weights(w, gemm_recipe)
    out = torch.empty(3, 256, dtype=torch.bfloat16)
    with pytest.raises(SpecError, match="x_scales.dtype"):
        op.check(xc, xs, wc, ws, out)
    xc, xs = quantize_activations(x, gemm_recipe)
    wc, ws = quantize_weights(w, other)
    with pytest.raises(SpecError, match="w_scales.dtype"):
        op.check(xc, xs, wc, ws, out)
    assert op._kernel is None  # nothing was loaded


def _ue8m0_independent(t: float) -> int:
    """Byte of 2^ceil(log2 t) via math.frexp (t = f * 2^e, 0.5 <= f < 1), clamped like the spec."""
    if t <= 0.0:
        return 0
    f, e = math.frexp(t)
    c = e - 1 if f == 0.5 else e
    return max(0, min(254, c + 127))


def test_ue8m0_conversion_is_bit_exact():
    rng = np.random.default_rng(0)
    with np.errstate(over="ignore"):   # 448 * 2^127 overflows FP32 and is dropped below
        amax = np.concatenate([
            rng.lognormal(0.0, 8.0, 4000), 2.0 ** np.arange(-140, 128, dtype=np.float64) * 448.0,
            np.nextafter(np.float32(448.0 * 2.0 ** np.arange(-20, 20)), np.float32(np.inf)),
            np.array([0.0, 1e-45, 1e-40, 3.0e38, 448.0, 449.0]),
        ]).astype(np.float32)
    amax = amax[np.isfinite(amax)]
    t = (torch.from_numpy(amax) / torch.full((amax.size,), 448.0)).contiguous()
    got = ue8m0_encode(t)
    want = torch.tensor([_ue8m0_independent(float(v)) for v in t.tolist()], dtype=torch.uint8)
    assert torch.equal(got, want), (got != want).nonzero()[:5]
    # The decoded value is exactly the power of two ml_dtypes' E8M0 type holds for that byte.
    import ml_dtypes
    b = np.arange(0, 255, dtype=np.uint8)
    ml = b.view(ml_dtypes.float8_e8m0fnu).astype(np.float64)
    assert np.array_equal(ue8m0_decode(torch.from_numpy(b)).double().numpy(), ml)
    # And it is a scale that never clips: t <= 2^ceil(log2 t).
    pos = t > 0
    assert (ue8m0_decode(got)[pos] >= t[pos]).all()


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.value)
def test_weight_quantizer_tiles_and_power_of_two(recipe):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(200, 272, generator=g) * torch.logspace(-3, 3, 200).unsqueeze(1)
    codes, scales = quantize_weights(w, recipe)
    assert codes.shape == (200, 272) and scales.shape == (2, 3)
    if recipe is ScaleRecipe.UE8M0:
        assert scales.dtype == torch.uint8
        v = ue8m0_decode(scales)
        assert torch.equal(v, torch.exp2(torch.log2(v).round()))   # powers of two
    else:
        assert scales.dtype == torch.float32
    deq = dequantize_weights(codes, scales, recipe)
    rel = (deq - w).abs() / w.abs().amax(dim=1, keepdim=True)
    assert rel.max() < 2 ** -4   # E4M3 keeps 3 mantissa bits of each tile's range


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.value)
@pytest.mark.parametrize("m,n,k", [(1, 256, 256), (7, 200, 272), (33, 2304, 1536)])
def test_reference_against_float64_and_plain_matmul(m, n, k, recipe):
    g = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    w = torch.randn(n, k, generator=g) * 0.05
    xc, xs = quantize_activations(x, recipe)
    wc, ws = quantize_weights(w, recipe)
    y32 = fp8_block_gemm(xc, xs, wc, ws, recipe)
    y64 = fp8_block_gemm(xc, xs, wc, ws, recipe, dtype=torch.float64)
    assert y32.dtype == torch.float32 and y64.dtype == torch.float64
    assert ((y32.double() - y64).norm() / y64.norm()) < 1e-6
    exact = x.double() @ w.double().T
    assert ((y64 - exact).norm() / exact.norm()) < 0.08   # two E4M3 roundings
