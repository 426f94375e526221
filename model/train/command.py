"""`python -m model train`: train a small K3 on the synthetic tasks (model/train/loop.py) and export
it in the official MXFP4 layout (DIR/checkpoint, with tasks.json naming the tasks for
`python -m model eval`)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from k3gen.errors import SpecError


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    from model.argtypes import float_in, int_in
    from model.train.config import PRESETS
    p.add_argument("--config", default="acc", choices=sorted(PRESETS),
                   help="acc: the accuracy model (tiny's K3 shapes, 4-digit sums and differences, retrieval up "
                   "to 8K tokens); toy: the CPU demonstration (2 layers, 2-digit sums, retrieval up to 192 tokens)")
    p.add_argument("--out", required=True, metavar="DIR", help="state.pt, train_log.jsonl, fp32.safetensors, checkpoint/")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--minutes", type=float_in(0.0, None, "minutes > 0", lo_open=True), metavar="M",
                   help="training time budget: the schedule (LR, curriculum, QAT) follows training seconds / (60 M)")
    g.add_argument("--steps", type=int_in(1, None, "steps >= 1"), metavar="N",
                   help="train exactly N steps (reproducible; the schedule follows step / N)")
    p.add_argument("--stop-after", type=float_in(0.0, None, "seconds > 0", lo_open=True), metavar="S",
                   help="end this call after S seconds, saving the state (continue with --resume)")
    p.add_argument("--resume", action="store_true", help="continue from DIR/state.pt")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="where to train: auto (a CUDA GPU when there is one), cpu or cuda")
    p.add_argument("--seed", type=int_in(0, 2**31 - 1, "seed >= 0"), default=None, metavar="N",
                   help="data and initialization seed (default: the config's)")
    p.add_argument("--threads", type=int_in(1, None, "threads >= 1"), default=None, metavar="N",
                   help="torch CPU threads")


def run(a) -> int:
    import torch
    from model.train.config import get_train_config
    from model.train.loop import Trainer
    if a.threads:
        torch.set_num_threads(a.threads)
    cuda = torch.cuda.is_available()
    if a.device == "cuda" and not cuda:
        raise SpecError("--device", "cuda", ["cpu", "auto"], "no CUDA GPU")
    device = "cuda" if a.device == "cuda" or (a.device == "auto" and cuda) else "cpu"
    tc = get_train_config(a.config, **({"seed": a.seed} if a.seed is not None else {}))
    out = Path(a.out)
    if not a.resume and (out / "state.pt").exists():
        raise SpecError("--out", str(out), "a folder without state.pt", "pass --resume to continue that run")
    tr = Trainer(tc, out, device)
    if a.resume:
        if not (out / "state.pt").exists():
            raise SpecError("--resume", str(out), "a folder with state.pt")
        tr.load_state()
        print(f"resumed at step {tr.step}, {tr.seconds:.0f}s trained")
    print(f"training {tc.name} ({tr.cfg.name}: {sum(p.numel() for p in tr.net.parameters()) / 1e6:.2f} M parameters) "
          f"on {device}" + (f" ({torch.cuda.get_device_name()})" if device == "cuda" else ""))
    s = tr.run(minutes=a.minutes, steps=a.steps, stop_after=a.stop_after)
    print(json.dumps(s))
    return 0


__all__ = ["add_train_arguments", "run"]
