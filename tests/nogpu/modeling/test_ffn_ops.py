"""model/ffn_ops.py on the CPU: the reference path's FFN and residual-stream ops (RefOps) against
FP64 formulas written here, and the kernel path's (KernelOps: k3gen:: ops, which run
the ops' references on CPU tensors) against RefOps bit for bit: the router and its grouped order,
the AttnRes mix with its fused partial-sum update (accumulate and seal) and the plain residual,
routed_expert_norm, and the GLU (fused [gate | up] GEMM, glu_act, down GEMM) on padded FP8 weights."""
from __future__ import annotations

import types

import pytest
import torch

from k3gen.ir.dtypes import ScaleRecipe
from k3gen.ops.act_quant_fp8.reference import dequantize
from k3gen.ops.moe_route.reference import moe_route
from model.arch import AttnResWeights
from model.ffn_ops import QAct
from model.formats.assemble import Rank, glu, quantize_blocks
from model.dist import Layout
from model.ops import KernelOps, RefOps
from model.weights import GluWeights

R = ScaleRecipe.FP32
CFG = types.SimpleNamespace(experts=64, top_k=6, n_group=4, topk_group=2, renormalize=True, routed_scale=2.5,
                            act="situ", situ_beta=4.0, situ_linear_beta=25.0, eps=1e-5)


def kernel_ops() -> KernelOps:
    from model.config import TargetConfig
    t = TargetConfig(kv="bf16", ssm="fp32", path="kernel")
    return KernelOps(t.target, R, t.ssm, t.kv_layout(), 2, 2, 0)


def _rms64(x, w, eps):
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double()


def test_route_is_moe_route_and_kernel_path_equal():
    g = torch.Generator().manual_seed(0)
    logits, bias = torch.randn(9, 64, generator=g), torch.randn(64, generator=g) * 0.1
    got = RefOps(R).route(logits, bias, CFG)
    want = moe_route(logits, bias, top_k=6, n_group=4, topk_group=2, renormalize=True, routed_scale=2.5)
    for f in ("ids", "weights", "counts", "offsets", "perm", "inv"):
        assert torch.equal(got[f], getattr(want, f)), f
    k = kernel_ops().route(logits, bias, CFG)
    for f in got:
        assert torch.equal(k[f].cpu(), got[f]), f


@pytest.mark.parametrize("seal", [False, True])
def test_attn_res_mix_is_the_formula_and_updates_in_place(seal):
    """softmax_i(q . RMSNorm(V_i)) V_i over the sources after the delta update, then BF16(RMSNorm * w)
    and its FP8 codes; the buffer's source n - 1 holds the update afterwards."""
    g = torch.Generator().manual_seed(int(seal))
    h, M, n = 256, 3, 3
    src = torch.randn(4, M, h, generator=g)
    delta = torch.randn(M, h, generator=g).to(torch.bfloat16)
    w = AttnResWeights(proj=torch.randn(h, generator=g) * h ** -0.5, norm=1 + 0.1 * torch.randn(h, generator=g))
    nw = (1 + 0.1 * torch.randn(h, generator=g)).to(torch.bfloat16)
    V = src[:n].double().clone()
    V[n - 1] = delta.double() if seal else V[n - 1] + delta.double()
    score = (_rms64(V, torch.ones(h), 1e-5) * w.query().double()).sum(-1)
    x = (torch.softmax(score, 0)[..., None] * V).sum(0)
    want = _rms64(x, nw.float(), 1e-5)
    s_ref, s_k = src.clone(), src.clone()
    got = RefOps(R).attn_res_mix(s_ref, n, w, nw, 1e-5, delta, seal)
    assert isinstance(got, QAct)
    assert torch.equal(s_ref[n - 1], V[n - 1].float())
    assert ((got.x.double() - want).abs() <= 2 ** -7 * want.abs() + 1e-6).all()     # BF16 rounding
    from k3gen.ops.act_quant_fp8.reference import act_quant_fp8
    codes, scales = act_quant_fp8(got.x, R)
    assert torch.equal(got.codes, codes) and torch.equal(got.scales, scales)
    mixed = RefOps(R).attn_res_mix(src.clone(), n, w, nw, 1e-5, delta, seal, mixed=True)
    assert float((mixed.double() - x).abs().max() / x.abs().max()) < 1e-6
    k = kernel_ops().attn_res_mix(s_k, n, w, nw, 1e-5, delta, seal)
    assert torch.equal(s_k, s_ref) and all(torch.equal(a, b) for a, b in zip(k, got))


def test_plain_residual_is_one_source():
    """Without AttnRes (w None) the mix of the one source is the source: RMSNorm(partial + delta)."""
    g = torch.Generator().manual_seed(3)
    src = torch.randn(1, 2, 128, generator=g)
    delta = torch.randn(2, 128, generator=g)
    nw = torch.ones(128, dtype=torch.bfloat16)
    want = _rms64(src[0].double() + delta.double(), nw.float(), 1e-5)
    got = RefOps(R).attn_res_mix(src, 1, None, nw, 1e-5, delta)
    assert ((got.x.double() - want).abs() <= 2 ** -7 * want.abs() + 1e-6).all()


def test_latent_norm_is_rmsnorm_and_kernel_path_equal():
    g = torch.Generator().manual_seed(4)
    y, w = torch.randn(5, 512, generator=g) * 3, (1 + 0.1 * torch.randn(512, generator=g)).to(torch.bfloat16)
    got = RefOps(R).latent_norm(y, w, 1e-5)
    want = _rms64(y, w.float(), 1e-5)
    assert ((got.x.double() - want).abs() <= 2 ** -7 * want.abs() + 1e-6).all()
    k = kernel_ops().latent_norm(y, w, 1e-5)
    assert all(torch.equal(a, b) for a, b in zip(k, got))


@pytest.mark.parametrize("inter", [256, 200])       # 200: gate and up zero-padded to 256 rows
def test_glu_is_the_fp64_formula_on_the_fp8_weights(inter):
    """down(act(gate x, up x)) against FP64 on the same FP8 values, with the kernel path's roundings:
    BF16 GEMM outputs, the BF16 hidden, the FP8 activation of down's input; padding rows are exact."""
    from model.arch import situ
    g = torch.Generator().manual_seed(inter)
    hid = 256
    q = lambda n, k: quantize_blocks(lambda r, c, t=torch.randn(n, k, generator=g) * k ** -0.5: t[r, c], n, k, R)  # noqa: E731
    gate_up, down, I = glu(q(inter, hid), q(inter, hid), q(hid, inter), Rank(Layout(1).place(0)))
    w = GluWeights(gate_up, down, I)
    assert w.width == 256 and I == inter
    x = (torch.randn(4, hid, generator=g)).to(torch.bfloat16)
    got = RefOps(R).glu(x, w, CFG)
    from k3gen.ops.act_quant_fp8.reference import act_quant_fp8
    xq = dequantize(*act_quant_fp8(x, R), R).double()
    W = gate_up.dequant().double()
    gu = (xq @ W.T).float().to(torch.bfloat16)
    h = situ(gu[:, :256].double(), gu[:, 256:].double()).to(torch.bfloat16)
    assert torch.equal(h[:, inter:].float(), torch.zeros(4, 256 - inter))
    want = dequantize(*act_quant_fp8(h, R), R).double() @ down.dequant().double().T
    err = float((got.double() - want).norm() / want.norm())
    assert err < 2e-2, err          # one FP8 code flip where FP32 and FP64 SiTU land apart, BF16 out
    k = kernel_ops().glu(x, w, CFG)
    assert torch.equal(k, got)
