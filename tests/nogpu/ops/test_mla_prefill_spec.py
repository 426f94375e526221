"""mla_prefill on the CPU: spec fields and refusals, the launch plan, the reference against a naive
FP64 loop (varlen, prefixes) and as the model's prefill attention, the sm_90a compile (HGMMA,
no spills, the register split) and the launcher's typed argument errors."""
from __future__ import annotations

import pytest
import torch

from k3gen.errors import SpecError
from k3gen.ops import spec_from_canonical
from k3gen.ops.mla_prefill.launcher import MlaPrefill, check_offsets
from k3gen.ops.mla_prefill.reference import mla_prefill, naive
from k3gen.ops.mla_prefill.spec import SMEM_BYTES, SOFTMAX_SCALE, MlaPrefillSpec, OutDtype, PrefillKernel
from k3gen.targets import TARGETS

SM90 = TARGETS["sm90"]
BF = torch.bfloat16
WGMMA_KERNELS = [k for k in PrefillKernel if k.value.startswith("wgmma")]


def test_fields_slug_and_canonical_round_trip():
    s = MlaPrefillSpec(target=SM90, heads=12)
    # auto: the pingpong schedule (variants.py: the fastest of the four in the H100 A/B).
    assert s.kernel is PrefillKernel.WGMMA_PP and s.out_dtype is OutDtype.FP32 and s.slug() == "h12-fp32-pp"
    b = MlaPrefillSpec(target=SM90, heads=96, out_dtype=OutDtype.BF16, kernel=PrefillKernel.WGMMA_CP)
    assert b.slug() == "h96-bf16-cp" and b.digest() != s.digest() and s.impl.tma and not b.impl.tma
    assert spec_from_canonical(b.canonical(), SM90) == b
    assert abs(s.softmax_scale - 192 ** -0.5) < 1e-15 and SOFTMAX_SCALE == s.softmax_scale
    assert s.entry == "k3gen_mla_prefill" and s.smem_bytes == SMEM_BYTES <= 232448
    ov = MlaPrefillSpec(target=SM90, heads=12, kernel=PrefillKernel.WGMMA_OV)
    w = MlaPrefillSpec(target=SM90, heads=12, kernel=PrefillKernel.WGMMA)
    assert ov.slug() == "h12-fp32-ov" and ov.impl.overlap and not ov.impl.pingpong and not w.impl.overlap
    assert w.slug() == "h12-fp32" and s.impl.overlap and s.impl.pingpong


@pytest.mark.parametrize("bad", [0, -1, 129, True, 12.0])
def test_bad_heads(bad):
    with pytest.raises(SpecError, match="heads"):
        MlaPrefillSpec(target=SM90, heads=bad)


def test_bad_enums():
    with pytest.raises(SpecError, match="out_dtype"):
        MlaPrefillSpec(target=SM90, heads=12, out_dtype="fp16")
    with pytest.raises(SpecError, match="kernel"):
        MlaPrefillSpec(target=SM90, heads=12, kernel="mma")


@pytest.mark.parametrize("target", ["sm103-nvfp4", "sm107-nvfp4", "sm100-mxfp4"])
def test_blackwell_targets_get_tcgen05_and_refuse_wgmma_with_a_reason(target):
    # auto: the tcgen05 kernel (tests/nogpu/ops/test_mla_prefill_tcgen05.py); the wgmma ones say why not.
    assert MlaPrefillSpec(target=TARGETS[target], heads=12).kernel is PrefillKernel.TCGEN05
    for k in WGMMA_KERNELS:
        with pytest.raises(SpecError, match="needs wgmma"):
            MlaPrefillSpec(target=TARGETS[target], heads=12, kernel=k)
    with pytest.raises(SpecError, match="needs tcgen05"):
        MlaPrefillSpec(target=SM90, heads=12, kernel=PrefillKernel.TCGEN05)


def test_launch_plan():
    s = MlaPrefillSpec(target=SM90, heads=12)
    assert s.grid(1, 4096) == (12, 32, 1) and s.grid(8, 1000) == (12, 8, 8) and s.grid(3, 1) == (12, 1, 3)
    assert s.grid(1, 4096, heads_fast=False) == (32, 12, 1)
    # The persistent variant: one CTA per SM, never more than the items (heads x q-blocks x B).
    ps = MlaPrefillSpec(target=SM90, heads=12, kernel=PrefillKernel.WGMMA_PS)
    assert ps.grid(1, 4096, sms=132) == (132, 1, 1) and ps.grid(2, 128, sms=132) == (24, 1, 1)
    with pytest.raises(SpecError):
        ps.grid(1, 4096)
    # K/V of every head within the L2 share: heads fastest (H12 T4096); H96 T4096 runs a head's q-blocks together.
    assert s.heads_fast(4096) and not MlaPrefillSpec(target=SM90, heads=96).heads_fast(4096)
    from k3gen.ir.dims import evaluate
    assert evaluate(s.flops(), N=4096) == 2 * 12 * 320 * 4096 * 4097 // 2


def _inputs(H, cq, ck, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    nq, nk = cq[-1], ck[-1]
    q = (torch.randn(nq, H, 192, generator=g) * scale).to(BF)
    kv = torch.randn(nk, H, 256, generator=g).to(BF)
    rows = torch.randn(nk, 576, generator=g).to(BF)
    return q, kv[..., :128], rows[:, 512:], kv[..., 128:]


def test_reference_matches_the_naive_formula_with_prefixes():
    cq, ck = [0, 1, 4, 4, 9], [0, 3, 6, 6, 16]     # prefixes 2, 0, (empty), 2
    q, kn, kp, v = _inputs(2, cq, ck, seed=1, scale=2.0)
    got = mla_prefill(q, kn, kp, v, torch.tensor(cq), torch.tensor(ck))
    want = naive(q, kn, kp, v, cq, ck)
    assert got.dtype == torch.float32 and got.shape == (9, 2, 128)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)


def test_rows_without_keys_are_zero():
    q, kn, kp, v = _inputs(1, [0, 3], [0, 1], seed=2)   # len_k < len_q: rows 0, 1 see nothing
    got = mla_prefill(q, kn, kp, v, [0, 3], [0, 1])
    assert torch.count_nonzero(got[:2]) == 0 and torch.allclose(got[2, 0], v[0, 0].float())


def test_model_prefill_attention_is_the_reference_with_prefix():
    """The model's prefill attention (RefOps: a continued sequence's cached prefix in the keys,
    pf.cu_k) is this reference, and matches the naive loop."""
    from model.layers import Prefill
    from model.ops import RefOps
    cq, ck = [0, 5, 17, 18], [0, 9, 21, 30]            # prefixes 4, 0, 8
    q, kn, kp, v = _inputs(3, cq, ck, seed=3)
    z = torch.zeros(3, dtype=torch.int32)
    pf = Prefill(slots=z, cu_seqlens=torch.tensor(cq, dtype=torch.int32), cu_host=cq, block_table=z[:, None],
                 resume=z, max_len=12, start=torch.tensor([4, 0, 8], dtype=torch.int32), start_host=[4, 0, 8],
                 cu_k=torch.tensor(ck, dtype=torch.int32), cu_k_host=ck)
    got = RefOps(None).prefill_attention(q, kn, kp, v, pf)
    assert torch.equal(got, mla_prefill(q, kn, kp, v, cq, ck))
    assert torch.allclose(got, naive(q, kn, kp, v, cq, ck), rtol=1e-5, atol=1e-6)


def test_continuation_pieces_equal_one_piece():
    """Keys of the prefix + new rows: the rows of a later piece equal the same rows of one piece."""
    q, kn, kp, v = _inputs(2, [0, 20], [0, 20], seed=4)
    whole = mla_prefill(q, kn, kp, v, [0, 20], [0, 20])
    for lo in (0, 7, 13):
        part = mla_prefill(q[lo:], kn, kp, v, [0, 20 - lo], [0, 20])
        assert torch.allclose(part, whole[lo:], rtol=1e-6, atol=1e-7)


# -- compile ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("kernel,out_dtype", [(k, o) for k in WGMMA_KERNELS for o in OutDtype])
def test_compiles_to_hgmma_without_spills(kernel, out_dtype):
    from k3gen.pipeline.build import build_one
    from k3gen.pipeline.inspect import sass_text
    r = build_one(MlaPrefillSpec(target=SM90, heads=12, out_dtype=out_dtype, kernel=kernel))
    (k,) = r.resources
    assert k["function"] == "k3gen_mla_prefill" and k["local"] == 0 and k["stack"] == 0, k
    assert k["registers"] <= 168, k   # 384 threads, one CTA per SM; setmaxnreg splits 56 / 224
    text = sass_text(r.cubin)
    # QK: 12 K-steps over 192 dims (Q, K from shared memory); PV: 8 K-steps, P from registers, V N-major.
    # The overlapped schedule has a prologue QK and an epilogue PV besides its loop.
    # wgmma_pf: also the step that joins an item's last PV to the next item's first QK.
    copies = {PrefillKernel.WGMMA_OV: 2, PrefillKernel.WGMMA_PP: 2, PrefillKernel.WGMMA_PS: 2,
              PrefillKernel.WGMMA_PF: 3}.get(kernel, 1)
    assert text.count("HGMMA.64x128x16.F32.BF16") == 20 * copies and text.count(".tnspB") == 8 * copies
    # K / V boxes by TMA (3 + 2 per tile, in the prologue and the loop), Q and a tail tile's V by cp.async
    # (wgmma_cp: everything); the persistent kernel issues every tile in its loop and Q by 6 boxes.
    tma = {PrefillKernel.WGMMA_CP: 0, PrefillKernel.WGMMA_PS: 5 + 6, PrefillKernel.WGMMA_PF: 5 + 6}.get(kernel, 10)
    assert "HMMA" not in k["sass"] and "USETMAXREG" in text and "LDGSTS" in text and text.count("UTMALDG") == tma
    # One wait per GEMM group (ptxas did not serialize the wgmmas): loop QK, loop PV (+ prologue, epilogue).
    assert text.count("WARPGROUP.DEPBAR") <= 2 * copies and text.count("WARPGROUP.ARRIVE") <= 2 * copies


@pytest.mark.parametrize("heads", [6, 96])
@pytest.mark.parametrize("kernel", [PrefillKernel.WGMMA_CP, PrefillKernel.WGMMA_PP, PrefillKernel.WGMMA_PS,
                                    PrefillKernel.WGMMA_PF])
def test_every_head_count_compiles_without_spills(heads, kernel):
    from k3gen.pipeline.build import build_one
    (k,) = build_one(MlaPrefillSpec(target=SM90, heads=heads, kernel=kernel)).resources
    assert k["local"] == 0 and k["stack"] == 0 and k["registers"] <= 168, k


def test_template_checks_the_plan():
    from k3gen.pipeline.build import lower
    src = lower(MlaPrefillSpec(target=SM90, heads=6)).source
    assert '#include "k3gen/mla/prefill.cuh"' in src and f"kSmem == {SMEM_BYTES}" in src
    assert "kHeads = 6;" in src and "kOutF32 = true;" in src


# -- launcher argument errors (CPU tensors: every check runs before the device check) ------------
def _args(H=2, nq=5, nk=5, out_dtype=torch.float32):
    q, kn, kp, v = _inputs(H, [0, nq], [0, nk])
    cu = torch.tensor([0, nq], dtype=torch.int32)
    ck = torch.tensor([0, nk], dtype=torch.int32)
    return dict(q=q, k_nope=kn, k_pe=kp, v=v, cu_seqlens_q=cu, cu_seqlens_k=ck,
                out=torch.empty(nq, H, 128, dtype=out_dtype), max_seqlen_q=nq)


def _call(op, **kw):
    op.check(kw["q"], kw["k_nope"], kw["k_pe"], kw["v"], kw["cu_seqlens_q"], kw["cu_seqlens_k"], kw["out"],
             kw["max_seqlen_q"])


def test_well_formed_cpu_inputs_fail_only_at_the_device_check():
    op = MlaPrefill(MlaPrefillSpec(target=SM90, heads=2))
    with pytest.raises(SpecError, match="device"):
        _call(op, **_args())


@pytest.mark.parametrize("name,bad", [
    ("q", lambda a: a["q"].float()),
    ("q", lambda a: a["q"][..., :128]),
    ("q", lambda a: torch.zeros(5, 3, 192, dtype=BF)),
    ("q", lambda a: torch.zeros(5 * 386, dtype=BF).as_strided((5, 2, 192), (386, 193, 1))),   # unaligned heads
    ("k_nope", lambda a: a["k_nope"].contiguous().half()),
    ("k_nope", lambda a: torch.zeros(5, 3, 128, dtype=BF)),
    ("k_pe", lambda a: torch.zeros(5, 2, 64, dtype=BF)),
    ("k_pe", lambda a: torch.zeros(5, 128, dtype=BF)[:, ::2]),
    ("v", lambda a: torch.zeros(5, 2, 256, dtype=BF)[..., 1:129]),
    ("cu_seqlens_q", lambda a: a["cu_seqlens_q"].long()),
    ("cu_seqlens_k", lambda a: torch.tensor([0, 2, 5], dtype=torch.int32)),
    ("out", lambda a: a["out"].to(BF)),
    ("out", lambda a: torch.empty(5, 2, 129)[..., :128]),
    ("max_seqlen_q", lambda a: 5.0),
    ("max_seqlen_q", lambda a: -1),
])
def test_broken_arguments_raise_spec_errors(name, bad):
    op = MlaPrefill(MlaPrefillSpec(target=SM90, heads=2))
    a = _args()
    a[name] = bad(a)
    with pytest.raises(SpecError, match=name):
        _call(op, **a)


def test_bf16_spec_wants_a_bf16_out():
    op = MlaPrefill(MlaPrefillSpec(target=SM90, heads=2, out_dtype=OutDtype.BF16))
    with pytest.raises(SpecError, match="out"):
        _call(op, **_args())
    with pytest.raises(SpecError, match="device"):
        _call(op, **_args(out_dtype=BF))


def test_host_validation_of_offsets():
    op = MlaPrefill(MlaPrefillSpec(target=SM90, heads=2))
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    op.validate_inputs(i32([0, 3, 5]), i32([0, 4, 9]), 5, 9, 3)
    for cq, ck, mx, what in (([0, 6], [0, 6], 6, "cu_seqlens_q"), ([1, 5], [0, 5], 5, "cu_seqlens_q"),
                             ([0, 3, 2], [0, 3, 5], 3, "cu_seqlens_q"), ([0, 5], [0, 10], 5, "cu_seqlens_k"),
                             ([0, 5], [0, 4], 5, "lengths"), ([0, 5], [0, 5], 4, "max_seqlen_q")):
        with pytest.raises(SpecError, match=what):
            op.validate_inputs(i32(cq), i32(ck), 5, 9, mx)
    with pytest.raises(SpecError):
        check_offsets("cu", [], 3)


def test_tensor_maps_describe_the_strided_views(monkeypatch):
    """head_map / rope_map hand the encoder byte geometry of the views the model and the tests pass:
    k_nope / v halves of a [N, H, 256] expansion, a contiguous [N, H, 128], k_pe columns 512.. of
    [N, 576] cache rows; one box = one [128 rows][128 B] SW128 block."""
    import k3gen.ops.mla_prefill.launcher as L
    seen = []
    monkeypatch.setattr(L, "encode_tma", lambda ptr, dims, strides, box: seen.append((ptr, dims, strides, box)))
    kv = torch.zeros(40, 12, 256, dtype=BF)
    rows = torch.zeros(40, 576, dtype=BF)
    L.head_map(kv[..., :128])
    L.head_map(kv[..., 128:])
    L.head_map(torch.zeros(40, 12, 128, dtype=BF))
    L.rope_map(rows[:, 512:])
    L.head_map(torch.zeros(0, 1, 128, dtype=BF))
    q = torch.zeros(40, 12, 3 * 192, dtype=BF)[..., 192:384]   # a strided view: the persistent kernel's Q
    L.q_map(q)
    L.q_map(torch.zeros(40, 1, 192, dtype=BF))
    assert seen[0][1:] == ((256, 12, 40), (512, 12 * 512), (128, 1, 128))
    assert seen[1][0] == seen[0][0] + 256 and seen[1][1:] == seen[0][1:]
    assert seen[2][1:] == ((256, 12, 40), (256, 12 * 256), (128, 1, 128))
    assert seen[3][0] == rows.data_ptr() + 1024 and seen[3][1:] == ((128, 40), (1152,), (128, 128))
    assert seen[4][1] == (256, 1, 1) and seen[4][2][0] == 256   # one head, no rows: a valid map all the same
    # q: [rows][heads][384 bytes], box [64 rows][1 head][128 bytes] (one consumer's SW128 block)
    assert seen[5][0] == q.data_ptr() and seen[5][1:] == ((384, 12, 40), (1152, 12 * 1152), (128, 1, 64))
    assert seen[6][1:] == ((384, 1, 40), (384, 384), (128, 1, 64))
