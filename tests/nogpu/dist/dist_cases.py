"""What the tensor/expert parallel tests run on each rank (and at TP1, in the test process): a tiny K3
whose head counts split four ways, and one fixed scenario over prefill, decode, speculative verify +
commit and greedy / speculative generation."""
from __future__ import annotations

import contextlib

import torch

from k3gen.presets import preset_dict
from model.config import ModelConfig, config_from_dict

DRAFTS = 3
PROMPTS = [[4, 8, 15, 16, 23, 42, 4, 8, 15, 16, 101, 7], [1, 2, 3, 1, 2, 3, 1]]
NEW = 8
LOGITS = ("prefill", "decode1", "decode2", "verify", "after_commit")


def tiny4_dict() -> dict:
    """The `tiny` preset with 4 KDA and 8 MLA heads (tiny's 2 do not split over 4 ranks; MLA's q_b has
    192 rows per head, so a rank needs an even number of heads to own whole 128-row tiles) and a 512
    expert intermediate (the shared experts' FP8 [gate | up] and down split in whole 128-row tiles
    over 4 ranks: model/shard.py)."""
    d = preset_dict("tiny")
    t = d["text_config"]
    t["linear_attn_config"]["num_heads"] = 4
    t["num_attention_heads"] = 8
    t["moe_intermediate_size"] = 512
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


def build(cfg, checkpoint, par=None, device="cpu", path="reference"):
    from model.generate import build_model
    return build_model(cfg, "sm90", "bf16", "fp32", DRAFTS, path, checkpoint, 0, device, 64, 2, par=par)


def rank_scenario(rank: int, world: int, checkpoint: str, ep: int, device: str = "cpu", backend=None,
                  cfg=None, path: str = "reference") -> dict:
    """One rank of Layout(world, ep): builds its model through model/dist.py + model/shard.py, runs the
    scenario, checks that every rank generated the same tokens. Rank 0 returns the logits. `device`
    "cuda:0" with backend "gloo" puts every rank on one GPU (the GPU test)."""
    from model import dist
    dev = torch.device(device)
    par = dist.init(dist.Layout(world, ep), dev.type, timeout_s=60, backend=backend,
                    device=dev if dev.type == "cuda" else None)
    try:
        m = build(cfg or tiny4(), checkpoint, par, str(dev), path)
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


@contextlib.contextmanager
def one_thread():
    """The ranks run one thread each; TP1 runs so too (the same GEMM blocking)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def _blocks(n: int, parts: int, reverse: bool) -> list[slice]:
    k = n // parts
    b = [slice(i * k, (i + 1) * k) for i in range(parts)]
    return b[::-1] if reverse else b


@contextlib.contextmanager
def order_variant(m, parts: int, reverse: bool):
    """TP1 with the sums a layout splits computed as `parts` block sums added in order (or reversed):
    the row-parallel projections over their input columns (FP32 partials, as RankOps): o_proj and the
    down projections of the dense MLP and the shared experts; and the routed experts' weighted sum
    over the experts (FP64 partials rounded to FP32)."""
    import model.moe_torch as T
    from k3gen.ops.act_quant_fp8.reference import act_quant_fp8, dequantize
    from model.ffn_ops import QAct
    from model.weights import DenseMlpWeights
    ops, ein = m.ops, T._ein
    split = {id(lw.attn.o_proj) for lw in m.w.layers}
    for lw in m.w.layers:
        f = lw.ffn
        split |= {id(g.down) for g in ([f] if isinstance(f, DenseMlpWeights) else [f.shared]) if g is not None}

    class Ops:
        def __getattr__(self, name):
            return getattr(ops, name)

        def linear(self, x, w):
            if id(w) not in split:
                return ops.linear(x, w)
            q = (x.codes, x.scales) if isinstance(x, QAct) else act_quant_fp8(x, ops.recipe)
            xd, W = dequantize(*q, ops.recipe), w.dequant()
            return sum(xd[:, b] @ W[:, b].T for b in _blocks(w.k, parts, reverse)).to(torch.bfloat16)

        def glu(self, x, w, cfg):
            return self.linear(QAct(None, *ops.glu_hidden(x, w, cfg)), w.down)

    def ein_blocks(eq, a, b):
        if eq != "me,mew->mw":
            return ein(eq, a, b)
        return sum(ein(eq, a[:, s], b[:, s]) for s in _blocks(a.shape[1], parts, reverse))
    m.ops, T._ein = Ops(), ein_blocks
    try:
        yield m
    finally:
        m.ops, T._ein = ops, ein


def order_bound(make, tp1: dict) -> float:
    """The bound on a layout's logits vs TP1 (test_dist_layouts.py says why): twice the most that the
    order variants (2 and 4 blocks, forward and reversed) move TP1's logits, at least FP32's 1e-5.
    `make()` builds a fresh TP1 model."""
    from numerics import rel_rms, tolerance
    worst = 0.0
    for parts in (2, 4):
        for rev in (False, True):
            m = make()
            with order_variant(m, parts, rev):
                v = scenario(m)
            worst = max([worst] + [rel_rms(v[k], tp1[k]) for k in LOGITS])
    return max(tolerance(torch.float32).rel_rms, 2 * worst)
