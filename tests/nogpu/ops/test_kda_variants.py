"""The KDA variant tables: every variant says in words why it cannot implement a spec, `auto`
picks what the committed generated trees were built with (same canonical spec, same file), and
the launch-time schedules read their measured bands from variants.py."""
from __future__ import annotations

import copy
import json
from dataclasses import replace
from pathlib import Path

import pytest

from k3gen.errors import SpecError
from k3gen.ir.dtypes import SsmDtype
from k3gen.ops import spec_from_canonical
from k3gen.ops.kda_decode.spec import KdaDecodeSpec
from k3gen.ops.kda_prefill.spec import KdaPrefillSpec, PrefillAlgo
from k3gen.ops.kda_verify.spec import KdaVerifySpec, VerifyVariant
from k3gen.targets import TARGETS

ROOT = Path(__file__).resolve().parents[3]
SM90, SM100 = TARGETS["sm90"], TARGETS["sm100-mxfp4"]
# A pre-Hopper target: no bulk copies, mbarriers or clusters.
SM80 = replace(SM90, name="sm80-test", arch="sm_80", sm=80, mma="mma.sync")
KDA_OPS = ("kda_decode", "kda_verify", "kda_prefill")


def _on(spec, target):
    """The spec's fields with another target, without building (and so validating) a new spec."""
    other = copy.copy(spec)
    object.__setattr__(other, "target", target)
    return other


def test_decode_variant_reasons():
    spec = KdaDecodeSpec(target=SM90, heads=12)
    assert spec.impl.name == "fused" and spec.lowering == "nvrtc"
    for v in KdaDecodeSpec.variants.variants:
        assert v.can_implement(spec) is None
        assert "sm_90" in v.can_implement(_on(spec, SM80))
    with pytest.raises(SpecError, match="no kda_decode kernel can implement.*clusters"):
        KdaDecodeSpec(target=SM80, heads=12)


def test_verify_variant_reasons():
    table = KdaVerifySpec.variants
    assert table.names() == ("nvfp4", "original")
    fp32 = KdaVerifySpec(target=SM90, heads=12, drafts=3)
    bf16 = KdaVerifySpec(target=SM90, heads=12, drafts=3, ssm=SsmDtype.BF16)
    assert table.reasons(fp32) == {"nvfp4": None, "original": None}
    assert "frozen" in table.get("nvfp4").can_implement(_on(fp32, SM100))
    assert "FP32 state only" in table.get("original").can_implement(bf16)
    for name in table.names():
        assert "sm_90" in table.get(name).can_implement(_on(fp32, SM80))
    with pytest.raises(SpecError, match="variant='original'.*FP32 state only"):
        KdaVerifySpec(target=SM90, heads=12, drafts=3, ssm=SsmDtype.BF16, variant=VerifyVariant.ORIGINAL)
    # The launch schedules each cubin carries (the template renders exactly these entries).
    assert fp32.impl.schedules(fp32) == ("rows", "prefetch", "split")
    m7 = KdaVerifySpec(target=SM90, heads=12, drafts=7)
    assert m7.impl.schedules(m7) == ("rows",)
    orig = KdaVerifySpec(target=SM100, heads=12, drafts=3)
    assert orig.variant is VerifyVariant.ORIGINAL and orig.impl.schedules(orig) == ("rows",)


def test_prefill_variant_reasons():
    table = KdaPrefillSpec.variants
    assert table.names() == ("chunk64_tc", "chunk64")
    spec = KdaPrefillSpec(target=SM90, heads=12)
    assert spec.algo is PrefillAlgo.CHUNK64
    assert table.get("chunk64").can_implement(spec) is None
    assert "needs tcgen05" in table.get("chunk64_tc").can_implement(spec)
    for name in table.names():
        assert "sm_90" in table.get(name).can_implement(_on(spec, SM80))
    with pytest.raises(SpecError, match="algo='chunk64_tc'.*needs tcgen05"):
        KdaPrefillSpec(target=SM90, heads=12, algo=PrefillAlgo.CHUNK64_TC)
    with pytest.raises(SpecError, match="no kda_prefill kernel can implement.*chunk64: needs bulk copies"):
        KdaPrefillSpec(target=SM80, heads=12)
    with pytest.raises(SpecError, match="algo='token'"):
        KdaPrefillSpec(target=SM90, heads=12, algo="token")


@pytest.mark.parametrize("tree", ["sm90", "sm100_mxfp4", "sm103_nvfp4", "sm107_nvfp4"])
def test_auto_picks_what_the_committed_trees_hold(tree):
    """Every KDA kernel of a committed manifest, rebuilt with its variant field left to `auto`,
    is the same spec (canonical, digest, file)."""
    man = json.loads((ROOT / "generated" / tree / "manifest.json").read_text())
    target = next(t for t in TARGETS.values() if t.module_name == tree)
    seen = 0
    for k in man["kernels"]:
        if k["op"] not in KDA_OPS:
            continue
        d = dict(k["spec"])
        field = {"kda_verify": "variant", "kda_prefill": "algo"}.get(k["op"])
        if field:
            d.pop(field)
        spec = spec_from_canonical(json.dumps(d), target)
        assert spec.digest() == k["digest"], (k["name"], spec.canonical())
        seen += 1
    assert seen >= (4 if tree == "sm100_mxfp4" else 20)  # sm100: the 4 frozen original verify kernels


def test_schedule_bands_are_data():
    from k3gen.ops.kda_decode import variants as dec
    from k3gen.ops.kda_decode.launcher import choose_schedule as dec_schedule
    from k3gen.ops.kda_verify import variants as ver
    from k3gen.ops.kda_verify.launcher import choose_schedule as ver_schedule
    sms = 132
    edge = dec.SCHEDULE_BANDS.stream_min_items_per_sm * sms
    assert dec_schedule(edge // 12, 12, sms, True, True) == "stream"
    assert dec_schedule(edge // 12 - 1, 12, sms, True, True) == "rows"
    bounds = [b for b, _ in ver.SCHEDULE_BANDS]
    assert bounds == sorted(bounds) and bounds[-1] == float("inf")
    assert {name for _, name in ver.SCHEDULE_BANDS} <= set(ver.SCHEDULES)
    assert ver_schedule(1, 12, sms, True) == ver.SCHEDULE_BANDS[0][1]
    assert ver_schedule(10**6, 12, sms, True) == ver.SCHEDULE_BANDS[-1][1]
