"""One MLA decode launch of a wgmma kernel (issue 27's racecheck triage): a single sequence of the
sanitize test's cache, split plan as asked, small enough for
`compute-sanitizer --tool racecheck --racecheck-trace-sync yes` to print every barrier event of its
few CTAs. Checks the output against the reference, so a wrong variant also shows.

    compute-sanitizer --tool racecheck --racecheck-report hazard --racecheck-trace-sync yes \\
        python3 tools/race_mla_one.py [--fmt nvfp4-linear-m3|fp8-tok128] [--len 130] [--splits 1]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "gpu")]


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fmt", default="nvfp4-linear-m3", help="a cache format of tests/gpu/test_mla_decode.py")
    p.add_argument("--len", type=int, default=130, help="the sequence's cached length")
    p.add_argument("--splits", type=int, default=1)
    a = p.parse_args(argv)
    import test_mla_decode as M  # noqa: PLC0415  (needs the GPU; imported after the arguments parse)
    b = M.Batch(a.fmt, [a.len], 1, seed=11)
    op = M.attn(a.fmt, 12, 1, "wgmma")
    q = b.query(12, 11)
    ref = b.reference(q)
    M.assert_close(b.run(op, q, plan=op.plan(1, a.len, splits=a.splits)), ref, f"{a.fmt} len {a.len} s{a.splits}")
    print(f"{a.fmt} len {a.len} splits {a.splits}: output matches the reference")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
