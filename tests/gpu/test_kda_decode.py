"""kda_decode kernels (sm90) vs the FP32 reference on fresh random inputs.

Tolerances: BF16 output relative RMS <= 1e-2 and every element within 2^-6 |ref| + 1e-3 max|ref|
(one BF16 ulp is <= 2^-7 |ref|); FP32 state relative RMS <= 1e-5; BF16 state at most one BF16 ulp
from the reference's rounding; conv windows and untouched slots bitwise. NaN never passes (outputs
are poisoned with NaN before each run, and every compared tensor must be finite).
"""
from __future__ import annotations

import functools

import pytest
import torch

from k3gen.ir.dtypes import GateKind, SsmDtype
from k3gen.ops.kda_decode.spec import KdaDecodeSpec
from k3gen.ops.kda_decode.reference import kda_decode as ref_decode
from k3gen.ops.kda_decode.reference import kda_token_loop, random_weights
from k3gen.runtime.graphs import capture
from k3gen.targets import get_target
from numerics import rel_rms

pytestmark = pytest.mark.gpu
K = 128
DEV = "cuda"


def sync():
    torch.cuda.synchronize()

TORCH_SSM = {SsmDtype.FP32: torch.float32, SsmDtype.BF16: torch.bfloat16}


@functools.lru_cache(maxsize=None)
def op_for(heads: int, gate: GateKind, ssm: SsmDtype):
    from k3gen.ops.kda_decode.launcher import KdaDecode
    return KdaDecode(KdaDecodeSpec(target=get_target("sm90"), heads=heads, gate=gate, ssm=ssm)).load()


class Case:
    """One batch: CPU tensors for the reference and GPU copies for the kernel."""

    def __init__(self, H, B, ssm: SsmDtype, seed, *, padded=(), num_slots=None, zero_window=False):
        g = torch.Generator().manual_seed(seed)
        D = H * K
        self.H, self.B, self.ssm_dtype = H, B, ssm
        num_slots = num_slots or 2 * B + 5
        self.w = random_weights(H, generator=g)
        self.qkvg = torch.randn(B, 4 * D + 16, generator=g).to(torch.bfloat16)       # row stride > 4D
        fab = torch.randn(B, K + H + 3, generator=g).to(torch.bfloat16)              # [f_a | b | pad]
        self.fa, self.beta = fab[:, :K], fab[:, K:K + H]
        self.fab = fab
        self.ssm = (torch.randn(num_slots, H, K, K, generator=g) * 0.05).to(TORCH_SSM[ssm])
        self.conv = torch.randn(num_slots, 3 * D, 3, generator=g).to(torch.bfloat16)
        perm = torch.randperm(num_slots, generator=g)[:B]
        self.slots = perm.to(torch.int32)
        for i in padded:
            self.slots[i] = -1 - i
        if zero_window:
            self.conv[self.slots[self.slots >= 0].long()] = 0
        self.ssm0, self.conv0 = self.ssm.clone(), self.conv.clone()

    def gpu(self):
        fab = self.fab.to(DEV)
        wg = self.w.to(DEV)
        return dict(qkvg=self.qkvg.to(DEV), fa=fab[:, :K], beta_logit=fab[:, K:K + self.H], ssm=self.ssm.to(DEV),
                    conv=self.conv.to(DEV), slots=self.slots.to(DEV), conv_w=wg.conv_w, fb_w=wg.fb_w,
                    dt_bias=wg.dt_bias, a_log=wg.a_log, norm_w=wg.norm_w,
                    out=torch.full((self.B, self.H, K), float("nan"), dtype=torch.bfloat16, device=DEV))

    def reference(self, gate):
        ssm, conv = self.ssm0.clone(), self.conv0.clone()
        out = ref_decode(self.qkvg, self.fa, self.beta, ssm, conv, self.slots, self.w, gate=gate)
        return out, ssm, conv

    def reference_fp32_state(self, gate):
        """The state update from the same (BF16-valued) start, kept in FP32: no final rounding."""
        ssm, conv = self.ssm0.float().clone(), self.conv0.clone()
        ref_decode(self.qkvg, self.fa, self.beta, ssm, conv, self.slots, self.w, gate=gate)
        return ssm


def run(op, t, split=None, schedule=None):
    return op(t["qkvg"], t["fa"], t["beta_logit"], t["ssm"], t["conv"], t["slots"], t["conv_w"], t["fb_w"],
              t["dt_bias"], t["a_log"], t["norm_w"], t["out"], split=split, schedule=schedule)


def assert_out_close(got, ref):
    got, ref = got.float().cpu(), ref.float().cpu()
    assert torch.isfinite(got).all(), "non-finite output"
    assert rel_rms(got, ref) <= 1e-2, rel_rms(got, ref)
    bound = ref.abs() * 2**-6 + 1e-3 * ref.abs().max()
    bad = (got - ref).abs() > bound
    assert not bad.any(), f"{int(bad.sum())} elements off, max {float((got - ref).abs().max())}"


def _ordered_bits(x: torch.Tensor) -> torch.Tensor:
    i = x.view(torch.int16).int()
    return torch.where(i < 0, -(i & 0x7FFF), i)


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """Spacing of BF16 numbers at |x| (8 significant bits)."""
    e = torch.floor(torch.log2(x.abs().clamp_min(2.0**-126)))
    return torch.exp2(e - 7)


def assert_state_close(got, ref, ssm: SsmDtype, ref32=None):
    """FP32: relative RMS <= 1e-5. BF16: the stored value is the BF16 rounding of an FP32 state
    within FP32 arithmetic error of the reference: |got - ref32| <= one BF16 ulp of ref32, or
    <= 1e-5 x RMS(ref32) where cancellation makes the value tiny (FP32 order-of-operations error)."""
    got, ref = got.cpu(), ref.cpu()
    assert torch.isfinite(got.float()).all(), "non-finite state"
    if ssm is SsmDtype.FP32:
        assert rel_rms(got, ref) <= 1e-5, rel_rms(got, ref)
        return
    ref32 = ref.float() if ref32 is None else ref32.cpu().float()
    err = (got.float() - ref32).abs()
    rms = float(ref32.pow(2).mean().sqrt())
    bad = (err > bf16_ulp(ref32)) & (err > 1e-5 * rms)
    assert not bad.any(), f"BF16 state: {int(bad.sum())} elements off, max err {float(err[bad].max())}"
    assert float((got == ref).double().mean()) > 0.99, "BF16 state rounds differently from the reference"


def check_case(case: Case, gate: GateKind, split=None, schedule=None):
    op = op_for(case.H, gate, case.ssm_dtype)
    t = case.gpu()
    run(op, t, split, schedule)
    sync()
    out, ssm, conv = case.reference(gate)
    live = case.slots >= 0
    assert torch.equal(t["out"].cpu()[~live], torch.zeros_like(out[~live])), "padded rows must be zeros"
    assert_out_close(t["out"][live.to(DEV)], out[live])
    idx = case.slots[live].long()
    untouched = torch.ones(case.ssm.shape[0], dtype=torch.bool)
    untouched[idx] = False
    got_ssm, got_conv = t["ssm"].cpu(), t["conv"].cpu()
    assert torch.equal(got_ssm[untouched], case.ssm0[untouched]), "a slot outside `slots` changed"
    assert torch.equal(got_conv[untouched], case.conv0[untouched]), "a conv window outside `slots` changed"
    assert torch.equal(got_conv[idx], conv[idx]), "conv window shift"
    ref32 = case.reference_fp32_state(gate)[idx] if case.ssm_dtype is SsmDtype.BF16 else None
    assert_state_close(got_ssm[idx], ssm[idx], case.ssm_dtype, ref32)
    return t


CASES = [  # (H, B, gate, ssm, padded rows)
    (6, 3, GateKind.BOUNDED, SsmDtype.FP32, (1,)),
    (12, 1, GateKind.BOUNDED, SsmDtype.FP32, ()),
    (12, 8, GateKind.BOUNDED, SsmDtype.BF16, (0, 5)),
    (12, 37, GateKind.BOUNDED, SsmDtype.FP32, (36,)),
    (12, 5, GateKind.SOFTPLUS, SsmDtype.FP32, (2,)),
    (12, 64, GateKind.SOFTPLUS, SsmDtype.BF16, (3,)),
    (24, 4, GateKind.BOUNDED, SsmDtype.BF16, ()),
    (24, 19, GateKind.BOUNDED, SsmDtype.FP32, (7,)),
    (96, 2, GateKind.BOUNDED, SsmDtype.FP32, ()),
    (96, 3, GateKind.BOUNDED, SsmDtype.BF16, (1,)),
]


@pytest.mark.parametrize("H,B,gate,ssm,padded", CASES,
                         ids=[f"H{c[0]}-B{c[1]}-{c[2].value}-{c[3].value}" for c in CASES])
def test_matches_reference(H, B, gate, ssm, padded):
    check_case(Case(H, B, ssm, seed=H * 1000 + B, padded=padded), gate)


@pytest.mark.parametrize("ssm", list(SsmDtype))
def test_every_split(ssm):
    """Cluster sizes 1..8 on the same inputs: each matches the reference; the state does not depend
    on the split (same per-channel arithmetic), the output only through the RMS sum order."""
    states, outs = [], []
    for split in (1, 2, 4, 8):
        t = check_case(Case(12, 3, ssm, seed=77, padded=(1,)), GateKind.BOUNDED, split=split)
        states.append(t["ssm"].cpu())
        outs.append(t["out"].float().cpu())
    assert all(torch.equal(s, states[0]) for s in states[1:])
    assert all(rel_rms(o, outs[0]) < 4e-3 for o in outs[1:])


def test_zero_conv_window():
    check_case(Case(12, 6, SsmDtype.FP32, seed=5, zero_window=True), GateKind.BOUNDED)


def test_8192_steps_drift():
    """One sequence for 8192 steps in FP32 state vs an FP64 token loop: final state rel RMS <= 1e-4."""
    H, T = 6, 8192
    g = torch.Generator().manual_seed(11)
    w = random_weights(H, generator=g)
    D = H * K
    # Long memory (3/4 of the channels decay by < 1% a step), so rounding errors accumulate.
    w.dt_bias = torch.rand(D, generator=g) * -4.0
    w.fb_w = (w.fb_w.float() * 0.3).to(torch.bfloat16)
    qkvg = torch.randn(T, 1, 4 * D, generator=g).to(torch.bfloat16).to(DEV)
    fab = torch.randn(T, 1, K + H, generator=g).to(torch.bfloat16).to(DEV)
    s0 = torch.randn(1, H, K, K, generator=g) * 0.05
    c0 = torch.randn(1, 3 * D, 3, generator=g).to(torch.bfloat16)
    op = op_for(H, GateKind.BOUNDED, SsmDtype.FP32)
    wg = w.to(DEV)
    ssm = torch.zeros(4, H, K, K, device=DEV)
    conv = torch.zeros(4, 3 * D, 3, dtype=torch.bfloat16, device=DEV)
    ssm[2], conv[2] = s0[0].to(DEV), c0[0].to(DEV)
    slots = torch.tensor([2], dtype=torch.int32, device=DEV)
    out = torch.empty(1, H, K, dtype=torch.bfloat16, device=DEV)
    last = None
    for t in range(T):
        op(qkvg[t], fab[t, :, :K], fab[t, :, K:], ssm, conv, slots, wg.conv_w, wg.fb_w, wg.dt_bias, wg.a_log,
           wg.norm_w, out)
        if t == T - 1:
            last = out.clone()
    sync()
    ref_out, ref_s, ref_w, _ = kda_token_loop(qkvg.transpose(0, 1), fab[..., :K].transpose(0, 1),
                                              fab[..., K:].transpose(0, 1), s0.to(DEV), c0.to(DEV), wg,
                                              dtype=torch.float64)
    err = rel_rms(ssm[2], ref_s[0])
    assert err <= 1e-4, err
    assert torch.equal(conv[2].cpu(), ref_w[0].to(torch.bfloat16).cpu())
    assert_out_close(last[0], ref_out[0, -1].float())


STREAM_CASES = [  # (H, B, gate, ssm, padded rows): several items per CTA, ranges crossing heads
    (12, 64, GateKind.BOUNDED, SsmDtype.FP32, (0, 63)),
    (12, 130, GateKind.BOUNDED, SsmDtype.FP32, (5, 129)),  # ~6 items per CTA at 2 CTAs per SM
    (12, 50, GateKind.SOFTPLUS, SsmDtype.BF16, (7,)),
    (96, 4, GateKind.BOUNDED, SsmDtype.BF16, (2,)),   # short head runs: f_b reloaded every 4 items
    (12, 1, GateKind.SOFTPLUS, SsmDtype.FP32, ()),    # every item a new head
    (12, 3, GateKind.BOUNDED, SsmDtype.BF16, (1,)),
    (96, 5, GateKind.BOUNDED, SsmDtype.FP32, ()),
    (6, 4, GateKind.BOUNDED, SsmDtype.FP32, (3,)),    # fewer items than SMs: one item per CTA
    (24, 45, GateKind.BOUNDED, SsmDtype.BF16, (44,)),
]


@pytest.mark.parametrize("H,B,gate,ssm,padded", STREAM_CASES,
                         ids=[f"H{c[0]}-B{c[1]}-{c[2].value}-{c[3].value}" for c in STREAM_CASES])
def test_stream_schedule_matches_reference(H, B, gate, ssm, padded):
    check_case(Case(H, B, ssm, seed=H * 7 + B, padded=padded), gate, schedule="stream")


@pytest.mark.parametrize("ssm", list(SsmDtype))
def test_stream_equals_rows_bitwise(ssm):
    """Both schedules do the same arithmetic per item: same output, state and windows, bit for bit."""
    case = Case(24, 30, ssm, seed=9, padded=(4,))
    got = []
    for schedule in ("rows", "stream"):
        t = check_case(case, GateKind.BOUNDED, split=1 if schedule == "rows" else None, schedule=schedule)
        got.append((t["out"].cpu(), t["ssm"].cpu(), t["conv"].cpu()))
    assert all(torch.equal(a, b) for a, b in zip(*got))


def test_stream_bad_input_is_typed():
    from k3gen.errors import SpecError
    op = op_for(12, GateKind.BOUNDED, SsmDtype.FP32)
    t = Case(12, 8, SsmDtype.FP32, seed=2).gpu()
    with pytest.raises(SpecError):
        run(op, dict(t, qkvg=t["qkvg"][:, 1:]), schedule="stream")   # 2-byte aligned rows
    with pytest.raises(SpecError):
        run(op, t, split=2, schedule="stream")
    with pytest.raises(SpecError):
        run(op, t, schedule="columns")


def test_launch_does_not_reload():
    """Launches reuse the loaded entries: nothing is loaded or read back per launch."""
    op = op_for(12, GateKind.BOUNDED, SsmDtype.FP32)
    t = Case(12, 8, SsmDtype.FP32, seed=6).gpu()
    run(op, t, schedule="stream")
    kernel, stream = op._kernel, op._stream
    run(op, t)
    run(op, t, schedule="stream")
    assert op._kernel is kernel and op._stream is stream


@pytest.mark.parametrize("B,sched", [(2, None), (40, None), (64, "stream")], ids=["cluster", "single", "stream"])
def test_cuda_graph_replay_equals_eager(B, sched):
    H = 12
    op = op_for(H, GateKind.BOUNDED, SsmDtype.FP32)
    base = Case(H, B, SsmDtype.FP32, seed=21)
    t = base.gpu()
    run(op, t, schedule=sched)  # loads the module before capture
    sync()
    graph = capture(lambda: run(op, t, schedule=sched))
    for step in range(3):
        fresh = Case(H, B, SsmDtype.FP32, seed=100 + step, padded=(step % B,) if step else ())
        src = fresh.gpu()
        for name in ("qkvg", "ssm", "conv", "slots"):
            t[name].copy_(src[name])
        t["fa"].copy_(src["fa"]), t["beta_logit"].copy_(src["beta_logit"])
        t["out"].fill_(float("nan"))
        graph.replay()
        sync()
        g_out, g_ssm, g_conv = t["out"].clone(), t["ssm"].clone(), t["conv"].clone()
        t["ssm"].copy_(src["ssm"]), t["conv"].copy_(src["conv"]), t["out"].fill_(float("nan"))
        run(op, t, schedule=sched)
        sync()
        assert torch.equal(g_out, t["out"]) and torch.equal(g_ssm, t["ssm"]) and torch.equal(g_conv, t["conv"])
        assert torch.isfinite(g_out.float()).all()


@pytest.mark.parametrize("B,ssm,schedule", [(1, SsmDtype.FP32, None), (2, SsmDtype.FP32, None),
                                             (40, SsmDtype.FP32, None), (3, SsmDtype.FP32, "stream"),
                                             (40, SsmDtype.BF16, "stream")])
def test_pdl_chain_equals_plain_launches(B, ssm, schedule):
    """Four dependent steps on one state pool (each reads the state, windows and slots the previous
    step wrote), launched with programmatic dependent launch inside a CUDA graph, equal the same
    four steps launched plainly and eagerly, for both schedules: the prologue before
    griddepcontrol.wait reads weights only and its L2 prefetches (from racing slot reads) cannot
    change what the loads after the wait see."""
    H, steps = 12, 4
    op = op_for(H, GateKind.BOUNDED, ssm)
    t = Case(H, B, ssm, seed=41 + B).gpu()
    ssm0, conv0 = t["ssm"].clone(), t["conv"].clone()
    outs = [torch.full_like(t["out"], float("nan")) for _ in range(steps)]

    def chain(pdl):
        for o in outs:
            op(t["qkvg"], t["fa"], t["beta_logit"], t["ssm"], t["conv"], t["slots"], t["conv_w"], t["fb_w"],
               t["dt_bias"], t["a_log"], t["norm_w"], o, pdl=pdl, schedule=schedule)

    chain(False)
    sync()
    want = [o.clone() for o in outs] + [t["ssm"].clone(), t["conv"].clone()]
    t["ssm"].copy_(ssm0), t["conv"].copy_(conv0)
    for o in outs:
        o.fill_(float("nan"))
    graph = capture(lambda: chain(True))
    graph.replay()
    sync()
    got = outs + [t["ssm"], t["conv"]]
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert not torch.equal(want[0], want[1])   # the steps really differ (state carried between them)


@pytest.mark.parametrize("B,ssm,split", [(1, SsmDtype.FP32, 8), (40, SsmDtype.FP32, 1), (40, SsmDtype.BF16, 2)])
def test_l2_warming_changes_no_bits(B, ssm, split):
    """The row kernel with every L2 warming on (before the PDL wait, and one wave ahead: at B = 40
    CTAs 0..215 warm CTAs 264..479) gives the bits of the kernel with none, from the same inputs."""
    H = 12
    op = op_for(H, GateKind.BOUNDED, ssm)
    c = Case(H, B, ssm, seed=61 + B, padded=(B // 2,) if B > 1 else ())
    got = []
    for warm in (False, True):
        t = c.gpu()
        t["out"].fill_(float("nan"))
        op(t["qkvg"], t["fa"], t["beta_logit"], t["ssm"], t["conv"], t["slots"], t["conv_w"], t["fb_w"],
           t["dt_bias"], t["a_log"], t["norm_w"], t["out"], split=split, schedule="rows", warm=warm, ahead=warm)
        sync()
        got.append((t["out"].clone(), t["ssm"].clone(), t["conv"].clone()))
    assert all(torch.equal(a, b) for a, b in zip(*got))
    live = c.slots >= 0
    assert torch.equal(got[1][0].cpu()[~live], torch.zeros_like(got[1][0].cpu()[~live]))
    assert_out_close(got[1][0][live.to(DEV)], c.reference(GateKind.BOUNDED)[0][live])


@pytest.mark.parametrize("B,ssm", [(2, SsmDtype.FP32), (33, SsmDtype.BF16)])
def test_twenty_runs_bitwise_identical(B, ssm):
    op = op_for(12, GateKind.BOUNDED, ssm)
    t = Case(12, B, ssm, seed=31).gpu()
    ssm0, conv0 = t["ssm"].clone(), t["conv"].clone()
    first = None
    for _ in range(20):
        t["ssm"].copy_(ssm0), t["conv"].copy_(conv0), t["out"].fill_(float("nan"))
        run(op, t)
        sync()
        now = (t["out"].clone(), t["ssm"].clone(), t["conv"].clone())
        if first is None:
            first = now
        assert all(torch.equal(a, b) for a, b in zip(first, now))


@pytest.mark.parametrize("split", [1, 4])
def test_sanitize_reduced_matrix(split):
    """Small enough to run under compute-sanitizer memcheck (tools/h200.sh selects `sanitize`)."""
    check_case(Case(12, 3, SsmDtype.BF16, seed=3, padded=(1,)), GateKind.BOUNDED, split=split)
    check_case(Case(6, 2, SsmDtype.FP32, seed=4), GateKind.BOUNDED, split=split)


def test_sanitize_stream_schedule():
    check_case(Case(12, 4, SsmDtype.BF16, seed=13, padded=(1,)), GateKind.BOUNDED, schedule="stream")
    check_case(Case(96, 5, SsmDtype.FP32, seed=14, padded=(0,)), GateKind.BOUNDED, schedule="stream")
