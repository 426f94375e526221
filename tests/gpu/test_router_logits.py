"""router_logits on the H200 against its CPU replay of the kernel's summation order, EXACTLY (every
logit bit for bit): K3's router (7168 x 896), the small preset's (1024 x 32) and a ragged expert count,
BF16 weights and FP32 ones (the model's stored router; here with values off the BF16 grid, so the
kernel's round-to-nearest-even must match torch's), M in {1, 2, 7, 8, 9, 64, 512}, outputs poisoned
first; rows in any batch equal the same rows alone (row invariance); graph replay == eager; typed errors."""
from __future__ import annotations

import functools

import pytest
import torch

from k3gen.errors import SpecError
from k3gen.ops.router_logits.launcher import RouterLogits
from k3gen.ops.router_logits.reference import fp64, router_logits
from k3gen.ops.router_logits.spec import RouterLogitsSpec, RouterWeight
from k3gen.runtime.graphs import capture
from k3gen.targets import TARGETS
from numerics import poison

pytestmark = pytest.mark.gpu

SM90 = TARGETS["sm90"]
SHAPES = {"k3": (7168, 896, "bf16"), "k3_f32": (7168, 896, "fp32"), "small": (1024, 32, "bf16"),
          "small_f32": (1024, 32, "fp32"), "ragged": (256, 5, "bf16")}
MS = (1, 2, 7, 8, 9, 64, 512)


@functools.lru_cache(maxsize=None)
def op_for(name: str) -> RouterLogits:
    h, e, wt = SHAPES[name]
    return RouterLogits(RouterLogitsSpec(target=SM90, hidden=h, experts=e, weight=RouterWeight(wt))).load()


def _inputs(spec, M: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(M, spec.hidden, generator=g) * torch.exp(torch.randn(M, 1, generator=g))).to(torch.bfloat16)
    w = torch.randn(spec.experts, spec.hidden, generator=g) * spec.hidden ** -0.5
    return x, (w.to(torch.bfloat16) if spec.weight is RouterWeight.BF16 else w)


def _run(op, x, w):
    out = poison(torch.empty(x.shape[0], op.spec.experts, dtype=torch.float32, device="cuda"))
    op(x.cuda(), w.cuda(), out)
    torch.cuda.synchronize()
    return out.cpu()


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("M", MS)
def test_exact_against_reference(name, M):
    op = op_for(name)
    x, w = _inputs(op.spec, M, seed=M * 11 + len(name))
    got = _run(op, x, w)
    want = router_logits(x, w)
    assert torch.equal(got, want), f"{(got != want).sum()} of {got.numel()} logits differ"
    # and the FP64 logits (of the BF16-rounded weight) within FP32 rounding of the dot products
    wb = w.to(torch.bfloat16)
    ref = fp64(x, wb)
    scale = (x.double().abs() @ wb.double().abs().T).clamp_min(1e-30)
    assert float(((got.double() - ref.double()).abs() / scale).max()) < 2 ** -16   # n u, n = 224 + 5 adds


def test_rows_do_not_depend_on_the_batch():
    op = op_for("k3")
    x, w = _inputs(op.spec, 64, seed=5)
    full = _run(op, x, w)
    for lo, hi in ((0, 1), (3, 4), (5, 14), (8, 16), (63, 64)):
        assert torch.equal(_run(op, x[lo:hi], w), full[lo:hi]), (lo, hi)


def test_graph_replay_equals_eager():
    op = op_for("k3")
    x, w = _inputs(op.spec, 9, seed=3)
    xd, wd = x.cuda(), w.cuda()
    out = poison(torch.empty(9, op.spec.experts, dtype=torch.float32, device="cuda"))
    graph = capture(lambda: op(xd, wd, out))
    x2, _ = _inputs(op.spec, 9, seed=4)
    xd.copy_(x2.cuda())
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), router_logits(x2, w))


def test_bad_arguments_raise():
    op = op_for("small")
    x = torch.zeros(4, 1024, dtype=torch.bfloat16, device="cuda")
    w = torch.zeros(32, 1024, dtype=torch.bfloat16, device="cuda")
    out = torch.empty(4, 32, device="cuda")
    with pytest.raises(SpecError, match="x"):
        op(x[:, :512], w, out)
    with pytest.raises(SpecError, match="w"):
        op(x, w.float(), out)
    with pytest.raises(SpecError, match="out"):
        op(x, w, out[:, :16])
    with pytest.raises(SpecError, match="out"):
        op(x, w, out.to(torch.bfloat16))
