"""Chunked prefill on the H200 (kernel path: kda_prefill with `resume`, mla_prefill with a cached prefix
in cu_seqlens_k, kv_cache_write at the pieces' start positions), small config. First run (H100,
2026-12-05): 14 of 16 pass; FP8 KV + FP32 SSM fails at cuts 37 and 1/64/100/129/200/255 (median-row
relative RMS 0.102 against a bound of 0.098), open. tools/diag_chunked_prefill.py (H100, 2026-12-07,
cut 37) finds no single kernel: swapping kv_cache_write for its reference changes no printed digit
(median 0.1006, 2.10x the floor), and swapping any one of mla_prefill, kda_prefill or the FP8
GEMMs for its reference brings the median row to 1.43x / 1.29x / 1.19x the floor (all-row 1.14-1.18x
in every case). A likely reading (not yet tested): the FP8 prefix quantization turns the sum of those
kernels' stated rounding differences into whole E4M3 steps of the cached keys, which the reference's
FP32-projection floor moves less often. tools/diag_fp8_flips.py (CPU, 2026-12-07) does not support that
reading: one-ulp flips of 1%, 10% or 30% of every projection's BF16 outputs move the reference's logits by
1.18-1.26x its floor (median row) with FP8 KV and 1.18-1.22x with BF16 KV, no more with FP8. So the
kernels' differences are not plain output roundings; what they are is still open. No one kernel is wrong
alone, and the bound is not loosened.
The CPU tests of the same contract: tests/nogpu/modeling/test_model_chunked_prefill_cpu.py.
On the kernels a prompt in pieces is not one piece bit for bit (kda_prefill's 64-token chunks start at
each piece, the FP8 GEMMs' sums may follow the row count above 128 rows), so the checks follow
test_model_small.py's teacher-forced method: every logits row of the kernel path's chunked prefill
against the reference path's chunked prefill (the same cuts, so the same FP8 prefix quantization and
BF16 state roundings), judged against the reference's own rounding floor measured in the same run
(its projections summed in FP32: helpers.floor_error, FLOOR_FACTOR x on the all-row and median-row
relative RMS); and the kernel path's chunked logits against its own one piece, judged the same way.
A mutation of each half (the cached prefix dropped from the MLA keys, the KDA state reset on resume)
must fail the first check: if one does not, that mutation is below this model's rounding floor and the
test says so by failing.
"""
from __future__ import annotations

import functools

import pytest
import torch

import model.layers as L
from model.cache import HybridCache
from model.config import TargetConfig, small_config
from model.model import K3Model
from model.ops import KernelOps
from model.weights import load_weights
from helpers import floor_error, logits_errors, random_checkpoint_dir, reference_projections_in_fp32

pytestmark = pytest.mark.gpu
CFG = small_config()
N = 300
# 2 pieces: inside the first 64-token page / at a page and 64-token chunk boundary / past it; 7 pieces.
CUTS = [(37,), (128,), (200,), (1, 64, 100, 129, 200, 255)]
COMBOS = [("bf16", "fp32"), ("fp8", "fp32"), ("bf16", "bf16")]


@functools.lru_cache(maxsize=1)
def checkpoint_dir():
    return random_checkpoint_dir(CFG, 11)


@functools.lru_cache(maxsize=None)
def weights():
    return load_weights(checkpoint_dir(), CFG).to("cuda")


def make(kv, ssm, path="kernel"):
    t = TargetConfig(kv=kv, ssm=ssm, max_drafts=3, path=path)
    return K3Model(weights(), t, HybridCache(CFG, t, num_slots=2, num_pages=20, max_seq_len=512, device="cuda"))


def prompt(seed=0):
    return torch.randint(0, CFG.vocab, (N,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(m: K3Model, cuts=()) -> torch.Tensor:
    b = [0, *cuts, N]
    seq = prompt()
    out = torch.cat([m.prefill([0], [seq[x:y]], all_logits=True, resume=x > 0) for x, y in zip(b, b[1:])])
    m.release([0])
    return out.float().cpu()


def reference(kv, ssm, cuts):
    """(the reference path's chunked logits, the same with FP32 projections: the floor)."""
    want = run(make(kv, ssm, "reference"), cuts)
    with reference_projections_in_fp32():
        alt = run(make(kv, ssm, "reference"), cuts)
    return want, alt


def report(what, got, want, alt):
    e, f = logits_errors(got, want), logits_errors(alt, want)
    print(f"\n{what}: rel {e['rel']:.4f} (floor {f['rel']:.4f}), median row {e['median']:.4f} "
          f"(floor {f['median']:.4f}), top-1 {e['top1']:.4f}")


@pytest.mark.parametrize("cuts", CUTS, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("kv,ssm", COMBOS, ids=lambda x: x)
def test_kernel_chunked_prefill_vs_reference(kv, ssm, cuts):
    want, alt = reference(kv, ssm, cuts)
    m = make(kv, ssm)
    got = run(m, cuts)
    assert torch.isfinite(got).all()
    report(f"[{kv} KV, {ssm} SSM, cuts {cuts}] kernel chunked vs reference chunked", got, want, alt)
    msg = floor_error(got, want, alt, f"chunked prefill logits ({kv} KV, {ssm} SSM, cuts {cuts})")
    assert msg is None, msg
    ran = {k for k, v in m.ops.ran.items() if v}
    assert {"kernel:kda_prefill", "kernel:mla_prefill", "kernel:kv_cache_write"} <= ran, ran
    assert not {k for k in ran if k.startswith("ref:")}, ran
    assert m.cache.mgr.free_slots == 2 and m.cache.mgr.free_pages == 20


@pytest.mark.parametrize("cuts", [CUTS[0], CUTS[3]], ids=lambda c: "-".join(map(str, c)))
def test_kernel_chunked_vs_kernel_one_piece(cuts):
    """BF16 KV + FP32 SSM: what chunking alone moves on the kernels, against the reference's floor of
    one piece (on the reference path chunking moves nothing: the CPU test)."""
    want, alt = reference("bf16", "fp32", ())
    m = make("bf16", "fp32")
    one, got = run(m, ()), run(m, cuts)
    report(f"[cuts {cuts}] kernel chunked vs kernel one piece", got, one, alt)
    msg = floor_error(got, one, alt, f"kernel chunked vs one piece (cuts {cuts})")
    assert msg is None, msg


@pytest.mark.parametrize("mutation", ["prefix dropped", "kda state reset"])
def test_mutations_fail_the_reference_check(mutation, monkeypatch):
    cuts = CUTS[3]
    want, alt = reference("bf16", "fp32", cuts)
    if mutation == "prefix dropped":
        real = L.mla_cached_prefix
        monkeypatch.setattr(L, "mla_cached_prefix", lambda *a: torch.zeros_like(real(*a)))
    else:
        real = KernelOps.kda_prefill

        def reset(self, qkvg, fa, beta, cu, slots, resume, pools, w):
            return real(self, qkvg, fa, beta, cu, slots, torch.zeros_like(resume), pools, w)
        monkeypatch.setattr(KernelOps, "kda_prefill", reset)
    got = run(make("bf16", "fp32"), cuts)
    report(f"[mutation: {mutation}] kernel chunked vs reference chunked", got, want, alt)
    assert floor_error(got, want, alt, mutation) is not None, f"{mutation}: within the rounding floor"
