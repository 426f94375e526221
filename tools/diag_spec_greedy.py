"""Which op makes speculative decoding diverge from greedy on the small model (GPU diagnostic).

Runs tests/gpu/test_model_small.py's speculative-vs-greedy generation for one (kv, ssm) combo
under variants that make one suspect batch-invariant at a time:
  base      as shipped;
  rowwise   the PyTorch stand-ins (MoE on dequantized experts, dense MLP) computed one row at a
            time, so their rows cannot depend on M = B (decode) vs B * T (verify);
  pertoken  verify attention as T single-token mla_decode launches (as NVFP4 KV does);
  both      rowwise + pertoken.
Prints, per variant, every first divergence (request, token, greedy / speculative margins).
Usage: python tools/diag_spec_greedy.py [kv] [ssm]
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: model/ and tests/
from model import layers as L  # noqa: E402
from model.generate import Request  # noqa: E402
from model.ops import KernelOps  # noqa: E402
from tests.gpu import test_model_small as tm  # noqa: E402

ORIG = {"moe": L.moe, "dense_mlp": L.dense_mlp, "attn": KernelOps.mla_attention}


def rowwise(fn):
    def run(ops, w, xn, *rest):
        return torch.cat([fn(ops, w, xn[i:i + 1], *rest) for i in range(xn.shape[0])])
    return run


def per_token_attention(self, layout, q, cache, block_table, start, ring_slot, scale):
    T = q.shape[1]
    if T == 1:
        return ORIG["attn"](self, layout, q, cache, block_table, start, ring_slot, scale)
    return torch.cat([ORIG["attn"](self, layout, q[:, t:t + 1].contiguous(), cache, block_table, start + t,
                                   ring_slot, scale) for t in range(T)], dim=1)


def variant(name):
    L.moe, L.dense_mlp, KernelOps.mla_attention = ORIG["moe"], ORIG["dense_mlp"], ORIG["attn"]
    if name in ("rowwise", "both"):
        L.moe, L.dense_mlp = rowwise(ORIG["moe"]), rowwise(ORIG["dense_mlp"])
    if name in ("pertoken", "both"):
        KernelOps.mla_attention = per_token_attention


def main():
    kv = sys.argv[1] if len(sys.argv) > 1 else "bf16"
    ssm = sys.argv[2] if len(sys.argv) > 2 else "fp32"
    for name in ("base", "rowwise", "pertoken", "both"):
        variant(name)
        _, g = tm.make(kv, ssm, graphs=True)
        ps = [p[:8] * 3 for p in tm.prompts(4, seed=7)]
        greedy = g.generate([Request(p, 24) for p in ps])
        spec = g.generate([Request(p, 24) for p in ps], speculative=True)
        div = []
        for i, (a, b) in enumerate(zip(greedy, spec)):
            for t, (x, y) in enumerate(zip(a.out, b.out)):
                if x != y:
                    div.append((i, t, round(a.margins[t], 4), round(b.margins[t], 4)))
                    break
        acc = sum(g.accepted) / max(len(g.accepted), 1)
        print(f"[{kv}-{ssm}] {name:8s} divergences (req, tok, greedy margin, spec margin): {div}; "
              f"accepted/verify {acc:.2f}", flush=True)


if __name__ == "__main__":
    main()
