"""mla_prefill on the H200 against the FP64 reference (tests/numerics.py's BF16 bound: BF16 operands,
P rounded to BF16, FP32 accumulation), outputs poisoned first: lengths {1, 15, 16, 17, 63, 64, 65,
1000, 4096} in one varlen batch at H 6 / 12 / 96, both output dtypes, strided views as the model
passes them (k_nope / v halves of one kv_b expansion, k_pe a column slice of the cache rows),
continuation in 2 and 7 pieces (one varlen launch of prefixed pieces) against one piece, graph
replay == eager, out-of-range offsets clamped on the device, a small `sanitize` case."""
from __future__ import annotations

import pytest
import torch

from k3gen.ops.mla_prefill.launcher import MlaPrefill
from k3gen.ops.mla_prefill.reference import mla_prefill
from k3gen.ops.mla_prefill.spec import MlaPrefillSpec, OutDtype, PrefillKernel
from k3gen.runtime.graphs import capture
from k3gen.targets import TARGETS
from numerics import assert_close, poison, rel_rms

pytestmark = pytest.mark.gpu
SM90 = TARGETS["sm90"]
BF = torch.bfloat16
LENGTHS = (1, 15, 16, 17, 63, 64, 65, 1000, 4096)
# The kernels sm_90a builds (the tcgen05 one is the SM100 family's: test_mla_prefill_tcgen05.py, CPU only).
KERNELS = tuple(k for k in tuple(PrefillKernel)[1:]
                if MlaPrefillSpec.variants.reasons(MlaPrefillSpec(target=SM90, heads=12))[k.value] is None)


def _op(H, out_dtype=OutDtype.FP32, kernel=PrefillKernel.AUTO):
    return MlaPrefill(MlaPrefillSpec(target=SM90, heads=H, out_dtype=out_dtype, kernel=kernel)).load()


def _keys(H, nk, seed):
    """k_nope / v as the two halves of one [nk, H, 256] expansion, k_pe columns 512.. of [nk, 576] rows."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    kv = torch.randn(nk, H, 256, device="cuda", generator=g).to(BF)
    rows = torch.randn(nk, 576, device="cuda", generator=g).to(BF)
    return kv[..., :128], rows[:, 512:], kv[..., 128:]


def _q(H, nq, seed):
    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    return torch.randn(nq, H, 192, device="cuda", generator=g).to(BF)


def _cu(lengths):
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def _run(op, q, kn, kp, v, cq, ck, max_q, dtype=torch.float32, heads_fast=None):
    i32 = dict(dtype=torch.int32, device="cuda")
    out = poison(torch.empty(q.shape[0], q.shape[1], 128, dtype=dtype, device="cuda"))
    op(q, kn, kp, v, torch.tensor(cq, **i32), torch.tensor(ck, **i32), out, max_q, heads_fast=heads_fast)
    torch.cuda.synchronize()
    return out


@pytest.mark.parametrize("H", [6, 12, 96])
def test_varlen_batch_matches_reference(H):
    cu = _cu(LENGTHS)
    q, (kn, kp, v) = _q(H, cu[-1], H), _keys(H, cu[-1], H)
    ref = mla_prefill(q, kn, kp, v, cu, cu)
    for kernel in KERNELS:
        out = _run(_op(H, kernel=kernel), q, kn, kp, v, cu, cu, max(LENGTHS))
        for b, n in enumerate(LENGTHS):
            assert_close(out[cu[b]:cu[b + 1]], ref[cu[b]:cu[b + 1]], torch.bfloat16,
                         what=f"{kernel.value} H{H} length {n}")


@pytest.mark.parametrize("heads_fast", [True, False])
@pytest.mark.parametrize("kernel", KERNELS)
def test_bf16_output_contiguous_keys_both_grid_orders(kernel, heads_fast):
    """Contiguous k_nope / v / k_pe (the model's einsum outputs) and both grid orders."""
    H, lengths = 12, (17, 300, 1, 129)
    cu = _cu(lengths)
    q, (kn, kp, v) = _q(H, cu[-1], 5), (t.contiguous() for t in _keys(H, cu[-1], 5))
    out = _run(_op(H, OutDtype.BF16, kernel), q, kn, kp, v, cu, cu, 300, BF, heads_fast=heads_fast)
    assert_close(out, mla_prefill(q, kn, kp, v, cu, cu), what="bf16 out")


def test_nan_in_another_sequence_stays_there():
    """A tail tile's V rows past the sequence end belong to the next sequence: a NaN there must not
    reach this sequence (its V comes by zero-filling copies), and K rows there are masked by a select."""
    H, lengths = 6, (100, 200)
    cu = _cu(lengths)
    q, (kn, kp, v) = _q(H, cu[-1], 6), _keys(H, cu[-1], 6)
    kn[100:110] = float("nan")
    v[100:110] = float("inf")
    kp[100:110] = float("nan")
    for kernel in KERNELS:
        out = _run(_op(H, kernel=kernel), q, kn, kp, v, cu, cu, 200)
        assert_close(out[:100], mla_prefill(q[:100], kn[:100], kp[:100], v[:100], [0, 100], [0, 100]),
                     torch.bfloat16, what=kernel.value)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("pieces", [2, 7])
@pytest.mark.parametrize("H", [12, 96])
def test_continuation_equals_one_piece(H, pieces, kernel):
    """A 1000-token prompt in `pieces` parts (uneven cuts), all parts in one varlen launch, part j with
    the keys of every earlier row as its prefix (its own copy of them), against the whole prompt."""
    n = 1000
    q, (kn, kp, v) = _q(H, n, 40 + pieces), _keys(H, n, 40 + pieces)
    op = _op(H, kernel=kernel)
    whole = _run(op, q, kn, kp, v, [0, n], [0, n], n)
    cuts = sorted({0, n, *[int(n * (j / pieces) ** 1.3) + j for j in range(1, pieces)]})
    assert len(cuts) == pieces + 1
    ck = [0]
    kn_p, kp_p, v_p = [], [], []
    for lo, hi in zip(cuts, cuts[1:]):
        kn_p.append(kn[:hi])
        kp_p.append(kp[:hi])
        v_p.append(v[:hi])
        ck.append(ck[-1] + hi)
    KN, KP, V = torch.cat(kn_p), torch.cat(kp_p), torch.cat(v_p)
    out = _run(op, q, KN, KP, V, cuts, ck, max(b - a for a, b in zip(cuts, cuts[1:])))
    ref = mla_prefill(q, kn, kp, v, [0, n], [0, n])
    assert_close(out, ref, torch.bfloat16, what=f"{pieces} pieces")
    assert rel_rms(out, whole) <= 4e-3   # kernel vs kernel: other tile alignments, same math


@pytest.mark.parametrize("kernel", KERNELS)
def test_graph_replay_equals_eager(kernel):
    H, lengths = 12, (65, 1000, 3)
    cu = _cu(lengths)
    q, (kn, kp, v) = _q(H, cu[-1], 7), _keys(H, cu[-1], 7)
    op = _op(H, kernel=kernel)
    i32 = dict(dtype=torch.int32, device="cuda")
    cq = torch.tensor(cu, **i32)
    out = poison(torch.empty(cu[-1], H, 128, device="cuda"))
    op(q, kn, kp, v, cq, cq, out, 1000)
    torch.cuda.synchronize()
    eager = out.clone()
    graph = capture(lambda: op(q, kn, kp, v, cq, cq, out, 1000))
    poison(out)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    assert_close(eager, mla_prefill(q, kn, kp, v, cu, cu), torch.bfloat16)


@pytest.mark.parametrize("kernel", KERNELS)
def test_sanitize_out_of_range_offsets_are_clamped(kernel):
    """Unvalidated offsets past the tensors, negative or decreasing ones address no row outside them:
    the kernel clamps each sequence to [0, N] (sequence 1: query rows 30..39 with no keys, written as
    zeros; sequence 2: empty)."""
    H = 6
    q, (kn, kp, v) = _q(H, 40, 9), _keys(H, 40, 9)
    out = _run(_op(H, kernel=kernel), q, kn, kp, v, [0, 30, 1 << 30, -7], [0, 30, -5, 1 << 29], 1 << 12)
    assert_close(out[:30], mla_prefill(q[:30], kn[:30], kp[:30], v[:30], [0, 30], [0, 30]), torch.bfloat16)
    assert torch.count_nonzero(out[30:]) == 0


@pytest.mark.parametrize("kernel", KERNELS)
def test_sanitize_bad_offsets_are_reported_in_the_error_word(kernel):
    """mla_prefill's device error word (k3gen/runtime/faults.py): nothing for good offsets; `rows`
    for offsets past the tensors or query rows past the grid; `length` for fewer keys than queries."""
    from k3gen.runtime import faults
    H = 6
    q, (kn, kp, v) = _q(H, 240, 12), _keys(H, 240, 12)
    op = _op(H, kernel=kernel)
    cases = [([0, 30, 240], [0, 30, 240], 210, set()),
             ([0, 30, 1 << 30], [0, 30, 240], 1 << 12, {"rows"}),
             ([0, 30, 240], [0, 30, 100], 210, {"length"}),     # sequence 1: 210 queries, 70 keys
             ([0, 200, 240], [0, 200, 240], 100, {"rows"})]      # 200 rows, one 128-row block
    for cq, ck, max_q, want in cases:
        faults.clear()
        _run(op, q, kn, kp, v, cq, ck, max_q)
        got = set(faults.read().get("mla_prefill", []))
        assert got == want, (cq, ck, max_q, got)


@pytest.mark.parametrize("kernel", KERNELS)
def test_sanitize_small(kernel):
    """Small enough for compute-sanitizer memcheck / racecheck (tools/h200.sh selects `sanitize`):
    lengths 1, 17, 130 with prefixes 0, 5, 3."""
    H = 6
    cq, ck = _cu((1, 17, 130)), _cu((1, 22, 133))
    q, (kn, kp, v) = _q(H, cq[-1], 11), _keys(H, ck[-1], 11)
    out = _run(_op(H, kernel=kernel), q, kn, kp, v, cq, ck, 130)
    assert_close(out, mla_prefill(q, kn, kp, v, cq, ck), torch.bfloat16)


@pytest.mark.parametrize("kernel", [PrefillKernel.WGMMA_PS, PrefillKernel.WGMMA_PF])
def test_persistent_counters_return_to_zero(kernel):
    """wgmma_ps / wgmma_pf draw its work items from two device counters that every launch must leave at zero
    (eager calls and graph replays start from zero with no memset): after eager launches and a replay
    with sequences shorter than the grid (skipped items) they read [0, 0], and the outputs stay right."""
    H, cu = 12, _cu((65, 1000, 3))
    q, (kn, kp, v) = _q(H, cu[-1], 13), _keys(H, cu[-1], 13)
    op = _op(H, kernel=kernel)
    ref = mla_prefill(q, kn, kp, v, cu, cu)
    for _ in range(3):
        assert_close(_run(op, q, kn, kp, v, cu, cu, 2048), ref, torch.bfloat16)
    assert op._counters(torch.cuda.current_device()).tolist() == [0, 0]
    cq = torch.tensor(cu, dtype=torch.int32, device="cuda")
    out = torch.empty(cu[-1], H, 128, device="cuda")
    graph = capture(lambda: op(q, kn, kp, v, cq, cq, out, 2048))
    for _ in range(2):
        poison(out)
        graph.replay()
        torch.cuda.synchronize()
        assert_close(out, ref, torch.bfloat16)
    assert op._counters(torch.cuda.current_device()).tolist() == [0, 0]
