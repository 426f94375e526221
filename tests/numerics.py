"""How GPU results are compared with the FP32 references (DESIGN.md "Contracts"): relative RMS plus a
max-abs bound per dtype, fresh random inputs, outputs poisoned first. NaN never passes.

The table holds the bounds the tests have always used; none is looser than before. Tests with a
sharper per-element model keep it next to this check (the KDA ops: every element within
2^-6 |ref| + 1e-3 max|ref|; the FP8 GEMMs: within BF16 rounding plus the tensor cores' accumulation
error), and kernel-vs-kernel comparisons (schedules, batch invariance) keep their own 4e-3.

Import as `from numerics import ...` (tests/ is on sys.path: its conftest.py is at the root of the
test tree and pytest puts that folder there) or `from tests.numerics import ...` from the repository.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Tolerance:
    rel_rms: float                 # ||actual - expected|| / ||expected||
    max_abs: float | None = None   # every |actual - expected| <= max_abs * max|expected| + abs_floor
    abs_floor: float = 0.0


TOLERANCES: dict[torch.dtype, Tolerance] = {
    # BF16 outputs against an FP32/FP64 reference: BF16 rounding (2^-9 relative) plus FP32
    # accumulation order. rel RMS 1e-2 everywhere; max-abs as mla_decode bounds it.
    torch.bfloat16: Tolerance(rel_rms=1e-2, max_abs=3e-2, abs_floor=1e-3),
    # FP32 recurrent state against the FP32 reference (KDA ssm and draft records): order of
    # operations only. No element bound: cancellation makes single elements tiny.
    torch.float32: Tolerance(rel_rms=1e-5),
}


# kda_prefill `chunk64` (k3gen/include/k3gen/kda/prefill_chunk64.cuh): BF16 tensor-core operands with
# FP32 sums (W, e^G Q, K e^(G_C - G), Aqk, the off-diagonal decay factors and the state S as the
# operand of each chunk's products), an FP32 solve, U and state. Each product term carries ~2^-9
# relative rounding, so the raw O and the final state sit about 2.4e-3 relative RMS from the FP64
# token loop, flat from 65 to 8192 tokens (reference.chunk64_emulation, which rounds where the
# kernel does, measured on the CPU: the decayed state does not accumulate it). The bounds keep 4x
# over that: out (BF16, after the gated RMSNorm, plus its own 2^-9 rounding) the BF16 entry above;
# the final state (FP32, or BF16 storage: one more 2^-9 rounding) rel RMS 1e-2. FLA's own chunk_kda
# tests hold BF16 inputs to an error ratio of 5e-3 to 8e-3 on o and the final state, the same scale.
# A token-by-token FP32 kernel stays on the FP32 table above.
KDA_CHUNK64_OUT = Tolerance(rel_rms=1e-2, max_abs=3e-2, abs_floor=1e-3)
KDA_CHUNK64_STATE = Tolerance(rel_rms=1e-2)


def rel_rms(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| in FP64 on the CPU; NaN or Inf anywhere makes it NaN/Inf,
    which compares false against every bound."""
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    return float((a - e).norm() / e.norm().clamp_min(1e-30))


def tolerance(dtype: torch.dtype | str) -> Tolerance:
    if isinstance(dtype, str):
        dtype = getattr(torch, {"bf16": "bfloat16", "fp32": "float32"}.get(dtype, dtype))
    if dtype not in TOLERANCES:
        raise KeyError(f"no tolerance for {dtype}: add it to tests/numerics.TOLERANCES")
    return TOLERANCES[dtype]


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | str | Tolerance | None = None,
                 what: str = "") -> None:
    """actual (a kernel's output) against expected (the reference) with the bounds of `dtype`
    (default: actual's dtype; a Tolerance: a named entry such as KDA_CHUNK64_OUT). Non-finite values
    in actual always fail."""
    tol = dtype if isinstance(dtype, Tolerance) else tolerance(dtype if dtype is not None else actual.dtype)
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    where = f"{what}: " if what else ""
    if a.shape != e.shape:
        raise AssertionError(f"{where}shape {tuple(a.shape)} != reference {tuple(e.shape)}")
    bad = ~torch.isfinite(a)
    if bad.any():
        raise AssertionError(f"{where}{int(bad.sum())} non-finite values (NaN never passes), first at "
                             f"{bad.nonzero()[0].tolist()}")
    err = rel_rms(a, e)
    if not err <= tol.rel_rms:
        raise AssertionError(f"{where}relative RMS {err:.3g} > {tol.rel_rms:g}")
    if tol.max_abs is not None:
        diff = (a - e).abs()
        bound = tol.max_abs * float(e.abs().max()) + tol.abs_floor
        if not float(diff.max()) <= bound:
            raise AssertionError(f"{where}max abs error {float(diff.max()):.3g} > {bound:.3g} "
                                 f"({int((diff > bound).sum())} elements)")


def poison(tensor: torch.Tensor) -> torch.Tensor:
    """Fill an output, in place, with what no kernel may leave behind unnoticed: NaN for floating
    types (FP8 included), all bits set for integer types (a 0xFF byte is NaN as E4M3). Returns it."""
    if tensor.is_floating_point():
        return tensor.fill_(float("nan"))
    if tensor.dtype == torch.uint8:
        return tensor.fill_(0xFF)
    return tensor.fill_(-1)   # all bits set in two's complement
