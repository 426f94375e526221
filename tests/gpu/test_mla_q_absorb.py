"""mla_q_absorb on the H200 (norm+quantize, FP8 Q-B GEMM, absorption) against the FP32 reference:
both scale recipes, B in {1, 2, 7, 8, 33, 128}, q_a as a slice of the A-projection row, W_UK as a
view of kv_b, graph replay with a preallocated workspace."""
from __future__ import annotations

import pytest
import torch

from k3gen.ir.dtypes import ScaleRecipe
from k3gen.ops.mla_q_absorb.spec import MlaQAbsorbSpec
from k3gen.ops.fp8_block_gemm.reference import quantize_weights
from k3gen.ops.mla_q_absorb.reference import mla_q_absorb
from k3gen.runtime.graphs import capture
from k3gen.ops.mla_q_absorb.launcher import MlaQAbsorb
from k3gen.targets import TARGETS
from numerics import rel_rms

pytestmark = pytest.mark.gpu
RECIPES = tuple(ScaleRecipe)
SPECS = {(h, r): MlaQAbsorbSpec(target=TARGETS["sm90"], heads=h, recipe=r) for h in (12,) for r in RECIPES}


def _inputs(B, H, recipe, seed):
    g = torch.Generator().manual_seed(seed)
    row = (torch.randn(B, 1536 + 576 + H * 128, generator=g) * 2).to(torch.bfloat16).cuda()
    q_a = row[:, :1536]
    norm_w = (1 + 0.1 * torch.randn(1536, generator=g)).to(torch.bfloat16).cuda()
    codes, scales = quantize_weights(torch.randn(H * 192, 1536, generator=g) * 0.03, recipe)
    kv_b = (torch.randn(H * 256, 512, generator=g) * 0.1).to(torch.bfloat16).cuda()
    return q_a, norm_w, codes.cuda(), scales.cuda(), kv_b.view(H, 256, 512)[:, :128]


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.value)
@pytest.mark.parametrize("B", [1, 2, 7, 8, 33, 128])
def test_matches_reference(B, recipe):
    H = 12
    op = MlaQAbsorb(SPECS[(H, recipe)]).load()
    ws = op.workspace(128)
    q_a, norm_w, codes, scales, w_uk = _inputs(B, H, recipe, seed=B)
    out = torch.full((B, H, 576), float("nan"), dtype=torch.bfloat16, device="cuda")
    op(q_a, norm_w, codes, scales, w_uk, out, workspace=ws)
    torch.cuda.synchronize()
    ref = mla_q_absorb(q_a.cpu(), norm_w.cpu(), codes.cpu(), scales.cpu(), w_uk.cpu(), recipe)
    assert not torch.isnan(out).any()
    assert rel_rms(out.cpu(), ref) <= 1e-2
    # The quantized activations follow the act_quant_fp8 contract of this recipe.
    sdt = torch.float32 if recipe is ScaleRecipe.FP32 else torch.uint8
    assert ws["scales"].dtype == sdt


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.value)
def test_graph_replay_and_sanitize_small(recipe):
    op = MlaQAbsorb(SPECS[(12, recipe)]).load()
    ws = op.workspace(8)
    q_a, norm_w, codes, scales, w_uk = _inputs(3, 12, recipe, seed=4)
    out = torch.full((3, 12, 576), float("nan"), dtype=torch.bfloat16, device="cuda")
    op(q_a, norm_w, codes, scales, w_uk, out, workspace=ws)
    torch.cuda.synchronize()
    eager = out.clone()
    graph = capture(lambda: op(q_a, norm_w, codes, scales, w_uk, out, workspace=ws))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
