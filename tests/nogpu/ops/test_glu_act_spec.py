"""glu_act on the CPU: spec validation, the reference against the FP64 formulas of model/arch.py
(SiTU, SiLU) and against act_quant_fp8 of its BF16 hidden, and the kernel compiling for sm90, sm103
and sm107 without local memory."""
from __future__ import annotations

import math

import pytest
import torch

from k3gen.errors import SpecError
from k3gen.ir.dtypes import ScaleRecipe
from k3gen.ops import spec_from_canonical
from k3gen.ops.act_quant_fp8.reference import act_quant_fp8
from k3gen.ops.glu_act.reference import glu_act, glu_act_spec, hidden
from k3gen.ops.glu_act.spec import GluActSpec, GluKind
from k3gen.pipeline.build import build_one
from k3gen.targets import TARGETS

SM90 = TARGETS["sm90"]


@pytest.mark.parametrize("kw,field", [
    (dict(inter=0), "inter"), (dict(inter=100), "inter"), (dict(inter=True), "inter"),
    (dict(inter=128, act="gelu"), "act"), (dict(inter=128, beta=0.0), "beta"),
    (dict(inter=128, linear_beta=float("inf")), "linear_beta"), (dict(inter=128, beta=4), "beta"),
    (dict(inter=128, act=GluKind.SILU, beta=2.0), "beta"), (dict(inter=128, recipe="fp16"), "recipe"),
])
def test_bad_fields_raise(kw, field):
    with pytest.raises(SpecError) as e:
        GluActSpec(target=SM90, **kw)
    assert e.value.field == field


@pytest.mark.parametrize("kw", [dict(inter=768), dict(inter=256, act=GluKind.SILU, recipe=ScaleRecipe.UE8M0),
                                dict(inter=128, beta=2.0, linear_beta=10.0)])
def test_canonical_round_trip_and_slug(kw):
    s = GluActSpec(target=SM90, **kw)
    assert spec_from_canonical(s.canonical(), SM90) == s
    assert s.slug().startswith(f"i{s.inter}-{s.act.value}-{s.recipe.value}")


def _fp64_situ(g, u, beta, lb):
    """SiTU written from its definition, elementwise with math (an independent FP64 evaluation)."""
    return [beta * math.tanh(a / beta) / (1 + math.exp(-a)) * (lb * math.tanh(b / lb)) for a, b in zip(g, u)]


def _fp64_silu(g, u):
    return [a / (1 + math.exp(-a)) * b for a, b in zip(g, u)]


@pytest.mark.parametrize("act", ["situ", "silu"])
def test_hidden_is_the_fp64_formula_rounded_to_bf16(act):
    """The reference's h against Python's math on the same BF16 inputs: equal up to the FP64
    evaluation order (far below BF16's step), so at most one BF16 ulp where the value sits on an edge."""
    g = torch.Generator().manual_seed(1)
    gu = (torch.randn(16, 512, generator=g) * torch.tensor([0.3, 3.0, 30.0, 80.0]).repeat(128)).to(torch.bfloat16)
    h = hidden(gu, 256, act, 4.0, 25.0).float().reshape(-1)
    gl, ul = gu[:, :256].double().reshape(-1).tolist(), gu[:, 256:].double().reshape(-1).tolist()
    want = torch.tensor(_fp64_situ(gl, ul, 4.0, 25.0) if act == "situ" else _fp64_silu(gl, ul), dtype=torch.float64)
    ulp = torch.finfo(torch.bfloat16).eps * want.abs().clamp_min(1e-30)
    assert bool(((h.double() - want).abs() <= ulp).all())
    assert (h.double() - want).abs().div(want.abs().clamp_min(1e-30)).max() < 2 ** -8
    # and the model's FP32 formula (model/arch.py) agrees within FP32 + BF16 rounding
    from model import arch
    f = arch.situ if act == "situ" else arch.silu_glu
    m = f(gu[:, :256].float(), gu[:, 256:].float()).reshape(-1).double()
    assert float(((m - want).abs() / want.abs().clamp_min(1e-6)).max()) < 1e-5


def test_saturation_and_zero():
    """Large gates saturate SiTU at beta * linear_beta (4 * 25); zeros give zero codes and a zero FP32 scale."""
    gu = torch.zeros(2, 256, dtype=torch.bfloat16)
    gu[0, :128], gu[0, 128:] = 300.0, 3000.0
    h = hidden(gu, 128)
    assert torch.equal(h[0], torch.full((128,), 100.0, dtype=torch.bfloat16))
    c, s = glu_act(gu, 128)
    assert torch.equal(c[1], torch.zeros(128, dtype=torch.uint8)) and float(s[1, 0]) == 0.0


@pytest.mark.parametrize("recipe", list(ScaleRecipe), ids=lambda r: r.value)
def test_codes_are_act_quant_of_the_bf16_hidden(recipe):
    s = GluActSpec(target=SM90, inter=384, recipe=recipe)
    gu = (torch.randn(5, 768, generator=torch.Generator().manual_seed(2)) * 4).to(torch.bfloat16)
    c, sc = glu_act_spec(s, gu)
    wc, ws = act_quant_fp8(hidden(gu, 384), recipe)
    assert torch.equal(c, wc) and torch.equal(sc, ws)
    assert sc.shape == (5, 3) and sc.dtype == (torch.float32 if recipe is ScaleRecipe.FP32 else torch.uint8)


@pytest.mark.parametrize("target", ["sm90", "sm103-nvfp4", "sm107-nvfp4"])
@pytest.mark.parametrize("kw", [dict(inter=768), dict(inter=4224, recipe=ScaleRecipe.UE8M0),
                                dict(inter=128, act=GluKind.SILU)])
def test_kernel_compiles_without_local_memory(target, kw):
    r = build_one(GluActSpec(target=TARGETS[target], **kw))
    (x,) = r.resources
    assert x["function"] == "k3gen_glu_act"
    assert x["local"] == 0 and x["stack"] == 0 and x["registers"] <= 64, x
    assert not any(op.startswith(("LDL", "STL")) for op in x["sass"])
    assert any(op.startswith("DMUL") or op.startswith("DFMA") for op in x["sass"])   # the FP64 activation
