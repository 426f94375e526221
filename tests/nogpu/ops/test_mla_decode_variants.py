"""mla_decode variants on the CPU: each says in words why it cannot implement a spec, `auto` picks
exactly what it picked before the variants were data (the committed manifests' specs and the old
rule over a grid), explicit schedules are checked with the variant's reasons, and the template and
launcher read the chosen variant's plan."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from k3gen.errors import SpecError
from k3gen.ir.dtypes import Fp8ScaleGranularity, KvDtype, ScaleLayout
from k3gen.ops import spec_from_canonical
from k3gen.ops.mla_decode.spec import MlaDecodeSpec
from k3gen.ops.mla_decode.variants import VARIANTS, tm_default_rows
from k3gen.pipeline.build import lower
from k3gen.targets import TARGETS

ROOT = Path(__file__).resolve().parents[3]
SM90, SM103, SM107 = (TARGETS[n] for n in ("sm90", "sm103-nvfp4", "sm107-nvfp4"))
MLA_TARGETS = (SM90, SM103, SM107)


def formats(target):
    """(kv, extra fields) of every KV format the target stores, both NVFP4 scale layouts."""
    out = []
    for kv in target.kv_dtypes:
        if kv is KvDtype.NVFP4:
            out += [(kv, dict(max_drafts=3, scale_layout=lay)) for lay in ScaleLayout]
        elif kv is KvDtype.FP8:
            out += [(kv, dict(fp8_scales=g)) for g in Fp8ScaleGranularity]
        else:
            out.append((kv, {}))
    return out


def old_auto(target, kv, scale_layout):
    """schedule="auto" as MlaDecodeSpec.__post_init__ resolved it before the variant table."""
    layout = scale_layout or target.nvfp4_scale_layout
    wg = target.mma == "wgmma" and (kv is KvDtype.FP8 or (kv is KvDtype.NVFP4 and layout is ScaleLayout.LINEAR))
    qm = target.mma == "wgmma" and kv is KvDtype.BF16
    # issue 26: the tcgen05 targets get a tcgen05 kernel (NVFP4: with their 128x4 scale swizzle); since
    # the B300 projection priced it (bench/cases/mla_decode_b300.py), tokens on M at every H * T
    if target.mma == "tcgen05" and (kv is not KvDtype.NVFP4 or layout is ScaleLayout.SWIZZLE_128X4):
        return "tcgen05_tm"
    return "wgmma_qm" if qm else "wgmma" if wg else "mma"


def test_declared_order():
    assert VARIANTS.names() == ("tcgen05_tm", "tcgen05", "wgmma_qm", "wgmma", "mma")
    assert MlaDecodeSpec.variant_field == "schedule" and MlaDecodeSpec.variants is VARIANTS


@pytest.mark.parametrize("target", MLA_TARGETS, ids=lambda t: t.name)
def test_auto_picks_what_the_committed_manifest_names(target):
    """Every committed mla_decode spec, rebuilt with schedule and m_tiles left to `auto`, is the same
    spec (fields, digest, file name) the generated tree holds."""
    manifest = json.loads((ROOT / "generated" / target.module_name / "manifest.json").read_text())
    kernels = [k for k in manifest["kernels"] if k["op"] == "mla_decode"]
    assert kernels
    for k in kernels:
        d = dict(k["spec"], schedule="auto", m_tiles=None)
        if d["kv"] != "nvfp4":
            d["scale_layout"] = None
        s = spec_from_canonical(json.dumps(d), target)
        assert json.loads(s.canonical()) == k["spec"] and s.digest() == k["digest"], k["name"]
        if k.get("file"):
            assert Path(k["file"]).name == s.file_stem + ".cu"


@pytest.mark.parametrize("target", MLA_TARGETS, ids=lambda t: t.name)
def test_auto_matches_the_old_rule(target):
    for kv, kw in formats(target):
        for h, t in ((6, 1), (12, 1), (16, 1), (12, 2), (33, 1), (96, 4), (128, 8)):
            s = MlaDecodeSpec(target=target, heads=h, tokens=t, kv=kv, **kw)
            assert s.schedule == old_auto(target, kv, kw.get("scale_layout")), (kv, kw, h, t)
            # The m_tiles default of the kernel it got (as before: 64 rows for wgmma_qm, 16 for the
            # FP8/NVFP4 wgmma, 16 or 32 for mma.sync by H * T).
            want = {"tcgen05_tm": tm_default_rows(h * t) // 16, "tcgen05": 4, "wgmma_qm": 4, "wgmma": 1,
                    "mma": 1 if h * t <= 16 else 2}[s.schedule]
            assert s.m_tiles == want and "-mt" not in s.slug()
            assert s == MlaDecodeSpec(target=target, heads=h, tokens=t, kv=kv, schedule=s.schedule, **kw)


CANNOT = {   # variant -> specs (as fields) it cannot implement
    "tcgen05_tm": [dict(target=SM90, heads=12),
                   dict(target=SM107, heads=12, kv=KvDtype.NVFP4, max_drafts=3, scale_layout=ScaleLayout.LINEAR)],
    "tcgen05": [dict(target=SM90, heads=12),
                dict(target=SM103, heads=12, kv=KvDtype.NVFP4, max_drafts=3, scale_layout=ScaleLayout.LINEAR)],
    "wgmma_qm": [dict(target=SM103, heads=12), dict(target=SM90, heads=12, kv=KvDtype.FP8),
                 dict(target=SM90, heads=12, kv=KvDtype.NVFP4, max_drafts=3)],
    "wgmma": [dict(target=SM107, heads=12, kv=KvDtype.FP8), dict(target=SM90, heads=12),
              dict(target=SM90, heads=12, kv=KvDtype.NVFP4, max_drafts=3, scale_layout=ScaleLayout.SWIZZLE_128X4)],
}


@pytest.mark.parametrize("name", sorted(CANNOT))
def test_can_implement_says_why_in_words(name):
    v = VARIANTS.get(name)
    for kw in CANNOT[name]:
        spec = MlaDecodeSpec(schedule="mma", **kw)
        why = v.can_implement(spec)
        assert isinstance(why, str) and len(why.split()) >= 4, (name, kw, why)
        # An explicit request names the field, the value, the variants that can, and the reason.
        with pytest.raises(SpecError) as e:
            MlaDecodeSpec(schedule=name, **kw)
        assert e.value.field == "schedule" and e.value.value == name
        assert "mma" in e.value.allowed and name not in e.value.allowed and why in str(e.value)


def test_mma_implements_every_spec():
    for target in MLA_TARGETS:
        for kv, kw in formats(target):
            assert VARIANTS.get("mma").can_implement(MlaDecodeSpec(target=target, heads=12, kv=kv, **kw)) is None


def test_bf16_tokens_on_m_schedule_is_gone():
    with pytest.raises(SpecError, match=r"schedule='wgmma' is not allowed; allowed: wgmma_qm, mma") as e:
        MlaDecodeSpec(target=SM90, heads=12, schedule="wgmma")
    assert "BF16 KV: schedule 'wgmma_qm'" in str(e.value)
    with pytest.raises(SpecError, match="schedule='tiles'"):
        MlaDecodeSpec(target=SM90, heads=12, schedule="tiles")
    assert not (ROOT / "k3gen/include/k3gen/mla/decode_wg.cuh").read_text().count("decode(const Params")


def test_explicit_m_tiles_are_the_variants():
    with pytest.raises(SpecError, match="m_tiles=4"):
        MlaDecodeSpec(target=SM90, heads=128, m_tiles=4, schedule="mma")
    with pytest.raises(SpecError, match="m_tiles=2"):
        MlaDecodeSpec(target=SM90, heads=12, kv=KvDtype.FP8, m_tiles=2)
    s = MlaDecodeSpec(target=SM90, heads=128, m_tiles=1, schedule="mma")
    assert s.slug() == "h128-t1-bf16-mt1" and s.impl.plan(s).groups == 8


def test_template_reads_the_plan():
    """One include, no if-chains: the chosen variant's header, geometry struct, launch bounds and
    shared memory come from its plan."""
    tmpl = (ROOT / "k3gen/ops/mla_decode/template.cu.j2").read_text()
    assert len(re.findall(r"{%-?\s*(?:if|for)\b", tmpl)) <= 2 and "{% if" not in tmpl
    assert "k3gen/ir/ops" not in tmpl
    for kw in (dict(heads=96, tokens=4), dict(heads=12, kv=KvDtype.FP8), dict(heads=12, kv=KvDtype.NVFP4, max_drafts=3),
               dict(heads=12, schedule="mma"), dict(heads=12, kv=KvDtype.NVFP4, max_drafts=3, schedule="mma")):
        s = MlaDecodeSpec(target=SM90, **kw)
        k = s.impl.template_inputs(s)
        p = k["plan"]
        src = lower(s).source
        assert src.count("#include \"k3gen/mla/") == 1 and f'#include "{k["header"]}"' in src
        assert f"__launch_bounds__({p.threads}, {p.ctas_per_sm})" in src
        assert f"using Geo = {k['geo']};" in src and f"Geo::kSmem == {p.smem_bytes}" in src
        assert f"kStages = {p.stages};" in src and (("TmaMap kv_map" in src) == p.kv_map)


def test_heads_sweep_bench_specs():
    from bench import cases as bench_cases
    from bench.cases.mla_decode import HEADS_SWEEP, bench_specs, bars_specs, heads_sweep_specs
    assert callable(bench_cases.mla_decode_heads)
    full = heads_sweep_specs()
    assert [(s.heads, s.schedule) for s in full] == [(h, s) for h in HEADS_SWEEP for s in ("mma", "wgmma_qm")]
    assert {s.impl.plan(s).rows for s in full if s.schedule == "wgmma_qm"} == {64}
    for s in bench_specs(quick=True) + bars_specs():
        assert s.schedule != "wgmma" or s.kv is not KvDtype.BF16
