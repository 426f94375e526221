"""Tensor and expert parallelism on the CPU (gloo, spawned ranks): TP2, TP4, EP2, EP4 and TP2 x EP2 of a tiny
K3 give TP1's logits for prefill, decode, speculative verify and the decode after a partial commit, and TP1's
greedy and speculative tokens, the same on every rank; world size 1 through model/dist.py is TP1's path.

The bound. A layout computes every sum TP1 computes, in another order: o_proj as partial products over its
heads' columns added in rank order, the dense MLP and shared experts as partials over their intermediate,
the routed experts' sum as partials over expert / intermediate slices. In FP32 alone that moves the logits by
~1e-6 (TP2 and EP2 here: 4e-7 in prefill, bitwise in decode). But where such a difference lands on a BF16
rounding edge of an activation (o_proj's output, routed_expert_norm's, the next RMSNorm's), that element
rounds one BF16 ulp the other way, and a random model amplifies the change, through routing decisions above
all. The test measures exactly that on TP1 itself: TP1 rerun with each of those sums split into n blocks
(n = 2, 4, the layouts' rank counts) added in block order and in reverse (`_order_variant`) moves its logits
by at most E (measured: 2.7e-3 rel RMS, the one o_proj element at a rounding edge that TP4 also rounds the
other way). A layout may differ from TP1 by 2 E: the variants sample four orders of the same sums, a layout
is one more, and which of the elements near an edge cross differs between orders. Never below 1e-5, the
FP32 order-of-operations bound (tests/numerics.py) that applies when no rounding edge is crossed. A wrong
slice, a missing partial or a rank summing twice moves the logits by O(1).
"""
from __future__ import annotations

import contextlib

import pytest
import torch

import model.layers as L
from k3gen.ops.act_quant_fp8.reference import act_quant_fp8, dequantize
from model.checkpoint import write_random_checkpoint
from numerics import rel_rms, tolerance

import dist_cases as C
import dist_harness as H

LOGITS = ("prefill", "decode1", "decode2", "verify", "after_commit")
LAYOUTS = {"TP2": (2, 1), "TP4": (4, 1), "EP2": (2, 2), "EP4": (4, 4), "TP2xEP2": (4, 2)}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    d, _ = write_random_checkpoint(C.tiny4(), tmp_path_factory.mktemp("tiny4"), seed=3)
    return str(d)


@contextlib.contextmanager
def one_thread():
    """The ranks run one thread each; TP1 runs so too (the same GEMM blocking)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tp1(checkpoint):
    with one_thread():
        return C.scenario(C.build(C.tiny4(), checkpoint))


def _blocks(n: int, parts: int, reverse: bool) -> list[slice]:
    k = n // parts
    b = [slice(i * k, (i + 1) * k) for i in range(parts)]
    return b[::-1] if reverse else b


@contextlib.contextmanager
def _order_variant(m, parts: int, reverse: bool):
    """TP1 with the sums a layout splits computed as `parts` block sums added in order (or reversed):
    o_proj over its input columns (FP32 partials, as RankOps), the GLU down projection over the
    intermediate and the routed experts' weighted sum over the experts (FP64 partials rounded to FP32)."""
    ops, glu, ein = m.ops, L._glu, L._ein
    o_projs = {id(lw.attn.o_proj) for lw in m.w.layers}

    class Ops:
        def __getattr__(self, name):
            return getattr(ops, name)

        def linear(self, x, w):
            if id(w) not in o_projs:
                return ops.linear(x, w)
            xd, W = dequantize(*act_quant_fp8(x, ops.recipe), ops.recipe), w.dequant()
            return sum(xd[:, b] @ W[:, b].T for b in _blocks(w.k, parts, reverse)).to(torch.bfloat16)

    def glu_blocks(x, gate_w, up_w, down_w, act):
        h = act(L._mm(x, gate_w.T), L._mm(x, up_w.T)).to(torch.bfloat16)
        return sum(L._mm(h[:, b], down_w[:, b].T) for b in _blocks(h.shape[1], parts, reverse))

    def ein_blocks(eq, a, b):
        if eq != "me,mew->mw":
            return ein(eq, a, b)
        return sum(ein(eq, a[:, s], b[:, s]) for s in _blocks(a.shape[1], parts, reverse))
    m.ops, L._glu, L._ein = Ops(), glu_blocks, ein_blocks
    try:
        yield m
    finally:
        m.ops, L._glu, L._ein = ops, glu, ein


@pytest.fixture(scope="module")
def bound(checkpoint, tp1):
    worst = 0.0
    with one_thread():
        for parts in (2, 4):
            for rev in (False, True):
                m = C.build(C.tiny4(), checkpoint)
                with _order_variant(m, parts, rev):
                    v = C.scenario(m)
                worst = max([worst] + [rel_rms(v[k], tp1[k]) for k in LOGITS])
    return max(tolerance(torch.float32).rel_rms, 2 * worst)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_tp1(name, checkpoint, tp1, bound, tmp_path):
    world, ep = LAYOUTS[name]
    ranks = H.values(H.run_ranks(C.rank_scenario, world, tmp_path, checkpoint, ep))
    got = ranks[0]
    errs = {k: rel_rms(got[k], tp1[k]) for k in LOGITS}
    print(f"{name}: rel RMS vs TP1 {errs} (bound {bound:.3g})")
    assert all(e <= bound for e in errs.values()), f"{name}: {errs} > {bound:.3g}"
    for r, res in enumerate(ranks):
        assert res["greedy"] == tp1["greedy"], f"rank {r}"
        assert res["spec"] == tp1["spec"] == tp1["greedy"], f"rank {r}"
    assert got["accepted"] == tp1["accepted"]
    assert 0 in tp1["accepted"] and max(tp1["accepted"]) >= 2      # rejections and acceptances both ran


def test_order_variants_move_tp1_within_the_bound_they_set(bound):
    """The bound is what FP32 reassociation does to this model, not a guess: at least the FP32 floor,
    far below the O(1) of a wrong split (a checkpoint change that made it large would show here)."""
    assert tolerance(torch.float32).rel_rms <= bound < 2e-2


def test_world_size_1_is_the_plain_path(checkpoint, tp1, monkeypatch):
    """Parallel.single() builds the unsplit model, bitwise TP1, and issues no collective at all."""
    import torch.distributed as dist
    from model.dist import Parallel

    def forbidden(*a, **k):
        raise AssertionError("a collective at world size 1")
    for name in ("all_gather", "all_reduce", "all_gather_into_tensor", "init_process_group", "new_group",
                 "broadcast"):
        monkeypatch.setattr(dist, name, forbidden)
    par = Parallel.single()
    with one_thread():
        m = C.build(C.tiny4(), checkpoint, par)
        assert m.par is None and type(m.ops).__name__ == "RefOps"
        got = C.scenario(m)
    par.agree("nothing")
    par.check_equal([1, 2, 3])
    for k in LOGITS:
        assert torch.equal(got[k], tp1[k]), k
    assert got["greedy"] == tp1["greedy"] and got["spec"] == tp1["spec"]
