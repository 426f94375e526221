"""kda_verify on the CPU: spec validation, byte estimates, the reference's verify-then-commit
contract against the decode reference run token by token, padding, and NVRTC compiles for sm_90a,
sm_103a and sm_107a without spills."""
from __future__ import annotations

import pytest
import torch

from k3gen.errors import SpecError, TargetError
from k3gen.ir import evaluate
from k3gen.ops import spec_from_canonical
from k3gen.ir.dtypes import SsmDtype
from k3gen.ops.kda_verify.spec import KdaVerifySpec, VerifyVariant
from k3gen.ops.kda_decode.reference import kda_decode, random_weights
from k3gen.ops.kda_verify.reference import commit, kda_verify
from helpers import assert_each_rejected
from k3gen.targets import KDA_VERIFY_DRAFTS, KDA_VERIFY_HEADS, TARGETS, build_specs
from numerics import rel_rms as _rel

SM90, SM100, SM103, SM107 = (TARGETS[n] for n in ("sm90", "sm100-mxfp4", "sm103-nvfp4", "sm107-nvfp4"))
K = 128


@pytest.mark.parametrize("kw,needle", [
    ({"drafts": 0}, "drafts=0"),
    ({"drafts": 8}, "drafts=8"),
    ({"drafts": True}, "drafts=True"),
    ({"heads": 0}, "heads=0"),
    ({"gate": "sigmoid"}, "gate='sigmoid'"),
    ({"ssm": "fp8"}, "ssm='fp8'"),
    ({"variant": "v2"}, "variant='v2'"),
    ({"threads": 128}, "threads=128"),
    ({"min_blocks": 3}, "min_blocks=3"),
    ({"variant": VerifyVariant.ORIGINAL, "ssm": SsmDtype.BF16}, "stores FP32 state only"),
])
def test_spec_rejects(kw, needle):
    with pytest.raises(SpecError) as e:
        KdaVerifySpec(target=SM90, **{"heads": 12, "drafts": 3, **kw})
    assert needle in str(e.value)


def test_variants_and_targets():
    with pytest.raises(SpecError, match="variant='nvfp4'.*frozen with the original"):
        KdaVerifySpec(target=SM100, heads=12, drafts=3, variant=VerifyVariant.NVFP4)
    assert KdaVerifySpec(target=SM100, heads=12, drafts=3).variant is VerifyVariant.ORIGINAL   # auto
    assert KdaVerifySpec(target=SM90, heads=12, drafts=3).variant is VerifyVariant.NVFP4
    with pytest.raises(TargetError, match="ssm='bf16'"):
        KdaVerifySpec(target=SM100, heads=12, drafts=3, ssm=SsmDtype.BF16, variant=VerifyVariant.ORIGINAL)
    orig = KdaVerifySpec(target=SM100, heads=12, drafts=3, variant=VerifyVariant.ORIGINAL)
    assert orig.slug() == "h12-m3-bounded-fp32-orig"
    assert KdaVerifySpec(target=SM90, heads=12, drafts=3, variant=VerifyVariant.ORIGINAL).blocks_per_sm == 2
    assert KdaVerifySpec(target=SM90, heads=12, drafts=7).blocks_per_sm == 1
    assert KdaVerifySpec(target=SM103, heads=12, drafts=7).blocks_per_sm == 2


def test_build_specs():
    for t in (SM90, SM103, SM107):
        specs = [s for s in build_specs(t) if s.op == "kda_verify"]
        drafts = [m for m in KDA_VERIFY_DRAFTS if t.sm >= 100 or m <= 3]   # M = 7 needs 1 CTA/SM on sm_90a
        assert len(specs) == len(KDA_VERIFY_HEADS) * len(drafts) * 2
        assert all(s.blocks_per_sm == 2 for s in specs)
        assert all(s.variant is VerifyVariant.NVFP4 for s in specs)
        assert len({s.kernel_name for s in specs}) == len(specs)
        for s in specs:
            assert spec_from_canonical(s.canonical(), t) == s
    # The original target builds only the FP32 original variant (frozen: tests/golden).
    orig = [s for s in build_specs(SM100) if s.op == "kda_verify"]
    assert len(orig) == len(KDA_VERIFY_HEADS) * len(KDA_VERIFY_DRAFTS)
    assert all(s.variant is VerifyVariant.ORIGINAL and s.ssm is SsmDtype.FP32 and s.blocks_per_sm == 2 for s in orig)
    assert not [s for s in build_specs(SM100, ssm=SsmDtype.FP32) if s.op == "kda_verify"
                and s.variant is not VerifyVariant.ORIGINAL]


def test_bytes_moved():
    s = KdaVerifySpec(target=SM90, heads=12, drafts=3)
    B, H, D, M, T = 128, 12, 12 * K, 3, 4
    st = K * K * 4
    want = (B * H * (st + st + M * st) + B * 3 * D * (3 + 3 + M) * 4 + B * T * (4 * D + K + H) * 2 + 2 * B * 4
            + B * T * D * 2 + (3 * D * 4 + D * K) * 2 + (D + H + K) * 4)
    assert evaluate(s.bytes_moved(), B=B) == want
    bf = KdaVerifySpec(target=SM90, heads=12, drafts=3, ssm=SsmDtype.BF16)
    assert evaluate(s.bytes_moved(), B=B) - evaluate(bf.bytes_moved(), B=B) == B * H * st // 2
    assert evaluate(bf.bytes_moved(from_records=False), B=B) == evaluate(bf.bytes_moved(), B=B) - B * H * st // 2


# -- reference -------------------------------------------------------------------------------------
class Pools:
    """Verify pools and a twin decode pool holding the same committed state."""

    def __init__(self, H, M, num_slots, ssm_dtype, seed):
        g = torch.Generator().manual_seed(seed)
        D = H * K
        self.ssm = (torch.randn(num_slots, H, K, K, generator=g) * 0.05).to(ssm_dtype)
        self.rec = torch.full((num_slots, M, H, K, K), float("nan"))     # nothing pending yet
        conv = torch.randn(num_slots, 3 * D, 3, generator=g).to(torch.bfloat16)
        self.conv_ext = torch.full((num_slots, 3 * D, 3 + M), float("nan"))
        self.conv_ext[..., :3] = conv.float()
        self.pending = torch.zeros(num_slots, dtype=torch.int32)
        self.dec_ssm, self.dec_conv = self.ssm.clone(), conv.clone()   # decode twin (BF16 window)


def _tokens(B, T, H, g):
    D = H * K
    qkvg = torch.randn(B * T, 4 * D + 8, generator=g).to(torch.bfloat16)
    fab = torch.randn(B * T, K + H, generator=g).to(torch.bfloat16)
    return qkvg, fab[:, :K], fab[:, K:]


def _committed(p: Pools, slot):
    P = int(p.pending[slot])
    state = p.ssm[slot].float() if P == 0 else p.rec[slot, P - 1]
    return state, p.conv_ext[slot, :, P:P + 3]


@pytest.mark.parametrize("M", [1, 3, 7])
@pytest.mark.parametrize("ssm_dtype", [torch.float32, torch.bfloat16])
def test_verify_then_commit_equals_decode(M, ssm_dtype):
    """Row b accepts (b + r) % (M + 1) drafts in round r: every count 0..M, mixed pending values in
    the second and third rounds. The committed state and window must equal decoding the accepted
    tokens one by one (here the decode runs one row at a time, so only the row-count-dependent
    BLAS rounding separates them: FP32 to FP32 rounding, BF16 within BF16 rounding); the window
    exactly. Bit for bit at equal batch shapes: test_kda_verify_lossless.py."""
    H, T = 2, 1 + M
    B = M + 1
    g = torch.Generator().manual_seed(100 + M)
    w = random_weights(H, generator=g)
    p = Pools(H, M, 2 * B + 1, ssm_dtype, seed=M)
    slots = torch.randperm(2 * B + 1, generator=g)[:B].to(torch.int32)
    for rnd in range(3):
        qkvg, fa, b = _tokens(B, T, H, g)
        out = kda_verify(qkvg, fa, b, p.ssm, p.rec, p.conv_ext, p.pending, slots, w)
        assert out.shape == (B, T, H, K) and out.dtype == torch.bfloat16
        accepted = torch.tensor([(i + rnd) % (M + 1) for i in range(B)])
        commit(p.pending, slots, accepted + 1)
        for i in range(B):
            rows = slice(i * T, i * T + 1 + int(accepted[i]))
            sl = slots[i:i + 1]
            for r in range(rows.start, rows.stop):
                y = kda_decode(qkvg[r:r + 1], fa[r:r + 1], b[r:r + 1], p.dec_ssm, p.dec_conv, sl, w)
                assert _rel(out[i, r - rows.start], y[0]) < 1e-2
            state, window = _committed(p, int(sl))
            assert int(p.pending[sl]) == int(accepted[i])
            assert torch.equal(window, p.dec_conv[int(sl)].float())
            want = p.dec_ssm[int(sl)].float()
            # FP32: only batch-size-dependent BLAS rounding separates the two; BF16: the rounding.
            assert _rel(state, want) < (1e-6 if ssm_dtype == torch.float32 else 2**-8), _rel(state, want)
            if ssm_dtype == torch.bfloat16:  # keep both chains on the same committed state
                p.dec_ssm[int(sl)] = state.to(ssm_dtype)


def test_rejected_drafts_never_touch_committed_state():
    H, M = 2, 3
    g = torch.Generator().manual_seed(5)
    w = random_weights(H, generator=g)
    p = Pools(H, M, 4, torch.float32, seed=6)
    slots = torch.tensor([2], dtype=torch.int32)
    qkvg, fa, b = _tokens(1, 1 + M, H, g)
    kda_verify(qkvg, fa, b, p.ssm, p.rec, p.conv_ext, p.pending, slots, w)
    golden = p.ssm[2].clone()
    commit(p.pending, slots, torch.tensor([1]))  # only the golden token accepted
    assert int(p.pending[2]) == 0 and torch.equal(_committed(p, 2)[0], golden)
    commit(p.pending, slots, torch.tensor([0]))  # clamped at 0
    assert int(p.pending[2]) == 0


def test_padded_rows_write_zeros_and_touch_nothing():
    H, M, B = 2, 3, 4
    g = torch.Generator().manual_seed(7)
    w = random_weights(H, generator=g)
    p = Pools(H, M, 6, torch.float32, seed=8)
    p.rec.normal_(generator=g)
    p.conv_ext.normal_(generator=g)
    p.pending[:] = torch.tensor([0, 1, 2, 3, 1, 0], dtype=torch.int32)
    slots = torch.tensor([3, -1, 0, -5], dtype=torch.int32)
    before = (p.ssm.clone(), p.rec.clone(), p.conv_ext.clone())
    qkvg, fa, b = _tokens(B, 1 + M, H, g)
    out = torch.full((B, 1 + M, H, K), float("nan"), dtype=torch.bfloat16)
    kda_verify(qkvg, fa, b, p.ssm, p.rec, p.conv_ext, p.pending, slots, w, out)
    assert torch.equal(out[[1, 3]], torch.zeros_like(out[[1, 3]]))
    assert torch.isfinite(out[[0, 2]].float()).all()
    for now, old in zip((p.ssm, p.rec, p.conv_ext), before):
        assert torch.equal(now[[1, 2, 4, 5]], old[[1, 2, 4, 5]])
        assert not torch.equal(now[3], old[3])


# -- compile ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("target", ["sm90", "sm103-nvfp4", "sm107-nvfp4"])
@pytest.mark.parametrize("drafts,ssm,variant", [(3, SsmDtype.FP32, VerifyVariant.NVFP4),
                                                (3, SsmDtype.BF16, VerifyVariant.NVFP4),
                                                (7, SsmDtype.BF16, VerifyVariant.NVFP4),
                                                (1, SsmDtype.FP32, VerifyVariant.ORIGINAL)])
def test_compiles_without_spills(target, drafts, ssm, variant):
    from k3gen.pipeline.build import build_one
    from k3gen.pipeline.inspect import cubin_arch
    spec = KdaVerifySpec(target=TARGETS[target], heads=12, drafts=drafts, ssm=ssm, variant=variant)
    r = build_one(spec)
    assert cubin_arch(r.cubin) == spec.target.arch
    assert r.resources and all(x["local"] == 0 and x["stack"] == 0 for x in r.resources), r.resources
    assert all(x["registers"] <= 65536 // (256 * spec.blocks_per_sm) for x in r.resources), r.resources
    assert all(x["shared"] <= 48 * 1024 for x in r.resources)
    ops = {k for x in r.resources for k in x["sass"]}
    assert any(k.startswith("UBLKCP") for k in ops) and any(k.startswith("SYNCS") for k in ops), ops  # bulk copy
    from k3gen.ops.kda_verify.launcher import PREFETCH_ENTRY, has_prefetch
    pre = [x for x in r.resources if x["function"] == PREFETCH_ENTRY]
    assert len(pre) == (1 if has_prefetch(spec) else 0), [x["function"] for x in r.resources]
    assert all(x["registers"] <= 128 for x in pre), pre  # its launch bounds: two CTAs per SM
    from k3gen.ops.kda_verify.launcher import SPLIT_ENTRY
    split = [x for x in r.resources if x["function"] == SPLIT_ENTRY]
    assert len(split) == (1 if has_prefetch(spec) else 0), [x["function"] for x in r.resources]
    assert all(x["registers"] <= 128 for x in split), split  # its launch bounds: four CTAs per SM


def test_prefetch_schedule_choice_and_source():
    from k3gen.pipeline.render import render
    from k3gen.ops.kda_verify.launcher import PREFETCH_ENTRY, KdaVerify, choose_schedule, has_prefetch
    want = {(1, 12): "split", (3, 12): "split", (4, 12): "prefetch", (1, 96): "prefetch", (8, 12): "prefetch",
            (12, 12): "prefetch", (3, 96): "prefetch", (32, 12): "prefetch", (128, 12): "prefetch"}
    for (b, h), sched in want.items():
        assert choose_schedule(b, h, 132, True) == sched, (b, h)
    assert all(choose_schedule(b, 12, 132, False) == "rows" for b in (1, 32, 512))
    for m, variant, want in ((1, VerifyVariant.NVFP4, True), (3, VerifyVariant.NVFP4, True),
                             (4, VerifyVariant.NVFP4, False), (3, VerifyVariant.ORIGINAL, False)):
        spec = KdaVerifySpec(target=SM90, heads=12, drafts=m, variant=variant)
        assert has_prefetch(spec) == want and (PREFETCH_ENTRY in render(spec)) == want
    for sched, spec in (("stream", KdaVerifySpec(target=SM90, heads=12, drafts=3)),
                        ("prefetch", KdaVerifySpec(target=SM90, heads=12, drafts=7)),
                        ("split", KdaVerifySpec(target=SM90, heads=12, drafts=7)),
                        ("split", KdaVerifySpec(target=SM90, heads=12, drafts=3, variant=VerifyVariant.ORIGINAL))):
        with pytest.raises(SpecError) as e:
            KdaVerify(spec)(*([None] * 14), schedule=sched)
        assert "schedule" in str(e.value)
    with pytest.raises(SpecError) as e:
        KdaVerify(KdaVerifySpec(target=SM90, heads=12, drafts=3))(*([None] * 14), schedule="split", per_sm=1)
    assert "per_sm" in str(e.value)


def test_split_schedule_geometry():
    """Clusters never outnumber items (each CTA pair owns at least one), and at most per_sm CTAs
    per SM; the source carries the cluster entry and its shared-memory size for four per SM."""
    from k3gen.pipeline.render import render
    from k3gen.ops.kda_verify.launcher import SPLIT_ENTRY, SPREAD_SMEM, split_clusters
    # The padded prefetch launch fits one CTA per SM (228 KB per SM, 1 KB reserved per CTA), not two.
    assert SPREAD_SMEM + 1024 <= 228 * 1024 < 2 * (SPREAD_SMEM + 1024)
    assert split_clusters(128, 12, 132, 4) == 264 and split_clusters(128, 12, 132, 2) == 132
    assert split_clusters(1, 6, 132, 4) == 6 and split_clusters(0, 6, 132, 4) == 1
    assert split_clusters(32, 12, 132, 3) == 198
    src = render(KdaVerifySpec(target=SM90, heads=12, drafts=3))
    assert SPLIT_ENTRY in src and SPLIT_ENTRY + "_smem" in src and "__launch_bounds__(128, 4)" in src


# -- launcher (metadata checks only) ---------------------------------------------------------------
def test_launcher_checks():
    from k3gen.ops.kda_verify.launcher import KdaVerify
    H, M, B, S = 12, 3, 2, 4
    D, T = H * K, 1 + M
    bf = torch.bfloat16
    w = random_weights(H)
    args = dict(qkvg=torch.zeros(B * T, 4 * D, dtype=bf), fa=torch.zeros(B * T, K, dtype=bf),
                beta_logit=torch.zeros(B * T, H, dtype=bf), ssm=torch.zeros(S, H, K, K),
                draft_rec=torch.zeros(S, M, H, K, K), conv_ext=torch.zeros(S, 3 * D, 3 + M),
                pending=torch.zeros(S, dtype=torch.int32), slots=torch.zeros(B, dtype=torch.int32),
                conv_w=w.conv_w, fb_w=w.fb_w, dt_bias=w.dt_bias, a_log=w.a_log, norm_w=w.norm_w,
                out=torch.zeros(B, T, H, K, dtype=bf))
    op = KdaVerify(KdaVerifySpec(target=SM90, heads=H, drafts=M))
    assert_each_rejected(op, args, [("draft_rec", torch.zeros(S, M, H, K, K, dtype=bf), "draft_rec="),
                                    ("conv_ext", torch.zeros(S, 3 * D, 3), "conv_ext="),
                                    ("pending", torch.zeros(S), "pending="),
                                    ("qkvg", torch.zeros(B, 4 * D, dtype=bf), "qkvg="),
                                    ("out", torch.zeros(B, H, K, dtype=bf), "out="),
                                    ("out", None, "device=")])
