"""kda_prefill on the CPU: spec validation, byte estimates, the varlen reference against the decode
token loop, split continuation, padding, and NVRTC compiles for sm_90a, sm_103a and sm_107a without
spills."""
from __future__ import annotations

import pytest
import torch

from k3gen.errors import SpecError, TargetError
from k3gen.ir import evaluate
from k3gen.ops import spec_from_canonical
from k3gen.ir.dtypes import GateKind, SsmDtype
from k3gen.ops.kda_prefill.spec import (C64_PREP_SMEM, C64_REC_BYTES, C64_STATE_WARPS, KdaPrefillSpec,
                                        PrefillAlgo, c64_state_smem)
from k3gen.ops.kda_decode.reference import kda_token_loop, random_weights
from k3gen.ops.kda_prefill.reference import chunk64_emulation, chunk_emulation, kda_prefill
from helpers import assert_each_rejected
from k3gen.targets import KDA_PREFILL_HEADS, TARGETS, build_specs

SM90, SM100, SM103, SM107 = (TARGETS[n] for n in ("sm90", "sm100-mxfp4", "sm103-nvfp4", "sm107-nvfp4"))
K = 128


@pytest.mark.parametrize("kw,needle", [
    ({"heads": 0}, "heads=0"),
    ({"heads": 1.5}, "heads=1.5"),
    ({"gate": "sigmoid"}, "gate='sigmoid'"),
    ({"ssm": "fp8"}, "ssm='fp8'"),
    ({"threads": 512}, "threads=512"),
    ({"min_blocks": 0}, "min_blocks=0"),
    ({"min_blocks": 2}, "min_blocks=2"),
    ({"algo": "wy64"}, "algo='wy64'"),
    ({"algo": "chunk16"}, "algo='chunk16'"),      # deleted with chunkpar once chunk64 passed (issue 30)
    ({"algo": "chunkpar"}, "algo='chunkpar'"),
])
def test_spec_rejects(kw, needle):
    with pytest.raises(SpecError) as e:
        KdaPrefillSpec(target=SM90, **{"heads": 12, **kw})
    assert needle in str(e.value)


def test_targets_and_build_specs():
    with pytest.raises(TargetError, match="ssm='bf16'"):
        KdaPrefillSpec(target=SM100, heads=12, ssm=SsmDtype.BF16)
    for t in (SM90, SM103, SM107):
        for s in (KdaPrefillSpec(target=t, heads=h, ssm=d) for h in KDA_PREFILL_HEADS for d in SsmDtype):
            assert spec_from_canonical(s.canonical(), t) == s
    # auto is chunk64 on SM90 and chunk64_tc on the tcgen05 NVFP4 targets (not the frozen original target).
    for t, algo in ((SM90, PrefillAlgo.CHUNK64), (SM103, PrefillAlgo.CHUNK64_TC), (SM107, PrefillAlgo.CHUNK64_TC)):
        specs = [s for s in build_specs(t) if s.op == "kda_prefill"]
        assert len(specs) == len(KDA_PREFILL_HEADS) * 2 and all(s.algo is algo for s in specs)
    assert not [s for s in build_specs(SM100) if s.op == "kda_prefill"]
    c64 = KdaPrefillSpec(target=SM90, heads=12)
    assert c64.algo is PrefillAlgo.CHUNK64 and c64.slug() == "h12-bounded-fp32-chunk64"  # auto: what the model runs
    assert c64.smem_bytes == C64_PREP_SMEM <= 227 * 1024
    assert all(c64_state_smem(w) <= 227 * 1024 for w in C64_STATE_WARPS)
    assert spec_from_canonical(c64.canonical(), SM90) == c64


def test_bytes_moved():
    s = KdaPrefillSpec(target=SM90, heads=12)
    B, N, H, D = 3, 1000, 12, 12 * K
    want = (2 * B * H * K * K * 4 + 2 * B * 3 * D * 3 * 2 + N * (4 * D + K + H) * 2 + B * 12 + N * D * 2
            + (3 * D * 4 + D * K) * 2 + (D + H + K) * 4)
    assert evaluate(s.bytes_moved(), B=B, N=N) == want
    assert evaluate(s.flops(), N=N) > 7 * N * H * K * K


def _batch(lengths, H, seed):
    g = torch.Generator().manual_seed(seed)
    N, D = sum(lengths), H * K
    qkvg = torch.randn(N, 4 * D + 8, generator=g).to(torch.bfloat16)
    fab = torch.randn(N, K + H, generator=g).to(torch.bfloat16)
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    return qkvg, fab[:, :K], fab[:, K:], cu, g


def _pool(S, H, ssm_dtype, g):
    ssm = (torch.randn(S, H, K, K, generator=g) * 0.05).to(ssm_dtype)
    conv = torch.randn(S, 3 * H * K, 3, generator=g).to(torch.bfloat16)
    return ssm, conv


@pytest.mark.parametrize("ssm_dtype", [torch.float32, torch.bfloat16])
def test_reference_equals_token_loop(ssm_dtype):
    H, lengths = 2, [1, 5, 0, 9, 3]
    qkvg, fa, b, cu, g = _batch(lengths, H, seed=1)
    w = random_weights(H, generator=g)
    ssm, conv = _pool(8, H, ssm_dtype, g)
    slots = torch.tensor([6, 0, 3, 2, -1], dtype=torch.int32)
    resume = torch.tensor([1, 0, 1, 1, 1], dtype=torch.int32)
    ssm0, conv0 = ssm.clone(), conv.clone()
    out = torch.full((qkvg.shape[0], H, K), float("nan"), dtype=torch.bfloat16)
    kda_prefill(qkvg, fa, b, cu, slots, resume, ssm, conv, w, out)
    for i, L in enumerate(lengths):
        lo, hi, sl = int(cu[i]), int(cu[i + 1]), int(slots[i])
        if sl < 0 or L == 0:
            assert torch.equal(out[lo:hi], torch.zeros_like(out[lo:hi]))
            if sl >= 0:
                assert torch.equal(ssm[sl], ssm0[sl]) and torch.equal(conv[sl], conv0[sl])
            continue
        s0 = ssm0[sl].float() if resume[i] else torch.zeros(H, K, K)
        w0 = conv0[sl].float() if resume[i] else torch.zeros(3 * H * K, 3)
        o, s, win, _ = kda_token_loop(qkvg[None, lo:hi], fa[None, lo:hi], b[None, lo:hi], s0[None], w0[None], w)
        assert torch.equal(out[lo:hi], o[0].to(torch.bfloat16))
        assert torch.equal(ssm[sl], s[0].to(ssm_dtype)) and torch.equal(conv[sl], win[0].to(torch.bfloat16))
    untouched = torch.ones(8, dtype=torch.bool)
    untouched[[6, 0, 2]] = False
    assert torch.equal(ssm[untouched], ssm0[untouched]) and torch.equal(conv[untouched], conv0[untouched])


def test_fresh_sequence_window_is_last_three_inputs():
    H = 2
    qkvg, fa, b, cu, g = _batch([2], H, seed=3)
    w = random_weights(H, generator=g)
    ssm, conv = _pool(2, H, torch.float32, g)
    kda_prefill(qkvg, fa, b, cu, torch.tensor([1], dtype=torch.int32), torch.tensor([0], dtype=torch.int32),
                ssm, conv, w)
    D3 = 3 * H * K
    assert torch.equal(conv[1, :, 0], torch.zeros(D3, dtype=torch.bfloat16))  # only 2 inputs so far
    assert torch.equal(conv[1, :, 1:], qkvg[:, :D3].t())


@pytest.mark.parametrize("split", [1, 7, 16])
def test_split_continuation_equals_one_call(split):
    H, L = 2, 20
    qkvg, fa, b, cu, g = _batch([L], H, seed=4)
    w = random_weights(H, generator=g)
    ssm, conv = _pool(3, H, torch.float32, g)
    slots = torch.tensor([2], dtype=torch.int32)
    one_s, one_c = ssm.clone(), conv.clone()
    one = kda_prefill(qkvg, fa, b, cu, slots, torch.tensor([0], dtype=torch.int32), one_s, one_c, w)
    parts = []
    for lo, hi, res in ((0, split, 0), (split, L, 1)):
        c = torch.tensor([0, hi - lo], dtype=torch.int32)
        parts.append(kda_prefill(qkvg[lo:hi], fa[lo:hi], b[lo:hi], c, slots, torch.tensor([res], dtype=torch.int32),
                                 ssm, conv, w))
    assert torch.equal(torch.cat(parts), one)
    assert torch.allclose(ssm, one_s, rtol=0, atol=1e-6) and torch.equal(conv, one_c)


def _token_recurrence(q, k, v, g, beta, s):
    s, outs = s.clone(), []
    for t in range(q.shape[0]):
        s = s * torch.exp(g[t])[None, :]
        u = beta[t] * (v[t] - s @ k[t])
        s = s + u[:, None] * k[t][None, :]
        outs.append(s @ q[t])
    return (torch.stack(outs) if outs else torch.empty(0, v.shape[1], dtype=q.dtype)), s


@pytest.mark.parametrize("T", [1, 15, 16, 17, 63, 64, 65, 200])
@pytest.mark.parametrize("gate_scale", [1.0, 8.0])
def test_chunk_algebra_equals_token_recurrence(T, gate_scale):
    """The plain chunked WY algebra (k3gen.ops.kda_prefill.reference.chunk_emulation, 16-token chunks):
    FP64 equal to the token recurrence to rounding; FP32 within 5e-6.
    gate_scale 8 gives decays near e^-40 per token (a softplus-like gate): no overflow or NaN."""
    g0 = torch.Generator().manual_seed(T)
    nrm = torch.nn.functional.normalize
    q = nrm(torch.randn(T, K, generator=g0), dim=-1) * K ** -0.5
    k = nrm(torch.randn(T, K, generator=g0), dim=-1)
    v = torch.randn(T, K, generator=g0)
    g = -5 * gate_scale * torch.sigmoid(torch.randn(T, K, generator=g0) * 3)
    b = torch.sigmoid(torch.randn(T, generator=g0))
    s0 = torch.randn(K, K, generator=g0) * 0.05
    ro, rs = _token_recurrence(*(x.double() for x in (q, k, v, g, b, s0)))
    for dt, tol in ((torch.float64, 1e-12), (torch.float32, 5e-6)):
        o, s = chunk_emulation(*(x.to(dt) for x in (q, k, v, g, b, s0)))
        assert torch.isfinite(o).all() and torch.isfinite(s).all()
        assert float((o.double() - ro).norm() / ro.norm()) <= tol
        assert float((s.double() - rs).norm() / rs.norm()) <= tol


@pytest.mark.parametrize("T", [1, 15, 16, 17, 63, 64, 65, 129, 700])
@pytest.mark.parametrize("gate_scale", [1.0, 8.0])
def test_chunk64_algebra_equals_token_recurrence(T, gate_scale):
    """chunk64's algebra (reference.chunk64_emulation: 64-token chunks, the off-diagonal decay split
    at each 16-token block's reference point): in FP64 without BF16 rounding equal to the token
    recurrence to rounding; with the kernel's BF16 operand rounding within 5e-3 relative RMS, half
    of tests/numerics.py's KDA_CHUNK64 bounds (the emulation measures 2.0e-3 .. 3.7e-3, flat in T).
    gate_scale 8 (decays near e^-40 per token, a softplus-like gate): finite, no overflow."""
    from numerics import KDA_CHUNK64_OUT, KDA_CHUNK64_STATE
    g0 = torch.Generator().manual_seed(T)
    nrm = torch.nn.functional.normalize
    q = nrm(torch.randn(T, K, generator=g0), dim=-1) * K ** -0.5
    k = nrm(torch.randn(T, K, generator=g0), dim=-1)
    v = torch.randn(T, K, generator=g0)
    g = -5 * gate_scale * torch.sigmoid(torch.randn(T, K, generator=g0) * 3)
    b = torch.sigmoid(torch.randn(T, generator=g0))
    s0 = torch.randn(K, K, generator=g0) * 0.05
    ro, rs = _token_recurrence(*(x.double() for x in (q, k, v, g, b, s0)))
    o, s = chunk64_emulation(*(x.double() for x in (q, k, v, g, b, s0)), bf16=False)
    assert float((o - ro).norm() / ro.norm()) <= 1e-12 and float((s - rs).norm() / rs.norm()) <= 1e-12
    for bounded in (False, True):  # the bounded-gate form also splits the diagonal blocks
        o, s = chunk64_emulation(*(x.double() for x in (q, k, v, g, b, s0)), bf16=False, bounded=bounded)
        assert float((o - ro).norm() / ro.norm()) <= 1e-12 and float((s - rs).norm() / rs.norm()) <= 1e-12
    # gate_scale 1 is the bounded gate (g >= -5): the kernel's bounded form; 8 the softplus form
    o, s = chunk64_emulation(*(x.float() for x in (q, k, v, g, b, s0)), bounded=gate_scale == 1.0)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    assert float((o.double() - ro).norm() / ro.norm()) <= KDA_CHUNK64_OUT.rel_rms / 2
    assert float((s.double() - rs).norm() / rs.norm()) <= KDA_CHUNK64_STATE.rel_rms / 2


@pytest.mark.parametrize("target", ["sm90", "sm103-nvfp4", "sm107-nvfp4"])
@pytest.mark.parametrize("ssm,gate", [(SsmDtype.FP32, GateKind.BOUNDED), (SsmDtype.BF16, GateKind.BOUNDED),
                                      (SsmDtype.FP32, GateKind.SOFTPLUS)])
def test_chunk64_compiles_without_spills(target, ssm, gate):
    """chunk64 (explicit on the tcgen05 targets, where auto is chunk64_tc and
    test_kda_prefill_tcgen05.py builds that): prep, the three state kernels and emit in one cubin:
    no local memory (spills), BF16 HMMA
    where the algebra says: prep 8 k steps x (8 gate channel tiles + 3 off-diagonal units) per warp
    (a loop body each; the bounded gate's diagonal blocks 8 more), each state kernel 64 (V_new) +
    64 (O) + 20 (causal Aqk) + 64 (state) per chunk."""
    from k3gen.pipeline.build import build_one
    from k3gen.pipeline.inspect import cubin_arch, sass_text
    spec = KdaPrefillSpec(target=TARGETS[target], heads=12, ssm=ssm, gate=gate, algo=PrefillAlgo.CHUNK64)
    r = build_one(spec)
    assert cubin_arch(r.cubin) == spec.target.arch
    by = {x["function"]: x for x in r.resources}
    assert set(by) == {"k3gen_kda_prefill", "k3gen_kda_prefill_emit",
                       *(f"k3gen_kda_prefill_state{w}" for w in C64_STATE_WARPS)}, sorted(by)
    assert all(x["local"] == 0 and x["registers"] <= 255 for x in r.resources), r.resources
    text = sass_text(r.cubin)
    assert "STL" not in text and "LDL" not in text, "local-memory traffic"
    hmma = {f: sum(n for k, n in x["sass"].items() if k.startswith("HMMA")) for f, x in by.items()}
    assert hmma["k3gen_kda_prefill"] == 64 + 8 + (8 if gate is GateKind.BOUNDED else 0), hmma
    assert hmma["k3gen_kda_prefill_emit"] == 0, hmma
    assert all(hmma[f"k3gen_kda_prefill_state{w}"] == 64 + 64 + 20 + 64 for w in C64_STATE_WARPS), hmma


def test_chunk64_workspace_and_state_warps():
    """One record per (item, head) plus the raw FP32 outputs; the state pass takes the fewest warps
    per CTA whose grid fits one CTA per SM (132 on the H200), else 8."""
    from k3gen.ops.kda_prefill.launcher import c64_state_warps
    spec = KdaPrefillSpec(target=SM90, heads=12)
    assert C64_REC_BYTES == 99840 and C64_REC_BYTES % 16 == 0
    assert spec.workspace_bytes(4096, 1) == 65 * 12 * C64_REC_BYTES + 4096 * 12 * 128 * 4
    assert type(spec.workspace_bytes(4096, 3)) is int
    assert [c64_state_warps(h, b, 132) for h, b in ((12, 1), (1, 1), (33, 1), (34, 1), (12, 5), (12, 8), (96, 1), (96, 4))] \
        == [2, 2, 2, 4, 4, 8, 8, 8]


def test_launcher_checks():
    from k3gen.ops.kda_prefill.launcher import KdaPrefill
    H, B, N, S = 12, 2, 10, 4
    D = H * K
    bf = torch.bfloat16
    w = random_weights(H)
    args = dict(qkvg=torch.zeros(N, 4 * D, dtype=bf), fa=torch.zeros(N, K, dtype=bf),
                beta_logit=torch.zeros(N, H, dtype=bf), cu_seqlens=torch.tensor([0, 4, 10], dtype=torch.int32),
                slots=torch.zeros(B, dtype=torch.int32), resume=torch.zeros(B, dtype=torch.int32),
                ssm=torch.zeros(S, H, K, K), conv=torch.zeros(S, 3 * D, 3, dtype=bf), conv_w=w.conv_w,
                fb_w=w.fb_w, dt_bias=w.dt_bias, a_log=w.a_log, norm_w=w.norm_w, out=torch.zeros(N, H, K, dtype=bf))
    op = KdaPrefill(KdaPrefillSpec(target=SM90, heads=H))
    assert_each_rejected(op, args, [("cu_seqlens", torch.tensor([0, 10], dtype=torch.int32), "cu_seqlens="),
                                    ("resume", torch.zeros(B, dtype=torch.bool), "resume="),
                                    ("fa", torch.zeros(N + 1, K, dtype=bf), "fa="),
                                    ("out", torch.zeros(N, H, K), "out="),
                                    ("out", None, "device=")])


def test_work_items_never_overlap():
    """The item map (sequence b owns items cu[b] // 64 + b onward) gives every sequence ceil(len / 64)
    items that overlap no other sequence's and fit the grid the launcher sizes."""
    g = torch.Generator().manual_seed(0)
    spec = KdaPrefillSpec(target=SM90, heads=6)
    for _ in range(200):
        B = int(torch.randint(1, 9, (1,), generator=g))
        lens = torch.randint(0, 300, (B,), generator=g).tolist()
        lens = [x if torch.rand(1, generator=g) > 0.3 else x % 3 for x in lens]
        cu = [0]
        for x in lens:
            cu.append(cu[-1] + x)
        items, owner = spec.workspace_items(cu[-1], B), {}
        for b, x in enumerate(lens):
            base = cu[b] // 64 + b
            for c in range(-(-x // 64)):
                assert base + c < items and base + c not in owner
                owner[base + c] = b
