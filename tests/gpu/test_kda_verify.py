"""kda_verify kernels (sm90) vs the FP32 reference and vs the kda_decode kernel run token by token.

Tolerances as tests/gpu/test_kda_decode.py: BF16 outputs relative RMS <= 1e-2 and elementwise
2^-6 |ref| + 1e-3 max|ref|; FP32 states (ssm FP32, every record) relative RMS <= 1e-5; BF16 ssm
within one BF16 ulp of the FP32 value; conv caches and untouched slots bitwise. With BF16 storage
the records hold the state rounded to BF16 after every token (as decode stores it): each is checked
as BF16 storage (exactly BF16-valued, within one BF16 ulp of one FP32 reference step from the
kernel's own previous state). Outputs are poisoned with NaN before every run; NaN never passes.
Bit-for-bit verify + commit == serial decode: tests/gpu/test_spec_lossless.py.
"""
from __future__ import annotations

import functools

import pytest
import torch

from k3gen.ir.dtypes import GateKind, SsmDtype
from k3gen.ops.kda_decode.spec import KdaDecodeSpec
from k3gen.ops.kda_verify.spec import KdaVerifySpec, VerifyVariant
from k3gen.ops.kda_decode.reference import kda_token_loop, random_weights
from k3gen.ops.kda_verify.reference import commit, start_of
from k3gen.ops.kda_verify.reference import kda_verify as ref_verify
from k3gen.runtime.graphs import capture
from k3gen.ops.kda_verify.variants import PERSISTENT_MAX_DRAFTS, SCHEDULES
from k3gen.targets import get_target
from numerics import rel_rms

pytestmark = pytest.mark.gpu
K = 128
DEV = "cuda"
TORCH_SSM = {SsmDtype.FP32: torch.float32, SsmDtype.BF16: torch.bfloat16}


@functools.lru_cache(maxsize=None)
def verify_op(heads, drafts, ssm=SsmDtype.FP32, gate=GateKind.BOUNDED, variant=VerifyVariant.NVFP4):
    from k3gen.ops.kda_verify.launcher import KdaVerify
    return KdaVerify(KdaVerifySpec(target=get_target("sm90"), heads=heads, drafts=drafts, ssm=ssm, gate=gate,
                                   variant=variant)).load()


@functools.lru_cache(maxsize=None)
def decode_op(heads, ssm):
    from k3gen.ops.kda_decode.launcher import KdaDecode
    return KdaDecode(KdaDecodeSpec(target=get_target("sm90"), heads=heads, ssm=ssm)).load()


def assert_out_close(got, ref):
    got, ref = got.float().cpu(), ref.float().cpu()
    assert torch.isfinite(got).all(), "non-finite output"
    assert rel_rms(got, ref) <= 1e-2, rel_rms(got, ref)
    bad = (got - ref).abs() > ref.abs() * 2**-6 + 1e-3 * ref.abs().max()
    assert not bad.any(), f"{int(bad.sum())} elements off"


def assert_state_close(got, ref32, dtype):
    got, ref32 = got.cpu().float(), ref32.cpu().float()
    assert torch.isfinite(got).all(), "non-finite state"
    if dtype == torch.float32:
        assert rel_rms(got, ref32) <= 1e-5, rel_rms(got, ref32)
        return
    ulp = torch.exp2(torch.floor(torch.log2(ref32.abs().clamp_min(2.0**-126))) - 7)
    err = (got - ref32).abs()
    bad = (err > ulp) & (err > 1e-5 * float(ref32.pow(2).mean().sqrt()))
    assert not bad.any(), f"BF16 state: {int(bad.sum())} elements off"


class Case:
    """Pools with random committed states, records and windows, and one step's tokens."""

    def __init__(self, H, M, B, ssm: SsmDtype, seed, *, padded=(), pending=None):
        g = torch.Generator().manual_seed(seed)
        D, T, S = H * K, 1 + M, 2 * B + 3
        self.H, self.M, self.B, self.T, self.ssm_dtype = H, M, B, T, TORCH_SSM[ssm]
        self.w = random_weights(H, generator=g)
        self.qkvg = torch.randn(B * T, 4 * D + 16, generator=g).to(torch.bfloat16)
        fab = torch.randn(B * T, K + H + 3, generator=g).to(torch.bfloat16)
        self.fab = fab
        self.ssm = (torch.randn(S, H, K, K, generator=g) * 0.05).to(self.ssm_dtype)
        self.rec = torch.randn(S, M, H, K, K, generator=g) * 0.05
        self.conv_ext = torch.randn(S, 3 * D, 3 + M, generator=g).to(torch.bfloat16).float()
        self.pending = (torch.randint(0, M + 1, (S,), generator=g) if pending is None
                        else torch.full((S,), pending)).to(torch.int32)
        self.slots = torch.randperm(S, generator=g)[:B].to(torch.int32)
        for i in padded:
            self.slots[i] = -1 - i

    def pools(self):
        return [self.ssm.clone(), self.rec.clone(), self.conv_ext.clone(), self.pending.clone()]

    def gpu(self, pools=None):
        ssm, rec, ce, pend = pools or self.pools()
        fab = self.fab.to(DEV)
        wg = self.w.to(DEV)
        return dict(qkvg=self.qkvg.to(DEV), fa=fab[:, :K], beta_logit=fab[:, K:K + self.H], ssm=ssm.to(DEV),
                    draft_rec=rec.to(DEV), conv_ext=ce.to(DEV), pending=pend.to(DEV), slots=self.slots.to(DEV),
                    conv_w=wg.conv_w, fb_w=wg.fb_w, dt_bias=wg.dt_bias, a_log=wg.a_log, norm_w=wg.norm_w,
                    out=torch.full((self.B, self.T, self.H, K), float("nan"), dtype=torch.bfloat16, device=DEV))


def run(op, t, schedule=None, **kw):
    return op(t["qkvg"], t["fa"], t["beta_logit"], t["ssm"], t["draft_rec"], t["conv_ext"], t["pending"], t["slots"],
              t["conv_w"], t["fb_w"], t["dt_bias"], t["a_log"], t["norm_w"], t["out"], schedule=schedule, **kw)


def check_against_reference(case: Case, gate=GateKind.BOUNDED, variant=VerifyVariant.NVFP4, schedule=None, **kw):
    ssm_e = SsmDtype.FP32 if case.ssm_dtype == torch.float32 else SsmDtype.BF16
    op = verify_op(case.H, case.M, ssm_e, gate, variant)
    t = case.gpu()
    run(op, t, schedule, **kw)
    torch.cuda.synchronize()
    ssm, rec, ce, pend = case.pools()
    start, window = start_of(ssm, rec, ce, pend, case.slots[case.slots >= 0].long())
    # the reference in the case's SSM dtype: it rounds the state after every token as the kernel does
    out = ref_verify(case.qkvg, case.fab[:, :K], case.fab[:, K:K + case.H], ssm, rec, ce, pend, case.slots, case.w,
                     gate=gate)
    ssm32 = ssm.float()
    live = case.slots >= 0
    got_out = t["out"].cpu()
    assert torch.equal(got_out[~live], torch.zeros_like(got_out[~live])), "padded rows must be zeros"
    assert_out_close(got_out[live], out[live])
    idx = case.slots[live].long()
    untouched = torch.ones(case.ssm.shape[0], dtype=torch.bool)
    untouched[idx] = False
    for name, got, base in (("ssm", t["ssm"], case.ssm), ("draft_rec", t["draft_rec"], case.rec),
                            ("conv_ext", t["conv_ext"], case.conv_ext)):
        assert torch.equal(got.cpu()[untouched], base[untouched]), f"{name} outside `slots` changed"
    assert torch.equal(t["pending"].cpu(), case.pending), "the kernel never writes pending"
    assert torch.equal(t["conv_ext"].cpu()[idx], ce[idx]), "conv_ext"
    if case.ssm_dtype == torch.float32:
        assert_state_close(t["ssm"][idx.to(DEV)], ssm32[idx], case.ssm_dtype)
        assert_state_close(t["draft_rec"][idx.to(DEV)], rec[idx], torch.float32)
    else:
        # token 0 from the common start state; token t >= 1 from the kernel's own state after t - 1
        # (BF16 chains of two FP32 implementations drift apart by an ulp now and then)
        one_step = functools.partial(kda_token_loop, w=case.w, gate=gate, return_states=True,
                                     state_round=torch.bfloat16)
        rows = case.slots.ge(0).nonzero().flatten()
        q3 = case.qkvg.view(case.B, case.T, -1)[rows]
        fa3 = case.fab[:, :K].reshape(case.B, case.T, K)[rows]
        b3 = case.fab[:, K:K + case.H].reshape(case.B, case.T, case.H)[rows]
        got_ssm = t["ssm"].cpu()[idx].float()
        got_rec = t["draft_rec"].cpu()[idx]
        _, _, _, st0 = one_step(q3[:, :1], fa3[:, :1], b3[:, :1], start, window)
        assert_state_close(got_ssm, st0[:, 0], torch.bfloat16)
        assert torch.equal(got_rec, got_rec.to(torch.bfloat16).float()), "records must hold BF16 values"
        got_ce = t["conv_ext"].cpu()[idx]
        for tt in range(1, case.T):
            prev = got_ssm if tt == 1 else got_rec[:, tt - 2]
            _, _, _, st = one_step(q3[:, tt:tt + 1], fa3[:, tt:tt + 1], b3[:, tt:tt + 1], prev,
                                   got_ce[:, :, tt - 1:tt + 2])
            assert_state_close(got_rec[:, tt - 1], st[:, 0], torch.bfloat16)
    return t


CASES = [  # (H, M, B, ssm, padded)
    (6, 1, 3, SsmDtype.FP32, (1,)),
    (12, 1, 5, SsmDtype.BF16, ()),
    (12, 3, 8, SsmDtype.FP32, (0, 5)),
    (12, 3, 37, SsmDtype.BF16, (36,)),
    (12, 7, 4, SsmDtype.FP32, (2,)),
    (12, 7, 9, SsmDtype.BF16, ()),
    (96, 3, 2, SsmDtype.FP32, ()),
    (96, 7, 3, SsmDtype.BF16, (1,)),
]


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("H,M,B,ssm,padded", CASES, ids=[f"H{c[0]}-M{c[1]}-B{c[2]}-{c[3].value}" for c in CASES])
def test_matches_reference(H, M, B, ssm, padded, schedule):
    if schedule != "rows" and M > PERSISTENT_MAX_DRAFTS:
        pytest.skip(f"the {schedule} schedule is built for M <= 3")
    check_against_reference(Case(H, M, B, ssm, seed=H * 100 + M * 10 + B, padded=padded), schedule=schedule)


def test_softplus_gate_and_original_variant():
    check_against_reference(Case(12, 3, 6, SsmDtype.FP32, seed=9), gate=GateKind.SOFTPLUS)
    check_against_reference(Case(12, 3, 6, SsmDtype.FP32, seed=9), gate=GateKind.SOFTPLUS, schedule="prefetch")
    check_against_reference(Case(12, 3, 6, SsmDtype.FP32, seed=9), gate=GateKind.SOFTPLUS, schedule="split")
    check_against_reference(Case(12, 3, 6, SsmDtype.FP32, seed=10), variant=VerifyVariant.ORIGINAL)


# Prefetch-schedule ranges: B*H above two CTAs per SM, so CTAs walk several items, cross head
# boundaries (f_b reloads) and meet runs of padded rows (a head whose items are all padded).
PREFETCH_CASES = [  # (H, M, B, ssm, padded)
    (12, 3, 57, SsmDtype.FP32, tuple(range(20, 48))),
    (12, 3, 61, SsmDtype.BF16, (0, 1, 2, 60)),
    (6, 1, 101, SsmDtype.FP32, tuple(range(0, 101, 3))),
    (96, 3, 4, SsmDtype.FP32, (3,)),
    (96, 3, 3, SsmDtype.BF16, ()),
    (12, 3, 9, SsmDtype.FP32, (4,)),   # 108 items: at most one CTA per SM (prefetch spread over SMs)
]


@pytest.mark.parametrize("schedule,per_sm", [("prefetch", None), ("split", 2), ("split", 4)])
@pytest.mark.parametrize("H,M,B,ssm,padded", PREFETCH_CASES,
                         ids=[f"H{c[0]}-M{c[1]}-B{c[2]}-{c[3].value}" for c in PREFETCH_CASES])
def test_prefetch_schedule_reference_and_bitwise_rows(H, M, B, ssm, padded, schedule, per_sm):
    """The prefetch and split kernels against the FP32 reference, and bit for bit against the row
    kernel (same expressions; the split kernel's RMSNorm runs emit's butterfly over both CTAs'
    partials): outputs, ssm, records and conv caches, with mixed pending values. The split
    schedule at 2 and 4 CTAs per SM gives its clusters different item ranges."""
    case = Case(H, M, B, ssm, seed=7 * B + H, padded=padded)
    kw = {"per_sm": per_sm} if per_sm else {}
    t_pre = check_against_reference(case, schedule=schedule, **kw)
    op = verify_op(H, M, ssm)
    t_rows = case.gpu()
    run(op, t_rows, "rows")
    torch.cuda.synchronize()
    for name in ("out", "ssm", "draft_rec", "conv_ext"):
        assert torch.equal(t_pre[name], t_rows[name]), f"{name}: {schedule} and row schedules differ"


def test_schedule_choice_and_errors():
    from k3gen.errors import SpecError
    op = verify_op(12, 3)
    assert op.schedule_for(1) == "split" and op.schedule_for(8) == "prefetch"
    assert op.schedule_for(512) == "prefetch"
    t = Case(12, 3, 2, SsmDtype.FP32, seed=5).gpu()
    with pytest.raises(SpecError):
        run(op, t, "stream")
    with pytest.raises(SpecError):
        run(verify_op(12, 7), Case(12, 7, 2, SsmDtype.FP32, seed=5).gpu(), "prefetch")
    with pytest.raises(SpecError):
        run(verify_op(12, 3, variant=VerifyVariant.ORIGINAL), t, "prefetch")
    with pytest.raises(SpecError):
        run(verify_op(12, 7), Case(12, 7, 2, SsmDtype.FP32, seed=5).gpu(), "split")
    with pytest.raises(SpecError):
        run(verify_op(12, 3, variant=VerifyVariant.ORIGINAL), t, "split")
    with pytest.raises(SpecError):
        run(op, t, "split", per_sm=5)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("M", [1, 3, 7])
@pytest.mark.parametrize("ssm", list(SsmDtype))
def test_verify_commit_equals_decode_kernel(M, ssm, schedule):
    """Done-when: for every accepted count 0..M (row b accepts (b + round) % (M + 1) drafts), three
    rounds so that pending differs across rows, verify + commit leaves the state and window of an
    FP32 token loop over the accepted tokens (from the state the step started at), and all 1 + M
    outputs match that loop (rounding the state to BF16 after every token with BF16 storage). The
    committed state is compared with test_kda_decode's criterion: FP32 records (and FP32 ssm) rel
    RMS <= 1e-5; a BF16 ssm must be the BF16 rounding of the FP32-accurate state (within one BF16
    ulp; BF16 records: test_matches_reference checks them token by token). The kda_decode kernel,
    run token by token as an independent chain over the three rounds, must reach the same state and
    outputs bit for bit, for both storage dtypes (SPEC.md section 3)."""
    if schedule != "rows" and M > PERSISTENT_MAX_DRAFTS:
        pytest.skip(f"the {schedule} schedule is built for M <= 3")
    H, B, T = 12, M + 1, 1 + M
    D, S = H * K, 2 * B + 1
    g = torch.Generator().manual_seed(1000 + M)
    w = random_weights(H, generator=g)
    wg = w.to(DEV)
    sdt = TORCH_SSM[ssm]
    vop = verify_op(H, M, ssm)
    dop = decode_op(H, ssm)
    ssm_v = (torch.randn(S, H, K, K, generator=g) * 0.05).to(sdt).to(DEV)
    rec = torch.full((S, M, H, K, K), float("nan"), device=DEV)
    conv = torch.randn(S, 3 * D, 3, generator=g).to(torch.bfloat16).to(DEV)
    ce = torch.full((S, 3 * D, 3 + M), float("nan"), device=DEV)
    ce[..., :3] = conv.float()
    pend = torch.zeros(S, dtype=torch.int32, device=DEV)
    ssm_d, conv_d = ssm_v.clone(), conv.clone()
    slots = torch.randperm(S, generator=g)[:B].to(torch.int32).to(DEV)
    for rnd in range(3):
        qkvg = torch.randn(B * T, 4 * D, generator=g).to(torch.bfloat16).to(DEV)
        fab = torch.randn(B * T, K + H, generator=g).to(torch.bfloat16).to(DEV)
        idx = slots.long()
        start, window = start_of(ssm_v, rec, ce, pend, idx)  # FP32 copies, before the kernel runs
        out = torch.full((B, T, H, K), float("nan"), dtype=torch.bfloat16, device=DEV)
        vop(qkvg, fab[:, :K], fab[:, K:], ssm_v, rec, ce, pend, slots, wg.conv_w, wg.fb_w, wg.dt_bias, wg.a_log,
            wg.norm_w, out, schedule=schedule)
        accepted = torch.tensor([(i + rnd) % (M + 1) for i in range(B)])
        commit(pend, slots, (accepted + 1).to(DEV))
        torch.cuda.synchronize()
        assert torch.equal(pend[idx].cpu(), accepted.to(torch.int32)), "commit sets pending = accepted drafts"
        ref_o, _, _, ref_states = kda_token_loop(qkvg.view(B, T, -1), fab[:, :K].reshape(B, T, K),
                                                 fab[:, K:].reshape(B, T, H), start, window, wg, return_states=True,
                                                 state_round=None if ssm is SsmDtype.FP32 else torch.bfloat16)
        for i in range(B):
            s, P = int(slots[i]), int(accepted[i])
            for t in range(T):
                assert_out_close(out[i, t], ref_o[i, t])
            want = ref_states[i, P]
            if P == 0:
                assert_state_close(ssm_v[s], want, sdt)
            elif ssm is SsmDtype.FP32:
                assert_state_close(rec[s, P - 1], want, torch.float32)
            raw = qkvg[i * T:i * T + P + 1, :3 * D].float().t()
            want_win = torch.cat([window[i], raw], dim=1)[:, -3:]
            assert torch.equal(ce[s, :, P:P + 3], want_win), "committed window"
            sl = slots[i:i + 1]
            y = torch.empty(1, H, K, dtype=torch.bfloat16, device=DEV)
            for t in range(P + 1):
                r = i * T + t
                dop(qkvg[r:r + 1], fab[r:r + 1, :K], fab[r:r + 1, K:], ssm_d, conv_d, sl, wg.conv_w, wg.fb_w,
                    wg.dt_bias, wg.a_log, wg.norm_w, y)
                assert torch.equal(out[i, t], y[0]), f"row {i} token {t}: verify output != decode output"
            torch.cuda.synchronize()
            state = ssm_v[s].float() if P == 0 else rec[s, P - 1]
            assert torch.equal(ce[s, :, P:P + 3].cpu(), conv_d[s].float().cpu()), "window vs decode chain"
            assert torch.equal(state, ssm_d[s].float()), "committed state != decode chain"


@pytest.mark.parametrize("schedule", [None, "rows", "split"])
@pytest.mark.parametrize("B", [3, 40])
def test_cuda_graph_replay_equals_eager(B, schedule):
    H, M = 12, 3
    op = verify_op(H, M)
    base = Case(H, M, B, SsmDtype.FP32, seed=21)
    t = base.gpu()
    run(op, t, schedule)
    torch.cuda.synchronize()
    graph = capture(lambda: run(op, t, schedule))
    for step in range(3):
        src = Case(H, M, B, SsmDtype.FP32, seed=100 + step, padded=(step % B,) if step else ()).gpu()
        names = ("qkvg", "ssm", "draft_rec", "conv_ext", "pending", "slots", "fa", "beta_logit")
        for name in names:
            t[name].copy_(src[name])
        t["out"].fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        g_res = [t[n].clone() for n in ("out", "ssm", "draft_rec", "conv_ext")]
        for name in ("ssm", "draft_rec", "conv_ext"):
            t[name].copy_(src[name])
        t["out"].fill_(float("nan"))
        run(op, t, schedule)
        torch.cuda.synchronize()
        assert all(torch.equal(a, t[n]) for a, n in zip(g_res, ("out", "ssm", "draft_rec", "conv_ext")))
        assert torch.isfinite(g_res[0].float()).all()


@pytest.mark.parametrize("schedule", ["prefetch", "split"])
@pytest.mark.parametrize("B,ssm", [(40, SsmDtype.FP32), (40, SsmDtype.BF16), (7, SsmDtype.FP32)])
def test_prefetch_pdl_chain_equals_plain_launches(B, ssm, schedule):
    """Four prefetch- or split-schedule steps on one pool (no commit between them, so each step
    starts from the state or record the previous step wrote), captured in a CUDA graph with
    programmatic dependent launch (and, prefetch, L2 warming before griddepcontrol.wait), equal the
    same steps launched plainly and eagerly, bit for bit; and warming without PDL changes no bits
    either."""
    H, M, steps = 12, 3, 4
    op = verify_op(H, M, ssm)
    base = Case(H, M, B, ssm, seed=51 + B, padded=(1,))
    names = ("ssm", "draft_rec", "conv_ext")
    t = base.gpu()
    outs = [torch.full_like(t["out"], float("nan")) for _ in range(steps)]

    def chain(**kw):
        if schedule == "split":
            kw.pop("warm")  # the split kernel has no warming prologue
        for o in outs:
            op(t["qkvg"], t["fa"], t["beta_logit"], t["ssm"], t["draft_rec"], t["conv_ext"], t["pending"],
               t["slots"], t["conv_w"], t["fb_w"], t["dt_bias"], t["a_log"], t["norm_w"], o, schedule=schedule,
               **kw)

    def reset():
        fresh = base.gpu()
        for n in names:
            t[n].copy_(fresh[n])
        for o in outs:
            o.fill_(float("nan"))

    chain(pdl=False, warm=False)
    torch.cuda.synchronize()
    want = [o.clone() for o in outs] + [t[n].clone() for n in names]
    assert not torch.equal(want[0], want[1])   # the steps really differ (state carried between them)
    reset()
    chain(pdl=False, warm=True)
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(outs + [t[n] for n in names], want))
    reset()
    graph = capture(lambda: chain(pdl=True, warm=True))
    reset()
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(outs + [t[n] for n in names], want))


def test_twenty_runs_bitwise_identical():
    op = verify_op(12, 3, SsmDtype.BF16)
    case = Case(12, 3, 9, SsmDtype.BF16, seed=31)
    first = None
    for _ in range(20):
        t = case.gpu()
        run(op, t)
        torch.cuda.synchronize()
        now = [t[n].cpu() for n in ("out", "ssm", "draft_rec", "conv_ext")]
        first = first or now
        assert all(torch.equal(a, b) for a, b in zip(first, now))


def test_sanitize_reduced_matrix():
    """Small enough for compute-sanitizer memcheck (tools/h200.sh selects `sanitize`)."""
    check_against_reference(Case(6, 3, 3, SsmDtype.BF16, seed=3, padded=(1,)))
    check_against_reference(Case(6, 7, 2, SsmDtype.FP32, seed=4))
    # 300 items on 264 CTAs: ranges of two items, a padded row inside a range.
    check_against_reference(Case(6, 3, 50, SsmDtype.BF16, seed=5, padded=(0, 7)), schedule="prefetch")
    # 150 clusters of two CTAs over 300 items (two each), a padded row inside a range.
    check_against_reference(Case(6, 3, 50, SsmDtype.FP32, seed=6, padded=(3, 30)), schedule="split", per_sm=2)
