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
    p.add_argument("--init", metavar="PATH", default=None,
                   help="start from a finished run's weights (its checkpoint/ folder, experts decoded from MXFP4, "
                   "or its fp32.safetensors) with a fresh optimizer and schedule; ignored when --resume finds a state")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="where to train: auto (a CUDA GPU when there is one), cpu or cuda")
    p.add_argument("--seed", type=int_in(0, 2**31 - 1, "seed >= 0"), default=None, metavar="N",
                   help="data and initialization seed (default: the config's)")
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", dest="overrides",
                   help="override a training setting of the config (a TrainConfig field, e.g. lr=1e-3) or of its "
                   "tasks (task.FIELD, e.g. task.order=vk); repeatable. Overrides are recorded in summary.json")
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
    tc = apply_overrides(get_train_config(a.config, **({"seed": a.seed} if a.seed is not None else {})), a.overrides)
    out = Path(a.out)
    if not a.resume and (out / "state.pt").exists():
        raise SpecError("--out", str(out), "a folder without state.pt", "pass --resume to continue that run")
    init = None
    if a.init and not a.resume:
        from model.config import config_from_dict
        init = _init_tensors(Path(a.init), config_from_dict(tc.model))
    tr = Trainer(tc, out, device, init=init, init_from=str(a.init) if init is not None else None)
    if init is not None:
        tr.log({"step": 0, "init": tr.init_from})
        print(f"starting from the weights in {a.init}")
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


def _init_tensors(path: Path, cfg) -> dict:
    """Canonical FP32 tensors of a finished run: a checkpoint folder in the official layout or an
    FP32 master-weight file. Every tensor the config has must be there with its shape."""
    from model.train.export import load_fp32, read_canonical
    from model.reference import canonical_shapes
    from k3gen.errors import K3genError
    if path.is_dir():
        try:
            _, tensors = read_canonical(path, cfg)
        except K3genError as e:
            raise SpecError("--init", str(path), f"a checkpoint of this config ({cfg.name})", str(e)) from e
    elif path.suffix == ".safetensors" and path.is_file():
        tensors = load_fp32(path)
    else:
        raise SpecError("--init", str(path), "a checkpoint folder or an fp32 .safetensors file")
    for n, s in canonical_shapes(cfg).items():
        if n not in tensors or tuple(tensors[n].shape) != tuple(s):
            got = tuple(tensors[n].shape) if n in tensors else "missing"
            raise SpecError("--init", str(path), f"{n} of shape {tuple(s)}", f"found {got}: another config")
    return tensors


def _parse(name: str, text: str, current):
    try:
        if isinstance(current, bool):
            if text.lower() not in ("true", "false", "1", "0"):
                raise ValueError
            return text.lower() in ("true", "1")
        if isinstance(current, (int, float, str)):
            return type(current)(text)
    except ValueError:
        pass
    raise SpecError("--set", f"{name}={text}", f"a value of type {type(current).__name__}")


def apply_overrides(tc, overrides: list[str]):
    """The config with `NAME=VALUE` overrides applied (typed by the field's current value); the model
    dict and tuple fields are not overridable."""
    import dataclasses
    top, task = {}, {}
    for item in overrides:
        name, sep, text = item.partition("=")
        if not sep:
            raise SpecError("--set", item, "NAME=VALUE")
        obj, field, dst = (tc.task, name[5:], task) if name.startswith("task.") else (tc, name, top)
        allowed = sorted(f.name for f in dataclasses.fields(obj)
                         if isinstance(getattr(obj, f.name), (bool, int, float, str)) and f.name != "name")
        if field not in allowed:
            raise SpecError("--set", name, allowed if obj is tc else [f"task.{f}" for f in allowed])
        dst[field] = _parse(name, text, getattr(obj, field))
    if task:
        top["task"] = dataclasses.replace(tc.task, **task)
    return dataclasses.replace(tc, **top) if top else tc


__all__ = ["add_train_arguments", "run", "apply_overrides"]
