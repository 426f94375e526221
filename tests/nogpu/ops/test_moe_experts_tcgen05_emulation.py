"""moe_experts "tcgen05" (include/k3gen/moe/experts_tc.cuh): its arithmetic emulated on the CPU, never
run (no Blackwell GPU here). The decode (hardware E2M1 -> BF16 conversion times the group scale in
BF16) against numerics.py for every code and scale byte; the FP8 activation operands (E4M3 -> BF16
times 2^(b - 127)) for every code and scale byte; and the whole op at TP8- / EP8-like small shapes,
both weight formats, both activation formats: the kernel's item walk (find_item over its grid rows),
its tiles (rows 0-31 gate / 32-63 up, or 64 w2 rows), its rounding points (exact BF16 operands, FP32
accumulation, the NVFP4 global and the activation in FP32 on the accumulator, h rounded to BF16, FP32
partials at perm[p], the SM90 combine's ordered FMA), into NaN-poisoned workspaces, against
reference.py."""
from __future__ import annotations

import pytest
import torch

from k3gen.ir.dtypes import ScaleRecipe
from k3gen.numerics import e2m1_decode, e4m3_decode, fp8_group_dequantize, ue8m0_decode
from k3gen.ops.moe_experts.reference import as_bytes, moe_experts
from k3gen.ops.moe_experts.spec import ActFormat, GluAct, MoeExpertsSpec, WeightFormat
from k3gen.ops.moe_experts.variants import plans
from k3gen.ops.moe_route.reference import grouped_order
from k3gen.targets import TARGETS
from numerics import assert_close, rel_rms
from test_moe_experts_spec import make_case
from test_moe_experts_tcgen05 import find_item, scan

SM103 = TARGETS["sm103-nvfp4"]


def bf16(x: torch.Tensor) -> torch.Tensor:
    return x.float().to(torch.bfloat16)


# -- operand values ----------------------------------------------------------------------------------------
def kernel_weight_values(fmt: WeightFormat, codes: torch.Tensor, scale_bytes: torch.Tensor) -> torch.Tensor:
    """decode_segment: cvt.rn.bf16x2.e2m1x2 (exact: every E2M1 value is a BF16) times segment_scales'
    BF16 multiplier (ue8m0_bf16x2: 2^(b - 127), b = 0 the subnormal 2^-127, 255 NaN; NVFP4: the E4M3
    value), one BF16 rounding (HMUL2 / HFMA2 with -0: round to nearest even)."""
    v = bf16(e2m1_decode(codes))
    s = bf16(ue8m0_decode(scale_bytes) if fmt is WeightFormat.MXFP4 else e4m3_decode(scale_bytes))
    return bf16(v.float() * s.float())


@pytest.mark.parametrize("fmt,scale_range", [(WeightFormat.MXFP4, range(2, 255)), (WeightFormat.NVFP4, range(256))])
def test_decode_is_numerics_bit_for_bit(fmt, scale_range):
    """Every E2M1 code x every scale byte: the kernel's BF16 operand equals numerics' FP32 decode (the
    SM90 kernel's value too), -0 and NaN included; UE8M0 bytes 0, 1 and 255 as the SM90 test bounds
    them (subnormal / NaN scales no checkpoint carries)."""
    codes = torch.arange(16, dtype=torch.uint8).repeat_interleave(len(scale_range))
    sb = torch.tensor(list(scale_range), dtype=torch.uint8).repeat(16)
    got = kernel_weight_values(fmt, codes, sb).float()
    sv = ue8m0_decode(sb) if fmt is WeightFormat.MXFP4 else e4m3_decode(sb)
    want = e2m1_decode(codes) * sv
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    assert torch.equal(got[~nan].view(torch.int32), want[~nan].view(torch.int32))   # +-0 and inf too


def test_fp8_activation_operands_are_exact_for_scale_bytes_from_3():
    """BChunks::store: cvt.rn.bf16x2.e4m3x2 times ue8m0_bf16x2(b), one BF16 rounding: every finite E4M3
    code x every byte 3..254 equals numerics.fp8_group_dequantize (the reference) bit for bit,
    overflow to inf included (an E4M3 x 2^n product has 4 significant bits: it is a BF16 or past both
    formats' range); bytes 0..2 round products below BF16's subnormal step, 255 is NaN in both
    (variants.py states it)."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]
    for b in range(256):
        x = torch.cat([codes, torch.zeros(256 - len(codes), dtype=torch.uint8)])[None]   # two 128-groups
        xs = torch.full((1, 2), b, dtype=torch.uint8)
        want = fp8_group_dequantize(x, xs, 128, ScaleRecipe.UE8M0)[0, :len(codes)]
        got = bf16(bf16(e4m3_decode(codes)).float() * bf16(ue8m0_decode(xs[0, :1])).float()).float()
        if 3 <= b <= 254:
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)), b
        elif b == 255:
            assert bool(torch.isnan(got).all() and torch.isnan(want).all())
        else:
            assert not torch.equal(got.view(torch.int32), want.view(torch.int32)), b


# -- the whole op -------------------------------------------------------------------------------------------
def glu_kernel(spec, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """experts.cuh glu_act in FP32: sigmoid(g) = 0.5 tanh(g / 2) + 0.5."""
    sg = 0.5 * torch.tanh(0.5 * g) + 0.5
    if spec.glu is GluAct.SILU:
        return g * sg * u
    b, lb = spec.situ_beta, spec.situ_linear_beta
    return b * torch.tanh(g * (1 / b)) * sg * (lb * torch.tanh(u * (1 / lb)))


def emulate(spec: MoeExpertsSpec, c: dict, base: int, sms: int | None = None, mutate: str = ""):
    """The tcgen05 kernels and the combine on the CPU: (out BF16, out FP32, h, y)."""
    p13, p2 = plans(spec)
    E, W, I, k, R = spec.experts, spec.hidden, spec.inter, spec.top_k, spec.route_experts
    T, nb = c["ids"].shape[0], spec.tokens_per_item
    nslots = T * k
    _, offsets, perm, _ = grouped_order(c["ids"], R)
    offs, perm = offsets.tolist(), perm.long()
    first, counts, per = scan(offs, base, E, nslots, nb)
    total = sum(counts)
    nv = spec.weights is WeightFormat.NVFP4
    if spec.act is ActFormat.BF16:
        x = c["x"].to(torch.bfloat16)
    else:   # BChunks: E4M3 -> BF16 times the UE8M0 scale of its 128-column group, rounded once
        xs = bf16(ue8m0_decode(c["x_scales"])).float().repeat_interleave(128, 1)
        x = bf16(bf16(e4m3_decode(c["x"])).float() * xs)
    h = torch.full((nslots, I), float("nan"), dtype=torch.bfloat16)
    y = torch.full((nslots, W), float("nan"))

    def a_tile(w, s, e, p, mt):
        """The tile's 64 weight rows (tile_rows: gate 32 mt.. | up I + 32 mt.., or w2 64 mt..) as the
        MMA reads them: kernel_weight_values of the codes and scale bytes the TMA / bulk copies bring."""
        r0 = 32 * mt if p.gate_up else 64 * mt
        r1 = r0 + (I if p.gate_up else 32)
        up = torch.arange(r1, r1 + 32)
        if mutate == "up_rows" and p.gate_up:
            up = up.roll(1)   # gate row i met with up row i - 1
        rows = torch.cat([torch.arange(r0, r0 + 32), up])
        lo, hi = w[e][rows] & 0xF, w[e][rows] >> 4
        codes = torch.stack([lo, hi], -1).flatten(-2)
        sb = as_bytes(s[e])[rows].repeat_interleave(spec.group, 1)
        return kernel_weight_values(spec.weights, codes, sb)

    for p, w, s in ((p13, c["w13"], c["s13"]), (p2, c["w2"], c["s2"])):
        rows = p.item_rows(spec.max_items(T), sms)
        for mt in range(p.mtiles):
            for yrow in range(min(rows, total)):
                for it in range(yrow, total, rows):
                    e, p0, n = find_item(first, per, offs, base, E, nslots, nb, it)
                    A = a_tile(w, s, e, p, mt).float()
                    if p.gate_up:   # B rows: the slots' tokens (perm clamped, as on SM90)
                        tok = torch.clamp(perm[p0:p0 + n], 0, nslots - 1) // k
                        B = x[torch.clamp(tok, max=T - 1)].float()
                    else:
                        B = h[p0:p0 + n].float()
                    D = A @ B.T                                   # FP32 accumulation (the TMEM tile)
                    if p.gate_up:
                        g, u = D[:32], D[32:]
                        if nv:
                            g, u = g * c["gs13"][e, 0], u * c["gs13"][e, 1]
                        h[p0:p0 + n, 32 * mt:32 * mt + 32] = glu_kernel(spec, g, u).T.to(torch.bfloat16)
                    else:
                        f = perm[p0:p0 + n]
                        col = 64 * mt + (mutate == "down_cols")
                        part = (D * c["gs2"][e, 0] if nv else D).T
                        y[f, col:col + 64] = part[:, :min(64, W - col)]
    # combine (experts.cuh, shared): out = sum over j in slot order of weights * y, FP32 FMA
    out = torch.zeros(T, W)
    local = c["ids"].long() - base
    ok = (local >= 0) & (local < E)
    yv = y.view(T, k, W)
    for j in range(k):
        term = c["weights"][:, j:j + 1].float() * yv[:, j]
        out = torch.where(ok[:, j:j + 1], out + term, out)
    return out.to(torch.bfloat16), out, h, y


SHAPES = {   # TP8-like: many experts, one stage of K per GEMM; EP8-like: local experts of a larger router,
             # K over a partial stage (384 = 256 + 128) and a partial SW128 atom (96 = 64 + 32)
    "tp8": dict(hidden=256, inter=64, experts=24, top_k=4),
    "ep8": dict(hidden=384, inter=96, experts=6, route_experts=24, top_k=4, n_tiles=1),
}


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("weights", list(WeightFormat))
@pytest.mark.parametrize("act,glu,T", [(ActFormat.BF16, GluAct.SITU, 1), (ActFormat.BF16, GluAct.SITU, 37),
                                       (ActFormat.FP8, GluAct.SILU, 19)])
def test_emulation_matches_the_reference(shape, weights, act, glu, T):
    kw = dict(SHAPES[shape], weights=weights, act=act, glu=glu)
    if act is ActFormat.FP8:
        kw["recipe"] = ScaleRecipe.UE8M0
    spec = MoeExpertsSpec(target=SM103, **kw)
    assert spec.impl.name == "tcgen05"
    c = make_case(spec, T, seed=T + len(shape) + 3 * len(weights.value))
    base = 12 if shape == "ep8" else 0
    ref, ref32 = moe_experts(spec, c["x"], c["w13"], c["s13"], c["w2"], c["s2"], c["ids"], c["weights"],
                             gs13=c["gs13"], gs2=c["gs2"], x_scales=c["x_scales"], expert_base=base)
    for sms in (None, 3):   # a CTA row per item, or few rows walking many items
        out, out32, h, y = emulate(spec, c, base, sms)
        local = ((c["ids"].long() - base >= 0) & (c["ids"].long() - base < spec.experts)).reshape(-1)
        assert not torch.isnan(y[local]).any(), "a local slot's partials were never written"
        assert_close(out, ref32, "bf16", "tcgen05 emulation vs reference")
        # beyond the table: FP32 accumulation order, the global applied after the sum and an h a BF16
        # rounding apart now and then are all that separate the two (measured <= 2.1e-6)
        assert rel_rms(out32, ref32) < 1e-4
        assert torch.equal(out, out32.to(torch.bfloat16))


@pytest.mark.parametrize("mutate", ["up_rows", "down_cols"])
def test_the_emulation_fails_on_wrong_index_math(mutate):
    """The check above can fail: an up row off by one or a down column off by one is caught."""
    spec = MoeExpertsSpec(target=SM103, weights=WeightFormat.MXFP4, **SHAPES["tp8"])
    c = make_case(spec, 9, seed=4)
    _, ref32 = moe_experts(spec, c["x"], c["w13"], c["s13"], c["w2"], c["s2"], c["ids"], c["weights"])
    with pytest.raises(AssertionError):
        out, out32, _, _ = emulate(spec, c, 0, mutate=mutate)
        assert_close(out, ref32, "bf16")
