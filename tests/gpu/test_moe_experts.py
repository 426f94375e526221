"""moe_experts on the H200 against the FP32 reference (tests/numerics.py BF16 bounds: the output goes
through the BF16 intermediate h): both weight formats (MXFP4, NVFP4 with globals), both activation
formats (BF16, FP8 per-token-128 in both scale recipes), T in {1, 2, 8, 64, 512}, skewed routing (one
expert takes half the tokens), EP (this rank's experts inside a larger router), the K3 TP8 / EP8
shapes, moe_route's kernel feeding it, graph replay == eager bit for bit, the dequantized values bit
for bit against numerics.py's decoders, bad routing without out-of-bounds access (the memcheck run
selects `-k sanitize`). Fresh random packed weights (random E2M1 bytes, scales in a sane range) and
inputs per case; outputs and workspace poisoned first."""
from __future__ import annotations

import functools

import pytest
import torch

from k3gen.ir.dtypes import ScaleRecipe
from k3gen.numerics import e2m1_decode, e4m3_decode, fp8_group_quantize, ue8m0_decode, unpack_e2m1
from k3gen.ops.moe_experts.launcher import MoeExperts
from k3gen.ops.moe_experts.reference import moe_experts as reference
from k3gen.ops.moe_experts.spec import ActFormat, GluAct, MoeExpertsSpec, WeightFormat
from k3gen.ops.moe_route.reference import grouped_order
from k3gen.runtime.graphs import capture
from k3gen.targets import TARGETS
from numerics import assert_close, poison

pytestmark = pytest.mark.gpu

SM90 = TARGETS["sm90"]
MX, NV = WeightFormat.MXFP4, WeightFormat.NVFP4
SMALL = dict(hidden=512, inter=128, experts=32, top_k=4)
SPECS = {
    "mx_bf16": MoeExpertsSpec(target=SM90, weights=MX, **SMALL),
    "nv_bf16": MoeExpertsSpec(target=SM90, weights=NV, **SMALL),
    "mx_fp8": MoeExpertsSpec(target=SM90, weights=MX, act=ActFormat.FP8, recipe=ScaleRecipe.FP32, **SMALL),
    "nv_fp8_ue8m0": MoeExpertsSpec(target=SM90, weights=NV, act=ActFormat.FP8, recipe=ScaleRecipe.UE8M0, **SMALL),
    # a K tail (inter 96: the down GEMM's last chunk is partial), SiLU, one 8-token tile per item
    "nv_bf16_tail_silu": MoeExpertsSpec(target=SM90, weights=NV, hidden=384, inter=96, experts=16, top_k=6,
                                        glu=GluAct.SILU, n_tiles=1),
    # EP: 8 local experts of a 32-expert router
    "mx_bf16_ep": MoeExpertsSpec(target=SM90, weights=MX, hidden=512, inter=128, experts=8, route_experts=32, top_k=4),
}
K3 = {
    "k3_tp8_mx_bf16": MoeExpertsSpec(target=SM90, weights=MX, hidden=3584, inter=384, experts=896, top_k=16),
    "k3_tp8_nv_fp8": MoeExpertsSpec(target=SM90, weights=NV, act=ActFormat.FP8, hidden=3584, inter=384,
                                    experts=896, top_k=16),
    "k3_ep8_mx_bf16": MoeExpertsSpec(target=SM90, weights=MX, hidden=3584, inter=3072, experts=112,
                                     route_experts=896, top_k=16),
}
TS = (1, 2, 8, 64, 512)
T_MAX = 512


def all_specs() -> list:
    return list(SPECS.values()) + list(K3.values())


@functools.lru_cache(maxsize=None)
def op_for(spec: MoeExpertsSpec) -> MoeExperts:
    return MoeExperts(spec).load()


def random_weights(spec, seed: int) -> dict:
    """Packed experts as a checkpoint holds them (random codes; scales keep |w| ~ 0.01 .. 0.1)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    E, W, I, gsz = spec.experts, spec.hidden, spec.inter, spec.group
    u8 = dict(dtype=torch.uint8, device="cuda", generator=g)
    w = {"w13": torch.randint(0, 256, (E, 2 * I, W // 2), **u8), "w2": torch.randint(0, 256, (E, W, I // 2), **u8)}
    if spec.weights is MX:   # 2^-8 .. 2^-5
        w["s13"] = torch.randint(119, 123, (E, 2 * I, W // gsz), **u8)
        w["s2"] = torch.randint(119, 123, (E, W, I // gsz), **u8)
        w["gs13"] = w["gs2"] = None
    else:                    # E4M3 0.5 .. 15 (codes 0x30..0x5F, positive normals), globals ~ 1e-3
        w["s13"] = torch.randint(0x30, 0x60, (E, 2 * I, W // gsz), **u8).view(torch.float8_e4m3fn)
        w["s2"] = torch.randint(0x30, 0x60, (E, W, I // gsz), **u8)
        f32 = dict(dtype=torch.float32, device="cuda", generator=g)
        w["gs13"] = torch.rand(E, 2, **f32) * 2e-3 + 5e-4
        w["gs2"] = torch.rand(E, 1, **f32) * 2e-3 + 5e-4
    return w


@functools.lru_cache(maxsize=None)
def k3_weights(name: str) -> dict:
    return random_weights(K3[name], seed=len(name))


def routing(spec, T: int, seed: int, skew: bool = False, fill: int | None = None) -> dict:
    """ids (k distinct experts of the router's R per token), weights, offsets, perm as moe_route
    writes them (its reference's grouped order); skew: expert `fill` (default: this rank's first)
    in the picks of half the tokens."""
    g = torch.Generator().manual_seed(seed)
    R, k = spec.route_experts, spec.top_k
    scores = torch.rand(T, R, generator=g)
    if skew:
        scores[: (T + 1) // 2, R - spec.experts if fill is None else fill] = 2.0
    ids = scores.topk(k, dim=1).indices.int()
    _, offsets, perm, _ = grouped_order(ids, R)
    w = torch.rand(T, k, generator=g) / k
    return {"ids": ids, "weights": w, "offsets": offsets, "perm": perm}


def activations(spec, T: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(T, spec.hidden, generator=g) * 2).to(torch.bfloat16)
    if spec.act is ActFormat.BF16:
        return x, None
    return fp8_group_quantize(x.float(), 128, spec.recipe)


def run(spec, w: dict, x, xs, route: dict, *, base: int = 0, f32: bool = True, ws=None, rows=None):
    op = op_for(spec)
    T = x.shape[0]
    ws = op.workspace(T_MAX if ws is None else ws) if not isinstance(ws, dict) else ws
    for t in ws.values():
        poison(t)
    out = poison(torch.empty(T, spec.hidden, dtype=torch.bfloat16, device="cuda"))
    out32 = poison(torch.empty(T, spec.hidden, dtype=torch.float32, device="cuda")) if f32 else None
    rc = {k: v.cuda() for k, v in route.items()}
    op(x.cuda(), w["w13"], w["s13"], w["w2"], w["s2"], rc, out, gs13=w["gs13"], gs2=w["gs2"],
       x_scales=None if xs is None else xs.cuda(), out_f32=out32, ws=ws, expert_base=base, rows=rows)
    torch.cuda.synchronize()
    return out, out32


def check(spec, w, x, xs, route, out, out32, base: int = 0, what: str = "") -> None:
    want, want32 = reference(spec, x, w["w13"], w["s13"], w["w2"], w["s2"], route["ids"], route["weights"],
                             gs13=w["gs13"], gs2=w["gs2"], x_scales=xs, expert_base=base)
    assert_close(out, want32, "bf16", f"{what} out")
    if out32 is not None:
        assert_close(out32, want32, "bf16", f"{what} out_f32 (through the BF16 intermediate)")
        assert torch.equal(out.cpu(), out32.cpu().to(torch.bfloat16)), f"{what}: out != bf16(out_f32)"


@pytest.mark.parametrize("T", TS)
@pytest.mark.parametrize("name", list(SPECS))
def test_matches_reference(name, T):
    spec = SPECS[name]
    w = random_weights(spec, seed=T + 17 * len(name))
    x, xs = activations(spec, T, seed=T * 3 + len(name))
    route = routing(spec, T, seed=T * 5 + len(name))
    base = 8 if spec.route_experts > spec.experts else 0
    out, out32 = run(spec, w, x, xs, route, base=base)
    check(spec, w, x, xs, route, out, out32, base, f"{name} T{T}")


@pytest.mark.parametrize("T", (8, 64, 512))
@pytest.mark.parametrize("name", ["mx_bf16", "nv_fp8_ue8m0", "mx_bf16_ep"])
def test_skewed_routing(name, T):
    """One expert in half the tokens' picks: items of 32 positions, many per weight tile."""
    spec = SPECS[name]
    w = random_weights(spec, seed=T + 1)
    x, xs = activations(spec, T, seed=T + 2)
    base = 8 if spec.route_experts > spec.experts else 0
    route = routing(spec, T, seed=T + 3, skew=True, fill=base + 3)
    assert int((route["ids"] == base + 3).sum()) >= T // 2
    out, out32 = run(spec, w, x, xs, route, base=base)
    check(spec, w, x, xs, route, out, out32, base, f"{name} skewed T{T}")


@pytest.mark.parametrize("rows", (1, 3))
@pytest.mark.parametrize("name", ["mx_bf16", "nv_fp8_ue8m0", "mx_bf16_ep"])
def test_persistent_ctas_walking_many_items_are_bitwise_the_default(name, rows):
    """grid.y capped at `rows`: every CTA walks many items (the persistent loop's pick / barriers /
    the down kernel's early weight loads on later items); an item is computed the same way whichever
    CTA takes it, so the outputs are bit for bit the default launch's."""
    spec = SPECS[name]
    T = 64
    w = random_weights(spec, seed=T + 5)
    x, xs = activations(spec, T, seed=T + 6)
    base = 8 if spec.route_experts > spec.experts else 0
    route = routing(spec, T, seed=T + 7, skew=True, fill=base + 1)
    assert spec.max_items(T) > 4 * rows
    out, out32 = run(spec, w, x, xs, route, base=base)
    got, got32 = run(spec, w, x, xs, route, base=base, rows=rows)
    assert torch.equal(got.view(torch.int16).cpu(), out.view(torch.int16).cpu()), name
    assert torch.equal(got32.view(torch.int32).cpu(), out32.view(torch.int32).cpu()), name
    check(spec, w, x, xs, route, got, got32, base, f"{name} rows {rows}")


@pytest.mark.parametrize("T", (1, 8, 64))
@pytest.mark.parametrize("name", list(K3))
def test_k3_shapes(name, T):
    spec = K3[name]
    w = k3_weights(name)
    x, xs = activations(spec, T, seed=T + 11)
    route = routing(spec, T, seed=T + 13, skew=T == 64)
    base = 112 * 2 if spec.route_experts > spec.experts else 0
    out, out32 = run(spec, w, x, xs, route, base=base, ws=64)
    check(spec, w, x, xs, route, out, out32, base, f"{name} T{T}")


def test_k3_route_kernel_feeds_the_experts():
    """moe_route's kernel outputs passed as they come (dict of views), T = 8 at K3 TP8."""
    from k3gen.ops.moe_route.launcher import MoeRoute
    from k3gen.ops.moe_route.spec import MoeRouteSpec
    spec = K3["k3_tp8_mx_bf16"]
    router = MoeRoute(MoeRouteSpec(target=SM90, experts=896, top_k=16)).load()
    g = torch.Generator(device="cuda").manual_seed(5)
    T = 8
    logits = torch.randn(T, 896, device="cuda", generator=g) * 2
    route = router(logits, torch.zeros(896, device="cuda"), router.workspace(T))
    w = k3_weights("k3_tp8_mx_bf16")
    x, _ = activations(spec, T, seed=7)
    out = poison(torch.empty(T, spec.hidden, dtype=torch.bfloat16, device="cuda"))
    op_for(spec)(x.cuda(), w["w13"], w["s13"], w["w2"], w["s2"], route, out, ws=op_for(spec).workspace(T))
    torch.cuda.synchronize()
    cpu = {k: v.cpu() for k, v in route.items()}
    want, want32 = reference(spec, x, w["w13"], w["s13"], w["w2"], w["s2"], cpu["ids"], cpu["weights"])
    assert_close(out, want32, "bf16", "route -> experts")


@pytest.mark.parametrize("name", ["mx_bf16", "nv_fp8_ue8m0", "mx_bf16_ep"])
def test_graph_replay_equals_eager_bitwise(name):
    spec = SPECS[name]
    op = op_for(spec)
    T = 8
    base = 8 if spec.route_experts > spec.experts else 0
    w = random_weights(spec, seed=99)
    ws = op.workspace(T)
    xs_buf = None
    x, xs = activations(spec, T, seed=1)
    route = {k: v.cuda() for k, v in routing(spec, T, seed=2).items()}
    x_buf = x.cuda()
    if xs is not None:
        xs_buf = xs.cuda()
    out = torch.empty(T, spec.hidden, dtype=torch.bfloat16, device="cuda")
    out32 = torch.empty(T, spec.hidden, dtype=torch.float32, device="cuda")
    call = lambda: op(x_buf, w["w13"], w["s13"], w["w2"], w["s2"], route, out, gs13=w["gs13"], gs2=w["gs2"],  # noqa: E731
                      x_scales=xs_buf, out_f32=out32, ws=ws, expert_base=base)
    call()
    torch.cuda.synchronize()
    eager, eager32 = out.clone(), out32.clone()
    graph = capture(call)
    for _ in range(2):
        poison(out), poison(out32), poison(ws["h"]), poison(ws["y"])
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.view(torch.int16), eager.view(torch.int16))
        assert torch.equal(out32.view(torch.int32), eager32.view(torch.int32))
    # new inputs and routing in the captured buffers: the replay computes them
    x2, xs2 = activations(spec, T, seed=3)
    r2 = routing(spec, T, seed=4, skew=True, fill=base + 1)
    x_buf.copy_(x2.cuda())
    if xs_buf is not None:
        xs_buf.copy_(xs2.cuda())
    for k, v in r2.items():
        route[k].copy_(v.cuda())
    graph.replay()
    torch.cuda.synchronize()
    check(spec, w, x2, xs2, r2, out, out32, base, f"{name} replay, new inputs")


@pytest.mark.parametrize("name", ["mx_bf16", "nv_bf16", "nv_bf16_tail_silu"])
@pytest.mark.parametrize("which", ["w13", "w2"])
def test_dequantized_values_bit_exact(name, which):
    """The probe decodes exactly as the GEMMs do; its values equal numerics.py's decoders (MXFP4:
    e2m1 * ue8m0; NVFP4: (e2m1 * e4m3) * global), zeros compared as values (+-0)."""
    spec = SPECS[name]
    op = op_for(spec)
    w = random_weights(spec, seed=5)
    codes, scales = w[which], w["s13" if which == "w13" else "s2"]
    E, rows, kh = codes.shape
    for e in (0, E - 1):
        got = poison(torch.empty(rows, 2 * kh, dtype=torch.float32, device="cuda"))
        op.dequantize(which, codes, scales if scales.dtype == torch.uint8 else scales.view(torch.uint8),
                      w["gs13" if which == "w13" else "gs2"], e, 0, rows, got)
        torch.cuda.synchronize()
        v = e2m1_decode(unpack_e2m1(codes[e].cpu()))
        sb = scales[e].cpu().view(torch.uint8)
        sv = ue8m0_decode(sb) if spec.weights is MX else e4m3_decode(sb)
        want = (v.unflatten(-1, (sb.shape[-1], spec.group)) * sv.unsqueeze(-1)).flatten(-2)
        if spec.weights is NV:
            gl = w["gs13"][e].cpu().repeat_interleave(spec.inter) if which == "w13" else w["gs2"][e].cpu().expand(rows)
            want = want * gl[:, None]
        got = got.cpu() + 0.0   # -0 -> +0 (a sign of zero is not a value)
        want = want + 0.0
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), f"{name} {which} expert {e}"


def test_sanitize_small_valid_case():
    spec = SPECS["nv_bf16_tail_silu"]
    w = random_weights(spec, seed=1)
    x, xs = activations(spec, 3, seed=2)
    route = routing(spec, 3, seed=3)
    out, out32 = run(spec, w, x, xs, route, ws=3)
    check(spec, w, x, xs, route, out, out32, 0, "sanitize")


@pytest.mark.parametrize("name", ["mx_fp8", "mx_bf16_ep"])
def test_sanitize_bad_routing_stays_in_bounds(name):
    """Out-of-range ids, offsets and perm entries give wrong sums but no out-of-bounds access (the
    memcheck run is what proves it); slots whose id is not local are never read."""
    spec = SPECS[name]
    T, k = 4, spec.top_k
    w = random_weights(spec, seed=4)
    x, xs = activations(spec, T, seed=5)
    route = routing(spec, T, seed=6)
    route["ids"][0, 0] = -5
    route["ids"][1, 1] = spec.route_experts + 7
    route["offsets"][3] = -100
    route["offsets"][5] = 10 ** 6
    route["perm"][2] = -1
    route["perm"][5] = T * k + 40
    out, out32 = run(spec, w, x, xs, route, base=8 if spec.route_experts > spec.experts else 0, ws=T)
    assert out.shape == (T, spec.hidden)
