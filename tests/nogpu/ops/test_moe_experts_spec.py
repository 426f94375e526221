"""moe_experts on the CPU: spec validation, the launch geometry (work items cover every routed slot
once), the register decode replayed bit for bit against numerics.py's decoders, and the FP32
reference against an independent FP64 NumPy formula."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from k3gen.errors import SpecError
from k3gen.ir.dtypes import ScaleRecipe
from k3gen.numerics import (e2m1_decode, e4m3_decode, fp8_group_quantize, mxfp4_quantize, nvfp4_quantize,
                            ue8m0_decode)
from k3gen.ops import spec_from_canonical
from k3gen.ops.moe_experts.reference import dequantize, moe_experts
from k3gen.ops.moe_experts.spec import ActFormat, GluAct, MoeExpertsSpec, WeightFormat
from k3gen.ops.moe_route.reference import grouped_order
from k3gen.targets import TARGETS
from numerics import assert_close

SM90 = TARGETS["sm90"]
FP4_HEADER = Path(__file__).resolve().parents[3] / "k3gen/include/k3gen/moe/fp4.cuh"
K3_TP8 = dict(hidden=3584, inter=384, experts=896, top_k=16)
K3_EP8 = dict(hidden=3584, inter=3072, experts=112, route_experts=896, top_k=16)


def spec(**kw) -> MoeExpertsSpec:
    kw.setdefault("weights", WeightFormat.MXFP4)
    return MoeExpertsSpec(target=SM90, **kw)


@pytest.mark.parametrize("kw,field", [
    (dict(hidden=100, inter=384, experts=8, top_k=2), "hidden"),
    (dict(hidden=0, inter=384, experts=8, top_k=2), "hidden"),
    (dict(hidden=3584 + 32, inter=384, experts=8, top_k=2, act=ActFormat.FP8), "hidden"),
    (dict(hidden=3584, inter=48, experts=8, top_k=2), "inter"),
    (dict(hidden=3584, inter=384, experts=0, top_k=2), "experts"),
    (dict(hidden=3584, inter=384, experts=1025, top_k=2), "experts"),
    (dict(hidden=3584, inter=384, experts=8, route_experts=4, top_k=2), "route_experts"),
    (dict(hidden=3584, inter=384, experts=8, top_k=9), "top_k"),
    (dict(hidden=3584, inter=384, experts=64, top_k=33), "top_k"),
    (dict(hidden=3584, inter=384, experts=8, top_k=2, recipe=ScaleRecipe.FP32), "recipe"),
    (dict(hidden=3584, inter=384, experts=8, top_k=2, n_tiles=3), "n_tiles"),
    (dict(hidden=3584, inter=384, experts=8, top_k=2, situ_beta=0.0), "situ_beta"),
    (dict(hidden=3584, inter=384, experts=8, top_k=2, situ_linear_beta=25), "situ_linear_beta"),
    (dict(hidden=3584, inter=384, experts=8, top_k=2, weights="mxfp4"), "weights"),
    (dict(hidden=True, inter=384, experts=8, top_k=2), "hidden"),
])
def test_bad_fields_raise(kw, field):
    with pytest.raises(SpecError) as e:
        spec(**kw)
    assert e.value.field == field


def test_blackwell_targets_get_the_tcgen05_kernel_or_a_reason():
    """sm103 / sm107 get variant tcgen05 (test_moe_experts_tcgen05.py); what it cannot do is refused
    with each variant's reason."""
    assert MoeExpertsSpec(target=TARGETS["sm103-nvfp4"], weights=WeightFormat.NVFP4, **K3_TP8).impl.name == "tcgen05"
    with pytest.raises(SpecError) as e:
        MoeExpertsSpec(target=TARGETS["sm103-nvfp4"], weights=WeightFormat.NVFP4, act=ActFormat.FP8,
                       recipe=ScaleRecipe.FP32, **K3_TP8)
    assert "tcgen05" in str(e.value) and "UE8M0" in str(e.value)


@pytest.mark.parametrize("kw", [dict(K3_TP8), dict(K3_EP8, weights=WeightFormat.NVFP4, act=ActFormat.FP8),
                                dict(K3_TP8, act=ActFormat.FP8, recipe=ScaleRecipe.UE8M0, glu=GluAct.SILU, n_tiles=1)])
def test_canonical_round_trip_slug_and_defaults(kw):
    s = spec(**kw)
    assert spec_from_canonical(s.canonical(), SM90) == s
    assert s.file_stem.startswith("moe_experts__") and s.route_experts >= s.experts
    assert (s.recipe is None) == (s.act is ActFormat.BF16)
    if s.act is ActFormat.FP8 and "recipe" not in kw:
        assert s.recipe is SM90.scale_recipe


def test_plans_of_the_k3_shapes():
    tp8, ep8 = spec(**K3_TP8), spec(**K3_EP8)
    assert (tp8.gate_up.wm, tp8.gate_up.wk, tp8.gate_up.kc) == (2, 4, 7)       # 28 chunks over 4 warps
    assert (tp8.down.wm, tp8.down.wk, tp8.down.kc) == (4, 1, 3)
    assert (ep8.down.wk, ep8.down.kc) == (3, 8)
    for s in (tp8, ep8):
        for p in (s.gate_up, s.down):
            assert p.wk * p.kc * 128 >= p.k and p.threads <= 256 and p.mtiles % p.wm == 0
    # T = 1: 16 experts x 48 m-tiles x 4 K warps on the gate_up: thousands of warps for 132 SMs.
    assert tp8.gate_up_grid(1) == (24, 16, 1) and tp8.down_grid(1) == (56, 16, 1)


def test_persistent_rows_are_the_resident_ctas():
    """With the device's SM count, grid.y is at most the rows resident at once (sms x min_blocks
    CTAs), never more than the items, never 0; the FP8 gate_up keeps a CTA per item."""
    tp8 = spec(**K3_TP8)
    assert tp8.max_items(64) == 900
    assert tp8.gate_up_grid(64, 132) == (24, 132 * 2 // 24, 1)       # 11 rows of 24 CTAs, 2 a SM
    assert tp8.down_grid(64, 132) == (56, 132 * 4 // 56, 1)
    assert tp8.gate_up_grid(1, 132)[1] == min(16, 11) and tp8.gate_up_grid(1, 10_000)[1] == 16
    assert tp8.gate_up_grid(64, 1)[1] == 1
    fp8 = spec(**K3_TP8, act=ActFormat.FP8)
    assert not fp8.gate_up.persistent and fp8.gate_up_grid(64, 132)[1] == 900 and fp8.down.persistent


def items_of(offsets: list[int], base: int, experts: int, nslots: int, nb: int) -> list[tuple[int, int, int]]:
    """The kernel's item list (ItemList in experts.cuh): expert-major, nb positions per item, offsets clamped."""
    out = []
    for e in range(experts):
        lo = min(max(offsets[base + e], 0), nslots)
        hi = min(max(offsets[base + e + 1], lo), nslots)
        out += [(e, p, min(nb, hi - p)) for p in range(lo, hi, nb)]
    return out


@pytest.mark.parametrize("T", [1, 2, 8, 64, 512])
@pytest.mark.parametrize("skew", [False, True])
def test_items_cover_every_local_slot_once_within_the_grid(T, skew):
    s = spec(**K3_EP8)
    g = torch.Generator().manual_seed(T)
    scores = torch.rand(T, s.route_experts, generator=g)
    if skew:
        scores[: T // 2 + 1, 3] = 2.0           # one expert takes half the tokens
    ids = scores.topk(s.top_k, dim=1).indices
    _, offsets, perm, _ = grouped_order(ids, s.route_experts)
    for base in (0, 112 * 3):
        items = items_of(offsets.tolist(), base, s.experts, T * s.top_k, s.tokens_per_item)
        assert len(items) <= s.max_items(T)
        covered = sorted(p for _, p0, n in items for p in range(p0, p0 + n))
        local = ((ids >= base) & (ids < base + s.experts)).sum()
        assert covered == list(range(int(offsets[base]), int(offsets[base + s.experts]))) and len(covered) == local


def test_items_of_garbage_offsets_stay_in_range():
    items = items_of([5, -7, 10 ** 9, 3, 2 ** 31 - 1], 0, 4, 12, 8)
    assert all(0 <= p0 and p0 + n <= 12 and n > 0 for _, p0, n in items)


# -- the register decode (include/k3gen/moe/fp4.cuh), replayed -------------------------------------
def _header_constants() -> dict:
    text = FP4_HEADER.read_text()
    return {k: int(v, 16) for k, v in re.findall(r"(kE2m1\w+) = (0x[0-9A-F]+)u", text)}


def prmt(a: int, b: int, sel: int) -> int:
    pool = a | (b << 32)
    out = 0
    for i in range(4):
        nib = (sel >> (4 * i)) & 0xF
        byte = (pool >> (8 * (nib & 7))) & 0xFF
        if nib & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return out


def e2m1x8_to_bf16(w: int, c: dict) -> list[int]:
    m = w & 0x77777777
    mh, w4 = m >> 16, (w << 4) & 0xFFFFFFFF
    lo_a, hi_a = prmt(c["kE2m1Lo0"], c["kE2m1Lo1"], m), prmt(c["kE2m1Hi0"], c["kE2m1Hi1"], m)
    lo_b, hi_b = prmt(c["kE2m1Lo0"], c["kE2m1Lo1"], mh), prmt(c["kE2m1Hi0"], c["kE2m1Hi1"], mh)
    sel = re.findall(r"prmt\((lo_[ab]), (hi_[ab]), (0x[0-9A-F]+)u\) \| \(prmt\(w4, w, (0x[0-9A-F]+)u\)",
                     FP4_HEADER.read_text())
    regs = {"lo_a": lo_a, "hi_a": hi_a, "lo_b": lo_b, "hi_b": hi_b}
    assert len(sel) == 4
    return [prmt(regs[lo], regs[hi], int(s1, 16)) | (prmt(w4, w, int(s2, 16)) & 0x80008000)
            for lo, hi, s1, s2 in sel]


def bf16_bits_to_float(h: np.ndarray) -> np.ndarray:
    return (h.astype(np.uint32) << 16).view(np.float32)


def test_e2m1_register_decode_matches_numerics_bit_for_bit():
    c = _header_constants()
    rng = np.random.default_rng(0)
    words = [sum(n << (4 * i) for i in range(8)) for n in range(16)]                 # all codes in every slot
    words += [sum(((n + i) % 16) << (4 * i) for i in range(8)) for n in range(16)]
    words += rng.integers(0, 2 ** 32, 2000, dtype=np.uint64).tolist()
    for w in words:
        pairs = e2m1x8_to_bf16(int(w), c)
        got = bf16_bits_to_float(np.array([(p >> (16 * h)) & 0xFFFF for p in pairs for h in (0, 1)]))
        codes = torch.tensor([(int(w) >> (4 * i)) & 0xF for i in range(8)], dtype=torch.uint8)
        want = e2m1_decode(codes).numpy()
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), hex(int(w))   # -0 included


def test_scale_products_are_exact_in_bf16():
    """The GEMM multiplies the decoded BF16 by the group scale in BF16: exact for every E4M3 scale
    and for UE8M0 bytes 2..254 (the product has <= 5 significant bits and stays normal) wherever it
    is finite (past 2^128 both the kernel and numerics give inf)."""
    v = e2m1_decode(torch.arange(16, dtype=torch.uint8)).double()
    e4 = e4m3_decode(torch.arange(256, dtype=torch.uint8)).double()
    ue = ue8m0_decode(torch.arange(2, 255, dtype=torch.uint8)).double()
    for s in (e4[torch.isfinite(e4)], ue):
        exact = v[:, None] * s[None, :]
        p = exact.float()
        fin = torch.isfinite(p)
        assert torch.equal(p.double()[fin], exact[fin]) and bool((exact[~fin].abs() >= 2.0 ** 128).all())
        bits = p[fin].view(torch.int32)
        assert bool(((bits & 0xFFFF) == 0).all())                                       # and in BF16


# -- the FP32 reference against FP64 NumPy ----------------------------------------------------------
E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])


def np_e4m3(c: np.ndarray) -> np.ndarray:
    c = c.astype(np.int64)
    e, m = (c >> 3) & 15, c & 7
    mag = np.where(e == 0, m * 2.0 ** -9, (8 + m) * 2.0 ** (e - 10))
    return np.where(c & 0x80, -mag, mag)


def np_dequant(fmt, codes, scales, glob):
    b = codes.numpy().astype(np.int64)
    v = E2M1[np.stack([b & 15, b >> 4], -1).reshape(*b.shape[:-1], -1)]
    s = scales.numpy().astype(np.int64)
    sv = 2.0 ** (s - 127) if fmt is WeightFormat.MXFP4 else np_e4m3(s)
    v = v * np.repeat(sv, v.shape[-1] // s.shape[-1], axis=-1)
    return v if glob is None else v * glob[..., None]


def np_bf16(x: np.ndarray) -> np.ndarray:
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    return u.astype(np.uint32).view(np.float32).astype(np.float64)


def make_case(s: MoeExpertsSpec, T: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    E, W, I, k = s.experts, s.hidden, s.inter, s.top_k
    w13f = torch.randn(E, 2 * I, W, generator=g) * 0.05
    w2f = torch.randn(E, W, I, generator=g) * 0.05
    if s.weights is WeightFormat.MXFP4:
        (w13, s13), (w2, s2), gs13, gs2 = mxfp4_quantize(w13f), mxfp4_quantize(w2f), None, None
    else:
        gs13, gs2 = torch.rand(E, 2, generator=g) * 0.01 + 0.001, torch.rand(E, 1, generator=g) * 0.01 + 0.001
        w13, s13 = nvfp4_quantize(w13f / w13_rows(gs13, I)[..., None], 1.0)
        w2, s2 = nvfp4_quantize(w2f / gs2[..., None], 1.0)
    x = torch.randn(T, W, generator=g).to(torch.bfloat16)
    xs = None
    if s.act is ActFormat.FP8:
        x, xs = fp8_group_quantize(x.float(), 128, s.recipe)
    ids = torch.stack([torch.randperm(s.route_experts, generator=g)[:k] for _ in range(T)]).int()
    w = torch.rand(T, k, generator=g)
    return dict(x=x, x_scales=xs, w13=w13, s13=s13, w2=w2, s2=s2, gs13=gs13, gs2=gs2, ids=ids, weights=w)


def w13_rows(gs13, inter):
    return gs13.repeat_interleave(inter, dim=1)


@pytest.mark.parametrize("weights", list(WeightFormat))
@pytest.mark.parametrize("act", list(ActFormat))
@pytest.mark.parametrize("glu", list(GluAct))
def test_reference_matches_fp64_numpy(weights, act, glu):
    s = spec(weights=weights, act=act, glu=glu, hidden=256, inter=64, experts=6, route_experts=12, top_k=4)
    c = make_case(s, 5, seed=len(weights.value) + 3 * len(act.value) + len(glu.value))
    base = 3
    got, got32 = moe_experts(s, c["x"], c["w13"], c["s13"], c["w2"], c["s2"], c["ids"], c["weights"],
                             gs13=c["gs13"], gs2=c["gs2"], x_scales=c["x_scales"], expert_base=base)
    nv = weights is WeightFormat.NVFP4
    W13 = np_dequant(weights, c["w13"], c["s13"], w13_rows(c["gs13"], s.inter).numpy() if nv else None)
    W2 = np_dequant(weights, c["w2"], c["s2"], np.repeat(c["gs2"].numpy(), s.hidden, 1) if nv else None)
    if act is ActFormat.BF16:
        x = c["x"].float().numpy().astype(np.float64)
    else:
        sc = c["x_scales"].numpy().astype(np.float64) if s.recipe is ScaleRecipe.FP32 \
            else 2.0 ** (c["x_scales"].numpy().astype(np.float64) - 127)
        x = np_e4m3(c["x"].numpy()) * np.repeat(sc, 128, axis=1)
    want = np.zeros((5, s.hidden))
    for t in range(5):
        for j in range(s.top_k):
            e = int(c["ids"][t, j]) - base
            if not 0 <= e < s.experts:
                continue
            gu = W13[e] @ x[t]
            gt, up = gu[: s.inter], gu[s.inter:]
            sig = 1 / (1 + np.exp(-gt))
            h = 4 * np.tanh(gt / 4) * sig * 25 * np.tanh(up / 25) if glu is GluAct.SITU else gt * sig * up
            want[t] += float(c["weights"][t, j]) * (W2[e] @ np_bf16(h))
    assert_close(got32, torch.from_numpy(want), "bf16", "FP32 out (through the BF16 intermediate)")
    assert_close(got, torch.from_numpy(want), "bf16", "BF16 out")
    assert torch.equal(got, got32.to(torch.bfloat16))


@pytest.mark.parametrize("weights", list(WeightFormat))
def test_reference_dequantization_is_the_numerics_decoders(weights):
    s = spec(weights=weights, hidden=128, inter=32, experts=2, top_k=1)
    c = make_case(s, 1, seed=9)
    nv = weights is WeightFormat.NVFP4
    got = dequantize(weights, c["w13"], c["s13"], w13_rows(c["gs13"], s.inter) if nv else None)
    want = np_dequant(weights, c["w13"], c["s13"], w13_rows(c["gs13"], s.inter).numpy() if nv else None)
    # numpy's FP64 product rounded once to FP32 = the FP32 product of an exact e2m1 * scale
    assert np.array_equal(got.numpy(), want.astype(np.float32))


# -- the launcher's metadata checks (CPU tensors: each bad argument fails before the device check) --
def _args(s: MoeExpertsSpec, T: int = 3) -> dict:
    E, W, I, k, gsz = s.experts, s.hidden, s.inter, s.top_k, s.group
    u8 = torch.uint8
    return dict(x=torch.zeros(T, W, dtype=torch.bfloat16), w13=torch.zeros(E, 2 * I, W // 2, dtype=u8),
                s13=torch.zeros(E, 2 * I, W // gsz, dtype=u8), w2=torch.zeros(E, W, I // 2, dtype=u8),
                s2=torch.zeros(E, W, I // gsz, dtype=u8),
                route={"ids": torch.zeros(T, k, dtype=torch.int32), "weights": torch.zeros(T, k),
                       "offsets": torch.zeros(s.route_experts + 1, dtype=torch.int32),
                       "perm": torch.zeros(T * k, dtype=torch.int32)},
                out=torch.zeros(T, W, dtype=torch.bfloat16))


@pytest.mark.parametrize("arg,bad,field", [
    ("x", lambda a: a["x"].float(), "x"),
    ("w13", lambda a: a["w13"][:, :-1], "w13"),
    ("s2", lambda a: a["s2"].float(), "s2.dtype"),
    ("route", lambda a: {k: v for k, v in a["route"].items() if k != "perm"}, "route"),
    ("route", lambda a: {**a["route"], "offsets": a["route"]["offsets"][:-1]}, "route['offsets']"),
    ("out", lambda a: a["out"][:, :-8], "out"),
])
def test_launcher_rejects_bad_arguments_with_typed_errors(arg, bad, field):
    from k3gen.ops.moe_experts.launcher import MoeExperts
    s = spec(hidden=256, inter=64, experts=4, top_k=2)
    a = _args(s)
    a[arg] = bad(a)
    op = MoeExperts(s)
    with pytest.raises(SpecError) as e:
        op.check(a["x"], a["w13"], a["s13"], a["w2"], a["s2"], a["route"], a["out"], None, None, None, None, None, 0)
    assert e.value.field == field


def test_launcher_checks_globals_scales_and_the_expert_base():
    from k3gen.ops.moe_experts.launcher import MoeExperts
    nv = spec(weights=WeightFormat.NVFP4, hidden=256, inter=64, experts=4, route_experts=8, top_k=2)
    a = _args(nv)
    with pytest.raises(SpecError, match="global"):
        MoeExperts(nv).check(a["x"], a["w13"], a["s13"], a["w2"], a["s2"], a["route"], a["out"],
                             None, None, None, None, None, 0)
    gs = (torch.ones(4, 2), torch.ones(4, 1))
    with pytest.raises(SpecError) as e:
        MoeExperts(nv).check(a["x"], a["w13"], a["s13"], a["w2"], a["s2"], a["route"], a["out"],
                             *gs, None, None, None, 5)
    assert e.value.field == "expert_base"
    fp8 = spec(hidden=256, inter=64, experts=4, top_k=2, act=ActFormat.FP8)
    a = _args(fp8)
    with pytest.raises(SpecError) as e:
        MoeExperts(fp8).check(torch.zeros(3, 256, dtype=torch.uint8), a["w13"], a["s13"], a["w2"], a["s2"], a["route"],
                              a["out"], None, None, None, None, None, 0)
    assert e.value.field == "x_scales"


# -- the swap-AB fragment mapping of expert_gemm (include/k3gen/moe/experts.cuh), replayed ---------
def mma_m16n8k16(d, regs_a, regs_b):
    """PTX m16n8k16 fragments of all 32 lanes -> D += A B: regs_a[lane] = 4 (lo, hi) pairs,
    regs_b[lane] = 2 pairs; pair halves are (lower K, upper K)."""
    A, B = np.zeros((16, 16)), np.zeros((16, 8))
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        for r, (row, col) in enumerate(((g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8))):
            A[row, col:col + 2] = regs_a[lane][r]
        for r, k0 in enumerate((2 * t, 2 * t + 8)):
            B[k0:k0 + 2, g] = regs_b[lane][r]
    return d + A @ B


def test_swap_ab_fragments_compute_the_dot_products():
    """Each lane's 32-value segment per row and chunk (rows g, g+8; K c*128 + 32t ..), decoded as
    word j -> pairs q[0..3], fed as {q0[0], q1[0], q0[1], q1[1]} x {B[4j], B[4j+1]} then
    {q0[2], q1[2], q0[3], q1[3]} x {B[4j+2], B[4j+3]} (B[i] = values 2i, 2i+1 of the token's
    segment): the accumulator rows are weight rows, columns tokens, and equal W X^T."""
    rng = np.random.default_rng(1)
    K, chunks = 256, 2
    Wm, X = rng.integers(-6, 7, (16, K)).astype(float), rng.integers(-3, 4, (8, K)).astype(float)
    D = np.zeros((16, 8))
    for c in range(chunks):
        def seg(mat, row, t):
            return mat[row, c * 128 + 32 * t: c * 128 + 32 * t + 32]
        for j in range(4):
            regs_a, regs_b = [None] * 32, [None] * 32
            for half in range(2):
                for lane in range(32):
                    g, t = lane >> 2, lane & 3
                    q0 = [seg(Wm, g, t)[8 * j + 2 * i: 8 * j + 2 * i + 2] for i in range(4)]
                    q1 = [seg(Wm, g + 8, t)[8 * j + 2 * i: 8 * j + 2 * i + 2] for i in range(4)]
                    b = [seg(X, g, t)[2 * i: 2 * i + 2] for i in range(16)]
                    i0 = 2 * half
                    regs_a[lane] = (q0[i0], q1[i0], q0[i0 + 1], q1[i0 + 1])
                    regs_b[lane] = (b[4 * j + i0], b[4 * j + i0 + 1])
                D = mma_m16n8k16(D, regs_a, regs_b)
    assert np.array_equal(D, Wm @ X.T)
    # the lane holding accumulator (row g, cols 2t, 2t+1) also holds (row g + 8, same cols): the
    # gate_up tile puts gate row i at A row g and up row i at g + 8, so SiTU needs no shuffle.


@pytest.mark.parametrize("rows", [0, -1, True, 2.0, "3"])
def test_bad_rows_raise_before_anything_runs(rows):
    from k3gen.ops.moe_experts.launcher import MoeExperts
    op = MoeExperts(spec(**K3_TP8))
    with pytest.raises(SpecError, match="rows"):
        op(None, None, None, None, None, {}, None, rows=rows)
