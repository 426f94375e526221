"""kda_decode on the CPU: spec validation, byte estimates, the references against an independent
float64 construction of SPEC.md section 2, slot/padding semantics, and NVRTC compiles for sm_90a,
sm_103a and sm_107a without local memory."""
from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from k3gen.errors import SpecError, TargetError
from k3gen.ir import evaluate
from k3gen.ops import spec_from_canonical
from k3gen.ir.dtypes import GateKind, SsmDtype
from k3gen.ops.kda_decode.spec import KdaDecodeSpec
from k3gen.ops.kda_decode.reference import kda_decode, kda_token_loop, random_weights
from k3gen.targets import KDA_DECODE_HEADS, TARGETS, build_specs

SM90, SM100, SM103, SM107 = (TARGETS[n] for n in ("sm90", "sm100-mxfp4", "sm103-nvfp4", "sm107-nvfp4"))
K = 128


# -- spec ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw,needle", [
    ({"head_dim_k": 64}, "head_dim_k=64"),
    ({"head_dim_v": 256}, "head_dim_v=256"),
    ({"gate": "sigmoid"}, "gate='sigmoid'"),
    ({"ssm": "fp8"}, "ssm='fp8'"),
    ({"heads": 0}, "heads=0"),
    ({"heads": True}, "heads=True"),
    ({"conv_width": 3}, "conv_width=3"),
    ({"threads": 128}, "threads=128"),
    ({"max_split": 3}, "max_split=3"),
    ({"min_blocks": 4}, "min_blocks=4"),
    ({"fb_weight": "fp8"}, "fb_weight='fp8'"),
])
def test_spec_rejects(kw, needle):
    args = {"heads": 12, **kw}
    with pytest.raises(SpecError) as e:
        KdaDecodeSpec(target=SM90, **args)
    assert needle in str(e.value)


def test_bf16_state_not_on_original_target():
    with pytest.raises(TargetError) as e:
        KdaDecodeSpec(target=SM100, heads=12, ssm=SsmDtype.BF16)
    assert "ssm='bf16'" in str(e.value) and "fp32" in str(e.value) and "sm100-mxfp4" in str(e.value)
    KdaDecodeSpec(target=SM100, heads=12)  # FP32 state is fine there (it just is not built)
    KdaDecodeSpec(target=SM103, heads=12, ssm=SsmDtype.BF16)


def test_keyword_only_and_any_head_count():
    with pytest.raises(TypeError):
        KdaDecodeSpec(SM90, 12)
    assert KdaDecodeSpec(target=SM90, heads=7).slug() == "h7-bounded-fp32"


def test_build_specs_and_identity():
    for t in (SM90, SM103, SM107):
        specs = [s for s in build_specs(t) if s.op == "kda_decode"]
        assert len(specs) == 2 * (len(KDA_DECODE_HEADS) + 1)
        assert {s.heads for s in specs} == set(KDA_DECODE_HEADS)
        assert {(s.gate, s.ssm) for s in specs if s.heads == 12} == {(g, d) for g in GateKind for d in SsmDtype}
        assert len({s.kernel_name for s in specs}) == len(specs)
        for s in specs:
            assert spec_from_canonical(s.canonical(), t) == s
        assert all(s.ssm is SsmDtype.BF16 for s in build_specs(t, ssm=SsmDtype.BF16) if s.op == "kda_decode")
    assert not [s for s in build_specs(SM100) if s.op == "kda_decode"]  # frozen target: not built


def test_bytes_moved():
    s = KdaDecodeSpec(target=SM90, heads=12)
    B, H, D = 128, 12, 12 * K
    state = 2 * B * H * K * K * 4
    other = 2 * B * 3 * D * 3 * 2 + B * (4 * D + K + H) * 2 + B * 4 + B * D * 2
    weights = (3 * D * 4 + D * K) * 2 + (D + H + K) * 4
    assert evaluate(s.bytes_moved(), B=B) == state + other + weights
    bf = KdaDecodeSpec(target=SM90, heads=12, ssm=SsmDtype.BF16)
    assert evaluate(s.bytes_moved(), B=B) - evaluate(bf.bytes_moved(), B=B) == state // 2
    assert evaluate(s.flops(), B=B) > 7 * B * H * K * K


# -- reference -------------------------------------------------------------------------------------
def _inputs(B, T, H, seed, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    D = H * K
    qkvg = torch.randn(B, T, 4 * D + 8, generator=g).to(dtype)       # padded row: a row stride > 4D
    fab = torch.randn(B, T, K + H, generator=g).to(dtype)            # one [f_a | b] row
    state = torch.randn(B, H, K, K, generator=g) * 0.05
    window = torch.randn(B, 3 * D, 3, generator=g).to(dtype)
    return qkvg, fab[..., :K], fab[..., K:], state, window


def _naive(qkvg, fa, b, state_vk, window, w, gate):
    """SPEC.md section 2 written out per head in float64 with S as K x V (not the V-first pool)."""
    N, T = qkvg.shape[:2]
    H = w.heads
    D = H * K
    d = torch.float64
    S = state_vk.to(d).transpose(-1, -2).clone()      # [N, H, K, V]
    win = window.to(d).clone()
    cw, fb = w.conv_w.to(d), w.fb_w.to(d)
    outs = torch.zeros(N, T, H, K, dtype=d)
    for n in range(N):
        for t in range(T):
            x = qkvg[n, t, :3 * D].to(d)
            y = torch.zeros(3 * D, dtype=d)
            for j in range(4):
                src = x if j == 3 else win[n, :, j]
                y += cw[:, j] * src
            y = y * torch.sigmoid(y)
            win[n] = torch.stack([win[n, :, 1], win[n, :, 2], x], -1)
            z_all = fb @ fa[n, t].to(d) + w.dt_bias.to(d)
            for h in range(H):
                sl = slice(h * K, (h + 1) * K)
                q, k, v = y[sl], y[D + h * K:D + (h + 1) * K], y[2 * D + h * K:2 * D + (h + 1) * K]
                q = q / torch.sqrt((q * q).sum() + 1e-6) * K ** -0.5
                k = k / torch.sqrt((k * k).sum() + 1e-6)
                beta = torch.sigmoid(b[n, t, h].to(d))
                a = torch.exp(w.a_log[h].to(d))
                z = z_all[sl]
                g = -5 * torch.sigmoid(a * z) if gate is GateKind.BOUNDED else -a * F.softplus(z)
                Sd = torch.diag(torch.exp(g)) @ S[n, h]
                u = beta * (v - Sd.t() @ k)
                S[n, h] = Sd + torch.outer(k, u)
                o = S[n, h].t() @ q
                go = qkvg[n, t, 3 * D + h * K:3 * D + (h + 1) * K].to(d)
                outs[n, t, h] = o / torch.sqrt((o * o).mean() + 1e-5) * w.norm_w.to(d) * torch.sigmoid(go)
    return outs, S.transpose(-1, -2), win


@pytest.mark.parametrize("gate", list(GateKind))
def test_token_loop_matches_independent_float64(gate):
    H, N, T = 2, 2, 3
    qkvg, fa, b, state, window = _inputs(N, T, H, seed=1)
    w = random_weights(H, generator=torch.Generator().manual_seed(2))
    out, s, win, states = kda_token_loop(qkvg, fa, b, state, window, w, gate=gate, dtype=torch.float64,
                                         return_states=True)
    ro, rs, rw = _naive(qkvg, fa, b, state, window, w, gate)
    torch.testing.assert_close(out, ro, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(s, rs, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(win, rw, rtol=0, atol=0)
    assert torch.equal(states[:, -1], s) and states.shape == (N, T, H, K, K)


def _pool(B, H, num_slots, seed, ssm_dtype):
    g = torch.Generator().manual_seed(seed)
    ssm = (torch.randn(num_slots, H, K, K, generator=g) * 0.05).to(ssm_dtype)
    conv = torch.randn(num_slots, 3 * H * K, 3, generator=g).to(torch.bfloat16)
    slots = torch.randperm(num_slots, generator=g)[:B].to(torch.int32)
    return ssm, conv, slots


@pytest.mark.parametrize("gate", list(GateKind))
@pytest.mark.parametrize("ssm_dtype", [torch.float32, torch.bfloat16])
def test_decode_equals_token_loop(gate, ssm_dtype):
    H, B, T = 3, 4, 3
    qkvg, fa, b, _, _ = _inputs(B, T, H, seed=3)
    w = random_weights(H, generator=torch.Generator().manual_seed(4))
    ssm, conv, slots = _pool(B, H, 9, seed=5, ssm_dtype=ssm_dtype)
    idx = slots.long()
    ref_out, ref_s, ref_w, _ = kda_token_loop(qkvg, fa, b, ssm[idx].float(), conv[idx], w, gate=gate,
                                              state_round=None if ssm_dtype == torch.float32 else ssm_dtype)
    others = torch.ones(ssm.shape[0], dtype=torch.bool)
    others[idx] = False
    ssm_o, conv_o = ssm[others].clone(), conv[others].clone()
    for t in range(T):
        out = kda_decode(qkvg[:, t], fa[:, t], b[:, t], ssm, conv, slots, w, gate=gate)
        assert out.dtype == torch.bfloat16 and out.shape == (B, H, K)
        assert torch.equal(out, ref_out[:, t].to(torch.bfloat16))
    assert torch.equal(ssm[idx], ref_s.to(ssm_dtype))
    assert torch.equal(conv[idx], ref_w.to(torch.bfloat16))
    assert torch.equal(ssm[others], ssm_o) and torch.equal(conv[others], conv_o)  # other slots untouched


def test_padded_rows_write_zeros_and_touch_nothing():
    H, B = 2, 5
    qkvg, fa, b, _, _ = _inputs(B, 1, H, seed=6)
    w = random_weights(H, generator=torch.Generator().manual_seed(7))
    ssm, conv, slots = _pool(B, H, 8, seed=8, ssm_dtype=torch.float32)
    slots[1] = -1
    slots[3] = -7
    live = slots >= 0
    ssm0, conv0 = ssm.clone(), conv.clone()
    out = torch.full((B, H, K), float("nan"), dtype=torch.bfloat16)
    kda_decode(qkvg[:, 0], fa[:, 0], b[:, 0], ssm, conv, slots, w, out)
    assert torch.equal(out[~live], torch.zeros_like(out[~live]))
    assert torch.isfinite(out[live].float()).all()
    untouched = torch.ones(8, dtype=torch.bool)
    untouched[slots[live].long()] = False
    assert torch.equal(ssm[untouched], ssm0[untouched]) and torch.equal(conv[untouched], conv0[untouched])
    assert not torch.equal(ssm[slots[live].long()], ssm0[slots[live].long()])


def test_fresh_sequence_zero_window_and_state():
    H, B = 2, 3
    qkvg, fa, b, _, _ = _inputs(B, 1, H, seed=9)
    w = random_weights(H, generator=torch.Generator().manual_seed(10))
    ssm = torch.zeros(B, H, K, K)
    conv = torch.zeros(B, 3 * H * K, 3, dtype=torch.bfloat16)
    slots = torch.arange(B, dtype=torch.int32)
    out = kda_decode(qkvg[:, 0], fa[:, 0], b[:, 0], ssm, conv, slots, w).float()
    assert torch.isfinite(out).all() and out.abs().max() > 0
    # From S = 0 the new state is the rank-1 k u^T (transposed: u k^T), so each head has rank 1.
    assert all(torch.linalg.matrix_rank(ssm[i, h]) == 1 for i in range(B) for h in range(H))
    assert torch.equal(conv[..., :2], torch.zeros_like(conv[..., :2]))
    assert torch.equal(conv[..., 2], qkvg[:, 0, :3 * H * K])


# -- compile ---------------------------------------------------------------------------------------
def _ptxas(spec):
    from k3gen.pipeline.inspect import sass_text
    from k3gen.pipeline.nvrtc import compile_cubin
    from k3gen.pipeline.render import render
    cubin, log = compile_cubin(render(spec), spec.file_stem, spec.target, extra=("--ptxas-options=-v",))
    return cubin, log, sass_text(cubin)


@pytest.mark.parametrize("target", ["sm90", "sm103-nvfp4", "sm107-nvfp4"])
@pytest.mark.parametrize("ssm,gate", [(SsmDtype.FP32, GateKind.BOUNDED), (SsmDtype.BF16, GateKind.BOUNDED),
                                      (SsmDtype.FP32, GateKind.SOFTPLUS)])
def test_compiles_without_spills(target, ssm, gate):
    from k3gen.pipeline.inspect import cubin_arch
    spec = KdaDecodeSpec(target=TARGETS[target], heads=12, ssm=ssm, gate=gate)
    cubin, log, sass = _ptxas(spec)
    assert cubin_arch(cubin) == spec.target.arch
    frames = re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log)
    regs = dict(re.findall(r"Compiling entry function '(\w+)'.*?Used (\d+) registers", log, re.S))
    assert frames and all(f == ("0", "0", "0") for f in frames), log
    assert set(regs) == {"k3gen_kda_decode", "k3gen_kda_decode_stream"}, log
    assert int(regs["k3gen_kda_decode"]) <= 128, log          # __launch_bounds__(256, 2): two CTAs per SM
    assert int(regs["k3gen_kda_decode_stream"]) <= 128, log   # two persistent CTAs per SM
    assert not re.search(r"\b(LDL|STL)\b", sass)
    for op in ("UBLKCP", "SYNCS", "UCGABAR_ARV"):   # bulk copy, mbarriers, cluster barrier
        assert op in sass, op


def test_split_choice_with_and_without_pdl():
    from k3gen.ops.kda_decode.launcher import choose_split
    # (heads, batch) -> split with PDL / without (bench/NOTES.md 2026-11-30 01:54 and 2026-11-29)
    for (H, B), (on, off) in {(12, 1): (8, 8), (24, 1): (8, 4), (96, 1): (2, 1), (12, 8): (2, 1),
                              (24, 8): (1, 1), (12, 32): (1, 1)}.items():
        assert choose_split(B, H, 132, 8, pdl=True) == on, (H, B)
        assert choose_split(B, H, 132, 8, pdl=False) == off, (H, B)
    assert choose_split(1, 12, 132, 2, pdl=True) == 2      # capped by the spec's max_split
    assert choose_split(4, 12, 132, pdl=False) == 2 and choose_split(512, 96, 132) == 1


def test_l2_warming_choice():
    from k3gen.ops.kda_decode.launcher import choose_warming
    R = 264   # two CTAs per SM on 132 SMs
    assert choose_warming(96, R, pdl=True) == (96, 0)          # H12 B1 split 8: one wave, warmed before the wait
    assert choose_warming(96, R, pdl=False) == (0, 0)          # ... which needs PDL
    assert choose_warming(384, R, pdl=True) == (0, 0)          # H12 B32: more than a wave, under 8
    assert choose_warming(1536, R, pdl=True) == (0, 0)         # H12 B128: 5.8 waves
    assert choose_warming(8 * R, R, pdl=True) == (0, R)        # from 8 waves: one wave ahead
    assert choose_warming(6144, R, pdl=False) == (0, R)        # H12 B512, with or without PDL
    assert choose_warming(96, R, True, warm=False, ahead=True) == (0, R)   # explicit overrides


def test_stream_schedule_for_many_bf16_items():
    from k3gen.ops.kda_decode.launcher import choose_schedule
    assert choose_schedule(440, 12, 132, True, True) == "stream"
    assert choose_schedule(439, 12, 132, True, True) == "rows"
    assert choose_schedule(512, 12, 132, True, False) == "rows"    # FP32 state: rows measured as fast
    assert choose_schedule(512, 12, 132, False, True) == "rows"    # unaligned q|k|v|g rows: no bulk copy


# -- launcher (metadata checks only: nothing here touches the CUDA driver) --------------------------
def _launch_args(H=12, B=3, S=5, ssm=torch.float32):
    D = H * K
    bf = torch.bfloat16
    fab = torch.zeros(B, K + H + 1, dtype=bf)
    w = random_weights(H)
    return dict(qkvg=torch.zeros(B, 4 * D + 8, dtype=bf), fa=fab[:, :K], beta_logit=fab[:, K:K + H],
                ssm=torch.zeros(S, H, K, K, dtype=ssm), conv=torch.zeros(S, 3 * D, 3, dtype=bf),
                slots=torch.zeros(B, dtype=torch.int32), conv_w=w.conv_w, fb_w=w.fb_w, dt_bias=w.dt_bias,
                a_log=w.a_log, norm_w=w.norm_w, out=torch.zeros(B, H, K, dtype=bf))


@pytest.mark.parametrize("name,bad,needle", [
    ("qkvg", lambda a: a["qkvg"][:, :100], "qkvg"),
    ("fa", lambda a: a["fa"].float(), "fa="),
    ("beta_logit", lambda a: a["beta_logit"][:, :5], "beta_logit="),
    ("ssm", lambda a: a["ssm"].to(torch.bfloat16), "ssm="),
    ("ssm", lambda a: a["ssm"].transpose(2, 3), "contiguous"),
    ("conv", lambda a: a["conv"][:4], "conv="),
    ("slots", lambda a: a["slots"].long(), "slots="),
    ("fb_w", lambda a: a["fb_w"].t(), "fb_w="),
    ("dt_bias", lambda a: a["dt_bias"].double(), "dt_bias="),
    ("a_log", lambda a: torch.zeros(128), "a_log="),
    ("out", lambda a: a["out"].float(), "out="),
    ("out", lambda a: a["out"].cpu(), "device="),   # right shapes, but not on a CUDA device
])
def test_launcher_checks(name, bad, needle):
    from k3gen.ops.kda_decode.launcher import KdaDecode
    op = KdaDecode(KdaDecodeSpec(target=SM90, heads=12))
    args = _launch_args()
    args[name] = bad(args)
    with pytest.raises(SpecError) as e:
        op(**args)
    assert needle in str(e.value)


def test_launcher_split_override_is_checked():
    from k3gen.ops.kda_decode.launcher import KdaDecode
    op = KdaDecode(KdaDecodeSpec(target=SM90, heads=12, max_split=2))
    with pytest.raises(SpecError, match="split=4"):
        op(**_launch_args(), split=4)
    with pytest.raises(SpecError, match="split=3"):
        op(**_launch_args(), split=3)


def test_validate_slots():
    from k3gen.errors import PageIndexError
    from k3gen.ops.kda_decode.launcher import KdaDecode
    KdaDecode.validate_slots(torch.tensor([3, -1, 0, -1], dtype=torch.int32), 4)
    with pytest.raises(PageIndexError, match="slot 4"):
        KdaDecode.validate_slots(torch.tensor([4], dtype=torch.int32), 4)
    with pytest.raises(SpecError, match="distinct"):
        KdaDecode.validate_slots(torch.tensor([1, 2, 1], dtype=torch.int32), 4)
