"""kda_prefill on sm90 (chunk64: 64-token WY chunks on BF16 tensor cores, the only algo since the
16-token 3xTF32 forms were deleted) vs the token-loop reference (FP32, and FP64 for long prompts):
outputs and final states within tests/numerics.py's KDA_CHUNK64_OUT / KDA_CHUNK64_STATE, the
8192-token prompt (drift) included; windows and untouched slots bitwise.
"""
from __future__ import annotations

import functools

import pytest
import torch

from k3gen.ir.dtypes import GateKind, SsmDtype
from k3gen.ops.kda_prefill.spec import KdaPrefillSpec, PrefillAlgo
from k3gen.ops.kda_prefill.variants import VARIANTS
from k3gen.ops.kda_decode.reference import random_weights
from k3gen.ops.kda_prefill.reference import kda_prefill as ref_prefill
from k3gen.runtime.graphs import capture
from k3gen.targets import get_target
from numerics import KDA_CHUNK64_OUT, KDA_CHUNK64_STATE, assert_close, rel_rms

pytestmark = pytest.mark.gpu
K = 128
DEV = "cuda"
TORCH_SSM = {SsmDtype.FP32: torch.float32, SsmDtype.BF16: torch.bfloat16}
LENGTHS = [1, 15, 16, 17, 63, 64, 65, 1000, 4096]
# The algos this GPU (sm90) can run: chunk64_tc needs tcgen05 (compile-only, tests/nogpu).
ALGOS = [PrefillAlgo(n) for n in VARIANTS.names() if n != PrefillAlgo.CHUNK64_TC.value]
C64 = PrefillAlgo.CHUNK64


def chunk_of(algo) -> int:
    """Tokens per chunk, from each sequence's start."""
    return 64


@functools.lru_cache(maxsize=None)
def op_for(heads, ssm=SsmDtype.FP32, gate=GateKind.BOUNDED, algo=C64):
    from k3gen.ops.kda_prefill.launcher import KdaPrefill
    return KdaPrefill(KdaPrefillSpec(target=get_target("sm90"), heads=heads, ssm=ssm, gate=gate, algo=algo)).load()


def assert_out_close(got, ref, algo=C64):
    got, ref = got.float().cpu(), ref.float().cpu()
    assert got.shape == ref.shape
    if got.numel() == 0:  # an empty prompt has no outputs to compare
        return
    assert torch.isfinite(got).all(), "non-finite output"
    print(f"ERR {algo} out rel_rms {rel_rms(got, ref):.3e} max_abs/max {float((got - ref).abs().max() / ref.abs().max()):.3e}")
    assert_close(got, ref, KDA_CHUNK64_OUT, what="out")


class Batch:
    def __init__(self, H, lengths, ssm: SsmDtype, seed, *, padded=(), resume=None):
        g = torch.Generator().manual_seed(seed)
        D, B = H * K, len(lengths)
        S = 2 * B + 3
        self.H, self.lengths, self.sdt = H, lengths, TORCH_SSM[ssm]
        self.w = random_weights(H, generator=g)
        N = sum(lengths)
        self.qkvg = torch.randn(N, 4 * D + 16, generator=g).to(torch.bfloat16)
        self.fab = torch.randn(N, K + H + 3, generator=g).to(torch.bfloat16)
        self.cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
        self.ssm = (torch.randn(S, H, K, K, generator=g) * 0.05).to(self.sdt)
        self.conv = torch.randn(S, 3 * D, 3, generator=g).to(torch.bfloat16)
        self.slots = torch.randperm(S, generator=g)[:B].to(torch.int32)
        for i in padded:
            self.slots[i] = -1 - i
        self.resume = (torch.randint(0, 2, (B,), generator=g) if resume is None
                       else torch.full((B,), int(resume))).to(torch.int32)

    def gpu(self):
        fab, wg = self.fab.to(DEV), self.w.to(DEV)
        return dict(qkvg=self.qkvg.to(DEV), fa=fab[:, :K], beta_logit=fab[:, K:K + self.H], cu_seqlens=self.cu.to(DEV),
                    slots=self.slots.to(DEV), resume=self.resume.to(DEV), ssm=self.ssm.clone().to(DEV),
                    conv=self.conv.clone().to(DEV), conv_w=wg.conv_w, fb_w=wg.fb_w, dt_bias=wg.dt_bias,
                    a_log=wg.a_log, norm_w=wg.norm_w,
                    out=torch.full((self.qkvg.shape[0], self.H, K), float("nan"), dtype=torch.bfloat16, device=DEV))


def run(op, t):
    return op(t["qkvg"], t["fa"], t["beta_logit"], t["cu_seqlens"], t["slots"], t["resume"], t["ssm"], t["conv"],
              t["conv_w"], t["fb_w"], t["dt_bias"], t["a_log"], t["norm_w"], t["out"])


def check(batch: Batch, gate=GateKind.BOUNDED, algo=C64, op=None):
    ssm_e = SsmDtype.FP32 if batch.sdt == torch.float32 else SsmDtype.BF16
    t = batch.gpu()
    op = op or op_for(batch.H, ssm_e, gate, algo)
    algo = op.spec.algo
    run(op, t)
    torch.cuda.synchronize()
    long = max(batch.lengths) > 65
    ref_dt = torch.float64 if long else torch.float32
    ssm32, conv = batch.ssm.to(DEV).to(ref_dt), batch.conv.clone().to(DEV)
    fab = batch.fab.to(DEV)
    out = ref_prefill(batch.qkvg.to(DEV), fab[:, :K], fab[:, K:K + batch.H], batch.cu, batch.slots, batch.resume,
                      ssm32, conv, batch.w.to(DEV), gate=gate, dtype=ref_dt)
    live = [i for i, s in enumerate(batch.slots.tolist()) if s >= 0]
    for i, L in enumerate(batch.lengths):
        lo, hi = int(batch.cu[i]), int(batch.cu[i + 1])
        if i in live:
            assert_out_close(t["out"][lo:hi], out[lo:hi], algo)
        else:
            assert torch.equal(t["out"][lo:hi].cpu(), torch.zeros(hi - lo, batch.H, K, dtype=torch.bfloat16))
    idx = batch.slots[live].long()
    untouched = torch.ones(batch.ssm.shape[0], dtype=torch.bool)
    untouched[idx] = False
    assert torch.equal(t["ssm"].cpu()[untouched], batch.ssm[untouched]), "a slot outside `slots` changed"
    assert torch.equal(t["conv"].cpu()[untouched], batch.conv[untouched])
    assert torch.equal(t["conv"].cpu()[idx], conv.cpu()[idx]), "conv window"
    got, ref = t["ssm"].cpu()[idx].float(), ssm32.cpu()[idx].float()
    assert torch.isfinite(got).all()
    print(f"ERR {algo} state {batch.sdt} rel_rms {rel_rms(got, ref):.3e}")
    assert rel_rms(got, ref) <= KDA_CHUNK64_STATE.rel_rms, rel_rms(got, ref)
    return t


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("ssm", list(SsmDtype))
def test_done_when_lengths_one_varlen_batch(ssm, algo):
    """Issue 30's length matrix in one varlen batch, an 8192-token prompt included (the drift test:
    against the FP64 loop)."""
    check(Batch(12, LENGTHS + [8192], ssm, seed=1), algo=algo)


@pytest.mark.parametrize("ssm", list(SsmDtype))
def test_chunk64_state_warps_bitwise(ssm):
    """The state pass at 2, 4 and 8 warps per CTA (the launcher picks by occupancy): every warp
    computes its 16 state rows the same way whatever the CTA shape, so all three are bitwise equal."""
    from k3gen.ops.kda_prefill.launcher import KdaPrefill
    batch = Batch(12, [1, 64, 65, 300, 17], ssm, seed=31, padded=(4,))
    res = []
    for w in (2, 4, 8):
        op = KdaPrefill(KdaPrefillSpec(target=get_target("sm90"), heads=12, ssm=ssm, algo=C64)).load()
        op.state_warps = w
        res.append(check(batch, op=op))
    for r in res[1:]:
        assert all(torch.equal(r[n], res[0][n]) for n in ("out", "ssm", "conv"))


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("H,ssm,gate", [(6, SsmDtype.FP32, GateKind.BOUNDED), (12, SsmDtype.BF16, GateKind.BOUNDED),
                                        (12, SsmDtype.FP32, GateKind.SOFTPLUS), (96, SsmDtype.FP32, GateKind.BOUNDED)])
def test_short_prompts_resume_and_padding(H, ssm, gate, algo):
    check(Batch(H, [3, 0, 17, 5, 64, 2, 33], ssm, seed=H + 7, padded=(3,)), gate, algo)


def _pieces(op, one: Batch, t1, cuts):
    """The prompt of `one` (one sequence) as continuation calls ending at each cut, from a copy of
    t1's inputs; returns (outputs, last call's tensors)."""
    H, L = one.H, one.lengths[0]
    parts, t = [], one.gpu()
    bounds = [0, *cuts, L]
    for lo, hi in zip(bounds, bounds[1:]):
        res = int(lo > 0)
        t["qkvg"], t["fa"], t["beta_logit"] = (x[lo:hi] for x in (t1["qkvg"], t1["fa"], t1["beta_logit"]))
        t["cu_seqlens"] = torch.tensor([0, hi - lo], dtype=torch.int32, device=DEV)
        t["resume"] = torch.tensor([res], dtype=torch.int32, device=DEV)
        t["out"] = torch.full((hi - lo, H, K), float("nan"), dtype=torch.bfloat16, device=DEV)
        run(op, t)
        parts.append(t["out"])
    torch.cuda.synchronize()
    return torch.cat(parts), t


def _assert_pieces_equal(algo, cuts, out, t, t1):
    """Bitwise when every cut falls on a chunk boundary (the same chunks, the FP32 state
    round-trips exactly); otherwise the chunks differ and the runs agree within chunk64's stated
    bounds."""
    assert torch.equal(t["conv"], t1["conv"])
    if all(c % chunk_of(algo) == 0 for c in cuts):
        assert torch.equal(out, t1["out"]), "same chunks: outputs bitwise"
        assert torch.equal(t["ssm"], t1["ssm"])
    else:
        assert_out_close(out, t1["out"].float(), algo)
        assert rel_rms(t["ssm"], t1["ssm"]) <= KDA_CHUNK64_STATE.rel_rms, rel_rms(t["ssm"], t1["ssm"])


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("split", [1, 16, 17, 64, 500, 512])
def test_split_in_two_equals_one_call(split, algo):
    """A prompt in two continuation calls equals one call (_assert_pieces_equal), and both match
    the reference (test_done_when_...)."""
    H, L = 12, 1000
    op = op_for(H, algo=algo)
    one = Batch(H, [L], SsmDtype.FP32, seed=5, resume=False)
    t1 = one.gpu()
    run(op, t1)
    out, t = _pieces(op, one, t1, [split])
    _assert_pieces_equal(algo, [split], out, t, t1)


@pytest.mark.parametrize("cuts", [[64, 128, 320, 640, 704, 960], [1, 17, 100, 333, 640, 641]])
def test_chunk64_seven_pieces_equal_one_call(cuts):
    """chunk64 over 1000 tokens in 7 continuation calls: bitwise on chunk boundaries, else within bound."""
    op = op_for(12)
    one = Batch(12, [1000], SsmDtype.FP32, seed=9, resume=False)
    t1 = one.gpu()
    run(op, t1)
    out, t = _pieces(op, one, t1, cuts)
    _assert_pieces_equal(C64, cuts, out, t, t1)


@pytest.mark.parametrize("algo", ALGOS)
def test_cuda_graph_replay_equals_eager(algo):
    H = 12
    op = op_for(H, algo=algo)
    base = Batch(H, [5, 40, 1, 9], SsmDtype.FP32, seed=21)
    t = base.gpu()
    run(op, t)
    torch.cuda.synchronize()
    graph = capture(lambda: run(op, t))
    for step in range(2):
        src = Batch(H, [9, 30, 6, 10], SsmDtype.FP32, seed=50 + step, padded=(step,)).gpu()  # same N = 55
        for name in ("qkvg", "fa", "beta_logit", "cu_seqlens", "slots", "resume", "ssm", "conv"):
            t[name].copy_(src[name])
        t["out"].fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        res = [t[n].clone() for n in ("out", "ssm", "conv")]
        t["ssm"].copy_(src["ssm"]), t["conv"].copy_(src["conv"]), t["out"].fill_(float("nan"))
        run(op, t)
        torch.cuda.synchronize()
        assert all(torch.equal(a, t[n]) for a, n in zip(res, ("out", "ssm", "conv")))


@pytest.mark.parametrize("algo", ALGOS)
def test_sanitize_reduced_matrix(algo):
    """Small enough for compute-sanitizer memcheck (tools/h200.sh selects `sanitize`)."""
    check(Batch(6, [1, 5, 0, 9, 21], SsmDtype.BF16, seed=3, padded=(1,)), algo=algo)
