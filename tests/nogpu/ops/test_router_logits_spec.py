"""router_logits on the CPU: spec validation, the reference's vectorized replay against a scalar
replay of the contract's order (NumPy float32, one rounding per step), against FP64 dot products
within FP32's summation bound, and the kernel compiling for sm90, sm103 and sm107 without local memory."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from k3gen.errors import SpecError
from k3gen.ops import spec_from_canonical
from k3gen.ops.router_logits.reference import fp64, router_logits
from k3gen.ops.router_logits.spec import RouterLogitsSpec, RouterWeight
from k3gen.pipeline.build import build_one
from k3gen.targets import TARGETS

SM90 = TARGETS["sm90"]


@pytest.mark.parametrize("kw,field", [
    (dict(hidden=0, experts=8), "hidden"), (dict(hidden=300, experts=8), "hidden"),
    (dict(hidden=True, experts=8), "hidden"), (dict(hidden=256, experts=0), "experts"),
    (dict(hidden=256, experts=1025), "experts"), (dict(hidden=256, experts=8.0), "experts"),
    (dict(hidden=256, experts=8, weight="fp16"), "weight"),
])
def test_bad_fields_raise(kw, field):
    with pytest.raises(SpecError) as e:
        RouterLogitsSpec(target=SM90, **kw)
    assert e.value.field == field


def test_canonical_round_trip_slug_and_grid():
    s = RouterLogitsSpec(target=SM90, hidden=7168, experts=896)
    assert spec_from_canonical(s.canonical(), SM90) == s
    assert s.slug() == "h7168-e896"
    assert s.grid(1) == (224, 1, 1) and s.grid(9) == (224, 2, 1)
    assert s.chunks_per_lane == 28
    f = RouterLogitsSpec(target=SM90, hidden=7168, experts=896, weight=RouterWeight.FP32)
    assert spec_from_canonical(f.canonical(), SM90) == f and f.slug() == "h7168-e896-wf32" and f != s


def test_fp32_weights_are_their_bf16_rounding():
    """An FP32 weight holding BF16 values (K3's stored router) gives the BF16 weight's logits; other
    FP32 values are rounded to BF16 (nearest even) first, as the kernel does."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 256, generator=g).to(torch.bfloat16)
    w = torch.randn(3, 256, generator=g)
    wb = w.to(torch.bfloat16)
    assert torch.equal(router_logits(x, wb.float()), router_logits(x, wb))
    assert torch.equal(router_logits(x, w), router_logits(x, wb))


def _scalar(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """The contract written out per logit: lane l sums chunks l, l + 32, ... (8 values each, K order)
    in float32, one rounding per step (the products of two BF16 values are exact), then the XOR butterfly."""
    M, H = x.shape
    E = w.shape[0]
    out = np.zeros((M, E), dtype=np.float32)
    for m in range(M):
        for e in range(E):
            lanes = []
            for lane in range(32):
                acc = np.float32(0.0)
                for c in range(lane, H // 8, 32):
                    for k in range(8 * c, 8 * c + 8):
                        acc = np.float32(acc + np.float32(x[m, k]) * np.float32(w[e, k]))
                lanes.append(acc)
            for d in (16, 8, 4, 2, 1):
                lanes = [np.float32(lanes[i] + lanes[i ^ d]) for i in range(32)]
            assert len({float(v) for v in lanes}) == 1       # every lane holds the same bits
            out[m, e] = lanes[0]
    return out


def test_reference_is_the_contract_order_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 512, generator=g) * 8).to(torch.bfloat16)
    w = torch.randn(5, 512, generator=g).to(torch.bfloat16)
    got = router_logits(x, w)
    want = torch.from_numpy(_scalar(x.float().numpy(), w.float().numpy()))
    assert torch.equal(got, want)
    # the replay is not the FP64 logits in disguise: FP32 rounding shows somewhere in these 15 sums
    assert not torch.equal(got, fp64(x, w))


def test_reference_within_fp32_summation_of_fp64():
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(6, 1024, generator=g) * torch.exp(torch.randn(6, 1, generator=g))).to(torch.bfloat16)
    w = (torch.randn(32, 1024, generator=g) * 1024 ** -0.5).to(torch.bfloat16)
    got, ref = router_logits(x, w).double(), fp64(x, w).double()
    scale = x.double().abs() @ w.double().abs().T
    assert float(((got - ref).abs() / scale).max()) < 2 ** -18     # n u with n = 4 * 8 + 5
    assert float(((got - ref).abs() / scale).max()) > 0            # FP32 rounding is there to see


def test_rows_are_independent_in_the_reference():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(9, 256, generator=g).to(torch.bfloat16)
    w = torch.randn(7, 256, generator=g).to(torch.bfloat16)
    full = router_logits(x, w)
    assert torch.equal(router_logits(x[4:6], w), full[4:6])


@pytest.mark.parametrize("target", ["sm90", "sm103-nvfp4", "sm107-nvfp4"])
@pytest.mark.parametrize("hidden,experts,weight", [(7168, 896, "fp32"), (7168, 896, "bf16"), (1024, 32, "bf16"),
                                                   (256, 5, "fp32")])
def test_kernel_compiles_without_local_memory(target, hidden, experts, weight):
    r = build_one(RouterLogitsSpec(target=TARGETS[target], hidden=hidden, experts=experts, weight=RouterWeight(weight)))
    (k,) = r.resources
    assert k["function"] == "k3gen_router_logits"
    assert k["local"] == 0 and k["stack"] == 0 and k["registers"] <= 128, k
    assert k["sass"].get("FFMA", 0) >= 64 and k["sass"].get("SHFL", 0) >= 5 * 8   # FMAs, the butterflies
    assert not any(op.startswith(("LDL", "STL")) for op in k["sass"])
    assert (k["sass"].get("F2FP", 0) > 0) == (weight == "fp32")        # FP32 weights rounded to BF16


def test_api_on_cpu_tensors_is_the_reference():
    """k3gen.api.router_logits on CPU tensors runs the reference through the k3gen:: op (functional
    and out=), and a wrong weight width is a typed error before any work."""
    from k3gen import api
    from k3gen.library import handle_of
    s = RouterLogitsSpec(target=SM90, hidden=512, experts=6)
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(2, 512, generator=g).to(torch.bfloat16), torch.randn(6, 512, generator=g).to(torch.bfloat16)
    h = handle_of(s)
    assert torch.equal(api.router_logits(h, x, w), router_logits(x, w))
    out = torch.full((2, 6), float("nan"))
    assert api.router_logits(h, x, w, out=out) is out and torch.equal(out, router_logits(x, w))
    with pytest.raises(SpecError, match="w"):
        api.router_logits(h, x, w[:, :256])


def test_the_enumerator_lists_the_router_where_the_kernel_takes_it():
    from k3gen.ops.router_logits.spec import has_kernel
    from k3gen.targets import model_specs
    for preset, hidden, experts in (("tiny", 256, 8), ("small", 1024, 32)):
        got = [s for s in model_specs(SM90, preset) if s.op == "router_logits"]
        assert [(s.hidden, s.experts, s.weight) for s in got] == [(hidden, experts, RouterWeight.FP32)]
    assert has_kernel(SM90, 7168, 896) and not has_kernel(SM90, 384, 8) and not has_kernel(SM90, 256, 1025)
    assert not has_kernel(TARGETS["sm100-mxfp4"], 7168, 896)       # the frozen menu


def test_header_geometry_is_the_launchers():
    """The launcher's grid (spec.WARPS experts x spec.ROWS rows per CTA, THREADS threads) and the
    kernel's own constants (router/logits.cuh kWarps, kRows) must agree: a mismatch would skip or
    repeat rows with no error."""
    import re
    from pathlib import Path

    import k3gen
    from k3gen.ops.router_logits import spec as S
    text = (Path(k3gen.__file__).parent / "include" / "k3gen" / "router" / "logits.cuh").read_text()
    consts = {n: int(v) for n, v in re.findall(r"constexpr int (kWarps|kRows) = (\d+);", text)}
    assert consts == {"kWarps": S.WARPS, "kRows": S.ROWS}, consts
    assert S.THREADS == 32 * S.WARPS
