"""fp8_block_gemm on the tcgen05 targets (sm103/sm107) without a GPU: the spec selects the CuTe DSL
kernel there and only there, and the cubins built through the normal pipeline (k3gen.pipeline.build) are
for the right arch, spill nothing, and are made of tcgen05 instructions: UTCQMMA fed from shared
memory descriptors, block-scaled (scale factors copied to TMEM with UTCCP) for UE8M0, plain
kind::f8f6f4 for FP32; operands by TMA (UTMALDG, the "tcgen05_tma" variant: no cp.async left),
TMEM loads in the epilogue, no mma.sync."""
from __future__ import annotations

import re

import pytest

from k3gen.pipeline.build import build_one
from k3gen.pipeline.inspect import sass_text
from k3gen.errors import SpecError
from k3gen.ir.dtypes import ScaleRecipe
from k3gen.ops.fp8_block_gemm.spec import TC_THREADS, Fp8BlockGemmSpec
from k3gen.targets import TARGETS, build_specs

pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl is not installed")

TC = {"sm103-nvfp4": "sm_103a", "sm107-nvfp4": "sm_107a"}
UE8M0, FP32 = ScaleRecipe.UE8M0, ScaleRecipe.FP32
# MMA K per instruction: 32 on sm_103a, 64 on sm_107a (Rubin); 128 K columns per stage.
MMAS_PER_BLOCK = {"sm103-nvfp4": 4, "sm107-nvfp4": 2}
SMEM_LIMIT = 227 * 1024


def test_lowering_follows_the_target():
    assert Fp8BlockGemmSpec(target=TARGETS["sm90"], n=256, k=256).lowering == "nvrtc"
    for name in TC:
        s = Fp8BlockGemmSpec(target=TARGETS[name], n=256, k=256)
        assert s.lowering == "cute" and s.threads == TC_THREADS
        assert s.grid(33) == (1, 1, 2)
    # The frozen original target builds no FP8 GEMM at all (its generated sources must not change).
    assert not [s for s in build_specs(TARGETS["sm100-mxfp4"]) if s.op == "fp8_block_gemm"]
    for name in TC:
        gemms = [s for s in build_specs(TARGETS[name]) if s.op == "fp8_block_gemm"]
        assert gemms and all(s.lowering == "cute" for s in gemms)


@pytest.mark.parametrize("recipe,bm", [(UE8M0, 32), (UE8M0, 16), (FP32, 128), (FP32, 16)])
def test_tcgen05_tile_limits(recipe, bm):
    with pytest.raises(SpecError, match="bm="):
        Fp8BlockGemmSpec(target=TARGETS["sm103-nvfp4"], n=256, k=256, recipe=recipe, bm=bm)


CASES = [(name, r, n, k, bm) for name in TC
         for r, n, k, bm in ((UE8M0, 200, 272, 64), (UE8M0, 1536, 7168, 128), (FP32, 200, 272, 64),
                             (FP32, 2304, 1536, 32))]


@pytest.fixture(scope="module")
def built():
    return {}


def _build(built, name, recipe, n, k, bm):
    key = (name, recipe, n, k, bm)
    if key not in built:
        spec = Fp8BlockGemmSpec(target=TARGETS[name], n=n, k=k, recipe=recipe, bm=bm)
        built[key] = (spec, build_one(spec))
    return built[key]


@pytest.mark.parametrize("name,recipe,n,k,bm", CASES,
                         ids=[f"{c[0]}-{c[1].value}-n{c[2]}-k{c[3]}-bm{c[4]}" for c in CASES])
def test_tcgen05_cubin(built, name, recipe, n, k, bm):
    spec, r = _build(built, name, recipe, n, k, bm)
    assert r.meta["arch"] == TC[name]
    abi = r.meta["params"]
    assert abi["block"] == [TC_THREADS, 1, 1]
    assert spec.mma == "tcgen05_tma"
    names = ["x_codes", "x_scales", "w_codes", "w_scales", "out"]
    assert [p["tensor"] for p in abi["params"]] == names + ["w_codes", "x_codes", "x_codes"]
    # After the tensors: W's and x's tensor maps (128 bytes, 64-aligned, by value) and x's TMA
    # coordinate tensor, whose one field is M.
    w_map, x_map, x_crd = abi["params"][5:]
    for p, box in ((w_map, [128, 128]), (x_map, [128, bm])):
        assert p["size"] == 128 and p["offset"] % 64 == 0 and p["tma"]["box"] == box, p
        assert [f["kind"] for f in p["fields"]] == ["tma"] and p["tma"]["swizzle"] == 128
    assert x_crd["tma"] == {"role": "coord"}
    assert [(f["kind"], f["symbol"], f["size"]) for f in x_crd["fields"]] == [("shape", "M", 4)]
    # M is the only runtime value: one 32-bit field in x_codes, x_scales and out, none in the weights.
    for p in abi["params"][:5]:
        dyn = [f for f in p["fields"] if f["kind"] != "ptr"]
        if p["tensor"].startswith("w_"):
            assert not dyn, p
        else:
            assert [(f["kind"], f["mode"], f["symbol"], f["size"]) for f in dyn] == [("shape", 0, "M", 4)], p
    assert 64 * 1024 < abi["dynamic_smem"] <= SMEM_LIMIT
    (res,) = r.resources
    assert res["local"] == 0 and res["stack"] == 0, res
    assert res["registers"] <= 168, res          # 288 threads: the register file still holds one CTA
    sass, text = res["sass"], sass_text(r.cubin)
    assert sass.get("HMMA", 0) == 0 and sass.get("HGMMA", 0) == 0, sass
    assert sass.get("UTCQMMA", 0) == MMAS_PER_BLOCK[name], sass
    mmas = re.findall(r"UTCQMMA\S* [^;]*;", text)
    assert all("gdesc[" in mma and "idesc[" in mma for mma in mmas), mmas
    if recipe is UE8M0:
        # Block-scaled: the scale factors are two more TMEM operands, filled by UTCCP from shared memory.
        assert all(mma.count("tmem[") == 3 for mma in mmas), mmas
        assert sass.get("UTCCP", 0) == 2, sass
    else:
        assert all(mma.count("tmem[") == 2 for mma in mmas), mmas   # one fewer: no scale factors
        assert sass.get("UTCCP", 0) == 0, sass
    # One TMA box per operand per stage (issued by one warp), nothing by cp.async.
    assert sass.get("UTMALDG", 0) == 2 and sass.get("LDGSTS", 0) == 0, sass
    assert len(re.findall(r"UTMALDG\.2D", text)) == 2, re.findall(r"UTMALDG\S*", text)
    assert sass.get("LDTM", 0) >= bm // 32, sass
    assert sass.get("UTCBAR", 0) >= 2, sass       # tcgen05.commit to the empty and full barriers
    ptx = built_ptx(r)
    kind = "kind::mxf8f6f4.block_scale" if recipe is UE8M0 else "kind::f8f6f4"
    assert re.search(r"tcgen05\.mma\.cta_group::1\." + re.escape(kind), ptx), kind


def built_ptx(r) -> str:
    from k3gen.pipeline.cute import compile_cute
    return compile_cute(r.artifact.spec).ptx
