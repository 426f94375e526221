"""`python -m bench --op NAME [--quick] [--out DIR]` runs one benchmark; `--list` names them all.

The same runner is `k3gen bench`. GPU benchmarks need a CUDA GPU; `build` runs on the CPU.
"""
from __future__ import annotations

import argparse
import sys


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--op", help="benchmark name (see --list)")
    p.add_argument("--quick", action="store_true", help="fewer shapes and repetitions")
    p.add_argument("--out", metavar="DIR", default=None,
                   help="folder for the JSON and PNG (default: bench/results/, keeping the newest run per name)")
    p.add_argument("--list", action="store_true", help="list the benchmarks (no GPU needed)")
    return p


def run(a) -> int:
    from bench import harness
    if a.list:
        return harness.list_cases()
    if not a.op:
        print("bench: give --op NAME or --list", file=sys.stderr)
        return 2
    check_op(a.op)
    return harness.main(a)


def check_op(name: str) -> None:
    """An unknown name is answered as such, before anything looks for a GPU."""
    from bench.cases import registry
    from k3gen.errors import K3genError
    known = list(registry())
    if name not in known:
        raise K3genError(f"unknown op {name!r}: no benchmark of that name; known: {', '.join(known)}")


def main(argv=None) -> int:
    from k3gen.errors import K3genError
    a = add_arguments(argparse.ArgumentParser(prog="python -m bench", description=__doc__)).parse_args(argv)
    try:
        return run(a)
    except K3genError as e:
        print(f"bench: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
