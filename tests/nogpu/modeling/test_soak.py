"""model/soak.py on the CPU reference path (issue 27's soak at CI size; tools/soak.py runs it long,
tests/gpu/test_model_soak.py on the kernel path): requests arrive while others run, decode and verify
steps mix with drawn accepted counts, slots and pages are reused; the accounting holds after every
step (soak raises otherwise), a rerun gives the same tokens, and a request whose KDA state is NaN
leaves every other request's tokens unchanged (its pages are scrubbed when it is freed)."""
from __future__ import annotations

import pytest

from model.cache import CacheStateError
from model.generate import build_model
from model.soak import check_accounting, soak

STEPS = 30


@pytest.mark.parametrize("kv,ssm", [("nvfp4", "bf16"), ("bf16", "fp32")])
def test_soak_reproducible_isolated_and_exactly_accounted(kv, ssm):
    m = build_model("tiny", "sm90", kv, ssm, 3, "reference", None, 0, "cpu", 256, 8)
    clean = soak(m, STEPS, 0)
    again = soak(m, STEPS, 0)
    poisoned = soak(m, STEPS, 0, poison_first=True)
    assert clean.verify_steps and clean.steps > clean.verify_steps and clean.accepted_drafts
    assert clean.admitted > m.cache.mgr.num_slots and clean.finished, "slots must be reused"
    assert clean.tokens == again.tokens
    assert poisoned.victim_nonfinite, "the poison did not reach the victim's logits"
    others = [i for i in clean.tokens if i != poisoned.victim]
    assert len(others) >= 6
    assert all(poisoned.tokens[i] == clean.tokens[i] for i in others), \
        [i for i in others if poisoned.tokens[i] != clean.tokens[i]]


def test_accounting_check_catches_a_leaked_page():
    m = build_model("tiny", "sm90", "bf16", "fp32", 3, "reference", None, 0, "cpu", 128, 2)
    m.prefill([0], [[1, 2, 3]])
    check_accounting(m, {0: type("R", (), {"prompt": [1, 2, 3], "out": [9]})()})
    m.cache.mgr._free_pages.pop()           # a page that neither a sequence nor the free list holds
    with pytest.raises(CacheStateError, match="leaked"):
        check_accounting(m, {0: type("R", (), {"prompt": [1, 2, 3], "out": [9]})()})


def test_requests_that_want_only_the_prefill_token_finish_at_admission():
    # max_new of 1 or 2: half the requests are done after their prefill; found on the H200 at step
    # ~1300 of the long soak (verify drew an accepted count from an empty range)
    m = build_model("tiny", "sm90", "bf16", "fp32", 3, "reference", None, 0, "cpu", 128, 4)
    r = soak(m, 20, 1, max_new=2, p_verify=0.9)
    assert r.verify_steps and r.finished > 4
    assert all(1 <= len(t) <= 2 for t in r.tokens.values())
    assert any(len(t) == 1 for t in r.tokens.values())
