"""A sequence may switch between decode and verify steps (an engine decodes a request whose drafter
has nothing to propose): K3Model.prepare -> HybridCache.sync_kda brings the KDA pools to the view
the next step reads. Checked on the reference path: every kept position of a random mix of decode
steps and verify steps (any accepted count) has the logits of plain serial decoding, bit for bit.
Without the sync a decode after a commit read the pre-verify state (0.12-0.28 rel RMS off). The LM
head is made row-invariant as tests/gpu/test_spec_lossless.py does (its FP32 GEMM sums a 1-row
decode and a 4-row verify in other orders)."""
from __future__ import annotations

import random

import pytest
import torch

from model.generate import build_model

COMBOS = [("bf16", "fp32"), ("nvfp4", "bf16"), ("fp8", "fp32")]


@pytest.fixture(scope="module")
def models():
    import model.layers as L
    import model.model as MM
    mp = pytest.MonkeyPatch()

    def logits(self, h):
        return L._mm(L.rms_norm(h, self.w.final_norm, self.cfg.eps).float(), self.w.lm_head.float().T)
    mp.setattr(MM.K3Model, "_logits", logits)
    yield {kv_ssm: build_model("tiny", "sm90", kv_ssm[0], kv_ssm[1], 3, "reference", None, 0, "cpu", 128, 4)
            for kv_ssm in COMBOS}
    mp.undo()


@pytest.mark.parametrize("kv_ssm", COMBOS, ids=lambda x: "-".join(x))
@pytest.mark.parametrize("seed", [0, 1])
def test_mixed_decode_and_verify_equal_serial_decode(models, kv_ssm, seed):
    m = models[kv_ssm]
    rng = random.Random(seed)
    V, T = m.cfg.vocab, 1 + m.tcfg.max_drafts
    prompt = [rng.randrange(V) for _ in range(rng.randint(1, 9))]
    seq = [rng.randrange(V) for _ in range(28)]
    m.prefill([0], [prompt])
    serial = [m.decode([0], [t])[0] for t in seq]
    m.release([0])
    m.prefill([1], [prompt])
    pos, kinds = 0, []
    try:
        while pos < len(seq):
            if rng.random() < 0.5:
                got = m.decode([1], [seq[pos]])[0]
                assert torch.equal(got, serial[pos]), f"decode at {pos} after {kinds[-3:]}"
                pos += 1
                kinds.append("d")
            else:
                window = (seq[pos:pos + T] + [rng.randrange(V) for _ in range(T)])[:T]
                lg = m.verify([1], [window])[0]
                a = rng.randint(1, min(T, len(seq) - pos))
                for j in range(a):
                    assert torch.equal(lg[j], serial[pos + j]), f"verify row {j} at {pos} after {kinds[-3:]}"
                m.commit([1], [a])
                pos += a
                kinds.append(f"v{a}")
    finally:
        m.release([1])
    assert "d" in kinds and any(k.startswith("v") for k in kinds), kinds
