"""moe_route on the CPU: spec validation, the reference's tie rule and grouped order, the reference
against model/arch.route, and the kernels compiling (sm90, sm103, sm107) without local memory."""
from __future__ import annotations

import math
from types import SimpleNamespace

import numpy

import pytest
import torch

from k3gen.errors import SpecError
from k3gen.ops import spec_from_canonical
from k3gen.ops.moe_route.reference import grouped_order, moe_route, route_spec, sigmoid_scores
from k3gen.ops.moe_route.spec import MoeRouteSpec
from k3gen.pipeline.build import build_one
from k3gen.targets import TARGETS
from model import arch

SM90 = TARGETS["sm90"]
CONFIGS = {
    "k3": dict(experts=896, top_k=16),
    "grouped": dict(experts=256, top_k=8, n_group=8, topk_group=4, routed_scale=2.5),
    "small": dict(experts=32, top_k=4),
    "raw": dict(experts=64, top_k=6, renormalize=False, routed_scale=1.5),
    "groups_of_one": dict(experts=16, top_k=3, n_group=16, topk_group=5),
}


def spec(name: str, target=SM90) -> MoeRouteSpec:
    return MoeRouteSpec(target=target, **CONFIGS[name])


@pytest.mark.parametrize("kw,field", [
    (dict(experts=0, top_k=1), "experts"), (dict(experts=1025, top_k=8), "experts"),
    (dict(experts=896, top_k=0), "top_k"), (dict(experts=896, top_k=33), "top_k"),
    (dict(experts=8, top_k=9), "top_k"), (dict(experts=896, top_k=16, n_group=3), "n_group"),
    (dict(experts=896, top_k=16, n_group=64), "n_group"),
    (dict(experts=256, top_k=8, n_group=8, topk_group=9), "topk_group"),
    (dict(experts=256, top_k=8, n_group=8, topk_group=0), "topk_group"),
    (dict(experts=256, top_k=40, n_group=8, topk_group=1), "top_k"),
    (dict(experts=256, top_k=16, n_group=32, topk_group=1), "topk_group"),
    (dict(experts=896, top_k=16, renormalize=1), "renormalize"),
    (dict(experts=896, top_k=16, routed_scale=0.0), "routed_scale"),
    (dict(experts=896, top_k=16, routed_scale=float("nan")), "routed_scale"),
    (dict(experts=896, top_k=16, routed_scale=2), "routed_scale"),
    (dict(experts=True, top_k=1), "experts"),
])
def test_bad_fields_raise(kw, field):
    with pytest.raises(SpecError) as e:
        MoeRouteSpec(target=SM90, **kw)
    assert e.value.field == field


@pytest.mark.parametrize("name", list(CONFIGS))
def test_canonical_round_trip_and_slug(name):
    s = spec(name)
    assert spec_from_canonical(s.canonical(), SM90) == s
    assert s.slug().startswith(f"e{s.experts}-k{s.top_k}")
    assert s.file_stem.startswith("moe_route__")


def _cfg(s: MoeRouteSpec):
    return SimpleNamespace(top_k=s.top_k, n_group=s.n_group, topk_group=s.topk_group,
                           renormalize=s.renormalize, routed_scale=s.routed_scale)


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("T", [1, 7, 64])
def test_reference_agrees_with_model_arch_route_without_ties(name, T):
    s = spec(name)
    g = torch.Generator().manual_seed(T)
    logits = torch.randn(T, s.experts, generator=g) * 2
    bias = torch.randn(s.experts, generator=g) * 0.1
    r = route_spec(s, logits, bias)
    ids, w = arch.route(logits, bias, _cfg(s))
    assert torch.equal(r.ids.long(), ids)
    torch.testing.assert_close(r.weights, w, rtol=3e-7, atol=1e-9)


def test_scores_are_one_over_one_plus_the_float64_exp_rounded_once():
    x = torch.linspace(-30, 30, 10001)
    e = numpy.float32([math.exp(-float(v)) for v in x.double()])
    want = torch.from_numpy(numpy.float32(1) / (numpy.float32(1) + e))
    assert torch.equal(sigmoid_scores(x), want)
    assert (sigmoid_scores(x) - torch.sigmoid(x)).abs().max() <= 2 ** -23   # torch's FP32 sigmoid: an ulp or two


def test_ties_go_to_the_lower_expert_index():
    E, k = 64, 6
    logits = torch.zeros(3, E)
    logits[1, [5, 40, 41, 63]] = 1.0          # four equal winners, then ties among the rest
    logits[2] = torch.arange(E) % 4 * 0.5     # values repeat every 4 experts
    r = moe_route(logits, torch.zeros(E), top_k=k)
    assert r.ids[0].tolist() == [0, 1, 2, 3, 4, 5]
    assert r.ids[1].tolist() == [5, 40, 41, 63, 0, 1]
    assert r.ids[2].tolist() == [3, 7, 11, 15, 19, 23]
    assert torch.equal(r.weights[0], torch.full((k,), 1 / 6, dtype=torch.float32) / (1 + 1e-20))


def test_group_ties_go_to_the_lower_group_and_masked_groups_are_never_picked():
    E, ng, tg, k = 32, 8, 2, 4
    logits = torch.zeros(1, E)
    logits[0, 4 * 5:4 * 5 + 4] = 3.0          # group 5 best; groups 0..4, 6, 7 tie
    logits[0, 4 * 7] = 2.5                    # group 7's best alone: it still loses on the 2-best sum
    logits[0, 4 * 7 + 1:4 * 8] = -3.0        # (its two best sum to 0.97 < 1, the tied groups' sum)
    r = moe_route(logits, torch.zeros(E), top_k=k, n_group=ng, topk_group=tg)
    assert r.ids[0].tolist() == [20, 21, 22, 23]
    r = moe_route(logits, torch.zeros(E), top_k=6, n_group=ng, topk_group=tg)
    assert r.ids[0].tolist() == [20, 21, 22, 23, 0, 1]


def test_bias_ranks_but_weights_use_the_unbiased_scores():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    bias = torch.tensor([10.0, 0.0, 0.0, 0.0])
    r = moe_route(logits, bias, top_k=2, renormalize=False)
    assert r.ids[0].tolist() == [0, 3]
    assert torch.equal(r.weights[0], sigmoid_scores(torch.tensor([0.0, 3.0])))


def test_grouped_order_sorts_by_expert_then_token():
    ids = torch.tensor([[3, 1], [1, 0], [3, 2], [0, 1]])
    counts, offsets, perm, inv = grouped_order(ids, 5)
    assert counts.tolist() == [2, 3, 1, 2, 0] and offsets.tolist() == [0, 2, 5, 6, 8, 8]
    assert perm.tolist() == [3, 6, 1, 2, 7, 5, 0, 4]
    assert torch.equal(inv[perm.long()], torch.arange(8, dtype=torch.int32))


def test_skewed_routing_counts():
    """One expert in every token's picks (half the slots of a k=2 router), the rest spread."""
    T, E = 64, 32
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(T, E, generator=g)
    logits[:, 7] = 20.0
    r = moe_route(logits, torch.zeros(E), top_k=2)
    assert int(r.counts[7]) == T and int(r.counts.sum()) == 2 * T
    assert r.perm[r.offsets[7]:r.offsets[8]].tolist() == [t * 2 for t in range(T)]


@pytest.mark.parametrize("target", ["sm90", "sm103-nvfp4", "sm107-nvfp4"])
@pytest.mark.parametrize("name", ["k3", "grouped", "small"])
def test_kernels_compile_without_local_memory(target, name):
    r = build_one(spec(name, TARGETS[target]))
    res = {x["function"]: x for x in r.resources}
    assert set(res) == {"k3gen_moe_route", "k3gen_moe_route_sort"}
    for x in res.values():
        assert x["local"] == 0 and x["stack"] == 0 and x["registers"] <= 128, x
        assert not any(op.startswith(("LDL", "STL")) for op in x["sass"]), x["sass"]
    assert any(op.startswith(("REDUX", "CREDUX")) for op in res["k3gen_moe_route"]["sass"])   # warp arg-max
