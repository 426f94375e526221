"""The serving soak (model/soak.py, issue 27) three times on one model: twice with the same seed
(the tokens must be identical) and once with the first request's KDA state poisoned with NaN
(every other request's tokens must be the clean run's). Accounting is checked after every step.

    python tools/soak.py --steps 2500 --path kernel --device cuda      # the H200 run (eager steps)
    python tools/soak.py --steps 20000 --slots 24 --path kernel --device cuda --graphs --parallel \
        --max-new 400 --max-seq-len 512     # the 2026-12-07 run (README)
    python tools/soak.py --steps 200 --config tiny                     # the CPU reference path
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


RUNS = (("clean", False), ("rerun", False), ("poisoned", True))


def _model(a):
    from model.generate import Generator, build_model
    sizes = None
    if a.graphs:   # powers of two below --slots, then --slots: every batch the soak can form has a graph
        sizes = tuple(sorted({min(1 << i, a.slots) for i in range(a.slots.bit_length() + 1)}))
    m = build_model(a.config, "sm90", a.kv, a.ssm, a.drafts, a.path, None, 0, a.device, a.max_seq_len, a.slots,
                    graph_batch_sizes=sizes)
    return m, (Generator(m, graphs=True).step if a.graphs else None)


def _run(a, name, poison, m=None, core=None, on_step=None):
    """One soak run (`m` None: this process builds its own model, as a --parallel worker)."""
    from model.soak import soak
    if m is None:
        import os

        import torch
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // len(RUNS)))   # the workers share the CPUs
        m, core = _model(a)
    t = time.time()

    def step(r):
        if on_step:
            on_step(r)
        elif r.steps % max(1, a.steps // 20) == 0:     # plain lines in logs
            print(f"{name}: {r.steps}/{a.steps} steps, {time.time() - t:.0f} s", file=sys.stderr, flush=True)
    rep = soak(m, a.steps, a.seed, poison_first=poison, on_step=step, p_arrive=a.arrive, core=core,
               max_prompt=a.max_prompt, max_new=a.max_new)
    rep.seconds = time.time() - t
    return rep


def main(argv=None) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="tiny")
    ap.add_argument("--kv", default="nvfp4", choices=["bf16", "fp8", "nvfp4"])
    ap.add_argument("--ssm", default="bf16", choices=["fp32", "bf16"])
    ap.add_argument("--drafts", type=int, default=3)
    ap.add_argument("--path", default="reference", choices=["reference", "kernel"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=200, help="model steps per run (each advances every live request)")
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--max-seq-len", type=int, default=256)
    ap.add_argument("--arrive", type=float, default=0.3,
                    help="probability of each further arrival per step (mean arrivals p / (1 - p))")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-prompt", type=int, default=48, help="prompt lengths drawn from 1..this")
    ap.add_argument("--max-new", type=int, default=96,
                    help="output lengths drawn from 1..this (longer requests: fewer admissions per step)")
    ap.add_argument("--graphs", action="store_true",
                    help="decode and verify steps replay CUDA graphs (kernel path on a GPU), as a serving engine")
    ap.add_argument("--parallel", action="store_true",
                    help="the three runs at once, one process (and model) each: on a GPU the steps are launch-bound")
    a = ap.parse_args(argv)
    runs = {}
    if a.parallel:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor
        with ProcessPoolExecutor(len(RUNS), mp_context=mp.get_context("spawn")) as ex:
            futs = {name: ex.submit(_run, a, name, poison) for name, poison in RUNS}
            runs = {name: f.result() for name, f in futs.items()}
    else:
        m, core = _model(a)
        tty = sys.stderr.isatty()
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      disable=not tty) as bar:
            for name, poison in RUNS:
                task = bar.add_task(name, total=a.steps)
                upd = (lambda r, task=task: bar.update(task, completed=r.steps)) if tty else None
                runs[name] = _run(a, name, poison, m, core, upd)
    c, r, p = runs["clean"], runs["rerun"], runs["poisoned"]
    others = [i for i in c.tokens if i != p.victim]
    leaked = [i for i in others if p.tokens.get(i) != c.tokens[i]]
    mode = (" graphs" if a.graphs else "") + (" parallel" if a.parallel else "")
    print(f"{a.config} {a.path}{mode} KV {a.kv} SSM {a.ssm} drafts {a.drafts}: {c.steps} steps ({c.verify_steps} "
          f"verify), {c.row_steps} sequence-steps, {c.admitted} admitted, {c.finished} finished, up to {c.max_live} "
          f"live, {c.accepted_drafts} drafts accepted; {c.seconds:.1f} / {r.seconds:.1f} / {p.seconds:.1f} s (clean / "
          f"rerun / poisoned); accounting exact after every step")
    print(f"reproducible: {c.tokens == r.tokens}; poisoned request {p.victim}: non-finite logits {p.victim_nonfinite}, "
          f"{len(others) - len(leaked)} of {len(others)} other requests' tokens unchanged")
    return 0 if c.tokens == r.tokens and p.victim_nonfinite and not leaked else 1


if __name__ == "__main__":
    raise SystemExit(main())
