"""Lossless speculative decoding on the GPU (SPEC.md section 3, issue 27): verify + commit == serial
decode, bit for bit.

- kda_decode gives the same bits at every cluster split and in the stream schedule (so "serial
  decode" is one thing whatever batch it runs in: the split is chosen by the batch size);
- op level: the kda_verify kernel (every schedule) + commit over every accepted pattern, including
  100 steps with every draft rejected and then every draft accepted, leaves exactly the state and
  window, and gives exactly the outputs, of the kda_decode kernel run token by token, for FP32 and
  BF16 SSM storage;
- model level (the K3 small preset on the kernel path, as tests/gpu/test_model_small.py builds it):
  speculative decoding with an oracle drafter forced to reject (100 steps) and then to accept gives
  plain greedy's tokens and logits bit for bit over >= 300 tokens, several seeds, for NVFP4 KV +
  BF16 SSM and BF16 KV + FP32 SSM. Two non-KDA parts of the step are not row-invariant yet and are
  replaced in that test by row-invariant equivalents (documented at `row_invariant_model`); the
  real BF16-KV attention path runs as its own expected failure.
"""
from __future__ import annotations

import functools

import pytest
import torch

from k3gen.ir.dtypes import SsmDtype
from k3gen.ops.kda_decode.reference import random_weights
from k3gen.ops.kda_decode.spec import KdaDecodeSpec
from k3gen.ops.kda_verify.reference import commit, start_of
from k3gen.ops.kda_verify.spec import KdaVerifySpec
from k3gen.ops.kda_verify.variants import PERSISTENT_MAX_DRAFTS
from k3gen.targets import get_target
from model.config import TargetConfig, small_config

pytestmark = pytest.mark.gpu
K = 128
DEV = "cuda"
TORCH_SSM = {SsmDtype.FP32: torch.float32, SsmDtype.BF16: torch.bfloat16}


@functools.lru_cache(maxsize=None)
def verify_op(heads, drafts, ssm):
    from k3gen.ops.kda_verify.launcher import KdaVerify
    return KdaVerify(KdaVerifySpec(target=get_target("sm90"), heads=heads, drafts=drafts, ssm=ssm)).load()


@functools.lru_cache(maxsize=None)
def decode_op(heads, ssm):
    from k3gen.ops.kda_decode.launcher import KdaDecode
    return KdaDecode(KdaDecodeSpec(target=get_target("sm90"), heads=heads, ssm=ssm)).load()


def weights_on_device(H, g):
    w = random_weights(H, generator=g).to(DEV)
    return w, (w.conv_w, w.fb_w, w.dt_bias, w.a_log, w.norm_w)


# -- kda_decode: one set of bits per token -----------------------------------------------------------
@pytest.mark.parametrize("ssm", list(SsmDtype))
@pytest.mark.parametrize("B", [1, 5, 40])
def test_decode_bits_independent_of_split_and_schedule(ssm, B):
    """Five chained steps at every split (1, 2, 4, 8) and in the stream schedule: outputs, states and
    windows bit for bit equal (the RMSNorm sum is kda/token_math.cuh's at every split)."""
    H = 12
    D, S = H * K, B + 2
    g = torch.Generator().manual_seed(300 + B)
    _, wargs = weights_on_device(H, g)
    op = decode_op(H, ssm)
    ssm0 = (torch.randn(S, H, K, K, generator=g) * 0.05).to(TORCH_SSM[ssm]).to(DEV)
    conv0 = torch.randn(S, 3 * D, 3, generator=g).to(torch.bfloat16).to(DEV)
    slots = torch.randperm(S, generator=g)[:B].to(torch.int32).to(DEV)
    steps = [(torch.randn(B, 4 * D, generator=g).to(torch.bfloat16).to(DEV),
              torch.randn(B, K + H, generator=g).to(torch.bfloat16).to(DEV)) for _ in range(5)]
    results = {}
    for mode in [("rows", 1), ("rows", 2), ("rows", 4), ("rows", 8), ("stream", None)]:
        st, cv = ssm0.clone(), conv0.clone()
        outs = []
        for qkvg, fab in steps:
            out = torch.full((B, H, K), float("nan"), dtype=torch.bfloat16, device=DEV)
            op(qkvg, fab[:, :K], fab[:, K:], st, cv, slots, *wargs, out, schedule=mode[0], split=mode[1])
            outs.append(out)
        torch.cuda.synchronize()
        results[mode] = (torch.stack(outs), st, cv)
    base = results[("rows", 1)]
    assert torch.isfinite(base[0].float()).all()
    for mode, got in results.items():
        for name, a, b in zip(("out", "ssm", "conv"), got, base):
            assert torch.equal(a, b), f"{mode}: {name} differs from split 1"


# -- op level: verify + commit == serial decode ------------------------------------------------------
class KernelTwin:
    """Verify pools and the decode pools of the same sequences on the GPU (tests/nogpu/ops/
    test_kda_verify_lossless.py's Twin with the kernels): serial decode runs in lockstep at the
    verify step's batch size, a row whose accepted tokens are used up continuing on a scratch copy."""

    def __init__(self, H, M, B, ssm, g):
        D, S = H * K, B + 3
        self.H, self.M, self.B, self.T, self.ssm = H, M, B, 1 + M, ssm
        self.w, self.wargs = weights_on_device(H, g)
        dt = TORCH_SSM[ssm]
        self.slots = torch.randperm(S, generator=g)[:B].to(torch.int32)
        self.ssm_p = (torch.randn(S, H, K, K, generator=g) * 0.05).to(dt).to(DEV)
        self.rec = torch.randn(S, M, H, K, K, generator=g).to(DEV)     # never read: nothing pending
        conv = torch.randn(S, 3 * D, 3, generator=g).to(torch.bfloat16).to(DEV)
        self.conv_ext = torch.randn(S, 3 * D, 3 + M, generator=g).to(DEV)
        self.conv_ext[..., :3] = conv.float()
        self.pending = torch.zeros(S, dtype=torch.int32, device=DEV)
        self.dec_ssm = torch.cat([self.ssm_p.clone(), torch.zeros(B, H, K, K, dtype=dt, device=DEV)])
        self.dec_conv = torch.cat([conv.clone(), torch.zeros(B, 3 * D, 3, dtype=torch.bfloat16, device=DEV)])
        self.scratch = torch.arange(S, S + B, dtype=torch.int32)
        self.untouched = [s for s in range(S) if s not in self.slots.tolist()]
        self.before = [t.clone() for t in (self.ssm_p, self.rec, self.conv_ext)]
        self.vop, self.dop = verify_op(H, M, ssm), decode_op(H, ssm)

    def step(self, accepted_drafts, g, schedule):
        B, T, H, D = self.B, self.T, self.H, self.H * K
        qkvg = torch.randn(B * T, 4 * D, generator=g).to(torch.bfloat16).to(DEV)
        fab = torch.randn(B * T, K + H, generator=g).to(torch.bfloat16).to(DEV)
        out = torch.full((B, T, H, K), float("nan"), dtype=torch.bfloat16, device=DEV)
        slots = self.slots.to(DEV)
        self.vop(qkvg, fab[:, :K], fab[:, K:], self.ssm_p, self.rec, self.conv_ext, self.pending, slots,
                 *self.wargs, out, schedule=schedule)
        acc = torch.as_tensor(accepted_drafts)
        commit(self.pending, slots, (acc + 1).to(DEV))
        for t in range(int(acc.max()) + 1):
            use = torch.where(acc >= t, self.slots, self.scratch)
            for i in range(B):
                if acc[i] < t:
                    s, sc = int(self.slots[i]), int(self.scratch[i])
                    self.dec_ssm[sc] = self.dec_ssm[s]
                    self.dec_conv[sc] = self.dec_conv[s]
            rows = (torch.arange(B) * T + t).to(DEV)
            y = torch.full((B, H, K), float("nan"), dtype=torch.bfloat16, device=DEV)
            self.dop(qkvg[rows], fab[rows, :K], fab[rows, K:], self.dec_ssm, self.dec_conv, use.to(DEV),
                     *self.wargs, y)
            for i in range(B):
                if acc[i] >= t:
                    assert torch.equal(out[i, t], y[i]), f"row {i} token {t}: verify output != decode output"
        torch.cuda.synchronize()
        state, window = start_of(self.ssm_p, self.rec, self.conv_ext, self.pending, slots.long())
        for i in range(B):
            s = int(self.slots[i])
            assert int(self.pending[s]) == int(acc[i]), "commit sets pending = accepted drafts"
            assert torch.equal(state[i], self.dec_ssm[s].float()), f"row {i}: committed state != serial decode"
            assert torch.equal(window[i], self.dec_conv[s].float()), f"row {i}: committed window"
        for now, old in zip((self.ssm_p, self.rec, self.conv_ext), self.before):
            assert torch.equal(now[self.untouched], old[self.untouched]), "a slot outside `slots` changed"


SCHED_CASES = [(1, "rows"), (1, "split"), (3, "rows"), (3, "prefetch"), (3, "split"), (7, "rows")]


@pytest.mark.parametrize("ssm", list(SsmDtype))
@pytest.mark.parametrize("M,schedule", SCHED_CASES, ids=[f"M{m}-{s}" for m, s in SCHED_CASES])
def test_kda_verify_commit_equals_serial_decode_kernel(M, schedule, ssm):
    """Row b accepts (b + r) % (M + 1) drafts in round r: every count 0..M every round and every
    (pending, accepted) pair over M + 2 rounds; outputs, committed states and windows bitwise."""
    assert schedule == "rows" or M <= PERSISTENT_MAX_DRAFTS
    g = torch.Generator().manual_seed(40 + 2 * M + (ssm is SsmDtype.BF16))
    B = M + 1
    tw = KernelTwin(12, M, B, ssm, g)
    for r in range(M + 2):
        tw.step([(i + r) % (M + 1) for i in range(B)], g, schedule)


@pytest.mark.parametrize("ssm", list(SsmDtype))
@pytest.mark.parametrize("schedule", ["rows", "prefetch", "split"])
def test_hundred_rejections_then_all_accepted_kernel(schedule, ssm):
    """The H200 failure's pattern (issue 27): 100 verify steps with every draft rejected, then 30
    with every draft accepted; a second row cycles through every count so pending is mixed."""
    g = torch.Generator().manual_seed(77 + (ssm is SsmDtype.BF16))
    M = 3
    tw = KernelTwin(12, M, 2, ssm, g)
    for r in range(130):
        tw.step([0 if r < 100 else M, r % (M + 1)], g, schedule)


# -- model level ---------------------------------------------------------------------------------------
CFG = small_config()
DRAFTS = 3
NEW_TOKENS = 320
COMBOS = [("nvfp4", "bf16"), ("bf16", "fp32")]


@functools.lru_cache(maxsize=1)
def small_weights():
    """The small preset's random checkpoint, as tests/gpu/test_model_small.py writes it (seed 11)."""
    from helpers import random_checkpoint_dir
    from model.weights import load_weights
    return load_weights(random_checkpoint_dir(CFG, 11), CFG).to(DEV)


def make_generator(kv, ssm, slots=4, invariant=False):
    from model.cache import HybridCache
    from model.generate import Generator
    from model.model import K3Model
    t = TargetConfig(kv=kv, ssm=ssm, max_drafts=DRAFTS, path="kernel", invariant=invariant)
    cache = HybridCache(CFG, t, num_slots=slots, num_pages=slots * 12, max_seq_len=24 + NEW_TOKENS + 32, device=DEV)
    m = K3Model(small_weights(), t, cache)
    return m, Generator(m)


def row_invariant_model(monkeypatch, per_token_attention: bool):
    """The two parts of the model step that still depend on the row count, replaced by row-invariant
    equivalents so that a difference left is the speculative path's own:
    - model/model.py K3Model._logits: the LM head is an FP32 torch GEMM over B*T rows (verify) or B
      rows (decode), and cuBLAS picks its FP32 reduction order by the row count (model/layers.py's
      note on the FFN stand-ins): here FP64 products rounded to FP32 (layers._mm), as those do;
    - with `per_token_attention`, model/ops.py KernelOps.mla_attention runs BF16/FP8-KV verify
      attention as one T = 1 mla_decode launch per query token, as it already does for NVFP4 KV (its
      single T = 1 + M launch reduces in another order than T = 1 decode: issue 27's MLA note).
    """
    import model.layers as L
    import model.model as MM
    import model.ops as O

    def logits(self, h):
        x = L.rms_norm(h, self.w.final_norm, self.cfg.eps)
        return L._mm(x.float(), self.w.lm_head.float().T)
    monkeypatch.setattr(MM.K3Model, "_logits", logits)
    if per_token_attention:
        real = O.KernelOps.mla_attention

        def per_token(self, layout, q, cache, block_table, start, ring_slot, scale):
            T = q.shape[1]
            if T == 1:
                return real(self, layout, q, cache, block_table, start, ring_slot, scale)
            return torch.cat([real(self, layout, q[:, t:t + 1], cache, block_table, start + t, ring_slot, scale)
                              for t in range(T)], dim=1)
        monkeypatch.setattr(O.KernelOps, "mla_attention", per_token)


def logit_rows(monkeypatch):
    """tests/helpers.py LogitSpy: the logits row of every emitted token, per request."""
    from helpers import LogitSpy
    return LogitSpy(monkeypatch)


def forced_drafter(greedy, prompts, M):
    """Proposes greedy's own continuation with a wrong first draft for the first 100 verify steps of
    each request (every draft rejected), then greedy's continuation right for 25 steps (all
    accepted), then the first wrong draft at a rotating position (every count 0..M)."""
    steps: dict[int, int] = {}

    def drafter(i, history, m):
        n = len(history) - len(prompts[i])
        k = steps.get(i, 0)
        steps[i] = k + 1
        d = (greedy[i].out[n:n + m] + [0] * m)[:m]
        wrong = 0 if k < 100 else (m if k < 125 else (k + i) % (m + 1))
        if wrong < m:
            d[wrong] = (d[wrong] + 1) % CFG.vocab
        return d
    return drafter


def run_spec_vs_greedy(kv, ssm, seed, monkeypatch, invariant=False):
    from model.generate import Request
    spy = logit_rows(monkeypatch)
    _, gen = make_generator(kv, ssm, invariant=invariant)
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, CFG.vocab, (24 - 3 * i,), generator=g).tolist() for i in range(3)]
    greedy = gen.generate([Request(p, NEW_TOKENS) for p in prompts])
    gen.accepted.clear()
    spec = gen.generate([Request(p, NEW_TOKENS) for p in prompts], speculative=True,
                        drafter=forced_drafter(greedy, prompts, DRAFTS))
    acc = list(gen.accepted)
    assert acc.count(0) >= 100 and acc.count(DRAFTS) >= 10 and set(range(DRAFTS + 1)) <= set(acc), \
        "the drafter must have been rejected and accepted as forced"
    for i, (a, b) in enumerate(zip(greedy, spec)):
        la, lb = spy.of(a), spy.of(b)
        assert len(a.out) == len(b.out) == NEW_TOKENS
        for t in range(NEW_TOKENS):
            if not torch.equal(la[t], lb[t]):
                d = (la[t] - lb[t]).abs().max()
                raise AssertionError(f"seed {seed} request {i} token {t}: logits differ (max {float(d):.3g}); "
                                     f"tokens {a.out[t]} vs {b.out[t]}")
        assert a.out == b.out, f"seed {seed} request {i}: tokens differ"


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("kv,ssm", COMBOS, ids=lambda x: x)
def test_model_speculative_bitwise_equals_greedy(kv, ssm, seed, monkeypatch):
    """>= 300 tokens per request, three requests per seed, drafter forced to reject then accept:
    tokens and the logits of every emitted position bit for bit plain greedy's, with the LM head
    (and BF16-KV verify attention) row-invariant as `row_invariant_model` describes. NVFP4 KV +
    BF16 SSM is the H200 failure of issue 27 (token 113)."""
    row_invariant_model(monkeypatch, per_token_attention=kv != "nvfp4")
    run_spec_vs_greedy(kv, ssm, seed, monkeypatch)


@pytest.mark.parametrize("kv,ssm", [(kv, ssm) for kv in ("bf16", "fp8", "nvfp4") for ssm in ("fp32", "bf16")],
                         ids=lambda x: x)
def test_model_speculative_bitwise_equals_greedy_invariant_mode(kv, ssm, monkeypatch):
    """The same for every KV x SSM combination, on the model as served with TargetConfig.invariant and
    nothing replaced: the LM head in fixed row blocks (model.lm_head), verify attention per query
    token for every KV dtype."""
    run_spec_vs_greedy(kv, ssm, 1, monkeypatch, invariant=True)


@pytest.mark.xfail(strict=False, reason=(
    "MLA, not KDA: with BF16 KV, KernelOps.mla_attention (model/ops.py) runs verify attention as one "
    "mla_decode launch with T = 1 + M and lengths = start + T for every query token. Each CTA takes "
    "KV tiles [split * per, +per) with ntiles = ceil(length / 64), per = ceil(ntiles / splits) "
    "(include/k3gen/mla/decode_wg_qm.cuh:236-239; decode.cuh:213-216, decode_tc.cuh:371 alike), so "
    "when a 64-token tile boundary lies between start + t + 1 (what the T = 1 decode of query t uses) "
    "and start + T, the split boundaries move and the partials combine in another order. Not strict: "
    "a run that never meets such a step passes. The KDA side is exact: "
    "test_kda_verify_commit_equals_serial_decode_kernel, tests/nogpu/ops/test_kda_verify_lossless.py"))
def test_model_speculative_bitwise_bf16_kv_multi_token_attention(monkeypatch):
    row_invariant_model(monkeypatch, per_token_attention=False)
    run_spec_vs_greedy("bf16", "fp32", 1, monkeypatch)
