"""The model's command line: `python -m model generate|plan-memory|eval|train ...`, also reachable as
`k3gen generate` / `k3gen plan-memory` / `k3gen eval` / `k3gen train` (k3gen/cli.py resolves
`generate_main` / `plan_main` / `eval_main` / `train_main` by name when one of them runs). Kept free of heavy imports: `--help` must answer fast.

Each argument is parsed and range-checked by argparse (one line on stderr, exit 2); what needs the
model config or several arguments together is checked by the command before any work (a typed
`K3genError`, which `k3gen` and `main` below print as one line on stderr, exit 2)."""
from __future__ import annotations

import argparse
import sys

# The same parser, help formatter and choices as the rest of `k3gen` (model/ may import k3gen).
from k3gen.cli import ARCH_CHOICES, KV_CHOICES, MAX_DRAFTS, MODEL_PRESETS, SSM_CHOICES, _Help, _Parser
from k3gen.errors import K3genError

from model.argtypes import float_in, int_in  # noqa: F401  (re-exported: the commands' argument types)

ARCH_HELP = "target GPU family: " + ", ".join(ARCH_CHOICES)


def prompt_ids(text: str) -> list[int]:
    """Comma-separated integers, at least one; their range is checked against the config's vocab."""
    parts = [x.strip() for x in text.split(",")]
    if not any(parts):
        raise argparse.ArgumentTypeError("the prompt is empty: give at least one token id")
    out = []
    for x in parts:
        try:
            out.append(int(x))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{x!r} in {text!r} is not an integer token id") from None
    return out


prompt_ids.__name__ = "token ids"


def add_generate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, metavar="NAME",
                   help=f"model config: a preset ({MODEL_PRESETS}) or a config.json / checkpoint folder "
                   "(default: the --checkpoint folder's config.json, else small)")
    p.add_argument("--arch", default="sm90", choices=ARCH_CHOICES, metavar="ARCH", help=ARCH_HELP)
    p.add_argument("--kv", default="bf16", choices=KV_CHOICES, help="KV cache dtype: {bf16,fp8,nvfp4}")
    p.add_argument("--ssm", default="fp32", choices=SSM_CHOICES, help="recurrent-state dtype: {fp32,bf16}")
    p.add_argument("--prompt-ids", default=[1, 2, 3, 4, 5, 6, 7, 8], type=prompt_ids, metavar="ID,..",
                   help="comma-separated token ids, each in [0, vocab) of the config "
                   "(default: 1,2,3,4,5,6,7,8; a negative first id needs --prompt-ids=-1,..)")
    p.add_argument("--batch", type=int_in(1, None, "the batch is >= 1"), default=1, metavar="N",
                   help="copies of the prompt run as one batch, >= 1")
    p.add_argument("--max-new", type=int_in(1, None, "the number of new tokens is >= 1"), default=16,
                   metavar="N", help="tokens to generate per sequence, >= 1")
    p.add_argument("--temperature", type=float_in(0.0, None, "the temperature is >= 0 (0: greedy)"),
                   default=0.0, metavar="T", help="sampling temperature, >= 0; 0 is greedy")
    p.add_argument("--seed", type=int_in(0, 2**63 - 1, "the seed is >= 0"), default=0, metavar="N",
                   help="sampling seed (request i uses seed + i) and the random checkpoint's seed")
    p.add_argument("--spec", type=int_in(0, MAX_DRAFTS, f"the draft count is in 0..{MAX_DRAFTS}"), default=0,
                   metavar="M", help=f"speculative decoding with M n-gram drafts, 0..{MAX_DRAFTS} "
                   "(greedy only: not with --temperature > 0); 0: off")
    p.add_argument("--checkpoint", default=None, metavar="DIR",
                   help="checkpoint folder in a published layout: compressed-tensors MXFP4 (moonshotai/Kimi-K3), "
                   "ModelOpt NVFP4 (nvidia/Kimi-K3-NVFP4) or plain save_pretrained BF16/FP32 (Kimi-Linear), "
                   "detected from its files (default: a random NVFP4 one of the config and --seed, made once in "
                   "the k3gen cache folder's checkpoints/; `k3gen cache clear` removes it)")
    p.add_argument("--path", default="auto", choices=("auto", "reference", "kernel"),
                   help="reference: PyTorch on the CPU; kernel: k3gen's kernels on a CUDA GPU; "
                   "auto: kernel when a GPU is found")
    p.add_argument("--graphs", action="store_true",
                   help="CUDA graphs per decode batch size (kernel path on a GPU; default: off)")
    p.add_argument("--invariant", action=argparse.BooleanOptionalAction, default=None,
                   help="batch-invariant, lossless serving (TargetConfig.invariant): a request's tokens and logits "
                   "the same bits whatever batch it shares, and speculative decoding bit for bit plain greedy "
                   "decoding for every KV dtype (kernel path; default: TargetConfig's)")
    p.add_argument("--prefill-chunk", type=int_in(1, None, "the piece length is >= 1 token"), default=None,
                   metavar="N", help="prefill the prompts in pieces of at most N tokens, each piece continuing "
                   "from the cached state (chunked prefill; not with --kv nvfp4); default: the whole prompt at once")
    p.add_argument("--max-seq-len", type=int_in(1, None, "the sequence length is >= 1"), default=512,
                   metavar="N", help="longest sequence the cache holds; must hold the prompt + --max-new")
    p.add_argument("--tp", type=int_in(1, None, "the tensor-parallel degree is >= 1"), default=1, metavar="N",
                   help="ranks: attention heads, vocabulary, dense and shared MLPs split over N; launch with "
                   "`torchrun --nproc-per-node N -m model generate ... --tp N` (default 1: no torch.distributed)")
    p.add_argument("--ep", type=int_in(1, None, "the expert-parallel degree is >= 1"), default=1, metavar="M",
                   help="routed experts split by id over M ranks (a divisor of --tp), each expert's "
                   "intermediate over tp/M (default 1: MoE TP over all ranks)")
    p.add_argument("--dist-timeout", type=float_in(0.0, None, "the timeout is > 0 seconds", lo_open=True),
                   default=600.0, metavar="S", help="seconds a collective waits for the other ranks before every "
                   "rank fails (a rank that died or hung; default 600)")


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default="k3", metavar="NAME",
                   help=f"model config: a preset ({MODEL_PRESETS}) or a config.json / checkpoint folder")
    p.add_argument("--arch", default="sm90", choices=ARCH_CHOICES, metavar="ARCH", help=ARCH_HELP)
    p.add_argument("--tp", type=int_in(1, None, "the tensor-parallel degree is >= 1"), default=8, metavar="N",
                   help="ranks (GPUs), >= 1; attention heads, dense and shared MLPs split by tp")
    p.add_argument("--ep", type=int_in(1, None, "the expert-parallel degree is >= 1"), default=1, metavar="N",
                   help="routed experts split by id over ep ranks (a divisor of tp), by intermediate over tp/ep")
    p.add_argument("--layout", default="nvfp4", choices=("mxfp4", "nvfp4", "bf16"),
                   help="checkpoint: nvfp4 (nvidia/Kimi-K3-NVFP4), mxfp4 (moonshotai/Kimi-K3) or bf16 (plain "
                   "save_pretrained, e.g. Kimi-Linear: routed experts stay BF16); weights as served")
    p.add_argument("--gpu-gib", type=float_in(0.0, None, "the GPU memory is > 0 GiB", lo_open=True),
                   default=141.0, metavar="GIB", help="GPU memory in GiB, > 0 (H200: 141 GB ~ 139 GiB usable)")
    p.add_argument("--util", type=float_in(0.0, 1.0, "the fraction is in (0, 1]", lo_open=True), default=0.9,
                   metavar="F", help="fraction of GPU memory for weights + cache, in (0, 1]")
    p.add_argument("--max-drafts", type=int_in(0, MAX_DRAFTS, f"the draft count is in 0..{MAX_DRAFTS}"),
                   default=0, metavar="M", help=f"speculative drafts the cache holds room for, 0..{MAX_DRAFTS}")


def run_generate(a) -> int:
    from model.generate import run
    return run(a)


def run_plan(a) -> int:
    from model.plan import run
    return run(a)


def add_eval_arguments(p: argparse.ArgumentParser) -> None:
    from model.eval.command import add_eval_arguments as add
    add(p)


def run_eval(a) -> int:
    from model.eval.command import run
    return run(a)


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    from model.train.command import add_train_arguments as add
    add(p)


def run_train(a) -> int:
    from model.train.command import run
    return run(a)


COMMANDS = {
    "generate": (add_generate_arguments, run_generate, "run the Kimi K3 model (small configs; reference path on a CPU)"),
    "plan-memory": (add_plan_arguments, run_plan, "sequences x tokens of the K3 config that fit a GPU, per KV/SSM dtype"),
    "eval": (add_eval_arguments, run_eval, "exact match of a trained checkpoint per KV/SSM dtype, batch, graphs, "
             "speculative decoding (docs/ACCURACY.md)"),
    "train": (add_train_arguments, run_train, "train the small K3 of the accuracy table on synthetic tasks"),
}


def _run(name: str, argv, prog: str | None) -> int:
    """Parse and run; a typed error propagates (`k3gen`'s main and `main` below print it)."""
    add, run, doc = COMMANDS[name]
    p = _Parser(prog=prog or f"python -m model {name}", description=doc, formatter_class=_Help)
    add(p)
    return run(p.parse_args(argv))


def generate_main(argv=None, prog: str | None = None) -> int:
    return _run("generate", argv, prog)


def plan_main(argv=None, prog: str | None = None) -> int:
    return _run("plan-memory", argv, prog)


def eval_main(argv=None, prog: str | None = None) -> int:
    return _run("eval", argv, prog)


def train_main(argv=None, prog: str | None = None) -> int:
    return _run("train", argv, prog)


def main(argv=None) -> int:
    p = _Parser(prog="python -m model", description="Kimi K3 assembled from k3gen's kernels", formatter_class=_Help)
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND", required=True, parser_class=_Parser)
    for name, (add, run, doc) in COMMANDS.items():
        sp = sub.add_parser(name, help=doc, description=doc, formatter_class=_Help)
        add(sp)
        sp.set_defaults(fn=run)
    a = p.parse_args(argv)
    try:
        from k3gen.config import check_all
        check_all()
        return a.fn(a) or 0
    except K3genError as e:
        print(f"{p.prog} {a.cmd}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"{p.prog} {a.cmd}: error: {e.strerror or e}" + (f": {e.filename}" if e.filename else ""),
              file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{p.prog}: interrupted", file=sys.stderr)
        return 130
