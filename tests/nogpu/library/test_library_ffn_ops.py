"""`k3gen::moe_route`, `k3gen::attn_res`, `k3gen::moe_experts` (functional and _out) on the CPU,
beyond test_ops.py's generic checks: the values against the ops' FP32 references called directly,
the _out forms against the functional ones, attn_res's in-place partial-sum update (delta, seal),
moe_route's T_max workspace (rows past T untouched), float8_e4m3fn scale bytes, opcheck at the
other two input combos, and the three under torch.compile(fullgraph=True) (issue 24)."""
from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from k3gen.ops.act_quant_fp8.reference import act_quant_fp8
from k3gen.ops.attn_res import reference as res_ref
from k3gen.ops.moe_experts.reference import moe_experts as experts_ref
from k3gen.ops.moe_route.reference import route_spec
from test_ops import COMBOS, IDS, _fake_args, by_op

NEW_OPS = ("moe_route", "moe_route_out", "attn_res", "attn_res_out", "moe_experts", "moe_experts_out")


def _clone(args):
    return tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)


def _bits(a, b) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.contiguous().view(torch.uint8),
                                                                     b.contiguous().view(torch.uint8))


@pytest.mark.parametrize("i", range(len(COMBOS)), ids=IDS)
def test_moe_route_values_and_workspace(i):
    c, o = by_op(i, "moe_route"), by_op(i, "moe_route_out")
    _, logits, bias = c.args
    want = route_spec(c.spec, logits, bias)
    got = c.overload(*c.args)
    for name, g in zip(("ids", "weights", "counts", "offsets", "perm", "inv"), got):
        assert _bits(g, getattr(want, name)), name
    args = _clone(o.args)
    o.overload(*args)
    T, k = logits.shape[0], c.spec.top_k
    ids, weights, counts, offsets, perm, inv = args[3:]
    for buf, fresh, n in ((ids, got[0], T), (weights, got[1], T), (perm, got[4], T * k), (inv, got[5], T * k)):
        assert _bits(buf[:n], fresh) and not buf[n:].any()     # the workspace's rows past T stay zero
    assert _bits(counts, got[2]) and _bits(offsets, got[3])


def _attn_want(spec, src, n, query, norm_w, delta, seal, M):
    """(src after the update, out, codes, scales, mixed) by the reference."""
    src = src.clone()
    if delta is not None:
        src[n - 1, :M] = res_ref.partial_update(None if seal else src[n - 1, :M], delta, seal)
    x = res_ref.mix(src[:n, :M], query, spec.eps)
    out = res_ref.norm(x, norm_w, spec.eps)
    codes, scales = act_quant_fp8(out, spec.recipe) if spec.fp8 else (None, None)
    return src, out, codes, scales, x


@pytest.mark.parametrize("i", range(len(COMBOS)), ids=IDS)
def test_attn_res_updates_src_in_place_and_mixes(i):
    c, o = by_op(i, "attn_res"), by_op(i, "attn_res_out")
    spec = c.spec
    # functional: src is a row slice (M = src.shape[1]); the delta (if any) is added, seal=False
    args = _clone(c.args)
    h_, src, n, query, norm_w, delta, seal, want_mixed = args
    M = src.shape[1]
    src0 = src.clone()
    w_src, w_out, w_codes, w_scales, w_x = _attn_want(spec, src0, n, query, norm_w, delta, seal, M)
    out, codes, scales, mixed = c.overload(*args)
    assert torch.equal(src, w_src) and _bits(out, w_out)
    if delta is not None:
        assert not torch.equal(src[n - 1], src0[n - 1]) and torch.equal(src[:n - 1], src0[:n - 1])
    else:
        assert torch.equal(src, src0)
    if spec.fp8:
        assert _bits(codes, w_codes) and _bits(scales, w_scales)
    else:
        assert codes.shape[0] == scales.shape[0] == 0
    assert _bits(mixed, w_x) if want_mixed else mixed.shape[0] == 0
    # _out: M = out.shape[0] rows of a taller buffer; seal=True with a delta (source n-1 := delta)
    args = list(_clone(o.args))
    src, n, delta, seal = args[1], args[2], args[5], args[6]
    M = args[-1].shape[0]
    src0 = src.clone()
    w_src, w_out, w_codes, w_scales, w_x = _attn_want(spec, src0, n, args[3], args[4], delta, seal, M)
    o.overload(*args)
    assert torch.equal(src, w_src) and torch.equal(src[:, M:], src0[:, M:]) and _bits(args[-1], w_out)
    if delta is not None:
        assert seal and torch.equal(src[n - 1, :M], delta.float())
    if spec.fp8:
        assert _bits(args[7], w_codes) and _bits(args[8], w_scales)
    if args[9] is not None:
        assert _bits(args[9], w_x)


@pytest.mark.parametrize("i", range(len(COMBOS)), ids=IDS)
def test_moe_experts_values_and_out_form(i):
    c, o = by_op(i, "moe_experts"), by_op(i, "moe_experts_out")
    spec = c.spec
    _, x, w13, s13, w2, s2, ids, weights, offsets, perm, gs13, gs2, xs, base, ws_h, ws_y, want_f32 = c.args
    want, want32 = experts_ref(spec, x, w13, s13, w2, s2, ids, weights, gs13=gs13, gs2=gs2, x_scales=xs,
                               expert_base=base)
    out, out32 = c.overload(*_clone(c.args))
    assert _bits(out, want) and float(want.float().abs().max()) > 0
    assert _bits(out32, want32) if want_f32 else out32.shape[0] == 0
    args = _clone(o.args)
    o.overload(*args)
    assert _bits(args[-1], want)
    if args[-2] is not None:
        assert _bits(args[-2], want32) and torch.equal(args[-1], args[-2].to(torch.bfloat16))


def test_moe_experts_takes_float8_scale_bytes():
    """The loaders keep NVFP4's E4M3 scales as float8_e4m3fn: the same bytes as uint8, the same sums
    (eager and fake). Not in library_inputs: opcheck's schema check cannot compare float8 inputs."""
    c = by_op(1, "moe_experts")
    assert c.spec.weights.value == "nvfp4"
    args = list(c.args)
    want = c.overload(*_clone(args))
    args[3], args[5] = args[3].view(torch.float8_e4m3fn), args[5].view(torch.float8_e4m3fn)
    got = c.overload(*_clone(args))
    assert all(_bits(g, w) for g, w in zip(got, want))
    mode = FakeTensorMode()
    with mode:
        fake = c.overload(*_fake_args(mode, args))
    assert [(f.shape, f.dtype) for f in fake] == [(w.shape, w.dtype) for w in want]


@pytest.mark.parametrize("op", NEW_OPS)
@pytest.mark.parametrize("i", [0, 2], ids=[IDS[0], IDS[2]])
def test_opcheck_other_combos(i, op):
    """test_ops.py runs opcheck at the nvfp4-bf16 inputs; here the others: FP32 delta with FP8
    codes and `mixed`, no delta with UE8M0 scales, BF16 and EP experts, plain and raw routing."""
    c = by_op(i, op)
    torch.library.opcheck(c.overload, _clone(c.args))


def test_the_chain_compiles_as_one_graph():
    """attn_res (the in-place delta on src), moe_route into moe_experts under
    torch.compile(fullgraph=True): no graph break, the eager values, src updated as eagerly."""
    ar, rt, ex = by_op(0, "attn_res"), by_op(0, "moe_route"), by_op(0, "moe_experts")
    ops = torch.ops.k3gen
    rs, es = rt.spec, ex.spec
    router = torch.randn(es.hidden, rs.experts, generator=torch.Generator().manual_seed(7)) * 0.05
    eargs = ex.args

    def step(src, x):
        out, _, _, _ = ops.attn_res(ar.args[0], src, ar.args[2], ar.args[3], ar.args[4], ar.args[5], False, False)
        logits = out[:, :es.hidden].float() @ router
        ids, w, _, offsets, perm, _ = ops.moe_route(rt.args[0], logits, rt.args[2])
        y, _ = ops.moe_experts(eargs[0], x, *eargs[2:6], ids, w, offsets, perm, *eargs[10:13], 0, None, None, False)
        return out, y

    x = eargs[1][:1].expand(ar.args[1].shape[1], -1).contiguous()
    src_e, src_c = ar.args[1].clone(), ar.args[1].clone()
    want = step(src_e, x)
    torch._dynamo.reset()
    ex_ = torch._dynamo.explain(step)(src_c.clone(), x)
    assert ex_.graph_break_count == 0 and ex_.graph_count == 1, ex_.break_reasons
    got = torch.compile(step, fullgraph=True, backend="aot_eager", dynamic=False)(src_c, x)
    assert all(_bits(g, w) for g, w in zip(got, want)) and torch.equal(src_c, src_e)
