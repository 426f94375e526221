"""k3gen.api, the public op API over the k3gen:: ops, on the CPU: handles, the out= forms, the
argument checks (typed errors), and that importing k3gen (or k3gen.api) never touches CUDA."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import k3gen.api as api
from k3gen.errors import SpecError
from k3gen.ir.dtypes import KvDtype, SsmDtype
from k3gen.library import table
from library_inputs import cases

CASES = {c.op: c for c in cases("cpu", heads=2, kv=KvDtype.NVFP4, ssm=SsmDtype.BF16, hidden=256, seed=5)}


def _clone(args):
    return tuple(a.clone() if isinstance(a, torch.Tensor) else [t.clone() for t in a] if isinstance(a, list) else a
                 for a in args)


def test_importing_k3gen_registers_nothing_and_the_cpu_path_loads_no_kernel():
    """`import k3gen` stays torch-free; k3gen.api registers the ops and runs one on the CPU without
    initializing CUDA or importing the cubin loader (a kernel loads on its first CUDA call)."""
    code = ("import sys, k3gen, k3gen.ops, k3gen.targets\n"
            "assert 'k3gen.library' not in sys.modules and 'torch' not in sys.modules\n"
            "import torch, k3gen.api as api\n"
            "from k3gen.ops.mla_vb_gate.spec import MlaVbGateSpec\n"
            "h = api.prepare(MlaVbGateSpec(target=k3gen.targets.get_target('sm90'), heads=1))\n"
            "o = api.mla_vb_gate(h, torch.zeros(2, 1, 512, dtype=torch.bfloat16),\n"
            "                    torch.zeros(1, 128, 512, dtype=torch.bfloat16), torch.zeros(2, 128, dtype=torch.bfloat16))\n"
            "assert o.shape == (2, 1, 128) and hasattr(torch.ops.k3gen, 'kda_decode')\n"
            "assert not torch.cuda.is_initialized() and 'k3gen.runtime.loader' not in sys.modules\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**__import__("os").environ, "CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 0, r.stderr


def test_a_handle_is_the_canonical_spec_and_parses_anywhere(monkeypatch):
    spec = CASES["kda_decode"].spec
    h = api.prepare(spec, load=False)
    assert h == spec.canonical() and api.spec_of(h) is spec
    monkeypatch.setattr(table, "_specs", {})      # another process: only the string
    again = api.spec_of(h)
    assert again == spec and again is not spec


def test_spec_or_handle_and_out_forms_agree():
    c = CASES["kda_decode"]
    a1, a2 = _clone(c.args), _clone(c.args)
    got = api.kda_decode(c.spec, *a1[1:])
    out = torch.full_like(got, float("nan"))
    res = api.kda_decode(c.args[0], *a2[1:], out=out)
    assert res is out and torch.equal(out, got)
    assert torch.equal(a1[4], a2[4]) and torch.equal(a1[5], a2[5])     # both wrote the pools alike


def test_cache_by_name_equals_cache_by_order():
    c = CASES["mla_decode"]
    h, q, cache, bt, lengths, ring, scale, splits = c.args[:8]
    names = list(c.spec.layout.tensors())
    plan = api.mla_decode_plan(h, q.shape[0], 1024, device="cpu")
    by_list = api.mla_decode(h, q, cache, bt, lengths, plan=plan, ring_slot=ring, scale=scale)
    by_name = api.mla_decode(h, q, dict(zip(names, cache)), bt, lengths, plan=plan, ring_slot=ring, scale=scale)
    assert plan.splits == 1 and torch.equal(by_list, by_name)
    with pytest.raises(SpecError, match="cache"):
        api.mla_decode(h, q, dict(zip(names[1:], cache[1:])), bt, lengths, plan=plan, ring_slot=ring, scale=scale)


def test_kv_write_then_decode_reads_the_rows():
    """The ops compose: rows appended through api.kv_cache_write are what api.mla_decode attends to."""
    from k3gen.ops.mla_decode.reference import mla_decode as ref
    w, d = CASES["kv_cache_write"], CASES["mla_decode"]
    h, rows, cu, start, bt, cache, ring, scale, _ = _clone(w.args)
    api.kv_cache_write(h, rows, cu, start, bt, cache, ring_slot=ring, scale=scale, max_rows_per_seq=1)
    q = d.args[1]
    lengths = start + 1
    plan = api.MlaDecodePlan(1)
    got = api.mla_decode(d.args[0], q, cache, bt, lengths, plan=plan, ring_slot=ring, scale=scale)
    want = ref(d.spec.layout, dict(zip(d.spec.layout.tensors(), cache)), q, bt, lengths, ring_slot=ring, scale=scale)
    torch.testing.assert_close(got.float(), want.to(torch.bfloat16).float())


def test_argument_errors_are_typed():
    w, d, aq = CASES["kv_cache_write"], CASES["mla_decode"], CASES["act_quant_fp8"]
    with pytest.raises(SpecError, match="kernel"):
        api.mla_vb_gate(object(), *CASES["mla_vb_gate"].args[1:])
    with pytest.raises(SpecError, match="codes/scales"):
        api.act_quant_fp8(aq.args[0], aq.args[1], codes=torch.empty(5, 256, dtype=torch.uint8))
    h, rows, cu, start, bt, cache, ring, scale, _ = w.args
    with pytest.raises(SpecError, match="max_rows_per_seq"):
        api.kv_cache_write(h, rows, cu, start, bt, cache, ring_slot=ring, scale=scale, max_rows_per_seq=None)
    with pytest.raises(SpecError, match="max_rows_per_seq"):
        api.kv_cache_write(h, rows, cu, start, bt, cache, ring_slot=ring, scale=scale, max_rows_per_seq=-1)
    hd, q, cl, bt2, lengths, ring2, sc, splits = d.args[:8]
    with pytest.raises(SpecError, match="plan"):
        api.mla_decode(hd, q, cl, bt2, lengths, plan=2, ring_slot=ring2, scale=sc)
    with pytest.raises(SpecError, match="batch"):
        api.mla_decode_plan(hd, 0, 128, device="cpu")
    with pytest.raises(SpecError, match="handle"):
        api.mla_decode_plan(CASES["kda_decode"].args[0], 1, 128, device="cpu")
    with pytest.raises(SpecError, match="part_o"):
        api.mla_decode(hd, q, cl, bt2, lengths, plan=api.MlaDecodePlan(2, torch.empty(1, 2, 2, 512), None),
                       ring_slot=ring2, scale=sc)


def test_commit_sets_pending():
    pending = torch.zeros(5, dtype=torch.int32)
    api.kda_commit(pending, torch.tensor([3, -1, 0], dtype=torch.int32), torch.tensor([2, 4, 1], dtype=torch.int32))
    assert pending.tolist() == [0, 0, 0, 1, 0]


def test_route_then_experts_and_the_workspace_forms():
    """api.moe_route's dict feeds api.moe_experts as it is; the workspace (out=) forms give the
    functional values (the route's views cover this call's T only)."""
    from k3gen.ops.moe_experts.reference import moe_experts as experts_ref
    from k3gen.ops.moe_route.spec import MoeRouteSpec
    e = CASES["moe_experts"]
    _, x, w13, s13, w2, s2, *_rest = e.args
    gs13, gs2, xs = e.args[10:13]
    rs = MoeRouteSpec(target=e.spec.target, experts=e.spec.route_experts, top_k=e.spec.top_k)
    logits = torch.randn(x.shape[0], rs.experts, generator=torch.Generator().manual_seed(3))
    bias = torch.zeros(rs.experts)
    route = api.moe_route(rs, logits, bias)
    ws = api.moe_route_workspace(rs, 8, device="cpu")
    again = api.moe_route(api.prepare(rs, load=False), logits, bias, out=ws)
    assert set(route) == set(api.ROUTE_OUTPUTS) and all(torch.equal(route[n], again[n]) for n in route)
    assert again["ids"].data_ptr() == ws["ids"].data_ptr() and again["perm"].shape[0] == x.shape[0] * rs.top_k
    got, got32 = api.moe_experts(e.spec, x, w13, s13, w2, s2, route, gs13=gs13, gs2=gs2, x_scales=xs, f32=True)
    want, want32 = experts_ref(e.spec, x, w13, s13, w2, s2, route["ids"], route["weights"], gs13=gs13, gs2=gs2,
                               x_scales=xs)
    assert torch.equal(got, want) and torch.equal(got32, want32)
    out = torch.full_like(got, float("nan"))
    mws = api.moe_experts_workspace(e.spec, 4, device="cpu")
    res = api.moe_experts(e.args[0], x, w13, s13, w2, s2, again, gs13=gs13, gs2=gs2, x_scales=xs, ws=mws, out=out)
    assert res is out and torch.equal(out, got)


def test_attn_res_forms_agree():
    c, o = CASES["attn_res"], CASES["attn_res_out"]
    h, src, n, query, norm_w, delta, seal, want_mixed = _clone(c.args)
    src2 = src.clone()
    got = api.attn_res(h, src, n, query, norm_w, delta=delta, seal=seal, mixed=True)
    assert isinstance(got, api.AttnResOut) and got.mixed.shape == (src.shape[1], src.shape[2])
    M = src.shape[1]
    out = torch.full((M, src.shape[2]), float("nan"), dtype=torch.bfloat16)
    codes, scales = (torch.empty(M, src.shape[2], dtype=torch.uint8), torch.empty(M, src.shape[2] // 128)) \
        if o.spec.fp8 else (None, None)
    res = api.attn_res(o.args[0], src2, n, query, norm_w, delta=delta, seal=seal, out=out, codes=codes,
                       scales=scales)
    assert res.out is out and torch.equal(out, got.out) and res.mixed is None and torch.equal(src, src2)
    assert api.attn_res(h, src.clone(), n, query, norm_w, delta=delta).mixed is None


def test_ffn_argument_errors_are_typed():
    e, r, a = CASES["moe_experts"], CASES["moe_route"], CASES["attn_res"]
    x, w13, s13, w2, s2, ids, weights, offsets, perm = e.args[1:10]
    route = {"ids": ids, "weights": weights, "offsets": offsets, "perm": perm}
    with pytest.raises(SpecError, match="route"):
        api.moe_experts(e.args[0], x, w13, s13, w2, s2, {"ids": ids}, gs13=e.args[10], gs2=e.args[11])
    with pytest.raises(SpecError, match="ws"):
        api.moe_experts(e.args[0], x, w13, s13, w2, s2, route, gs13=e.args[10], gs2=e.args[11], ws={"h": None})
    with pytest.raises(SpecError, match="out"):
        api.moe_experts(e.args[0], x, w13, s13, w2, s2, route, gs13=e.args[10], gs2=e.args[11],
                        out_f32=torch.empty(x.shape[0], e.spec.hidden))
    with pytest.raises(SpecError, match="max_tokens"):
        api.moe_route_workspace(r.args[0], 0, device="cpu")
    with pytest.raises(SpecError, match="max_tokens"):
        api.moe_experts_workspace(e.args[0], 0, device="cpu")
    with pytest.raises(SpecError, match="out"):
        api.moe_route(r.args[0], *r.args[1:], out={"ids": torch.empty(5, 8, dtype=torch.int32)})
    with pytest.raises(SpecError, match="out"):
        api.attn_res(a.args[0], *a.args[1:5], delta=a.args[5], codes=torch.empty(3, 7168, dtype=torch.uint8))
    with pytest.raises(SpecError, match="handle"):
        api.moe_route_workspace(e.args[0], 4, device="cpu")
