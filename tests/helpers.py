"""Test helpers that several test files share (`from helpers import ...`; tests/ is on sys.path, see
conftest.py). Tolerances live in numerics.py."""
from __future__ import annotations

import torch

from numerics import rel_rms


def fp8_gemm_inputs(m, n, k, recipe, seed):
    """Quantized FP8 GEMM operands on the GPU (x codes, x scales, w codes, w scales): rows spread
    over four decades of magnitude so that every tile scale differs."""
    from k3gen.ops.fp8_block_gemm.reference import quantize_activations, quantize_weights
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * torch.logspace(-2, 2, m).unsqueeze(1)).to(torch.bfloat16)
    w = torch.randn(n, k, generator=g) * torch.logspace(-3, 0, n).unsqueeze(1)
    xc, xs = quantize_activations(x, recipe)
    wc, ws = quantize_weights(w, recipe)
    return [t.cuda() for t in (xc, xs, wc, ws)]


def poisoned_bf16(m, n):
    return torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")


def fp8_gemm_close(out, xc, xs, wc, ws, recipe, bound: float):
    """No NaN, and rel RMS <= bound against both the FP64 and the FP32 reference; returns
    (got, ref64) in float64 on the CPU for the caller's per-element bound."""
    from k3gen.ops.fp8_block_gemm.reference import fp8_block_gemm
    assert not torch.isnan(out).any()
    ref64 = fp8_block_gemm(xc.cpu(), xs.cpu(), wc.cpu(), ws.cpu(), recipe, dtype=torch.float64)
    ref32 = fp8_block_gemm(xc.cpu(), xs.cpu(), wc.cpu(), ws.cpu(), recipe)
    got = out.cpu().double()
    assert rel_rms(got, ref64) <= bound
    assert rel_rms(got, ref32) <= bound
    return got, ref64


def assert_each_rejected(call, args: dict, cases) -> None:
    """For each (name, bad, needle) of `cases`, `call(**args)` with args[name] = bad (bad None:
    args unchanged; CPU tensors then fail the device check) raises a SpecError whose text holds
    `needle`."""
    import pytest

    from k3gen.errors import SpecError
    for name, bad, needle in cases:
        a = dict(args)
        if bad is not None:
            a[name] = bad
        with pytest.raises(SpecError) as e:
            call(**a)
        assert needle in str(e.value)


def random_block_tables(rng, num_seqs: int, per_seq: int, spare_pages: int, num_slots: int):
    """(num_pages, block table [num_seqs, per_seq] int32, ring slot [num_seqs] int32): shuffled, so
    no sequence's pages or ring slot are contiguous, with `spare_pages` pages no sequence owns."""
    num_pages = num_seqs * per_seq + spare_pages
    ids = list(range(num_pages))
    rng.shuffle(ids)
    bt = torch.tensor(ids[:num_seqs * per_seq], dtype=torch.int32).view(num_seqs, per_seq)
    slots = list(range(num_slots))
    rng.shuffle(slots)
    return num_pages, bt, torch.tensor(slots[:num_seqs], dtype=torch.int32)


def fp8_gemm_graph_replay(run, out, xc, xs, fresh, check) -> None:
    """Graph replay of an FP8 GEMM launch: the replay equals the eager run bit for bit, and a replay
    after new activations are copied in (`fresh()` -> (xc, xs)) passes `check(out)`. The eager run comes
    first because a launcher may allocate its workspace there, outside capture."""
    from k3gen.runtime.graphs import capture
    run()
    torch.cuda.synchronize()
    eager = out.clone()
    graph = capture(run)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    nxc, nxs = fresh()
    xc.copy_(nxc)
    xs.copy_(nxs)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    check(out)
