"""Time every launch plan of the sm90 FP8 block GEMM on the bar shapes, in one GPU call, and print
one table: which plan is fastest per (shape, M), the default plan's time, the bar and cuBLASLt.

Usage (H200, K3GEN_PREBUILT bundle from tools/prebuild_gpu.py, which builds these specs from
tests/gpu/specs.py):
    python tools/sweep_gemm.py [--quick] [--recipe fp32|ue8m0] [--json OUT.json]
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness import copy_ceiling_tbps  # noqa: E402
from bench.cases.fp8_block_gemm import fp8_block_gemm_sweep  # noqa: E402
from k3gen.ir.dtypes import ScaleRecipe  # noqa: E402


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="the two >= 32 MB shapes only")
    ap.add_argument("--recipe", default="fp32", choices=[r.value for r in ScaleRecipe])
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    ceiling = copy_ceiling_tbps()
    rows = fp8_block_gemm_sweep(ceiling, quick=a.quick, recipe=ScaleRecipe(a.recipe))
    print(f"copy ceiling {ceiling:.2f} TB/s")
    print(f"{'case':<52} {'us':>8} {'%copy':>6} {'%same':>6} {'x cuBLASLt':>10} {'bar us':>7}  default")
    groups: dict = {}
    for r in rows:
        groups.setdefault((r.extra["n"], r.extra["k"], r.extra["m"]), []).append(r)
    for rs in groups.values():
        best = min(rs, key=lambda r: r.us)
        for r in rs:
            bar = r.extra.get("bar_us")
            print(f"{r.case:<52} {r.us:8.2f} {r.pct_copy:6.0f} {r.pct_same_copy:6.0f} "
                  f"{(f'{r.speedup:.2f}' if r.speedup else '-'):>10} {(f'{bar:.1f}' if bar else '-'):>7}  "
                  f"{'*' if r.extra['default'] else ' '}{' BEST' if r is best else ''}")
        print()
    if a.json:
        Path(a.json).write_text(json.dumps({"ceiling_tbps": ceiling, "rows": [asdict(r) for r in rows]}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
