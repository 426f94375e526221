"""Which kernel makes the kernel path's chunked prefill leave the reference's (issue 30) on the GPU:
tests/gpu/test_model_chunked_prefill.py's small model and prompt; per (kv, ssm, cuts), the
kernel path's chunked logits against the reference path's chunked logits with every kernel, then
with one kernel op at a time swapped for its reference (RefOps / Ops), beside the rounding floor.
A swap that brings the error to the floor names the op; one-piece rows say whether chunking matters.

    python tools/diag_chunked_prefill.py [kv:ssm:cut,cut ...]   (default: fp8:fp32:37 and friends)
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "gpu")]

import test_model_chunked_prefill as C  # noqa: E402
from helpers import logits_errors  # noqa: E402
from model.ops import KernelOps, Ops, RefOps  # noqa: E402

SWAPS = {
    "kv_write": RefOps.kv_write,
    "prefill_attention": Ops.prefill_attention,
    "kda_prefill": RefOps.kda_prefill,
    "linear": RefOps.linear,
}


def line(what, got, want, alt):
    e, f = logits_errors(got, want), logits_errors(alt, want)
    print(f"  {what:28s} rel {e['rel']:.4f} ({e['rel'] / f['rel']:.2f}x floor)  median {e['median']:.4f} "
          f"({e['median'] / f['median']:.2f}x)  top1 {e['top1']:.3f}  [floor rel {f['rel']:.4f} median "
          f"{f['median']:.4f} top1 {f['top1']:.3f}]", flush=True)


def case(kv: str, ssm: str, cuts: tuple) -> None:
    print(f"== {kv} KV, {ssm} SSM, cuts {cuts or 'none'}", flush=True)
    want, alt = C.reference(kv, ssm, cuts)
    line("all kernels", C.run(C.make(kv, ssm), cuts), want, alt)
    for name, ref in SWAPS.items():
        mp = pytest.MonkeyPatch()
        mp.setattr(KernelOps, name, ref)
        mp.setattr(KernelOps, "linear_acc", RefOps.linear_acc, raising=False)
        try:
            line(f"{name} on the reference", C.run(C.make(kv, ssm), cuts), want, alt)
        except Exception as exc:   # noqa: BLE001 - a diagnostic: say it and go on
            print(f"  {name}: {type(exc).__name__}: {exc}", flush=True)
        finally:
            mp.undo()


def main(argv: list[str]) -> None:
    todo = argv or ["fp8:fp32:37", "fp8:fp32:", "fp8:fp32:1,64,100,129,200,255", "bf16:fp32:37", "fp8:bf16:37"]
    for t in todo:
        kv, ssm, cuts = t.split(":")
        case(kv, ssm, tuple(int(x) for x in cuts.split(",") if x))


if __name__ == "__main__":
    main(sys.argv[1:])
