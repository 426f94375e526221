"""glu_act on the H200 against its FP32/FP64 reference, EXACTLY (codes and scales bit for bit):
SiTU and SiLU, both FP8 recipes, K3 TP8 shapes (shared experts 768, dense 4224 per rank) and the
small preset's, M in {1, 2, 8, 64, 512}, outputs poisoned first, graph replay == eager."""
from __future__ import annotations

import functools

import pytest
import torch

from k3gen.errors import SpecError
from k3gen.ir.dtypes import ScaleRecipe
from k3gen.ops.glu_act.launcher import GluAct
from k3gen.ops.glu_act.reference import glu_act_spec
from k3gen.ops.glu_act.spec import GluActSpec, GluKind
from k3gen.runtime.graphs import capture
from k3gen.targets import TARGETS
from numerics import poison

pytestmark = pytest.mark.gpu

SM90 = TARGETS["sm90"]
SHAPES = {"k3_shared_tp8": dict(inter=768), "k3_dense_tp8": dict(inter=4224), "small": dict(inter=256),
          "silu": dict(inter=1024, act=GluKind.SILU)}
MS = (1, 2, 8, 64, 512)


@functools.lru_cache(maxsize=None)
def op_for(name: str, recipe: ScaleRecipe) -> GluAct:
    return GluAct(GluActSpec(target=SM90, recipe=recipe, **SHAPES[name])).load()


def _inputs(spec, M: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # gate/up magnitudes across SiTU's regimes (linear, tanh-saturating, sigmoid-off)
    x = torch.randn(M, 2 * spec.inter, generator=g) * torch.exp(torch.randn(M, 1, generator=g) * 1.5)
    return x.to(torch.bfloat16)


def _outs(spec, M: int):
    sdt = torch.float32 if spec.recipe is ScaleRecipe.FP32 else torch.uint8
    return (poison(torch.empty(M, spec.inter, dtype=torch.uint8, device="cuda")),
            poison(torch.empty(M, spec.groups, dtype=sdt, device="cuda")))


@pytest.mark.parametrize("recipe", list(ScaleRecipe), ids=lambda r: r.value)
@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("M", MS)
def test_exact_against_reference(name, recipe, M):
    op = op_for(name, recipe)
    gu = _inputs(op.spec, M, seed=M * 7 + len(name))
    codes, scales = _outs(op.spec, M)
    op(gu.cuda(), codes, scales)
    torch.cuda.synchronize()
    wc, ws = glu_act_spec(op.spec, gu)
    assert torch.equal(codes.cpu(), wc), f"{(codes.cpu() != wc).sum()} codes differ"
    assert torch.equal(scales.cpu(), ws)


def test_graph_replay_equals_eager():
    op = op_for("k3_shared_tp8", ScaleRecipe.FP32)
    gu = _inputs(op.spec, 8, 3).cuda()
    codes, scales = _outs(op.spec, 8)
    graph = capture(lambda: op(gu, codes, scales))
    gu.copy_(_inputs(op.spec, 8, 4).cuda())
    graph.replay()
    torch.cuda.synchronize()
    wc, ws = glu_act_spec(op.spec, gu.cpu())
    assert torch.equal(codes.cpu(), wc) and torch.equal(scales.cpu(), ws)


def test_bad_arguments_raise():
    op = op_for("small", ScaleRecipe.FP32)
    gu = torch.zeros(4, 512, dtype=torch.bfloat16, device="cuda")
    codes, scales = _outs(op.spec, 4)
    with pytest.raises(SpecError):
        op(gu[:, :256], codes, scales)
    with pytest.raises(SpecError):
        op(gu, codes, scales.to(torch.uint8))
