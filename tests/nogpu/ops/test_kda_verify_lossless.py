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
