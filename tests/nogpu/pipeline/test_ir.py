"""IR: dim expressions, spec identity (canonical/digest/slug), layouts and byte estimates, registry stems."""
import dataclasses
import json
from pathlib import Path

import pytest
import sympy

from k3gen.errors import SpecError
from k3gen.ir import evaluate, sym
from k3gen.ops import registry, spec_from_canonical
from k3gen.ir.dtypes import BLOCK_SCALED, NVFP4, MXFP4, KvDtype, ScaleLayout, SsmDtype
from k3gen.ir.layouts import KvLayout, StatePoolLayout, swizzle_128x4_offset
from k3gen.ops.kv_cache_write.spec import KvCacheWriteSpec
from k3gen.targets import TARGETS, build_specs

ROOT = Path(__file__).resolve().parents[3]


def test_dims():
    assert sym("B") == sympy.Symbol("B", positive=True, integer=True)
    assert evaluate(sym("B") * sym("T") * 3, B=2, T=5) == 30
    with pytest.raises(SpecError, match="values for every free dim"):
        evaluate(sym("B") * sym("T"), B=2)


def test_dtype_table():
    assert NVFP4.block == 16 and NVFP4.scale.name == "e4m3" and NVFP4.global_scale.name == "fp32"
    assert MXFP4.block == 32 and MXFP4.scale.name == "ue8m0" and MXFP4.global_scale is None
    assert NVFP4.bytes_per_element() == 0.5 + 1 / 16
    assert set(BLOCK_SCALED) == {"nvfp4", "mxfp4", "fp8_block128"}


@pytest.mark.parametrize("kv,page,bpt", [(KvDtype.BF16, 64, 1152), (KvDtype.FP8, 64, 576 + 20),
                                          (KvDtype.NVFP4, 128, 288 + 2 + 4)])
def test_kv_bytes_per_token(kv, page, bpt):
    assert KvLayout(kv=kv, page=page).bytes_per_token == bpt


def test_nvfp4_swizzled_bytes_and_ring():
    lay = KvLayout(kv=KvDtype.NVFP4, page=128, scale_layout=ScaleLayout.SWIZZLE_128X4, max_drafts=3)
    assert lay.bytes_per_token == 288 + 36  # the per-row scale matrix [128, 36]
    assert lay.ring == 19
    assert lay.tensors()["hp_tail"].concrete_shape(num_pages=1, num_slots=5) == (5, 19, 576)
    assert lay.bytes_per_seq_fixed == 19 * 576 * 2


def test_swizzle_is_a_bijection_on_a_page():
    offs = {swizzle_128x4_offset(r, c, 36) for r in range(128) for c in range(36)}
    assert len(offs) == 128 * 36 and max(offs) < 128 * 36
    assert swizzle_128x4_offset(0, 0, 36) == 0 and swizzle_128x4_offset(0, 4, 36) == 512
    assert swizzle_128x4_offset(33, 1, 36) == 1 + 16 + 4


def test_state_pool_bytes_match_spec_md():
    pool = StatePoolLayout(heads=12)
    t = pool.tensors()
    assert t["ssm"].nbytes.subs(sym("num_slots"), 1) == 786432
    assert StatePoolLayout(heads=12, ssm=SsmDtype.BF16).tensors()["ssm"].nbytes.subs(sym("num_slots"), 1) == 393216
    assert t["conv"].nbytes.subs(sym("num_slots"), 1) == 27648
    drafts = StatePoolLayout(heads=12, ssm=SsmDtype.BF16, max_drafts=3).tensors()
    assert drafts["draft_rec"].dtype.name == "fp32"  # records are FP32 whatever the SSM dtype
    assert drafts["draft_rec"].concrete_shape(num_slots=2) == (2, 3, 12, 128, 128)


def test_spec_identity_is_deterministic_and_sensitive():
    t = TARGETS["sm103-nvfp4"]
    a = KvCacheWriteSpec(target=t, kv=KvDtype.NVFP4, max_drafts=3)
    b = KvCacheWriteSpec(target=t, kv=KvDtype.NVFP4, max_drafts=3)
    c = KvCacheWriteSpec(target=t, kv=KvDtype.NVFP4, max_drafts=7)
    assert a == b and a.canonical() == b.canonical() and a.digest() == b.digest()
    assert a.digest() != c.digest() and a.slug() != c.slug()
    d = KvCacheWriteSpec(target=TARGETS["sm107-nvfp4"], kv=KvDtype.NVFP4, max_drafts=3)
    assert d.digest() != a.digest()
    assert json.loads(a.canonical())["op"] == "kv_cache_write"
    assert list(json.loads(a.canonical())) == sorted(json.loads(a.canonical()))
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.max_drafts = 1


@pytest.mark.parametrize("target", list(TARGETS))
def test_canonical_round_trip(target):
    t = TARGETS[target]
    for s in build_specs(t):
        assert spec_from_canonical(s.canonical(), t) == s


def test_estimates_come_from_the_layout():
    s = KvCacheWriteSpec(target=TARGETS["sm90"], kv=KvDtype.BF16)
    assert evaluate(s.bytes_moved(), B=2, T=3) == 2 * 3 * 1152 * 2 + 2 * 3 * 4


def test_every_op_has_all_layers():
    """One folder per op (DESIGN.md "Layout"): contract, variants, kernel source, reference, launcher, GPU test."""
    from k3gen.ops import launcher_path
    ops = ROOT / "k3gen" / "ops"
    for name, cls in registry().items():
        d = ops / name
        for f in ("spec.py", "variants.py", "reference.py", "launcher.py"):
            assert (d / f).exists(), f"{name}: {f}"
        assert (ROOT / "tests" / "gpu" / f"test_{name}.py").exists(), name
        assert cls.variants is not None and cls.variants.variants, name
        for v in cls.variants.variants:
            kernel = {"nvrtc": "template.cu.j2", "cute": "cute_kernel.py"}[v.lowering]
            assert (d / kernel).exists(), f"{name}: variant {v.name} needs {kernel}"
        assert launcher_path(name)[0] == f"k3gen.ops.{name}.launcher"
