"""What the tensor/expert parallel tests run on each rank (and at TP1, in the test process): a tiny K3
whose head counts split four ways, and one fixed scenario over prefill, decode, speculative verify +
commit and greedy / speculative generation."""
from __future__ import annotations

import torch

from k3gen.presets import preset_dict
from model.config import ModelConfig, config_from_dict

DRAFTS = 3
PROMPTS = [[4, 8, 15, 16, 23, 42, 4, 8, 15, 16, 101, 7], [1, 2, 3, 1, 2, 3, 1]]
NEW = 8


def tiny4_dict() -> dict:
    """The `tiny` preset with 4 KDA and 8 MLA heads (tiny's 2 do not split over 4 ranks; MLA's q_b has
    192 rows per head, so a rank needs an even number of heads to own whole 128-row tiles)."""
    d = preset_dict("tiny")
    t = d["text_config"]
    t["linear_attn_config"]["num_heads"] = 4
    t["num_attention_heads"] = 8
    return d


def tiny4() -> ModelConfig:
    return config_from_dict(tiny4_dict(), "tiny4")


def scenario(m) -> dict:
    """Logits of a fixed teacher-forced sequence of steps (so one step's noise cannot change later
    inputs), then greedy and speculative generation. Runs on any K3Model (one rank or the whole)."""
    from model.generate import Generator, Request
    out = {}
    ids = [0, 1]
    out["prefill"] = m.prefill(ids, PROMPTS, all_logits=True)
    out["decode1"] = m.decode(ids, [9, 33])
    out["decode2"] = m.decode(ids, [17, 2])
    out["verify"] = m.verify(ids, [[5, 6, 7, 8], [44, 45, 46, 47]])
    m.commit(ids, [3, 1])            # partial acceptance on one sequence, none on the other
    out["after_commit"] = m.decode(ids, [11, 12])
    m.release(ids)
    g = Generator(m)
    greedy = g.generate([Request(list(p), NEW) for p in PROMPTS])
    # Drafts from the greedy continuation with every third one wrong: verify accepts 0..3 drafts,
    # rewinds the rest and commits through `pending` (the n-gram drafter rarely hits on a random model).
    truth = [p + r.out for p, r in zip(PROMPTS, greedy)]

    def drafter(i, hist, k):
        d = truth[i][len(hist):len(hist) + k] + [0] * k
        return [t if (len(hist) + j) % 3 else (t + 1) % 512 for j, t in enumerate(d[:k])]
    spec = g.generate([Request(list(p), NEW) for p in PROMPTS], speculative=True, drafter=drafter)
    out = {k: v.float().cpu() for k, v in out.items()}
    out["greedy"] = [r.out for r in greedy]
    out["spec"] = [r.out for r in spec]
    out["margins"] = [r.margins for r in greedy]
    out["accepted"] = list(g.accepted)
    return out


def build(cfg, checkpoint, par=None):
    from model.generate import build_model
    return build_model(cfg, "sm90", "bf16", "fp32", DRAFTS, "reference", checkpoint, 0, "cpu", 64, 2, par=par)


def rank_scenario(rank: int, world: int, checkpoint: str, ep: int) -> dict:
    """One rank of Layout(world, ep): builds its model through model/dist.py + model/shard.py, runs the
    scenario, checks that every rank generated the same tokens. Rank 0 returns the logits."""
    from model import dist
    par = dist.init(dist.Layout(world, ep), "cpu", timeout_s=60)
    try:
        m = build(tiny4(), checkpoint, par)
        res = scenario(m)
        par.check_equal([t for r in res["greedy"] + res["spec"] for t in r])
    finally:
        par.close()
    if rank:
        return {k: res[k] for k in ("greedy", "spec")}
    return res


def failing_load(rank: int, world: int, checkpoint: str, bad_rank: int) -> dict:
    """Rank `bad_rank` is pointed at a folder with no checkpoint: its load raises; then every rank checks
    tokens that differ on rank 1. Returns the error type each step raised on this rank."""
    import os

    from model import dist
    par = dist.init(dist.Layout(world), "cpu", timeout_s=60)
    out = {}
    try:
        try:
            build(tiny4(), checkpoint if rank != bad_rank else os.path.join(checkpoint, "missing"), par)
            out["load"] = None
        except Exception as e:                 # noqa: BLE001 - the type is the result
            out["load"] = [c.__name__ for c in type(e).__mro__]
        try:
            par.check_equal([1, 2, 3, 4 + (rank == 1)])
            out["check"] = None
        except Exception as e:                 # noqa: BLE001
            out["check"] = [c.__name__ for c in type(e).__mro__]
    finally:
        par.close()
    return out


def hanging_load(rank: int, world: int, checkpoint: str, timeout_s: float, how: str) -> str:
    """Rank 1 never reaches the agreement after loading: it sleeps past the timeout ("hang") or exits
    ("die"); the others must raise a typed error instead of waiting."""
    import os
    import time

    from model import dist
    par = dist.init(dist.Layout(world), "cpu", timeout_s=timeout_s)
    if rank == 1:
        if how == "die":
            os._exit(3)
        time.sleep(timeout_s + 3)
        return "slept"
    build(tiny4(), checkpoint, par)
    return "loaded"
