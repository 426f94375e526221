"""Variant tables of the FP8 projection path and its neighbours (fp8_block_gemm, act_quant_fp8,
mla_q_absorb, mla_vb_gate, kv_cache_write): every variant says in words why it cannot implement a
spec, reading target features only, and `auto` picks for every committed spec what the committed
generated/*/manifest.json records (same canonical spec, same digest, same lowering)."""
from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest

from k3gen.errors import SpecError
from k3gen.ir.dtypes import KvDtype
from k3gen.ops import spec_from_canonical
from k3gen.ops.act_quant_fp8.spec import ActQuantFp8Spec
from k3gen.ops.fp8_block_gemm.spec import Fp8BlockGemmSpec
from k3gen.ops.kv_cache_write.spec import KvCacheWriteSpec
from k3gen.ops.mla_q_absorb.spec import MlaQAbsorbSpec
from k3gen.ops.mla_vb_gate.spec import MlaVbGateSpec
from k3gen.targets import TARGETS

GENERATED = Path(__file__).resolve().parents[3] / "generated"
OPS = ("fp8_block_gemm", "act_quant_fp8", "mla_q_absorb", "mla_vb_gate", "kv_cache_write")
SM90, SM103 = TARGETS["sm90"], TARGETS["sm103-nvfp4"]
# Features no preset has: an Ampere-class part (no E4M3 conversion, no wgmma, no TMA) and a
# wgmma part without TMA. Names are irrelevant: variants read features.
AMPERE = dataclasses.replace(SM90, name="test-sm80", arch="sm_80", sm=80, mma="mma.sync", tma=False)
NO_TMA = dataclasses.replace(SM90, name="test-no-tma", tma=False)

# One legal spec per op on sm90 (its fields fit every target's menu).
SPECS = {
    "fp8_block_gemm": Fp8BlockGemmSpec(target=SM90, n=256, k=512),
    "act_quant_fp8": ActQuantFp8Spec(target=SM90, k=1536),
    "mla_q_absorb": MlaQAbsorbSpec(target=SM90, heads=12),
    "mla_vb_gate": MlaVbGateSpec(target=SM90, heads=12),
    "kv_cache_write": KvCacheWriteSpec(target=SM90, kv=KvDtype.BF16),
}


def _moved(spec, target):
    """The spec as it would be on `target`, without construction (which would reject it)."""
    s = copy.copy(spec)
    object.__setattr__(s, "target", target)
    return s


def _is_sentence(reason) -> bool:
    return isinstance(reason, str) and len(reason.split()) >= 3


@pytest.mark.parametrize("op", OPS)
def test_every_variant_says_why_it_cannot(op):
    spec = SPECS[op]
    table = type(spec).variants
    assert table.op == op and table.names()
    for v in table.variants:
        fails = [why for t in (SM90, SM103, AMPERE, NO_TMA)
                 if (why := v.can_implement(_moved(spec, t))) is not None]
        if not v.checks:   # runs anywhere: no spec it cannot implement
            assert not fails, (v.name, fails)
            continue
        assert fails, f"{op}/{v.name} has checks but accepted every probe target"
        assert all(_is_sentence(w) for w in fails), (v.name, fails)
        assert not any(t.name in w for w in fails for t in TARGETS.values()), "reasons name features, not targets"


def test_fp8_block_gemm_variants_exclude_each_other():
    table = Fp8BlockGemmSpec.variants
    assert table.names() == ("tcgen05_tma", "tcgen05", "wgmma")
    on90 = table.reasons(SPECS["fp8_block_gemm"])
    assert on90["wgmma"] is None and "tcgen05" in on90["tcgen05"] and "tcgen05" in on90["tcgen05_tma"]
    on103 = table.reasons(_moved(SPECS["fp8_block_gemm"], SM103))
    assert on103["tcgen05_tma"] is None and on103["tcgen05"] is None and "wgmma" in on103["wgmma"]
    assert "TMA" in table.get("wgmma").can_implement(_moved(SPECS["fp8_block_gemm"], NO_TMA))


@pytest.mark.parametrize("op", [o for o in OPS if o != "mla_vb_gate"])
def test_construction_rejects_a_target_no_variant_fits(op):
    spec = SPECS[op]
    fields = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec) if f.name != "target"}
    with pytest.raises(SpecError) as e:
        type(spec)(target=AMPERE, **fields)
    # The message names each variant with its reason.
    for v in type(spec).variants.variants:
        assert f"{v.name}: {v.can_implement(_moved(spec, AMPERE))}" in str(e.value)


def test_mla_q_absorb_builds_on_the_targets_gemm():
    for t, mma, lowering in ((SM90, "wgmma", "nvrtc"), (SM103, "tcgen05_tma", "cute")):
        s = MlaQAbsorbSpec(target=t, heads=12)
        g = s.gemm_spec
        assert (g.mma, g.lowering, g.n, g.k, g.recipe) == (mma, lowering, 12 * 192, 1536, s.recipe)
        assert s.lowering == "nvrtc"
    why = MlaQAbsorbSpec.variants.get("three_launch").can_implement(_moved(SPECS["mla_q_absorb"], NO_TMA))
    assert why and "fp8_block_gemm" in why


def _committed():
    for manifest in sorted(GENERATED.glob("*/manifest.json")):
        m = json.loads(manifest.read_text())
        target = next(t for t in TARGETS.values() if t.name == m["target"])
        for k in m["kernels"]:
            if k["op"] in OPS:
                yield target, k


def test_auto_picks_what_the_committed_trees_record():
    seen = set()
    for target, k in _committed():
        spec = spec_from_canonical(json.dumps(k["spec"]), target)
        assert json.loads(spec.canonical()) == k["spec"] and spec.digest() == k["digest"], k["name"]
        assert spec.lowering == k["lowering"], (k["name"], spec.impl.name)
        if k["file"]:
            assert k["file"] == spec.file_stem + ".cu"
        if spec.op == "fp8_block_gemm":
            assert spec.mma in {"cute": ("tcgen05", "tcgen05_tma"), "nvrtc": ("wgmma",)}[k["lowering"]]
        seen.add((target.name, spec.op))
    assert {op for _, op in seen} == set(OPS)
    assert {t for t, _ in seen} == {t.name for t in TARGETS.values()}
