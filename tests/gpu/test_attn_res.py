"""attn_res on the H200 against the FP32 reference: the BF16 row within the BF16 tolerance and the
FP32 mixed row within the FP32 one (tests/numerics.py), both also bit for bit (the reference runs
the kernel's operations in its order); the FP8 codes and scales bit-equal to act_quant_fp8 of the
kernel's own BF16 row, through the reference and through the act_quant_fp8 kernel. Rows are
invariant: a row's bits do not depend on M or its position. Delta (the fused partial-sum update),
graph replay == eager, launch checks."""
from __future__ import annotations

import functools

import pytest
import torch

from k3gen.errors import SpecError
from k3gen.ir.dtypes import ScaleRecipe
from k3gen.ops.act_quant_fp8.launcher import ActQuantFp8
from k3gen.ops.act_quant_fp8.reference import act_quant_fp8
from k3gen.ops.act_quant_fp8.spec import ActQuantFp8Spec
from k3gen.ops.attn_res.launcher import AttnRes
from k3gen.ops.attn_res.reference import attn_res, partial_update
from k3gen.ops.attn_res.spec import AttnResSpec, ResDelta
from k3gen.runtime.graphs import capture
from k3gen.targets import TARGETS
from numerics import assert_close, poison

pytestmark = pytest.mark.gpu

SM90 = TARGETS["sm90"]
SPECS = {
    "k3-fp32": AttnResSpec(target=SM90, hidden=7168),
    "k3-ue8m0": AttnResSpec(target=SM90, hidden=7168, recipe=ScaleRecipe.UE8M0),
    "k3-bf16-dbf16": AttnResSpec(target=SM90, hidden=7168, fp8=False, delta=ResDelta.BF16),
    "k3-fp32-dfp32": AttnResSpec(target=SM90, hidden=7168, delta=ResDelta.FP32),
    "small-dfp32": AttnResSpec(target=SM90, hidden=1024, max_sources=4, delta=ResDelta.FP32),
    "h2304": AttnResSpec(target=SM90, hidden=2304, max_sources=3, recipe=ScaleRecipe.UE8M0),
}
# act_quant_fp8 of the BF16 row, for the bit-equality check through the other kernel.
QUANT = {(s.hidden, s.recipe): ActQuantFp8Spec(target=SM90, k=s.hidden, recipe=s.recipe)
         for s in SPECS.values() if s.fp8}


@functools.lru_cache(maxsize=None)
def op_for(name: str) -> AttnRes:
    return AttnRes(SPECS[name]).load()


class Case:
    """Random sources in a NaN-poisoned buffer (rows beyond M and sources beyond n stay NaN: the
    kernel must not read them), the pseudo-query and the norm weight."""

    def __init__(self, spec, M: int, n: int, seed: int, spare_rows: int = 3):
        h = spec.hidden
        g = torch.Generator().manual_seed(seed)
        self.spec, self.M, self.n = spec, M, n
        self.src = torch.full((spec.max_sources, M + spare_rows, h), float("nan"))
        mag = torch.exp(torch.empty(n, M, 1).uniform_(-2, 3, generator=g))
        self.src[:n, :M] = torch.randn(n, M, h, generator=g) * mag
        self.query = (1 + 0.2 * torch.randn(h, generator=g)) * torch.randn(h, generator=g) * 0.02
        self.norm_w = (1 + 0.1 * torch.randn(h, generator=g)).bfloat16()
        dd = torch.bfloat16 if spec.delta is ResDelta.BF16 else torch.float32
        self.delta = (torch.randn(M, h, generator=g) * 2).to(dd) if spec.delta is not ResDelta.NONE else None
        self.gpu = {"src": self.src.cuda(), "query": self.query.cuda(), "norm_w": self.norm_w.cuda()}

    def outputs(self, M=None):
        M = self.M if M is None else M
        h, s = self.spec.hidden, self.spec
        o = {"out": poison(torch.empty(M, h, dtype=torch.bfloat16, device="cuda")),
             "mixed": poison(torch.empty(M, h, device="cuda"))}
        if s.fp8:
            sdt = torch.float32 if s.recipe is ScaleRecipe.FP32 else torch.uint8
            o["codes"] = poison(torch.empty(M, h, dtype=torch.uint8, device="cuda"))
            o["scales"] = poison(torch.empty(M, s.groups, dtype=sdt, device="cuda"))
        return o

    def run(self, name, o=None, seal=False, src=None):
        o = self.outputs() if o is None else o
        kw = {"delta": self.delta.cuda(), "seal": seal} if self.delta is not None else {}
        op_for(name)(self.gpu["src"] if src is None else src, self.n, self.gpu["query"], self.gpu["norm_w"],
                     o["out"], codes=o.get("codes"), scales=o.get("scales"), mixed=o["mixed"], **kw)
        torch.cuda.synchronize()
        return o

    def sources_after(self, seal=False) -> torch.Tensor:
        """The n sources the kernel mixes (with the delta update applied to source n - 1)."""
        V = self.src[:self.n, :self.M].clone()
        if self.delta is not None:
            V[-1] = partial_update(V[-1], self.delta, seal)
        return V


def check_against_reference(case: Case, o: dict, what: str, V=None) -> None:
    s = case.spec
    ref = attn_res(case.sources_after() if V is None else V, case.query, case.norm_w, s.eps, s.recipe)
    out, mixed = o["out"].cpu(), o["mixed"].cpu()
    assert_close(out, ref["out"], torch.bfloat16, what=f"{what} out")
    assert_close(mixed, ref["mixed"], torch.float32, what=f"{what} mixed")
    assert torch.equal(mixed.view(torch.int32), ref["mixed"].view(torch.int32)), f"{what}: mixed not bitwise"
    assert torch.equal(out.view(torch.int16), ref["out"].view(torch.int16)), f"{what}: out not bitwise"
    if s.fp8:
        codes, scales = act_quant_fp8(out, s.recipe)      # of the kernel's own BF16 row
        assert torch.equal(o["codes"].cpu(), codes), f"{what}: codes != act_quant_fp8(out)"
        assert torch.equal(o["scales"].cpu().view(torch.uint8), scales.view(torch.uint8)), f"{what}: scales"


@pytest.mark.parametrize("M", [1, 2, 8, 64])
@pytest.mark.parametrize("name", list(SPECS))
def test_matches_reference(name, M):
    s = SPECS[name]
    for n in sorted({1, (s.max_sources + 1) // 2, s.max_sources}):
        case = Case(s, M, n, seed=M * 31 + n)
        o = case.run(name)
        check_against_reference(case, o, f"{name} M{M} n{n}")
        if s.delta is not ResDelta.NONE:   # the partial sum was updated in place, other sources untouched
            got = case.gpu["src"].cpu()
            assert torch.equal(got[:n, :M].view(torch.int32), case.sources_after().view(torch.int32))
            assert torch.isnan(got[n:]).all() and torch.isnan(got[:, M:]).all()


@pytest.mark.parametrize("name", ["k3-fp32", "k3-ue8m0", "h2304"])
def test_fp8_equals_the_act_quant_fp8_kernel(name):
    s = SPECS[name]
    case = Case(s, 16, s.max_sources, seed=4)
    o = case.run(name)
    q = ActQuantFp8(QUANT[(s.hidden, s.recipe)]).load()
    codes, scales = torch.empty_like(o["codes"]), torch.empty_like(o["scales"])
    q(o["out"], codes, scales)
    torch.cuda.synchronize()
    assert torch.equal(codes, o["codes"]) and torch.equal(scales.view(torch.uint8), o["scales"].view(torch.uint8))


def run_on(name: str, case: Case, src, delta, M: int) -> dict:
    o = case.outputs(M)
    op_for(name)(src, case.n, case.gpu["query"], case.gpu["norm_w"], o["out"], codes=o.get("codes"),
                 scales=o.get("scales"), mixed=o["mixed"], **({"delta": delta} if delta is not None else {}))
    torch.cuda.synchronize()
    return o


@pytest.mark.parametrize("name", ["k3-fp32", "k3-ue8m0", "k3-fp32-dfp32", "h2304", "small-dfp32"])
def test_rows_are_invariant(name):
    """64 rows at once, then rows alone and in other subsets at other positions of a larger
    buffer (the other rows NaN): identical bits for every output."""
    s = SPECS[name]
    case = Case(s, 64, s.max_sources, seed=8)
    src0 = case.gpu["src"]
    delta = case.delta.cuda() if case.delta is not None else None
    full = run_on(name, case, src0.clone(), delta, 64)
    g = torch.Generator().manual_seed(1)
    P = 70
    for rows in ([0], [63], [17], [5, 40, 2], torch.randperm(64, generator=g)[:9].tolist()):
        at = torch.randperm(P, generator=g)[:len(rows)].tolist()
        sub = torch.full((s.max_sources, P, s.hidden), float("nan"), device="cuda")
        sub[:, at] = src0[:, rows]
        d = None
        if delta is not None:
            d = torch.zeros(P, s.hidden, dtype=delta.dtype, device="cuda")
            d[at] = delta[rows]
        o = run_on(name, case, sub, d, P)
        for key in o:
            assert torch.equal(o[key][at].view(torch.uint8), full[key][rows].view(torch.uint8)), (name, rows, key)


@pytest.mark.parametrize("name", ["k3-bf16-dbf16", "k3-fp32-dfp32", "small-dfp32"])
def test_delta_seal_starts_the_new_source(name):
    """seal=True: source n-1 becomes delta and is never read (it holds NaN here)."""
    s = SPECS[name]
    case = Case(s, 8, s.max_sources, seed=12)
    case.src[s.max_sources - 1, :8] = float("nan")
    case.gpu["src"] = case.src.cuda()
    o = case.run(name, seal=True)
    V = case.src[:case.n, :8].clone()
    V[-1] = partial_update(None, case.delta, seal=True)
    check_against_reference(case, o, f"{name} seal", V=V)
    assert torch.equal(case.gpu["src"][case.n - 1, :8].cpu(), V[-1])


@pytest.mark.parametrize("name", ["k3-fp32", "k3-fp32-dfp32"])
def test_cuda_graph_replay_equals_eager(name):
    s = SPECS[name]
    M = 16
    case = Case(s, M, s.max_sources, seed=21)
    src_g, src_e = case.gpu["src"].clone(), case.gpu["src"].clone()
    og, oe = case.outputs(), case.outputs()
    delta = case.delta.cuda() if case.delta is not None else None
    kw = {"delta": delta} if delta is not None else {}
    op = op_for(name)

    def call(src, o):
        op(src, case.n, case.gpu["query"], case.gpu["norm_w"], o["out"], codes=o.get("codes"),
           scales=o.get("scales"), mixed=o["mixed"], **kw)

    graph = capture(lambda: call(src_g, og))
    g = torch.Generator().manual_seed(2)
    for it in range(3):
        fresh = torch.randn(s.max_sources, M, s.hidden, generator=g)
        src_g[:, :M].copy_(fresh.cuda())
        src_e[:, :M].copy_(fresh.cuda())
        if delta is not None:
            delta.copy_(torch.randn(M, s.hidden, generator=g).to(delta.dtype).cuda())
        graph.replay()
        call(src_e, oe)
        torch.cuda.synchronize()
        for k in og:
            assert torch.equal(og[k].view(torch.uint8), oe[k].view(torch.uint8)), (it, k)
        assert torch.equal(src_g.view(torch.int32), src_e.view(torch.int32))   # NaN rows beyond M too


def test_launch_checks():
    s = SPECS["k3-fp32"]
    case = Case(s, 4, 3, seed=1)
    o = case.outputs()
    op = op_for("k3-fp32")
    args = (case.gpu["src"], 3, case.gpu["query"], case.gpu["norm_w"], o["out"])
    kw = {"codes": o["codes"], "scales": o["scales"]}
    for n in (0, 10, True):
        with pytest.raises(SpecError, match="n="):
            op(args[0], n, *args[2:], **kw)
    with pytest.raises(SpecError, match="codes"):
        op(*args)
    with pytest.raises(SpecError, match="scales"):
        op(*args, codes=o["codes"], scales=o["scales"].view(torch.uint8))
    with pytest.raises(SpecError, match="delta"):
        op(*args, **kw, delta=torch.zeros(4, 7168, device="cuda"))
    with pytest.raises(SpecError, match="src"):
        op(case.gpu["src"].double(), *args[1:], **kw)
    with pytest.raises(SpecError, match="query"):
        op(*args[:2], case.gpu["query"][:-4], *args[3:], **kw)
    with pytest.raises(SpecError, match="delta"):
        op_for("k3-fp32-dfp32")(*args, **kw)


@pytest.mark.parametrize("name,M", [("k3-fp32", 3), ("k3-bf16-dbf16", 2), ("small-dfp32", 3), ("h2304", 2)])
def test_sanitize_small(name, M):
    """A reduced case for compute-sanitizer memcheck (tools/h200.sh runs the tests named `sanitize`)."""
    s = SPECS[name]
    case = Case(s, M, s.max_sources, seed=M)
    check_against_reference(case, case.run(name), f"sanitize {name}")
