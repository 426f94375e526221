"""k3gen.api.fla, the FLA-compatible KDA entry points, on the CPU (the k3gen:: ops run the FP32
references, so every stage the entry points invert runs as the kernels define it): FLA's parameter
names, order and defaults (fla-core 0.6.0), FLA's bare recurrence matched at the BF16 bound, and
typed errors for what k3gen's kernels cannot compute. The H200 twin against FLA itself is
tests/gpu/test_library.py::test_fla_entry_points_match_fla."""
from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F

from k3gen.api import fla
from k3gen.errors import SpecError
from numerics import assert_close

# fla-core 0.6.0, fla/ops/kda/fused_recurrent.py and chunk.py: (name, default) in order.
FLA_FUSED_RECURRENT = [("q", None), ("k", None), ("v", None), ("g", None), ("beta", None), ("A_log", None),
                       ("dt_bias", None), ("scale", None), ("initial_state", None), ("output_final_state", False),
                       ("use_qk_l2norm_in_kernel", False), ("use_gate_in_kernel", False),
                       ("use_beta_sigmoid_in_kernel", False), ("allow_neg_eigval", False), ("lower_bound", None),
                       ("state_v_first", False), ("cu_seqlens", None)]
FLA_CHUNK = [("q", None), ("k", None), ("v", None), ("g", None), ("beta", None), ("scale", None),
             ("initial_state", None), ("output_final_state", False), ("use_qk_l2norm_in_kernel", False),
             ("use_gate_in_kernel", False), ("use_beta_sigmoid_in_kernel", False), ("allow_neg_eigval", False),
             ("safe_gate", False), ("lower_bound", None), ("disable_recompute", False),
             ("return_intermediate_states", False), ("state_v_first", False), ("cu_seqlens", None),
             ("cu_seqlens_cpu", None), ("cp_context", None), ("use_graph", False), ("max_num_seqs", None)]
EMPTY = inspect.Parameter.empty


def _params(fn):
    ps = list(inspect.signature(fn).parameters.values())
    assert ps[-1].kind is inspect.Parameter.VAR_KEYWORD      # **kwargs, as FLA's
    return [(p.name, None if p.default is EMPTY else p.default) for p in ps[:-1]]


@pytest.mark.parametrize("name,want", [("fused_recurrent_kda", FLA_FUSED_RECURRENT), ("chunk_kda", FLA_CHUNK)])
def test_signature_is_fla_s(name, want):
    assert _params(getattr(fla, name)) == want
    try:
        import fla.ops.kda as real      # present on the H200 (carried wheel), not in CI
    except ImportError:
        return
    assert _params(getattr(real, name)) == want


def naive(q, k, v, g, beta, scale=None, initial_state=None):
    """FLA's recurrence (naive_recurrent_kda's math with the in-kernel L2 norm), FP64."""
    B, T, H, K = q.shape
    HV = v.shape[2]
    scale = K ** -0.5 if scale is None else scale
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q, k = q.repeat_interleave(HV // H, 2) * scale, k.repeat_interleave(HV // H, 2)
    S = torch.zeros(B, HV, K, v.shape[-1], dtype=torch.double)
    if initial_state is not None:
        S = S + initial_state.double()
    o = torch.zeros(B, T, HV, v.shape[-1], dtype=torch.double)
    for i in range(T):
        S = S * g[:, i].exp()[..., None]
        u = v[:, i] - (k[:, i][..., None] * S).sum(-2)
        S = S + torch.einsum("bhk,bhv->bhkv", beta[:, i][..., None] * k[:, i], u)
        o[:, i] = torch.einsum("bhk,bhkv->bhv", q[:, i], S)
    return o, S


def inputs(B=2, T=21, H=1, HV=2, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def rn(*s):
        return torch.randn(*s, generator=gen)
    K = 128
    q, k, v = rn(B, T, H, K).bfloat16(), rn(B, T, H, K).bfloat16(), rn(B, T, HV, K).bfloat16()
    g = F.logsigmoid(torch.rand(B, T, HV, K, generator=gen)).bfloat16()
    beta = torch.rand(B, T, HV, generator=gen).sigmoid().bfloat16()
    return q, k, v, g, beta, rn(B, HV, K, K), gen


def _check(o, s, ro, rs):
    assert_close(o, ro.float(), dtype=torch.bfloat16, what="o")
    # The final state's inputs went through one more BF16 rounding: the BF16 bound, not FP32's.
    assert_close(s, rs.float(), dtype=torch.bfloat16, what="final state")


@pytest.mark.parametrize("mode", ["chunk", "recurrent", "decode", "decode_kernel", "state_v_first", "gva",
                                  "no_initial_state", "scale"])
def test_matches_fla_recurrence(mode):
    B, T, H, HV = (3, 1, 2, 2) if mode.startswith("decode") else (2, 21, 1, 4 if mode == "gva" else 2)
    q, k, v, g, beta, h0, _ = inputs(B, T, H, HV)
    kw = dict(initial_state=None if mode == "no_initial_state" else h0, output_final_state=True,
              use_qk_l2norm_in_kernel=True)
    if mode == "scale":
        kw["scale"] = 0.3
    if mode == "state_v_first":
        kw.update(state_v_first=True, initial_state=h0.transpose(-1, -2).contiguous())
    if mode == "decode_kernel":
        kw["k3gen_decode"] = True
    fn = fla.chunk_kda if mode in ("chunk", "gva", "state_v_first") else fla.fused_recurrent_kda
    o, s = fn(q, k, v, g, beta, **kw)
    ro, rs = naive(q, k, v, g, beta, scale=kw.get("scale"), initial_state=None if mode == "no_initial_state" else h0)
    assert o.dtype == v.dtype and o.shape == v.shape and s.dtype == torch.float32
    _check(o, s.transpose(-1, -2) if mode == "state_v_first" else s, ro, rs)


@pytest.mark.parametrize("lower_bound", [None, -5.0], ids=["softplus", "bounded"])
@pytest.mark.parametrize("a_log", [True, False], ids=["A_log", "no-A_log"])
def test_gate_in_kernel(lower_bound, a_log):
    """use_gate_in_kernel: FLA's softplus gate and its bounded gate (lower_bound -5), with or
    without A_log, over a raw BF16 gate, dt_bias [HV * K], logits beta."""
    q, k, v, _, beta, h0, gen = inputs()
    HV, K = v.shape[2], 128
    graw = torch.randn(*v.shape[:3], K, generator=gen).bfloat16()
    A = torch.log(torch.rand(HV, generator=gen) * 15 + 1) if a_log else None
    dt = torch.randn(HV * K, generator=gen) * 0.5
    blog = torch.randn(beta.shape, generator=gen).bfloat16()
    o, s = fla.fused_recurrent_kda(q, k, v, graw, blog, A_log=A, dt_bias=dt, initial_state=h0, output_final_state=True,
                                   use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                   use_beta_sigmoid_in_kernel=True, lower_bound=lower_bound)
    z = graw.double() + dt.double().view(HV, K)
    a = torch.exp(A.double())[:, None] if a_log else (1.0 if lower_bound is not None else torch.exp(torch.tensor(1.0)))
    gg = lower_bound * torch.sigmoid(a * z) if lower_bound is not None else -a * F.softplus(z)
    _check(o, s, *naive(q, k, v, gg, torch.sigmoid(blog.double()), initial_state=h0))


def test_varlen():
    q, k, v, g, beta, _, gen = inputs(B=1, T=40)
    cu = torch.tensor([0, 3, 3, 40], dtype=torch.long)      # an empty sequence too
    h0 = torch.randn(3, v.shape[2], 128, 128, generator=gen)
    o, s = fla.chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
                         cu_seqlens=cu)
    for n in range(3):
        a, b = int(cu[n]), int(cu[n + 1])
        ro, rs = naive(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b], initial_state=h0[n:n + 1])
        if b > a:
            assert_close(o[:, a:b], ro.float(), dtype=torch.bfloat16)
        assert_close(s[n:n + 1], rs.float(), dtype=torch.bfloat16)


def test_the_norm_inversion_is_what_matches(monkeypatch):
    """The kernels' gated RMSNorm undone with the wrong eps leaves a different output: the check
    above fails (so it can)."""
    q, k, v, g, beta, h0, _ = inputs(T=5)
    monkeypatch.setattr(fla, "EPS_NORM", 1e-6)
    o, s = fla.chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    with pytest.raises(AssertionError, match="o"):
        _check(o, s, *naive(q, k, v, g, beta, initial_state=h0))


UNSUPPORTED = [
    (dict(use_qk_l2norm_in_kernel=False), "use_qk_l2norm_in_kernel"),
    (dict(allow_neg_eigval=True, use_beta_sigmoid_in_kernel=True), "allow_neg_eigval"),
    (dict(use_gate_in_kernel=True, lower_bound=-3.0), "lower_bound"),
    (dict(return_intermediate_states=True), "return_intermediate_states"),
    (dict(cp_context=object()), "cp_context"),
    (dict(use_gate_in_kernel=True), "A_log"),
    (dict(cu_seqlens=torch.tensor([0, 3, 21])), "q.shape"),
]


@pytest.mark.parametrize("kw,needle", UNSUPPORTED, ids=[u[1] for u in UNSUPPORTED])
def test_unsupported_arguments_are_typed_errors(kw, needle):
    q, k, v, g, beta, h0, _ = inputs(T=3)
    kw = {"use_qk_l2norm_in_kernel": True, **kw}
    with pytest.raises(SpecError, match=needle):
        fla.chunk_kda(q, k, v, g, beta, **kw)


def test_shapes_k3gen_cannot_take():
    q, k, v, g, beta, h0, _ = inputs(T=3)
    with pytest.raises(SpecError, match="head-wise beta"):
        fla.fused_recurrent_kda(q, k, v, g, beta[..., None].expand(*beta.shape, 128), use_qk_l2norm_in_kernel=True)
    with pytest.raises(SpecError, match="K/V"):
        fla.fused_recurrent_kda(q[..., :64], k[..., :64], v, g[..., :64], beta, use_qk_l2norm_in_kernel=True)
    with pytest.raises(SpecError, match="initial_state"):
        fla.fused_recurrent_kda(q, k, v, g, beta, initial_state=h0[:1], use_qk_l2norm_in_kernel=True)
