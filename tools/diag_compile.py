"""Diagnose tests/gpu/test_library.py::test_compiled_decode_step on the H200: per-step relative RMS
of the small model's decode logits, a compiled step_core against the eager model, for each mode
given (`eager`: step_core itself, the control; `default`: torch.compile without CUDA graphs;
`reduce-overhead`: with cudagraph trees), teacher-forced on eager's tokens.

    python tools/diag_compile.py [--kv bf16] [--ssm fp32] [modes ...]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "gpu")]

from numerics import rel_rms  # noqa: E402
from test_library import _small, _teacher_forced  # noqa: E402
from test_model_small import prompts  # noqa: E402

from model.ops import prepare_compile  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kv", default="bf16")
    ap.add_argument("--ssm", default="fp32")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("modes", nargs="*", default=["eager", "default", "reduce-overhead"])
    a = ap.parse_args()
    ps = prompts(4, seed=24, length=16)
    for mode in a.modes:
        torch._dynamo.reset()
        m = _small(a.kv, a.ssm)
        prepare_compile(m)

        def core(tokens, slots, start, m=m):
            return m.step_core(tokens, slots, start, 1)
        step = core if mode == "eager" else torch.compile(core, fullgraph=True, dynamic=False,
                                                          mode=None if mode == "default" else mode)
        me = _small(a.kv, a.ssm)
        me.load_kernels()
        for group in (ps[:1], ps):
            errs = [rel_rms(x, y) for x, y in _teacher_forced(m, step, me, group, a.steps)]
            print(f"{mode:>16} B={len(group)}: " + " ".join(f"{e:.2e}" for e in errs), flush=True)


if __name__ == "__main__":
    main()
