"""The model's command line: `python -m model generate|plan-memory ...`, also reachable as
`k3gen generate` / `k3gen plan-memory` (k3gen/cli.py resolves `generate_main` / `plan_main` by name
when one of them runs). Kept free of heavy imports: `--help` must answer fast."""
from __future__ import annotations

import argparse


def add_generate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default="small", help="model config: small, tiny, k3")
    p.add_argument("--arch", default="sm90")
    p.add_argument("--kv", default="bf16", choices=("bf16", "fp8", "nvfp4"))
    p.add_argument("--ssm", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--prompt-ids", default="1,2,3,4,5,6,7,8", help="comma-separated token ids")
    p.add_argument("--batch", type=int, default=1, help="copies of the prompt run as one batch")
    p.add_argument("--max-new", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--spec", type=int, default=0, help="speculative decoding with this many n-gram drafts")
    p.add_argument("--checkpoint", default=None, help="folder of a K3 NVFP4 checkpoint (default: a random one)")
    p.add_argument("--path", default="auto", choices=("auto", "reference", "kernel"))
    p.add_argument("--graphs", action="store_true", help="CUDA graphs per decode batch size (kernel path)")
    p.add_argument("--max-seq-len", type=int, default=512)


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default="k3")
    p.add_argument("--arch", default="sm90")
    p.add_argument("--tp", type=int, default=8, help="ranks (GPUs); attention heads, dense and shared MLPs split by tp")
    p.add_argument("--ep", type=int, default=1,
                   help="routed experts split by id over ep ranks (a divisor of tp), by intermediate over tp/ep")
    p.add_argument("--layout", default="nvfp4", choices=("mxfp4", "nvfp4"),
                   help="checkpoint: nvfp4 (nvidia/Kimi-K3-NVFP4) or mxfp4 (moonshotai/Kimi-K3); weights as served")
    p.add_argument("--gpu-gib", type=float, default=141.0, help="GPU memory (H200: 141 GB ~ 139 GiB usable)")
    p.add_argument("--util", type=float, default=0.9, help="fraction of GPU memory for weights + cache")
    p.add_argument("--max-drafts", type=int, default=0)


def run_generate(a) -> int:
    from model.generate import run
    return run(a)


def run_plan(a) -> int:
    from model.plan import run
    return run(a)


COMMANDS = {
    "generate": (add_generate_arguments, run_generate, "run the Kimi K3 model (small configs; reference path on a CPU)"),
    "plan-memory": (add_plan_arguments, run_plan, "sequences x tokens of the K3 config that fit a GPU, per KV/SSM dtype"),
}


def _run(name: str, argv, prog: str | None) -> int:
    add, run, doc = COMMANDS[name]
    p = argparse.ArgumentParser(prog=prog or f"python -m model {name}", description=doc)
    add(p)
    return run(p.parse_args(argv))


def generate_main(argv=None, prog: str | None = None) -> int:
    return _run("generate", argv, prog)


def plan_main(argv=None, prog: str | None = None) -> int:
    return _run("plan-memory", argv, prog)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m model", description="Kimi K3 assembled from k3gen's kernels")
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND", required=True)
    for name, (add, run, doc) in COMMANDS.items():
        sp = sub.add_parser(name, help=doc, description=doc)
        add(sp)
        sp.set_defaults(fn=run)
    a = p.parse_args(argv)
    return a.fn(a)
