"""Batch invariance of the K3 small preset on the kernel path (issue 27), with `TargetConfig.invariant`:
a request's decode and verify logits are bitwise the same alone, at any position of a batch of 5 or 8,
eager or replayed from the batch-8 CUDA graph (5 real rows padded), for NVFP4 KV + BF16 SSM, BF16
KV + FP32 SSM and FP8 KV + BF16 SSM. Each request is prefilled on its own (prefill's own batch invariance is not claimed:
its FP8 GEMMs over more than 128 rows choose tiles by the row count), then every scenario runs the
same teacher-forced steps: 3 decodes, a verify of 3 drafts with a partial commit, 2 decodes.

Without `invariant`, BF16 KV is the H200 finding of issue 27 (batch 5 vs the batch-8 graph 1.2e-2
apart): mla_decode's split count follows the batch size. That mode's difference is printed, not
asserted (the fix is the mode)."""
from __future__ import annotations

import functools

import pytest
import torch

from model.cache import HybridCache
from model.config import TargetConfig, small_config
from model.generate import Generator
from model.model import K3Model

pytestmark = pytest.mark.gpu
CFG = small_config()
COMBOS = [("nvfp4", "bf16"), ("bf16", "fp32"), ("fp8", "bf16")]
DRAFTS = 3
N_REQ = 8


@functools.lru_cache(maxsize=1)
def weights():
    from helpers import random_checkpoint_dir
    from model.weights import load_weights
    return load_weights(random_checkpoint_dir(CFG, 11), CFG).to("cuda")


def requests(seed=5):
    """Prompts of different lengths and each request's teacher-forced tokens for every step."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda n: torch.randint(0, CFG.vocab, (n,), generator=g).tolist()   # noqa: E731
    return [{"prompt": rnd(30 + 9 * i), "dec": rnd(5), "drafts": rnd(DRAFTS), "accept": 1 + i % (DRAFTS + 1)}
            for i in range(N_REQ)]


def run(m, gen, reqs, order, first_id):
    """The steps for the requests `order` (indices into reqs) as one batch; returns {request: [logits]}."""
    ids = [first_id + k for k in range(len(order))]
    for s, r in zip(ids, order):
        m.prefill([s], [reqs[r]["prompt"]])
    out = {r: [] for r in order}

    def step(tokens, T):
        lg = gen.step(ids, [x for t in tokens for x in t], T).view(len(ids), T, -1)
        for b, r in enumerate(order):
            out[r].append(lg[b].clone())
    for j in range(3):
        step([[reqs[r]["dec"][j]] for r in order], 1)
    step([[reqs[r]["dec"][3]] + reqs[r]["drafts"] for r in order], 1 + DRAFTS)
    m.commit(ids, [reqs[r]["accept"] for r in order])
    step([[reqs[r]["dec"][4]] for r in order], 1)
    step([[reqs[r]["dec"][0]] for r in order], 1)
    m.release(ids)
    return out


def scenarios(kv, ssm, invariant):
    t = TargetConfig(kv=kv, ssm=ssm, max_drafts=DRAFTS, path="kernel", invariant=invariant)
    cache = HybridCache(CFG, t, num_slots=N_REQ, num_pages=N_REQ * 8, max_seq_len=256, device="cuda")
    m = K3Model(weights(), t, cache)
    eager, graphs = Generator(m), Generator(m, graphs=True)
    reqs = requests()
    five = [3, 1, 0, 4, 2]
    res = {"alone": {}, "eager5": None, "graph5": None, "graph8": None}
    nid = 0
    for r in (0, 2, 4):
        res["alone"].update(run(m, eager, reqs, [r], nid))
        nid += 1
    res["eager5"] = run(m, eager, reqs, five, nid)
    nid += 5
    res["graph5"] = run(m, graphs, reqs, five, nid)
    nid += 5
    res["graph8"] = run(m, graphs, reqs, [7, 6, 5, 4, 3, 2, 1, 0], nid)
    return res


def differences(res) -> list[str]:
    bad = []
    for r in range(N_REQ):
        seen = [(name, res[name][r]) for name in res if r in res[name]]
        base_name, base = seen[0]
        for name, got in seen[1:]:
            for k, (a, b) in enumerate(zip(base, got)):
                if not torch.equal(a, b):
                    d = float((a - b).norm() / a.norm())
                    bad.append(f"request {r} step {k}: {base_name} vs {name} rel {d:.3g}")
    return bad


@pytest.mark.parametrize("kv,ssm", COMBOS, ids=lambda x: x)
def test_a_requests_logits_do_not_depend_on_its_batch(kv, ssm):
    res = scenarios(kv, ssm, invariant=True)
    assert len(res["alone"]) == 3 and len(res["graph8"]) == N_REQ
    bad = differences(res)
    assert not bad, "\n".join(bad[:12])


def test_default_mode_bf16_kv_difference_is_reported():
    """The default (invariant=False) with BF16 KV: printed for the record (issue 27's 1.2e-2)."""
    bad = differences(scenarios("bf16", "fp32", invariant=False))
    print(f"default mode, BF16 KV + FP32 SSM: {len(bad)} differing (request, step, scenario) rows;",
          "; ".join(bad[:6]))
