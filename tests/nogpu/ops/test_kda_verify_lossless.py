"""Lossless speculative decoding at the reference level (SPEC.md section 3): kda_verify + commit
over any accepted pattern leaves exactly the state, window and outputs of kda_decode run token by
token, bit for bit, for FP32 and BF16 SSM storage.

"Serial decode" here runs at the verify step's batch size: a row whose accepted tokens are used up
keeps running on a scratch copy of its slot (results thrown away), so every decode call has the
verify call's N rows and the f_b GEMM (whose CPU rounding depends on the row count) sees the same
shape. That is what a batch does in plain greedy decoding, where every live row takes a token.
"""
from __future__ import annotations

import pytest
import torch

from k3gen.ops.kda_decode.reference import kda_decode, random_weights
from k3gen.ops.kda_verify.reference import commit, kda_verify, start_of

K = 128


class Twin:
    """Verify pools and the decode pools of the same sequences, with one scratch slot per row."""

    def __init__(self, H, M, B, ssm_dtype, g):
        D = H * K
        S = B + 3   # slots of the verify chain: B used (permuted), 3 never touched
        self.H, self.M, self.B, self.T = H, M, B, 1 + M
        self.slots = torch.randperm(S, generator=g)[:B].to(torch.int32)
        self.ssm = (torch.randn(S, H, K, K, generator=g) * 0.05).to(ssm_dtype)
        self.rec = torch.randn(S, M, H, K, K, generator=g)   # never read: nothing pending yet
        conv = torch.randn(S, 3 * D, 3, generator=g).to(torch.bfloat16)
        self.conv_ext = torch.randn(S, 3 * D, 3 + M, generator=g)
        self.conv_ext[..., :3] = conv.float()
        self.pending = torch.zeros(S, dtype=torch.int32)
        # decode pools: slots 0..S-1 mirror the verify slots, S + b is row b's scratch slot
        self.dec_ssm = torch.cat([self.ssm.clone(), torch.zeros(B, H, K, K, dtype=ssm_dtype)])
        self.dec_conv = torch.cat([conv.clone(), torch.zeros(B, 3 * D, 3, dtype=torch.bfloat16)])
        self.scratch = torch.arange(S, S + B, dtype=torch.int32)
        self.untouched = [s for s in range(S) if s not in self.slots.tolist()]
        self.before = (self.ssm.clone(), self.rec.clone(), self.conv_ext.clone())

    def tokens(self, g):
        D = self.H * K
        qkvg = torch.randn(self.B * self.T, 4 * D + 8, generator=g).to(torch.bfloat16)
        fab = torch.randn(self.B * self.T, K + self.H, generator=g).to(torch.bfloat16)
        return qkvg, fab[:, :K], fab[:, K:]

    def step(self, w, accepted_drafts, g):
        """One verify step + commit, and the serial decode of the accepted tokens; compares them."""
        B, T = self.B, self.T
        qkvg, fa, b = self.tokens(g)
        out = torch.full((B, T, self.H, K), float("nan"), dtype=torch.bfloat16)
        kda_verify(qkvg, fa, b, self.ssm, self.rec, self.conv_ext, self.pending, self.slots, w, out)
        acc = torch.as_tensor(accepted_drafts)
        commit(self.pending, self.slots, acc + 1)
        # serial decode: step t feeds every row its token t, rows past their last accepted token
        # on their scratch slot (a copy of the real one), so each call has B live rows
        for t in range(int(acc.max()) + 1):
            use = torch.where(acc >= t, self.slots, self.scratch)
            for i in range(B):
                if acc[i] < t:
                    s = int(self.slots[i])
                    self.dec_ssm[int(self.scratch[i])] = self.dec_ssm[s]
                    self.dec_conv[int(self.scratch[i])] = self.dec_conv[s]
            rows = torch.arange(B) * T + t
            y = kda_decode(qkvg[rows], fa[rows], b[rows], self.dec_ssm, self.dec_conv, use, w)
            for i in range(B):
                if acc[i] >= t:
                    assert torch.equal(out[i, t], y[i]), f"row {i} token {t}: verify output != decode output"
        idx = self.slots.long()
        state, window = start_of(self.ssm, self.rec, self.conv_ext, self.pending, idx)
        for i in range(B):
            s = int(self.slots[i])
            assert int(self.pending[s]) == int(acc[i])
            assert torch.equal(state[i], self.dec_ssm[s].float()), f"row {i}: committed state != serial decode"
            assert torch.equal(window[i], self.dec_conv[s].float()), f"row {i}: committed window"
        for now, old in zip((self.ssm, self.rec, self.conv_ext), self.before):
            assert torch.equal(now[self.untouched], old[self.untouched]), "a slot outside `slots` changed"


SSM = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("ssm_dtype", SSM)
@pytest.mark.parametrize("M", [1, 3, 7])
def test_every_accepted_pattern(M, ssm_dtype):
    """Row b accepts (b + r) % (M + 1) drafts in round r: every count 0..M in every round, and
    every (previous pending, accepted) pair over M + 1 rounds."""
    g = torch.Generator().manual_seed(10 * M + (ssm_dtype == torch.bfloat16))
    H, B = 2, M + 1
    w = random_weights(H, generator=g)
    tw = Twin(H, M, B, ssm_dtype, g)
    for r in range(M + 2):
        tw.step(w, [(i + r) % (M + 1) for i in range(B)], g)


@pytest.mark.parametrize("ssm_dtype", SSM)
def test_hundred_rejections_then_all_accepted(ssm_dtype):
    """The H200 failure's pattern: 100 steps with every draft rejected (the golden token only),
    then every draft accepted for 20 steps; a second row alternates so pending is mixed."""
    g = torch.Generator().manual_seed(77 + (ssm_dtype == torch.bfloat16))
    H, M, B = 2, 3, 2
    w = random_weights(H, generator=g)
    tw = Twin(H, M, B, ssm_dtype, g)
    for r in range(120):
        tw.step(w, [0 if r < 100 else M, r % (M + 1)], g)


def test_bf16_records_hold_rounded_states():
    """With BF16 storage every record is a BF16 value held exactly in FP32 (what decode would
    have stored), and the committed ssm equals the record-free chain; with FP32 nothing rounds."""
    g = torch.Generator().manual_seed(5)
    H, M, B = 2, 3, 3
    w = random_weights(H, generator=g)
    for dt in SSM:
        tw = Twin(H, M, B, dt, g)
        tw.step(w, [M, 1, 0], g)
        rec = tw.rec[tw.slots.long()]
        if dt == torch.bfloat16:
            assert torch.equal(rec, rec.to(torch.bfloat16).float())
        else:
            assert not torch.equal(rec, rec.to(torch.bfloat16).float())


# -- model level, on the reference path ----------------------------------------------------------------
@pytest.mark.slow
def test_model_reference_speculative_bitwise_equals_greedy(monkeypatch):
    """The small K3 preset on the FP32 reference path (RefOps, CPU), NVFP4 KV + BF16 SSM (the H200
    failure of issue 27): speculative decoding with a drafter forced to reject (6 steps), then to
    accept (2 steps), then to fail at a rotating position gives plain greedy's tokens and logits bit
    for bit. The LM head runs as FP64 products rounded to FP32 (model/layers.py _mm): its FP32 GEMM
    rounds by the row count (B * T rows in verify, B in decode), which is not the KDA path's doing.
    Measured: with verify carrying unrounded FP32 states between drafts (the bug), this test's
    logits leave greedy's at token 8."""
    import tempfile
    from pathlib import Path

    import model.generate as G
    import model.layers as L
    import model.model as MM
    from model.cache import HybridCache
    from model.checkpoint import write_random_checkpoint
    from model.config import TargetConfig, small_config
    from model.weights import load_weights
    cfg, new, M = small_config(), 24, 3
    d = Path(tempfile.mkdtemp(prefix="k3gen-small-lossless-"))
    write_random_checkpoint(cfg, d, seed=11)
    t = TargetConfig(kv="nvfp4", ssm="bf16", max_drafts=M, path="reference")
    cache = HybridCache(cfg, t, num_slots=2, num_pages=8, max_seq_len=24 + new + 8)
    m = MM.K3Model(load_weights(d, cfg), t, cache)
    gen = G.Generator(m)
    rows: dict[int, list] = {}
    real_sample = G.sample

    def logits(self, h):
        return L._mm(L.rms_norm(h, self.w.final_norm, self.cfg.eps).float(), self.w.lm_head.float().T)

    def sample(lg, req, g):
        rows.setdefault(id(req), []).append(lg.clone())
        return real_sample(lg, req, g)
    monkeypatch.setattr(MM.K3Model, "_logits", logits)
    monkeypatch.setattr(G, "sample", sample)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, cfg.vocab, (24 - 3 * i,), generator=g).tolist() for i in range(2)]
    greedy = gen.generate([G.Request(p, new) for p in prompts])
    steps: dict[int, int] = {}

    def drafter(i, history, m_):
        n, k = len(history) - len(prompts[i]), steps.get(i, 0)
        steps[i] = k + 1
        dr = (greedy[i].out[n:n + m_] + [0] * m_)[:m_]
        wrong = 0 if k < 6 else (m_ if k < 8 else (k + i) % (m_ + 1))
        if wrong < m_:
            dr[wrong] = (dr[wrong] + 1) % cfg.vocab
        return dr
    spec = gen.generate([G.Request(p, new) for p in prompts], speculative=True, drafter=drafter)
    assert {0, M} <= set(gen.accepted), gen.accepted
    for i, (a, b) in enumerate(zip(greedy, spec)):
        la, lb = rows[id(a)], rows[id(b)]
        for tok in range(new):
            assert torch.equal(la[tok], lb[tok]), f"request {i} token {tok}: logits differ"
        assert a.out == b.out


# -- the kernels: compile, SASS ------------------------------------------------------------------------
@pytest.mark.parametrize("target,drafts", [("sm90", m) for m in (1, 2, 4, 5, 6, 7)] + [("sm103-nvfp4", 1)])
def test_bf16_verify_compiles_without_spills(target, drafts):
    """The per-token BF16 rounding at every draft count (test_kda_verify_spec covers M = 3 and 7 on
    every target): no local memory, within the launch bounds' registers."""
    from k3gen.pipeline.build import build_one
    from k3gen.ir.dtypes import SsmDtype
    from k3gen.ops.kda_verify.spec import KdaVerifySpec
    from k3gen.targets import TARGETS
    spec = KdaVerifySpec(target=TARGETS[target], heads=12, drafts=drafts, ssm=SsmDtype.BF16)
    r = build_one(spec)
    assert r.resources and all(x["local"] == 0 and x["stack"] == 0 for x in r.resources), r.resources
    assert not any(x["sass"].get("STL") or x["sass"].get("LDL") for x in r.resources), r.resources
    rows = next(x for x in r.resources if x["function"] == "k3gen_kda_verify")
    assert rows["registers"] <= 65536 // (256 * spec.blocks_per_sm), rows


def test_sass_rounding_and_state_layout():
    """BF16 verify rounds the register rows after every token (one F2FP pack per value pair: 32 per
    token on top of the typed ssm store), FP32 verify packs only its outputs; BF16 decode moves its
    rows as 8-byte words (the shared lane K slice), FP32 decode as 16-byte ones."""
    import re

    from k3gen.ir.dtypes import SsmDtype
    from k3gen.ops.kda_decode.spec import KdaDecodeSpec
    from k3gen.ops.kda_verify.spec import KdaVerifySpec
    from k3gen.pipeline.build import build_one
    from k3gen.pipeline.inspect import sass_text
    from k3gen.targets import TARGETS
    sm90 = TARGETS["sm90"]
    f2fp = {}
    for ssm in SsmDtype:
        r = build_one(KdaVerifySpec(target=sm90, heads=12, drafts=3, ssm=ssm))
        f2fp[ssm] = {x["function"]: x["sass"].get("F2FP", 0) for x in r.resources}
    assert len(f2fp[SsmDtype.FP32]) == 3 and all(n <= 2 for n in f2fp[SsmDtype.FP32].values()), f2fp
    assert all(n >= 2 * 32 + 2 for n in f2fp[SsmDtype.BF16].values()), f2fp
    for ssm, width in ((SsmDtype.BF16, "64"), (SsmDtype.FP32, "128")):
        sass = sass_text(build_one(KdaDecodeSpec(target=sm90, heads=12, ssm=ssm)).cubin)
        moves = set(re.findall(r"\b(?:LDG|STG)\.E\.EF\.(\d+)", sass))
        assert moves == {width}, (ssm, moves)
