"""Find the op that makes a verify row differ from the decode row (issue 27) on the H200: the
small model on the kernel path, greedy vs speculative with every draft rejected (so verify step k
and decode step k emit the same token from the same history), every KernelOps call's output
recorded per request row; prints, per (kv, ssm, seed), the first step and op whose row differs.
The LM head (and BF16-KV verify attention) is made row-invariant as tests/gpu/test_spec_lossless.py
row_invariant_model does.

    python tools/diag_spec_rows.py [--steps 100] [kv:ssm:seed ...]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "gpu")]

import test_spec_lossless as S  # noqa: E402
from model.ffn_ops import QAct  # noqa: E402

OPS = ("linear", "kda_decode", "kda_verify", "mla_attention", "q_absorb", "vb_gate", "route", "attn_res_mix",
       "latent_norm", "glu_hidden", "moe_experts", "router_logits", "kv_write")


def _rows(o, B: int, T: int):
    """Per request, its first row of op output `o` (None where the output has no row axis)."""
    if isinstance(o, QAct):
        o = o.x if o.x is not None else o.codes
    if isinstance(o, dict):
        o = o["weights"]
    if isinstance(o, tuple):
        o = o[0]
    if not torch.is_tensor(o):
        return None
    if o.dim() >= 2 and o.shape[0] == B and o.shape[1] == T and T > 1:
        return [o[i, 0].clone() for i in range(B)]
    if o.shape[0] == B * T:
        return [o[i * T].clone() for i in range(B)]
    if o.dim() >= 3 and o.shape[0] == B and o.shape[1] == 1:
        return [o[i, 0].clone() for i in range(B)]
    return None


def run(kv: str, ssm: str, seed: int, steps: int) -> None:
    from model.generate import Request
    mp = pytest.MonkeyPatch()
    try:
        S.row_invariant_model(mp, per_token_attention=kv != "nvfp4")
        m, gen = S.make_generator(kv, ssm)
        rec = {"phase": None, "step": -1, "T": 1, "B": 1}
        log: dict = {}
        for name in OPS:
            f = getattr(m.ops, name, None)
            if f is None:
                continue

            def wrap(*a, _f=f, _n=name, **k):
                o = _f(*a, **k)
                if rec["phase"] and rec["step"] < steps:
                    log.setdefault((rec["phase"], rec["step"]), []).append((_n, _rows(o, rec["B"], rec["T"])))
                return o
            setattr(m.ops, name, wrap)
        core = m.step_core

        def step_core(tokens, slots, start, T):
            rec["step"] += 1
            rec["T"], rec["B"] = T, slots.shape[0]
            return core(tokens, slots, start, T)
        m.step_core = step_core
        g = torch.Generator().manual_seed(seed)
        prompts = [torch.randint(0, S.CFG.vocab, (24 - 3 * i,), generator=g).tolist() for i in range(3)]
        rec["phase"], rec["step"] = "g", -1
        greedy = gen.generate([Request(p, S.NEW_TOKENS) for p in prompts])

        def drafter(i, history, n_drafts):
            n = len(history) - len(prompts[i])
            d = (greedy[i].out[n:n + n_drafts] + [0] * n_drafts)[:n_drafts]
            d[0] = (d[0] + 1) % S.CFG.vocab
            return d
        rec["phase"], rec["step"] = "s", -1
        gen.generate([Request(p, S.NEW_TOKENS) for p in prompts], speculative=True, drafter=drafter)
        for s in range(steps):
            a = [x for x in log.get(("g", s), []) if x[0] != "kda_decode"]
            b = [x for x in log.get(("s", s), []) if x[0] != "kda_verify"]
            for j, ((n1, r1), (n2, r2)) in enumerate(zip(a, b)):
                if n1 != n2:
                    print(f"{kv}/{ssm}/{seed}: step {s}: call {j} is {n1} in decode, {n2} in verify")
                    return
                if r1 is None or r2 is None:
                    continue
                for i, (x, y) in enumerate(zip(r1, r2)):
                    if x.shape != y.shape:
                        print(f"  step {s} call {j} {n1}: shapes {tuple(x.shape)} vs {tuple(y.shape)}")
                    elif not torch.equal(x, y):
                        prev = [n for n, _ in a[max(0, j - 4):j]]
                        print(f"{kv}/{ssm}/{seed}: first difference at step {s} (token {s + 1}), call {j} "
                              f"{n1} (after {prev}), request {i}: max {float((x.float() - y.float()).abs().max()):.3g}, "
                              f"{int((x != y).sum())} of {x.numel()} values", flush=True)
                        return
        print(f"{kv}/{ssm}/{seed}: rows equal over {steps} steps", flush=True)
    finally:
        mp.undo()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("cases", nargs="*", default=["nvfp4:bf16:2", "bf16:fp32:1"])
    a = ap.parse_args()
    for c in a.cases:
        kv, ssm, seed = c.split(":")
        run(kv, ssm, int(seed), a.steps)


if __name__ == "__main__":
    main()
