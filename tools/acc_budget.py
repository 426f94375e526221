"""The H200 budget of the accuracy run (issue 23), planned on the CPU: what one training step costs.

1. Trace: one training step (forward + backward) of the `acc` config at the real batch is run on
   PyTorch's meta device under a dispatch mode that records every op with a kernel (views excluded):
   its FLOPs (GEMMs, batched GEMMs, the triangular solves, attention, convolutions; one per output
   element for the rest) and the bytes it reads and writes. Nothing is computed: shapes only.
2. Measure: the same step at a small batch runs for real on this CPU; traced FLOPs and bytes over
   the measured seconds give the CPU's effective rates (reported, so the plan's inputs can be checked).
3. Project: each op on the H200 takes max(launch floor, bytes / bandwidth, FLOPs / GEMM rate),
   summed; assumptions as flags (defaults: 8 us per eager op of Python dispatch and launch, 3.0 TB/s
   = 70% of the 4.27 TB/s copy ceiling measured there, 200 TFLOP/s for TF32 GEMMs = 40% of the dense
   peak). The curriculum's mean step time gives the steps and tokens a `--minutes` budget buys.

This is a projection, not a measurement: the training run follows its time budget whatever the speed
(model/train/loop.py), and logs its real step times and tokens per second.

    python tools/acc_budget.py [--minutes 8] [--measure] [--launch-us 8] [--tbps 3.0] [--tflops 200]
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model.config import config_from_dict  # noqa: E402
from model.train.config import get_train_config  # noqa: E402
from model.train.loop import ret_length  # noqa: E402
from model.train.net import K3Train  # noqa: E402

GEMMS = {"aten.mm.default", "aten.bmm.default", "aten.addmm.default", "aten.baddbmm.default"}


def _numel(t) -> int:
    return t.numel() if isinstance(t, torch.Tensor) else 0


def _flat(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _flat(y)


class Trace(TorchDispatchMode):
    """Per kernel op: (name, FLOPs, bytes)."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, float, float]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if getattr(func, "is_view", False) or str(func) in ("aten.detach.default", "aten.lift_fresh.default"):
            return out
        name = str(func)
        ins, outs = list(_flat(args)), list(_flat(out))
        nbytes = sum(_numel(t) * t.element_size() for t in ins + outs)
        if name in GEMMS:
            a, b = (args[1], args[2]) if "add" in name else (args[0], args[1])
            flops = 2.0 * _numel(a) * b.shape[-1]
        elif "solve_triangular" in name:
            A, B = args[0], args[1]
            flops = float(_numel(B)) * A.shape[-1]
        elif "attention" in name or "convolution" in name:
            flops = 2.0 * sum(_numel(t) for t in ins) * 8   # small here; counted coarsely
        else:
            flops = float(sum(_numel(t) for t in outs))
        self.ops.append((name, flops, nbytes))
        return out


def step_trace(tc, L: int, arith_seqs: int | None = None, ret_tokens: int | None = None, device="meta"):
    """The ops of one training step: the arithmetic batch and one retrieval batch of length L."""
    cfg = config_from_dict(tc.model)
    net = K3Train(cfg, chunk=tc.chunk, sub=tc.sub).to(device)
    A = tc.arith_seqs if arith_seqs is None else arith_seqs
    R = tc.ret_tokens if ret_tokens is None else ret_tokens
    La = 1 + tc.arith_per_seq * tc.task.arith_len - 1
    shapes = [(A, La)] + ([(max(1, R // L), L)] if R else [])
    tr = Trace()
    t0 = time.perf_counter()
    with tr:
        for B, T in shapes:
            toks = torch.randint(0, cfg.vocab, (B, T)).to(device)
            net(toks).logsumexp(-1).mean().backward()
    return tr.ops, sum(B * T for B, T in shapes), time.perf_counter() - t0


def project(ops, launch_us: float, tbps: float, tflops: float) -> dict:
    t = sum(max(launch_us * 1e-6, b / (tbps * 1e12), (f / (tflops * 1e12) if n in GEMMS or "solve" in n
                                                      else f / (tbps * 1e12 / 4))) for n, f, b in ops)
    return {"ops": len(ops), "gflop": sum(f for _, f, _ in ops) / 1e9, "gbytes": sum(b for _, _, b in ops) / 1e9,
            "seconds": t, "launch_bound_s": len(ops) * launch_us * 1e-6}


def curriculum_lengths(tc, n: int = 400) -> list[int]:
    rng = np.random.default_rng(0)
    return [ret_length(tc, rng, (i + 0.5) / n) for i in range(n)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="acc")
    p.add_argument("--minutes", type=float, default=8.0, help="the training budget to plan (--minutes of train)")
    p.add_argument("--launch-us", type=float, default=8.0)
    p.add_argument("--tbps", type=float, default=3.0)
    p.add_argument("--tflops", type=float, default=200.0)
    p.add_argument("--measure", action="store_true", help="also time a small step on this CPU")
    p.add_argument("--json", metavar="FILE")
    a = p.parse_args(argv)
    tc = get_train_config(a.config)
    out = {"assumptions": {"launch_us": a.launch_us, "tbps": a.tbps, "tflops_tf32": a.tflops}, "lengths": {}}
    grid = [L for L in (256, 512, 1024, 2048, 4096, 8192) if tc.len_min <= L <= tc.len_max] or [tc.len_max]
    print(f"{tc.name}: arithmetic {tc.arith_seqs} x {tc.arith_per_seq * tc.task.arith_len} tokens + retrieval "
          f"{tc.ret_tokens} tokens per step; H200 projection per step (assumptions: {out['assumptions']})")
    print(f"{'L':>6} {'ops':>7} {'GFLOP':>8} {'GB':>7} {'launch s':>9} {'step s':>8} {'tok/s':>9}")
    for L in grid:
        ops, tokens, _ = step_trace(tc, L)
        pr = project(ops, a.launch_us, a.tbps, a.tflops)
        pr["tokens"] = tokens
        out["lengths"][L] = pr
        print(f"{L:>6} {pr['ops']:>7} {pr['gflop']:>8.0f} {pr['gbytes']:>7.1f} {pr['launch_bound_s']:>9.3f} "
              f"{pr['seconds']:>8.3f} {tokens / pr['seconds']:>9.0f}")
    # the curriculum's mean step: interpolate the step time in log L
    Ls = sorted(out["lengths"])
    xs, ys = [math.log(L) for L in Ls], [out["lengths"][L]["seconds"] for L in Ls]
    mean = float(np.mean([np.interp(math.log(L), xs, ys) for L in curriculum_lengths(tc)]))
    tok = float(np.mean([out["lengths"][L]["tokens"] for L in Ls]))
    steps = int(a.minutes * 60 / mean)
    out["plan"] = {"minutes": a.minutes, "mean_step_s": mean, "steps": steps, "tokens": steps * tok}
    print(f"curriculum mean step {mean:.3f} s -> {steps} steps, {steps * tok / 1e6:.0f} M tokens in {a.minutes} min")
    if a.measure:
        L = 512
        ops, tokens, _ = step_trace(tc, L, arith_seqs=4, ret_tokens=1024)
        cfg = config_from_dict(tc.model)
        net = K3Train(cfg, chunk=tc.chunk, sub=tc.sub)
        shapes = [(4, tc.arith_per_seq * tc.task.arith_len), (2, L)]
        t0 = time.perf_counter()
        for B, T in shapes:
            net(torch.randint(0, cfg.vocab, (B, T))).logsumexp(-1).mean().backward()
        dt = time.perf_counter() - t0
        g, b = sum(f for _, f, _ in ops) / 1e9, sum(x for _, _, x in ops) / 1e9
        out["cpu"] = {"tokens": tokens, "seconds": dt, "gflop": g, "gbytes": b, "torch_threads": torch.get_num_threads()}
        print(f"CPU (measured): a step of {tokens} tokens took {dt:.2f} s ({tokens / dt:.0f} tok/s): {g:.1f} GFLOP "
              f"({g / dt:.1f} GFLOP/s), {b:.1f} GB of operands ({b / dt:.1f} GB/s), {len(ops)} ops")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
