"""`python -m model eval` (= `k3gen eval`): the held-out question set through the FP32 reference path
and a grid of serving settings, one table of exact match with 95% intervals, results.json/md/png.

Rows: "fp32 reference" (teacher forcing on the checkpoint's stored values, model/eval/fp32.py), with
--fp32-weights also the FP32 master weights (what quantizing the checkpoint cost), then every
combination of --kv x --ssm x --batch (with or without CUDA graphs) x --spec on K3Model (--path: the kernels on a GPU,
or the reference ops; model/eval/serve.py). Results are written after every cell, so a run cut short
keeps what it finished; --max-seconds skips the cells that would start after that many seconds.
`--merge DIR..` joins earlier runs' results into one table.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from k3gen.errors import SpecError

from model.eval.serve import Cell


def _list(kind, allowed=None, what=""):
    def parse(text: str):
        out = []
        for x in text.split(","):
            x = x.strip()
            try:
                v = kind(x)
            except ValueError:
                raise argparse.ArgumentTypeError(f"{x!r} in {text!r} is not {what}") from None
            if allowed is not None and v not in allowed:
                raise argparse.ArgumentTypeError(f"{x!r} is not one of {', '.join(map(str, allowed))}")
            out.append(v)
        return out
    parse.__name__ = what
    return parse


def _batches(text: str) -> list[tuple[int, bool]]:
    out = []
    for x in text.split(","):
        x = x.strip()
        g = x.endswith("g")
        try:
            b = int(x[:-1] if g else x)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{x!r} in {text!r} is not a batch size (1, 2, 4, 8, or 8g)") from None
        if b not in (1, 2, 4, 8):
            raise argparse.ArgumentTypeError(f"{x!r}: batch sizes are 1, 2, 4, 8 (the captured decode graphs)")
        out.append((b, g))
    return out


_batches.__name__ = "batch sizes"


def add_eval_arguments(p: argparse.ArgumentParser) -> None:
    from model.argtypes import int_in
    from k3gen.cli import ARCH_CHOICES
    ARCH_HELP = "target GPU family: " + ", ".join(ARCH_CHOICES)
    p.add_argument("--checkpoint", metavar="DIR", help="a trained checkpoint in the official MXFP4 layout "
                   "(python -m model train writes DIR/checkpoint); its tasks.json names the tasks")
    p.add_argument("--path", default="auto", choices=("auto", "reference", "kernel", "none"),
                   help="the grid's path: kernel (GPU), reference (PyTorch ops, also on a CPU), auto (kernel on a "
                   "GPU), none (only the FP32 rows)")
    p.add_argument("--arch", default="sm90", choices=ARCH_CHOICES, metavar="ARCH", help=ARCH_HELP)
    p.add_argument("--kv", type=_list(str, ("bf16", "fp8", "nvfp4"), "KV dtypes"), default=["bf16"], metavar="L",
                   help="KV cache dtypes, comma-separated: bf16,fp8,nvfp4")
    p.add_argument("--ssm", type=_list(str, ("fp32", "bf16"), "SSM dtypes"), default=["fp32"], metavar="L",
                   help="recurrent-state dtypes, comma-separated: fp32,bf16")
    p.add_argument("--batch", type=_batches, default=[(1, False)], metavar="L",
                   help="decode batch sizes of 1,2,4,8, comma-separated; a trailing g (e.g. 8g) decodes that batch "
                   "size through CUDA graphs (kernel path)")
    p.add_argument("--spec", type=_list(int, range(0, 8), "draft counts"), default=[0], metavar="L",
                   help="n-gram speculative decoding draft counts, comma-separated (0: plain decoding), e.g. 0,3")
    p.add_argument("--questions", type=int_in(1, None, "at least one question"), default=200, metavar="N",
                   help="the first N held-out questions (even: arithmetic, odd: retrieval over --lengths)")
    p.add_argument("--lengths", type=_list(int, None, "context lengths"), default=[1024, 2048, 4096, 8192],
                   metavar="L", help="retrieval context lengths in tokens, cycled over the retrieval questions")
    p.add_argument("--fp32", default="chunked", choices=("chunked", "loop", "off"),
                   help="the FP32 reference row: chunked (batched training forward), loop (model/reference.py, "
                   "token-sequential, slow), off")
    p.add_argument("--fp32-weights", metavar="FILE", help="also score the FP32 master weights (fp32.safetensors)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="where the FP32 rows run")
    p.add_argument("--max-seconds", type=float, default=None, metavar="S",
                   help="skip cells that would start after S seconds of this run")
    p.add_argument("--out", default="eval-out", metavar="DIR", help="results.json, results.md, results.png")
    p.add_argument("--merge", nargs="+", metavar="DIR", help="join these runs' results.json into --out (no model run)")


def _cells(a, path: str) -> list[Cell]:
    cells = []
    if a.fp32 != "off":
        cells.append(Cell("fp32"))
        if a.fp32_weights:
            cells.append(Cell("fp32", weights="master"))
    if path == "none":
        return cells
    if any(g for _, g in a.batch) and path != "kernel":
        raise SpecError("--batch", ",".join(f"{b}g" for b, g in a.batch if g), "batch sizes without g",
                        "CUDA graphs need the kernel path on a GPU")
    for kv in a.kv:
        for ssm in a.ssm:
            for spec in sorted(set(a.spec)):
                for b, g in sorted(set(a.batch)):
                    cells.append(Cell(path, kv, ssm, b, g, spec))
    # Plain decoding before speculative, small batches before large, every KV x SSM group at each step:
    # each group's first cell (its baseline) is plain, smallest batch, eager, and cells skipped by
    # --max-seconds are the last settings of every group rather than whole groups.
    return sorted(cells, key=lambda c: (c.path != "fp32", c.spec, c.batch, c.graphs,
                                        a.kv.index(c.kv) if c.path != "fp32" else 0,
                                        a.ssm.index(c.ssm) if c.path != "fp32" else 0))


def task_spec(checkpoint, cfg):
    from model.train.tasks import TaskSpec
    f = Path(checkpoint) / "tasks.json"
    if f.is_file():
        d = json.loads(f.read_text())
        return TaskSpec(**{**d, "ops": tuple(d["ops"])})
    return TaskSpec(vocab=cfg.vocab)


def run(a) -> int:
    import torch
    from model.eval import report as R
    from model.eval.ui import console, progress
    con = console()
    if a.merge:
        return _merge(a, con)
    if not a.checkpoint or not Path(a.checkpoint).is_dir():
        raise SpecError("--checkpoint", a.checkpoint, "a checkpoint folder")
    cuda = torch.cuda.is_available()
    path = {"auto": "kernel" if cuda else "reference"}.get(a.path, a.path)
    if path == "kernel" and not cuda:
        raise SpecError("--path", "kernel", ["reference", "none"], "no CUDA GPU")
    device = "cuda" if (a.device == "cuda" or (a.device == "auto" and cuda)) else "cpu"
    from model.config import config_from_json
    from model.train.tasks import question_set
    cells = _cells(a, path)
    cfg = config_from_json(a.checkpoint)
    spec = task_spec(a.checkpoint, cfg)
    questions = question_set(a.questions, spec, tuple(a.lengths))
    meta = {"checkpoint": str(a.checkpoint), "questions": a.questions, "lengths": a.lengths,
            "task": {**dataclasses.asdict(spec), "ops": list(spec.ops)}, "arch": a.arch,
            "device": torch.cuda.get_device_name() if cuda else "cpu", "fp32_impl": a.fp32,
            "title": f"{cfg.name}: {a.questions} held-out questions", "checkpoint_sha256": _digest(a.checkpoint)}
    done: list[dict] = []
    t_run = time.perf_counter()
    with progress() as prog:
        for cell in cells:
            if a.max_seconds is not None and time.perf_counter() - t_run > a.max_seconds:
                con.print(f"skipped (--max-seconds {a.max_seconds:g}): {cell.name}")
                continue
            task = prog.add_task(cell.name, total=len(questions))

            def tick(n, task=task):
                prog.advance(task, n)
            t0 = time.perf_counter()
            res = _run(cell, a, cfg, questions, device, tick)
            extra = {k: v for k, v in res.items() if k != "answers"}
            extra.setdefault("seconds", round(time.perf_counter() - t0, 2))
            done.append(R.score(cell.name, cell.group, questions, res["answers"], extra))
            R.finalize(done, questions)
            R.compare(done)
            R.write(done, a.out, meta)
    con.print(R.table(done, meta["title"]))
    con.print(f"results: {Path(a.out) / 'results.json'}, results.md" + (", results.png" if (Path(a.out) / "results.png")
                                                                       .exists() else " (no matplotlib: no PNG)"))
    return 0


def _digest(folder) -> str:
    """sha256 over the checkpoint's safetensors files (names and bytes, in name order)."""
    import hashlib
    h = hashlib.sha256()
    for f in sorted(Path(folder).glob("*.safetensors")):
        h.update(f.name.encode())
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def _run(cell: Cell, a, cfg, questions, device: str, tick) -> dict:
    import torch
    from model.eval.fp32 import teacher_forced_chunked, teacher_forced_loop
    from model.eval.serve import run_cell
    if cell.path != "fp32":
        return run_cell(cell, questions, a.checkpoint, a.arch, "cuda" if cell.path == "kernel" else device, tick)
    from model.train.export import load_fp32, read_canonical
    _, tensors = read_canonical(a.checkpoint, cfg)
    if cell.weights == "master":
        tensors = load_fp32(a.fp32_weights)
    t0 = time.perf_counter()
    if a.fp32 == "loop":
        res = teacher_forced_loop(cfg, tensors, questions, device, tick)
    else:
        from model.train.net import K3Train
        net = K3Train(cfg, tensors=tensors).to(device)
        res = teacher_forced_chunked(net, questions, device, on_done=tick)
    if device == "cuda":
        torch.cuda.synchronize()
    return {"answers": [pred for _, pred in res], "seconds": round(time.perf_counter() - t0, 2),
            "method": f"teacher forcing ({a.fp32})"}


def _merge(a, con) -> int:
    """Earlier runs' cells in one table (also redraws the PNG of a run made where matplotlib was missing)."""
    from model.eval import report as R
    from model.train.tasks import TaskSpec, question_set
    cells, metas = R.load(a.merge)
    m = metas[0]
    n = max(x["questions"] for x in metas)
    spec = TaskSpec(**{**m["task"], "ops": tuple(m["task"]["ops"])})
    questions = question_set(n, spec, tuple(m["lengths"]))
    for c in cells:
        for k in ("delta_vs_reference", "flips_vs_reference", "differs_from", "answers_differ", "differing_ids"):
            c.pop(k, None)
    R.finalize(cells, questions)
    R.compare(cells)
    R.write(cells, a.out, {**m, "merged": [str(p) for p in a.merge], "questions": n})
    con.print(R.table(cells, m.get("title", "")))
    return 0


__all__ = ["add_eval_arguments", "run"]
