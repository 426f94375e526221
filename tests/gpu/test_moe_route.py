"""moe_route on the H200 against the FP32 reference, EXACTLY (ids, weights bit for bit, counts,
offsets, perm, inv): K3 TP8 routing (896 experts, top-16) and grouped / small / unrenormalized
routers, T in {1, 2, 8, 64, 512}, ties, skewed routing, graph replay == eager, validation."""
from __future__ import annotations

import functools

import pytest
import torch

from k3gen.errors import SpecError
from k3gen.ops.moe_route.launcher import MoeRoute
from k3gen.ops.moe_route.reference import route_spec
from k3gen.ops.moe_route.spec import MoeRouteSpec
from k3gen.runtime.graphs import capture
from k3gen.targets import TARGETS
from numerics import poison

pytestmark = pytest.mark.gpu

SM90 = TARGETS["sm90"]
SPECS = {
    "k3": MoeRouteSpec(target=SM90, experts=896, top_k=16),
    "grouped": MoeRouteSpec(target=SM90, experts=256, top_k=8, n_group=8, topk_group=4, routed_scale=2.5),
    "small": MoeRouteSpec(target=SM90, experts=32, top_k=4),
    "raw": MoeRouteSpec(target=SM90, experts=64, top_k=6, renormalize=False, routed_scale=1.5),
    "tiny": MoeRouteSpec(target=SM90, experts=8, top_k=2),
}
TS = (1, 2, 8, 64, 512)
T_MAX = 520


@functools.lru_cache(maxsize=None)
def op_for(name: str) -> MoeRoute:
    return MoeRoute(SPECS[name]).load()


def poisoned_workspace(op: MoeRoute, t_max: int = T_MAX) -> dict:
    ws = op.workspace(t_max)
    for t in ws.values():
        poison(t)
    return ws


def random_inputs(spec, T: int, seed: int, pad: int = 0):
    """logits [T, E] (a view with row stride E + pad when pad) and bias [E], CPU and CUDA."""
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(T, spec.experts + pad, generator=g) * 2 + torch.randn(T, 1, generator=g)
    bias = torch.randn(spec.experts, generator=g) * 0.1
    return full[:, :spec.experts], bias


def assert_routing_equal(out: dict, ref, what: str = "") -> None:
    torch.cuda.synchronize()
    for k in ("ids", "counts", "offsets", "perm", "inv"):
        got, want = out[k].cpu(), getattr(ref, k)
        if not torch.equal(got, want):
            bad = (got != want).nonzero()
            raise AssertionError(f"{what} {k}: {len(bad)} entries differ, first at {bad[0].tolist()}: "
                                 f"kernel {got[tuple(bad[0])]} reference {want[tuple(bad[0])]}")
    got, want = out["weights"].cpu(), ref.weights
    if not torch.equal(got.view(torch.int32), want.view(torch.int32)):
        d = (got - want).abs()
        raise AssertionError(f"{what} weights differ in {int((got != want).sum())} entries (max {float(d.max()):.3g})")


def run(name: str, logits, bias, ws=None):
    op = op_for(name)
    ws = poisoned_workspace(op) if ws is None else ws
    lg = logits.cuda() if logits.is_contiguous() else logits.cuda().contiguous()
    return op(lg, bias.cuda(), ws), ws


@pytest.mark.parametrize("T", TS)
@pytest.mark.parametrize("name", list(SPECS))
def test_matches_reference(name, T):
    spec = SPECS[name]
    logits, bias = random_inputs(spec, T, seed=T * 7 + len(name))
    out, ws = run(name, logits, bias)
    assert_routing_equal(out, route_spec(spec, logits, bias), f"{name} T{T}")
    n = T * spec.top_k
    assert bool((ws["perm"][n:] == -1).all()) and bool((ws["inv"][n:] == -1).all()), "wrote past T * k"


@pytest.mark.parametrize("name", ["k3", "grouped"])
def test_strided_logits(name):
    """Logits as a column slice of a wider GEMM output (row stride E + 4)."""
    spec = SPECS[name]
    g = torch.Generator().manual_seed(3)
    wide = torch.randn(37, spec.experts + 4, generator=g).cuda()
    bias = (torch.randn(spec.experts, generator=g) * 0.1).cuda()
    op = op_for(name)
    out = op(wide[:, :spec.experts], bias, poisoned_workspace(op))
    assert_routing_equal(out, route_spec(spec, wide[:, :spec.experts].cpu(), bias.cpu()), f"{name} strided")


@pytest.mark.parametrize("T", TS)
@pytest.mark.parametrize("name", ["k3", "grouped", "small"])
def test_ties(name, T):
    """Logits and bias from a few values: many exactly equal choices (and group scores); the
    lower expert (group) index wins."""
    spec = SPECS[name]
    g = torch.Generator().manual_seed(T + 1)
    logits = torch.randint(-2, 3, (T, spec.experts), generator=g).float() * 0.5
    bias = torch.randint(0, 2, (spec.experts,), generator=g).float() * 0.25
    ref = route_spec(spec, logits, bias)
    out, _ = run(name, logits, bias)
    assert_routing_equal(out, ref, f"{name} ties T{T}")
    zeros = torch.zeros(T, spec.experts)
    out, _ = run(name, zeros, torch.zeros(spec.experts))   # all tied: experts 0..k-1 (groups 0.. first)
    assert_routing_equal(out, route_spec(spec, zeros, torch.zeros(spec.experts)), f"{name} all tied")


@pytest.mark.parametrize("T", TS)
def test_skewed_routing(T):
    """One expert takes half the tokens (and, in a second call, every token picks the same k)."""
    spec = SPECS["k3"]
    logits, bias = random_inputs(spec, T, seed=11 * T)
    hot = 413
    half = max(1, T // 2)
    logits[:half, hot] = 30.0      # choice 1.5 for these tokens, ~0.5 for the others
    logits[half:, hot] = -30.0
    bias[hot] = 0.5
    ref = route_spec(spec, logits, bias)
    assert int(ref.counts[hot]) == half
    out, _ = run("k3", logits, bias)
    assert_routing_equal(out, ref, f"skewed T{T}")
    same = logits[:1].expand(T, -1).contiguous()
    ref = route_spec(spec, same, bias)
    assert int((ref.counts == T).sum()) == spec.top_k
    out, _ = run("k3", same, bias)
    assert_routing_equal(out, ref, f"identical tokens T{T}")


@pytest.mark.parametrize("name", ["k3", "grouped"])
def test_cuda_graph_replay_equals_eager(name):
    spec = SPECS[name]
    op = op_for(name)
    T = 64
    logits = torch.zeros(T, spec.experts, device="cuda")
    bias = torch.zeros(spec.experts, device="cuda")
    ws_graph, ws_eager = poisoned_workspace(op, T), poisoned_workspace(op, T)
    graph = capture(lambda: op(logits, bias, ws_graph))
    for it in range(4):
        lg, b = random_inputs(spec, T, seed=100 + it)
        logits.copy_(lg.cuda())
        bias.copy_(b.cuda())
        graph.replay()
        eager = op(logits, bias, ws_eager)
        torch.cuda.synchronize()
        for k in ws_graph:
            assert torch.equal(ws_graph[k], ws_eager[k]), (it, k)
        assert_routing_equal(eager, route_spec(spec, lg, b), f"{name} graph step {it}")


def test_validation_rejects_non_finite_logits(monkeypatch):
    monkeypatch.setenv("K3GEN_VALIDATE", "1")
    spec = SPECS["k3"]
    logits, bias = random_inputs(spec, 8, seed=5)
    out, _ = run("k3", logits, bias)                   # valid: the output checks pass
    assert_routing_equal(out, route_spec(spec, logits, bias))
    logits[3, 17] = float("nan")
    with pytest.raises(SpecError, match="logits"):
        run("k3", logits, bias)
    bias[2] = float("inf")
    logits[3, 17] = 0.0
    with pytest.raises(SpecError, match="bias"):
        run("k3", logits, bias)


def test_launch_checks():
    op = op_for("k3")
    ws = op.workspace(8)
    good = torch.zeros(8, 896, device="cuda")
    bias = torch.zeros(896, device="cuda")
    for bad, match in ((good.double(), "logits"), (torch.zeros(8, 895, device="cuda"), "logits"),
                       (torch.zeros(9, 896, device="cuda"), "workspace"),
                       (torch.zeros(8, 900, device="cuda")[:, 1:897], "logits")):
        with pytest.raises(SpecError, match=match):
            op(bad, bias, ws)
    with pytest.raises(SpecError, match="bias"):
        op(good, bias[:-1], ws)
    with pytest.raises(SpecError, match="workspace"):
        op(good, bias, {k: v for k, v in ws.items() if k != "inv"})


@pytest.mark.parametrize("name,T", [("k3", 3), ("grouped", 5), ("tiny", 2)])
def test_sanitize_small(name, T):
    """A reduced case for compute-sanitizer memcheck (tools/h200.sh runs the tests named `sanitize`)."""
    spec = SPECS[name]
    logits, bias = random_inputs(spec, T, seed=T)
    out, _ = run(name, logits, bias, ws=poisoned_workspace(op_for(name), T))
    assert_routing_equal(out, route_spec(spec, logits, bias), f"sanitize {name}")
