"""build: how long `k3gen build` of one target takes on the CPU, cold and warm (`python -m bench --op build`).

PERF.md's bar: on 2 CPU cores, cold < 120 s (empty kernel cache: every kernel through NVRTC) and
warm < 3 s (the same command again: every cubin from the cache, the bundle rewritten). Measured
here rather than asserted by a unit test: a loaded machine makes wall-clock asserts flaky, and
the tests keep only what the build must produce (tests/nogpu/pipeline/test_build.py).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.harness import case

TARGET = "sm103"
QUICK_TARGET = "sm100"   # the frozen target: 7 kernels, for a quick check of the plumbing
JOBS = 2
COLD_BAR_S = 120.0
WARM_BAR_S = 3.0
SUMMARY = re.compile(r"(\d+) kernels, (\d+) compiled, (\d+) from cache")


def _timed(cmd: list[str], env: dict) -> tuple[float, dict]:
    from k3gen.errors import K3genError
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - t0
    m = SUMMARY.search(p.stdout)
    if p.returncode != 0 or m is None:
        raise K3genError(f"`{' '.join(cmd)}` failed (exit {p.returncode}):\n{(p.stderr or p.stdout)[-2000:]}")
    kernels, compiled, cached = map(int, m.groups())
    return seconds, {"kernels": kernels, "compiled": compiled, "from_cache": cached}


@case(device="cpu")
def build(quick: bool = False) -> list[dict]:
    """Cold and warm `k3gen build` of one target (sm103, -j 2; --quick: sm100) vs cold < 120 s, warm < 3 s."""
    target = QUICK_TARGET if quick else TARGET
    with tempfile.TemporaryDirectory(prefix="k3gen-bench-build-") as tmp:
        tmp = Path(tmp)
        # A fresh cache makes the first run cold; generated/ goes to the temporary folder so the
        # benchmark never rewrites the committed tree.
        env = {**os.environ, "K3GEN_CACHE_DIR": str(tmp / "cache")}
        cmd = [sys.executable, "-m", "k3gen", "build", "--arch", target, "-j", str(JOBS),
               "--generated", str(tmp / "generated"), "--out", str(tmp / "bundle")]
        rows = []
        for name, bar, want in (("cold", COLD_BAR_S, "from_cache"), ("warm", WARM_BAR_S, "compiled")):
            print(f"  build {name}: {target}, -j {JOBS}", flush=True)
            seconds, counts = _timed(cmd, env)
            # Cold compiles everything and warm nothing, else the figure is not the one the bar is for.
            expected = counts[want] == 0
            rows.append({"case": f"{name} {target}", "seconds": seconds, "bar_s": bar,
                         "meets_bar": seconds < bar if expected else None, "target": target, "jobs": JOBS,
                         **counts, "as_expected": expected,
                         "detail": f"{counts['kernels']} kernels, {counts['compiled']} compiled"
                                   + ("" if expected else f" (a {name} build should have {want} = 0)")})
    return rows
