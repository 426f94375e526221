"""Bit-exact checks of k3gen.numerics against independent constructions.

Independent = ml_dtypes casts (float8_e4m3fn, float4_e2m1fn, float8_e8m0fnu) and brute-force
nearest-grid search in float64 with ties to the even code, on numpy (not torch) arithmetic.
"""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from k3gen.ir.dtypes import E2M1_GRID, ScaleRecipe
from k3gen import numerics as Q
E4M3_GRID = np.array([np.float64(np.uint8(c).view(ml_dtypes.float8_e4m3fn)) for c in range(0x7F)])


def _nearest_even(a: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """Index of the nearest grid magnitude to |a| (float64 exact here); ties go to the even index."""
    d = np.abs(np.abs(a.astype(np.float64))[:, None] - grid[None, :])
    best = d.min(axis=1, keepdims=True)
    cand = d == best
    idx = np.argmax(cand, axis=1)
    two = cand.sum(axis=1) > 1
    # Ties are only ever between neighbours: the even code of the pair wins.
    idx = np.where(two & (idx % 2 == 1), idx + 1, idx)
    return np.minimum(idx, len(grid) - 1)


def _sign(a: np.ndarray, bit: int) -> np.ndarray:
    return np.where(np.signbit(a), bit, 0)


def brute_e4m3(a: np.ndarray) -> np.ndarray:
    a = np.clip(a.astype(np.float32), -448, 448)
    return (_nearest_even(a, E4M3_GRID) | _sign(a, 0x80)).astype(np.uint8)


def brute_e2m1(a: np.ndarray) -> np.ndarray:
    a = np.clip(a.astype(np.float32), -6, 6)
    return (_nearest_even(a, np.array(E2M1_GRID)) | _sign(a, 0x8)).astype(np.uint8)


def mld_e4m3(a: np.ndarray) -> np.ndarray:
    return np.clip(a.astype(np.float32), -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


def mld_e2m1(a: np.ndarray) -> np.ndarray:
    return np.clip(a.astype(np.float32), -6, 6).astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0xF


def ref_e4m3(a: np.ndarray) -> np.ndarray:
    return Q.e4m3_encode(torch.from_numpy(a.astype(np.float32))).numpy()


def ref_e2m1(a: np.ndarray) -> np.ndarray:
    return Q.e2m1_encode(torch.from_numpy(a.astype(np.float32))).numpy()


def all_bf16() -> np.ndarray:
    v = np.arange(1 << 16, dtype=np.uint32) << 16
    f = v.view(np.float32)
    return f[np.isfinite(f)]


def around(points) -> np.ndarray:
    """Each point and its float32 neighbours (the values where RNE decisions flip)."""
    p = np.asarray(points, dtype=np.float32)
    out = [p, np.nextafter(p, np.float32(np.inf)), np.nextafter(p, np.float32(-np.inf))]
    out = np.concatenate(out)
    return np.concatenate([out, -out])


def midpoints(grid) -> np.ndarray:
    g = np.asarray(grid, dtype=np.float64)
    return ((g[1:] + g[:-1]) / 2).astype(np.float32)  # exact: the grids are short dyadics


# -- E4M3 ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,vals", [
    ("all_bf16", all_bf16()),
    ("midpoints", around(np.concatenate([midpoints(E4M3_GRID), E4M3_GRID, [448, 464, 480, 1e30]]))),
])
def test_e4m3_encode_matches_ml_dtypes_and_brute_force(name, vals):
    got = ref_e4m3(vals)
    np.testing.assert_array_equal(got, mld_e4m3(vals))
    np.testing.assert_array_equal(got, brute_e4m3(vals))


def test_e4m3_specials():
    x = np.array([0.0, -0.0, np.inf, -np.inf, 1e-45, -1e-45, 2 ** -10, 2 ** -10 * 1.0000001,
                  3 * 2 ** -10, 464.0, 464.00003], np.float32)
    assert ref_e4m3(x).tolist() == [0x00, 0x80, 0x7E, 0xFE, 0x00, 0x80, 0x00, 0x01, 0x02, 0x7E, 0x7E]
    assert ref_e4m3(np.array([np.nan], np.float32)).tolist() == [0x7F]


def test_e4m3_decode_all_codes():
    codes = np.arange(256, dtype=np.uint8)
    want = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    got = Q.e4m3_decode(torch.from_numpy(codes)).numpy()
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    ok = ~np.isnan(want)
    np.testing.assert_array_equal(got[ok].view(np.uint32), want[ok].view(np.uint32))  # -0 too


def test_e4m3_round_trip_of_codes():
    codes = np.array([c for c in range(256) if c & 0x7F != 0x7F], np.uint8)
    dec = Q.e4m3_decode(torch.from_numpy(codes))
    assert Q.e4m3_encode(dec).numpy().tolist() == codes.tolist()


finite_f32 = st.floats(width=32, allow_nan=False, allow_infinity=True, allow_subnormal=True)


@settings(max_examples=300, deadline=None)
@given(st.lists(finite_f32, min_size=1, max_size=64))
def test_e4m3_fuzz(xs):
    a = np.array(xs, np.float32)
    np.testing.assert_array_equal(ref_e4m3(a), mld_e4m3(a))


# -- E2M1 ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,vals", [
    ("all_bf16", all_bf16()),
    ("midpoints", around(np.concatenate([midpoints(E2M1_GRID), E2M1_GRID, [6, 7, 1e30]]))),
])
def test_e2m1_encode_matches_ml_dtypes_and_brute_force(name, vals):
    got = ref_e2m1(vals)
    np.testing.assert_array_equal(got, mld_e2m1(vals))
    np.testing.assert_array_equal(got, brute_e2m1(vals))


def test_e2m1_ties_and_sign():
    x = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.1, -0.0, 0.0, -7.0, np.inf], np.float32)
    assert ref_e2m1(x).tolist() == [0, 2, 2, 4, 4, 6, 6, 0x8, 0x8, 0, 0xF, 0x7]


@settings(max_examples=300, deadline=None)
@given(st.lists(finite_f32, min_size=1, max_size=64))
def test_e2m1_fuzz(xs):
    a = np.array(xs, np.float32)
    np.testing.assert_array_equal(ref_e2m1(a), brute_e2m1(a))


def test_e2m1_decode_and_pack():
    codes = torch.arange(16, dtype=torch.uint8)
    want = np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    np.testing.assert_array_equal(Q.e2m1_decode(codes).numpy(), want)
    packed = Q.pack_e2m1(codes)
    assert packed.tolist() == [0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE]
    assert Q.unpack_e2m1(packed).tolist() == codes.tolist()


# -- UE8M0 -----------------------------------------------------------------------------------------
def brute_ue8m0(s: float) -> int:
    if math.isnan(s):
        return 255
    if s <= 0:
        return 0
    if math.isinf(s):
        return 254
    m, e = math.frexp(s)  # s = m * 2**e, m in [0.5, 1): exact on doubles
    k = e - 1 if m == 0.5 else e
    return min(max(k + 127, 0), 254)


def test_ue8m0_encode_edges():
    vals = [0.0, -1.0, 1.0, 1.5, 0.75, 2.0 ** -126, 2.0 ** -127, 2.0 ** -127 * 1.5, 1e-45,
            2.0 ** 127, 2.0 ** 127 * 1.01, 3e38, float("inf"), 448 / 448, 1 / 448]
    x = np.array(vals, np.float32)
    got = Q.ue8m0_encode(torch.from_numpy(x)).numpy().tolist()
    assert got == [brute_ue8m0(float(v)) for v in x]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.floats(width=32, min_value=0, allow_nan=False), min_size=1, max_size=32))
def test_ue8m0_fuzz(xs):
    x = np.array(xs, np.float32)
    got = Q.ue8m0_encode(torch.from_numpy(x)).numpy()
    assert got.tolist() == [brute_ue8m0(float(v)) for v in x]
    dec = Q.ue8m0_decode(torch.from_numpy(got)).numpy().astype(np.float64)
    # 2**ceil(log2 s) >= s, and it is the smallest such power (up to the 2**-127 floor).
    assert np.all((dec >= x) | (got == 254))
    assert np.all((dec / 2 < x) | (got == 0))


def test_ue8m0_decode_matches_ml_dtypes():
    b = np.arange(256, dtype=np.uint8)
    want = b.view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    got = Q.ue8m0_decode(torch.from_numpy(b)).numpy()
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(got[:255], want[:255])


# -- NVFP4 -----------------------------------------------------------------------------------------
def np_nvfp4(x: np.ndarray, G: float):
    """Independent NVFP4 block quantizer in numpy FP32 + ml_dtypes + brute-force rounding."""
    G = np.float32(G)
    xb = x.astype(np.float32).reshape(-1, 16)
    amax = np.abs(xb).max(axis=1)
    with np.errstate(over="ignore"):
        s = (amax / np.float32(6)) * G
    sc = mld_e4m3(s)
    d = sc.view(ml_dtypes.float8_e4m3fn).astype(np.float32) / G
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        q = brute_e2m1((xb / d[:, None]).ravel()).reshape(xb.shape)
    q = np.where(d[:, None] == 0, 0, q).astype(np.uint8)
    packed = (q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8)
    return packed.reshape(*x.shape[:-1], -1), sc.reshape(*x.shape[:-1], -1)


def check_nvfp4(x: np.ndarray, G: float):
    p, s = Q.nvfp4_quantize(torch.from_numpy(x), G)
    wp, ws = np_nvfp4(x, G)
    np.testing.assert_array_equal(s.numpy(), ws)
    np.testing.assert_array_equal(p.numpy(), wp)
    assert not torch.isnan(Q.e4m3_decode(s)).any()
    return p, s


@pytest.mark.parametrize("G", [1.0, 2688 / 30, 448 * 6 / 3.0, 1e-3, 1e30])
def test_nvfp4_random_and_edges(G):
    g = np.random.default_rng(0)
    x = (g.standard_normal((64, 64)) * np.exp(g.uniform(-12, 8, (64, 1)))).astype(np.float32)
    x[0] = 0                      # all-zero blocks: scale 0, codes 0
    x[1, :16] = -0.0
    x[2] = 1e-40                  # subnormal
    x[3] = np.float32(3e38) * np.sign(g.standard_normal(64))  # huge: scale saturates at 448
    x[4, :16] = np.array(E2M1_GRID * 2, np.float32) * np.float32(0.25)  # ties after scaling
    check_nvfp4(x, G)


def test_nvfp4_zero_block_codes_are_zero_even_negative():
    x = np.full((1, 16), -0.0, np.float32)
    p, s = check_nvfp4(x, 1.0)
    assert p.tolist() == [[0] * 8] and s.tolist() == [[0]]


def test_nvfp4_dequant_error_bound():
    g = np.random.default_rng(1)
    G = 2688 / 30
    x = g.standard_normal((256, 128)).astype(np.float32)
    p, s = Q.nvfp4_quantize(torch.from_numpy(x), G)
    y = Q.nvfp4_dequantize(p, s, G).numpy()
    d = np.repeat((Q.e4m3_decode(s).numpy() / np.float32(G)), 16, axis=1)
    # Unsaturated: |x - y| <= half the widest E2M1 gap (2) times the step.
    assert np.all(np.abs(x - y) <= d * 1.0 + 1e-12)
    assert np.isfinite(y).all()


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(width=32, min_value=-1e6, max_value=1e6, allow_subnormal=True),
                min_size=16, max_size=16),
       st.sampled_from([1.0, 89.6, 0.01, 1e4]))
def test_nvfp4_fuzz(xs, G):
    check_nvfp4(np.array([xs], np.float32), G)


def test_nvfp4_scale_op_order_is_observable():
    """The reference's `(amax / 6) * G` must be distinguishable from other orders, else the
    bit-exact kernel tests could not catch an order change."""
    G = np.float32(2688 / 30)
    mids = midpoints(E4M3_GRID)
    amax = (mids.astype(np.float64) * 6 / float(G)).astype(np.float32)
    # Values a few ulps around the E4M3 midpoints: where the rounding of `(amax / 6) * G`
    # decides the stored scale.
    amax = np.concatenate([(amax.view(np.int32) + k).view(np.float32) for k in range(-3, 4)])
    ours = Q.nvfp4_scale(torch.from_numpy(amax), float(G))[0].numpy()
    other = mld_e4m3(amax * (G / np.float32(6)))
    assert (ours != other).any()
    np.testing.assert_array_equal(ours, mld_e4m3((amax / np.float32(6)) * G))


def test_division_not_reciprocal():
    """Codes use IEEE x / d; a reciprocal multiply gives other bits near the decision points."""
    d = np.float32(0.3)
    base = (midpoints(E2M1_GRID).astype(np.float64) * float(d)).astype(np.float32)
    x = np.concatenate([(base.view(np.int32) + k).view(np.float32) for k in range(-3, 4)])
    codes = Q.e2m1_quantize_step(torch.from_numpy(x), torch.tensor(d)).numpy()
    np.testing.assert_array_equal(codes, brute_e2m1(x / d))
    assert (brute_e2m1(x / d) != brute_e2m1(x * (np.float32(1) / d))).any()


# -- MXFP4 -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("rounding", ["ceil", "floor"])
def test_mxfp4(rounding):
    g = np.random.default_rng(4)
    x = (g.standard_normal((32, 64)) * np.exp(g.uniform(-20, 20, (32, 1)))).astype(np.float32)
    x[0] = 0
    p, sb = Q.mxfp4_quantize(torch.from_numpy(x), rounding=rounding)
    xb = x.reshape(-1, 32)
    amax = np.abs(xb).max(axis=1)
    if rounding == "ceil":
        want_sb = np.array([brute_ue8m0(float(v)) for v in (amax / np.float32(6))], np.uint8)
    else:
        want_sb = np.array([0 if a == 0 else min(max(math.frexp(float(a))[1] - 1 - 2 + 127, 0), 254)
                            for a in amax], np.uint8)
    np.testing.assert_array_equal(sb.numpy().ravel(), want_sb)
    s = want_sb.view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    q = brute_e2m1((xb / s[:, None]).ravel()).reshape(xb.shape)
    np.testing.assert_array_equal(Q.unpack_e2m1(p).numpy().reshape(xb.shape), q)
    y = Q.mxfp4_dequantize(p, sb).numpy().reshape(xb.shape)
    assert np.isfinite(y).all()
    if rounding == "ceil":  # never clips: error within one grid gap of the scaled block
        assert np.all(np.abs(xb - y) <= s[:, None] * 1.0)


# -- FP8 per group ---------------------------------------------------------------------------------
@pytest.mark.parametrize("recipe", [ScaleRecipe.FP32, ScaleRecipe.UE8M0])
def test_fp8_group(recipe):
    g = np.random.default_rng(5)
    x = (g.standard_normal((16, 512)) * np.exp(g.uniform(-30, 30, (16, 1)))).astype(np.float32)
    x[0] = 0
    x[1] = 1e-40
    x[2, :128] = 3e38
    codes, s = Q.fp8_group_quantize(torch.from_numpy(x), 128, recipe)
    xb = x.reshape(16, 4, 128)
    amax = np.abs(xb).max(axis=2)
    if recipe is ScaleRecipe.FP32:
        ws = amax / np.float32(448)
        np.testing.assert_array_equal(s.numpy(), ws)
    else:
        wb = np.array([brute_ue8m0(float(v)) for v in (amax / np.float32(448)).ravel()], np.uint8)
        np.testing.assert_array_equal(s.numpy().ravel(), wb)
        ws = wb.view(ml_dtypes.float8_e8m0fnu).astype(np.float32).reshape(16, 4)
    with np.errstate(divide="ignore", invalid="ignore"):
        want = mld_e4m3(xb / ws[..., None])
    want = np.where(ws[..., None] == 0, 0, want).reshape(16, 512)
    np.testing.assert_array_equal(codes.numpy(), want)
    y = Q.fp8_group_dequantize(codes, s, 128, recipe).numpy()
    assert np.isfinite(y).all() and not np.isnan(s.numpy().astype(np.float32)).any()
    ok = amax.repeat(128, axis=1) > 1e-30
    rel = np.abs(y - x)[ok] / np.abs(x)[ok].clip(min=amax.repeat(128, axis=1)[ok] / 448 * 64)
    assert rel.max() <= 2 ** -4 + 1e-6


def test_tensors_on_other_shapes_and_dtypes():
    x = torch.randn(3, 5, 32, dtype=torch.bfloat16)
    p, s = Q.nvfp4_quantize(x, 10.0)
    assert p.shape == (3, 5, 16) and s.shape == (3, 5, 2) and p.dtype == torch.uint8
    with pytest.raises(ValueError):
        Q.nvfp4_quantize(torch.zeros(3, 20), 1.0)
