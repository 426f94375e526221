"""A rank that fails raises on every rank, typed, instead of leaving the others waiting: a load that
raises (every other rank gets RankFailedError at the agreement), a rank that hangs or dies before it
(the process group's timeout / the broken connection end the others' collective: CollectiveError), and
ranks that generated different tokens (RankMismatchError on every rank). The harness kills a rank still
running at its deadline and fails the test: a hang cannot pass."""
from __future__ import annotations

import pytest

from model.checkpoint import write_random_checkpoint

import dist_cases as C
import dist_harness as H

TIMEOUT_S = 4.0


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    d, _ = write_random_checkpoint(C.tiny4(), tmp_path_factory.mktemp("tiny4"), seed=3)
    return str(d)


def test_a_rank_that_fails_to_load_fails_every_rank(checkpoint, tmp_path):
    r0, r1 = H.values(H.run_ranks(C.failing_load, 2, tmp_path, checkpoint, 1))
    assert "CheckpointError" in r1["load"]                 # its own typed error
    assert r0["load"][0] == "RankFailedError" and "DistError" in r0["load"]
    # The group survives an agreed failure: a token mismatch after it is seen by both ranks.
    assert r0["check"][0] == r1["check"][0] == "RankMismatchError"


@pytest.mark.parametrize("how", ["hang", "die"])
def test_a_rank_that_never_answers_times_out_every_other(checkpoint, tmp_path, how):
    res = H.run_ranks(C.hanging_load, 2, tmp_path / how, checkpoint, TIMEOUT_S, how,
                      deadline_s=TIMEOUT_S + 60)
    r0 = res[0]
    assert not r0["ok"] and "CollectiveError" in r0["mro"], r0.get("trace", r0)
    if how == "hang":
        assert r0["type"] == "CollectiveTimeoutError", r0["message"]
        assert res[1] == {"ok": True, "value": "slept"}
    else:
        assert res[1]["exitcode"] == 3
