"""tests/gpu/test_model_small.py's teacher-forced comparison (kernel path vs reference path, 8
prompts x 32 forced tokens) with parts of the kernel path swapped for the reference's, to see
which op the measured error comes from: prints rel RMS, top-1 agreement and mean KL per variant.

    python tools/diag_teacher_forced.py [--kv nvfp4 --ssm bf16] [variants: all experts ffn]
variants: `all` the kernel path as is; `experts` with the routed experts on the PyTorch stand-in;
`ffn` with the FFN's kernels (route, glu, experts, latent norm, the stream's mix) on the references.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "gpu")]

import test_model_small as S  # noqa: E402
from numerics import rel_rms  # noqa: E402


def variant(mp, name: str) -> None:
    from model.ffn_ops import FfnOps, KernelFfnOps, RefFfnOps
    if name in ("experts", "ffn"):
        mp.setattr(KernelFfnOps, "moe_experts", FfnOps.moe_experts)
    if name == "ffn":
        for op in ("route", "attn_res_mix", "latent_norm", "glu_hidden"):
            mp.setattr(KernelFfnOps, op, getattr(RefFfnOps, op))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kv", default="nvfp4")
    ap.add_argument("--ssm", default="bf16")
    ap.add_argument("variants", nargs="*", default=["all", "experts", "ffn"])
    a = ap.parse_args()
    for v in a.variants:
        mp = pytest.MonkeyPatch()
        try:
            variant(mp, v)
            _, got, want, _ = S._teacher_forced(a.kv, a.ssm)
            top1 = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
            kl = torch.nn.functional.kl_div(torch.log_softmax(got, -1), torch.log_softmax(want, -1), log_target=True,
                                            reduction="batchmean").item()
            print(f"{a.kv}/{a.ssm} {v:8}: rel RMS {rel_rms(got, want):.4f}  top-1 {top1:.4f}  KL {kl:.4f}", flush=True)
        finally:
            mp.undo()


if __name__ == "__main__":
    main()
