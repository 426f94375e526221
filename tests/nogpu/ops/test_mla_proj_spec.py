"""mla_q_absorb and mla_vb_gate on the CPU: spec validation, the Q-B GEMM a query-path spec
implies, and the references against independent float64 computations."""
from __future__ import annotations

import pytest
import torch

from k3gen.pipeline.build import build_one
from k3gen.errors import SpecError
from k3gen.ir.dtypes import ScaleRecipe
from k3gen.ops.mla_q_absorb.spec import MlaQAbsorbSpec
from k3gen.ops.mla_vb_gate.spec import MlaVbGateSpec
from k3gen.ops.fp8_block_gemm.reference import quantize_weights
from k3gen.ops.mla_q_absorb.reference import mla_q_absorb
from k3gen.ops.mla_vb_gate.reference import mla_vb_gate
from k3gen.targets import TARGETS

SM90, SM103 = TARGETS["sm90"], TARGETS["sm103-nvfp4"]


def test_specs_validate():
    with pytest.raises(SpecError, match="heads=0"):
        MlaQAbsorbSpec(target=SM90, heads=0)
    with pytest.raises(SpecError, match="eps="):
        MlaQAbsorbSpec(target=SM90, heads=12, eps=0.0)
    with pytest.raises(SpecError, match="heads="):
        MlaVbGateSpec(target=SM90, heads=-1)


def test_query_path_implies_its_q_b_gemm():
    s = MlaQAbsorbSpec(target=SM103, heads=12)
    g = s.gemm_spec
    assert (g.n, g.k, g.recipe) == (12 * 192, 1536, ScaleRecipe.UE8M0) and g.target is SM103
    s = MlaQAbsorbSpec(target=SM90, heads=96, recipe=ScaleRecipe.UE8M0)
    assert s.gemm_spec.recipe is ScaleRecipe.UE8M0 and s.gemm_spec.n == 96 * 192


@pytest.mark.parametrize("recipe", tuple(ScaleRecipe), ids=lambda r: r.value)
def test_q_absorb_reference_against_float64(recipe):
    H, B = 3, 5
    g = torch.Generator().manual_seed(2)
    q_a = (torch.randn(B, 1536, generator=g) * 3).to(torch.bfloat16)
    norm_w = (1 + 0.1 * torch.randn(1536, generator=g)).to(torch.bfloat16)
    wqb = torch.randn(H * 192, 1536, generator=g) * 0.03
    w_uk = (torch.randn(H, 128, 512, generator=g) * 0.1).to(torch.bfloat16)
    codes, scales = quantize_weights(wqb, recipe)
    out, q = mla_q_absorb(q_a, norm_w, codes, scales, w_uk, recipe, return_q=True)
    assert out.shape == (B, H, 576)
    # Independent: float64 norm, unquantized Q-B, absorption.
    x = q_a.double()
    qn = x / torch.sqrt(x.square().mean(-1, keepdim=True) + 1e-5) * norm_w.double()
    qq = (qn @ wqb.double().T).view(B, H, 192)
    lat = torch.einsum("bhd,hdc->bhc", qq[..., :128], w_uk.double())
    want = torch.cat([lat, qq[..., 128:]], -1)
    rel = (out.double() - want).norm() / want.norm()
    assert rel < 0.08, rel   # FP8 activations and weights
    assert torch.equal(out[..., 512:], q[..., 128:])   # the rope part is copied, never rotated


def test_vb_gate_reference_against_a_loop():
    H, B = 2, 3
    g = torch.Generator().manual_seed(3)
    o_lat = torch.randn(B, H, 512, generator=g).to(torch.bfloat16)
    w_uv = torch.randn(H, 128, 512, generator=g).to(torch.bfloat16)
    gate = torch.randn(B, H * 128 + 40, generator=g).to(torch.bfloat16)   # a wider A-projection row
    y = mla_vb_gate(o_lat, w_uv, gate)
    for b in range(B):
        for h in range(H):
            ref = (w_uv[h].double() @ o_lat[b, h].double()) / (1 + torch.exp(-gate[b, h * 128:(h + 1) * 128].double()))
            assert torch.allclose(y[b, h].double(), ref, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("target", ["sm90", "sm103-nvfp4", "sm107-nvfp4"])
def test_mla_kernels_compile_without_spills(target):
    t = TARGETS[target]
    for spec in (MlaQAbsorbSpec(target=t, heads=12), MlaVbGateSpec(target=t, heads=12)):
        r = build_one(spec)
        names = {x["function"] for x in r.resources}
        want = {"k3gen_mla_q_absorb", "k3gen_mla_q_norm_quant"} if spec.op == "mla_q_absorb" else {"k3gen_mla_vb_gate"}
        assert names == want
        for x in r.resources:
            assert x["local"] == 0 and x["stack"] == 0 and x["registers"] <= 128, x
