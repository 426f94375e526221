"""Every validation error of the targets and specs: its type and a message naming field, value
and allowed set."""
import dataclasses

import pytest

from k3gen.hf_config import ConfigError
from k3gen.errors import SpecError, TargetError
from k3gen.ir.dtypes import KvDtype, ScaleLayout, ScaleRecipe, SsmDtype
from k3gen.ir.layouts import KvLayout
from k3gen.ops.kv_cache_write.spec import KvCacheWriteSpec
from k3gen.targets import (DEFAULT_DRAFTS, DEFAULT_MODEL, DEFAULT_TPS, K3_MENU, TARGETS, ServingOptions, SpecMenu,
                           build_specs, check_serving, get_model, get_target, model_specs, serving_sweep)

SM90, SM100, SM103, SM107 = (TARGETS[n] for n in ("sm90", "sm100-mxfp4", "sm103-nvfp4", "sm107-nvfp4"))


def _raises(exc, *needles):
    class Ctx:
        def __enter__(self):
            self.cm = pytest.raises(exc)
            self.info = self.cm.__enter__()
            return self.info

        def __exit__(self, *a):
            r = self.cm.__exit__(*a)
            msg = str(self.info.value)
            for n in needles:
                assert n in msg, f"{n!r} not in {msg!r}"
            return r
    return Ctx()


def test_unknown_arch():
    with _raises(TargetError, "arch='sm80'", "sm90", "sm103") as e:
        get_target("sm80")
    assert e.value.field == "arch" and e.value.value == "sm80"


def test_aliases():
    assert get_target("sm100") is SM100 and get_target("sm103") is SM103 and get_target("sm107") is SM107
    assert SM103.arch == "sm_103a" and SM107.arch == "sm_107a" and SM90.arch == "sm_90a" and SM100.arch == "sm_100a"


def test_nvfp4_presets_share_one_implementation():
    # Thin presets: everything but name/arch/sm is the same.
    a, b = SM103.__dict__.copy(), SM107.__dict__.copy()
    for k in ("name", "arch", "sm"):
        a.pop(k), b.pop(k)
    assert a == b


def test_nvfp4_page_must_be_128():
    with _raises(SpecError, "page=64", "128"):
        KvLayout(kv=KvDtype.NVFP4, page=64)
    with _raises(SpecError, "page=64", "128"):
        KvCacheWriteSpec(target=SM103, kv=KvDtype.NVFP4, page=64)
    with _raises(SpecError, "page=256"):
        check_serving(SM103, ServingOptions(kv=KvDtype.NVFP4, page=256))


def test_bf16_page_must_be_64():
    with _raises(SpecError, "page=128", "64"):
        KvCacheWriteSpec(target=SM90, kv=KvDtype.BF16, page=128)
    with _raises(SpecError, "page=32", "64"):
        check_serving(SM90, ServingOptions(kv=KvDtype.BF16, page=32))


def test_nvfp4_no_chunked_prefill():
    with _raises(SpecError, "chunked_prefill=True", "False"):
        check_serving(SM103, ServingOptions(kv=KvDtype.NVFP4, chunked_prefill=True))
    check_serving(SM103, ServingOptions(kv=KvDtype.FP8, chunked_prefill=True))  # allowed off NVFP4


def test_nvfp4_not_on_original_target():
    with _raises(TargetError, "kv='nvfp4'", "bf16, fp8", "sm100-mxfp4"):
        check_serving(SM100, ServingOptions(kv=KvDtype.NVFP4))
    with _raises(TargetError, "kv='nvfp4'"):
        KvCacheWriteSpec(target=SM100, kv=KvDtype.NVFP4)
    with _raises(TargetError, "kv='nvfp4'"):
        build_specs(SM100, kv=KvDtype.NVFP4)


def test_bf16_ssm_not_on_original_target():
    with _raises(TargetError, "ssm='bf16'", "fp32", "sm100-mxfp4"):
        check_serving(SM100, ServingOptions(kv=KvDtype.BF16, ssm=SsmDtype.BF16))
    check_serving(SM103, ServingOptions(kv=KvDtype.BF16, ssm=SsmDtype.BF16))


@pytest.mark.parametrize("field,value,needle", [
    ("context_start_alignment", 8, "context_start_alignment=8"),
    ("partial_page_reuse", True, "partial_page_reuse=True"),
    ("context_parallel", True, "context_parallel=True"),
    ("disaggregated", True, "disaggregated=True"),
])
def test_nvfp4_restrictions(field, value, needle):
    with _raises(SpecError, needle):
        check_serving(SM107, ServingOptions(kv=KvDtype.NVFP4, **{field: value}))
    check_serving(SM107, ServingOptions(kv=KvDtype.BF16, **{field: value}))  # only NVFP4 restricts


def test_max_drafts_range():
    with _raises(SpecError, "max_drafts=8", "0..7"):
        check_serving(SM103, ServingOptions(kv=KvDtype.NVFP4, max_drafts=8))


def test_spec_field_errors():
    with _raises(SpecError, "kv='int4'"):
        KvCacheWriteSpec(target=SM90, kv="int4")
    with _raises(SpecError, "scale_layout='swz128x4'"):
        KvCacheWriteSpec(target=SM90, kv=KvDtype.BF16, scale_layout=ScaleLayout.SWIZZLE_128X4)
    with _raises(SpecError, "max_drafts=3"):
        KvCacheWriteSpec(target=SM90, kv=KvDtype.FP8, max_drafts=3)
    with _raises(SpecError, "target="):
        KvCacheWriteSpec(target="sm90", kv=KvDtype.BF16)
    with pytest.raises(TypeError):  # keyword-only
        KvCacheWriteSpec(SM90, KvDtype.BF16)


def test_default_scale_layout_follows_target():
    assert KvCacheWriteSpec(target=SM90, kv=KvDtype.NVFP4).scale_layout is ScaleLayout.LINEAR
    assert KvCacheWriteSpec(target=SM103, kv=KvDtype.NVFP4).scale_layout is ScaleLayout.SWIZZLE_128X4


# -- features, menus and the enumerator ------------------------------------------------------------
def test_no_code_decides_by_target_name():
    """Behaviour follows features (mma, fp4_cvt, tma, recipes, menu, frozen), never a preset's name."""
    import pathlib
    import re
    root = pathlib.Path(__file__).resolve().parents[3]
    names = "|".join(re.escape(n) for n in TARGETS)
    pat = re.compile(rf"""target\.name\s*(==|!=|in\b|not in\b)|["']({names})["']\s*(==|!=)|(==|!=)\s*["']({names})["']""")
    hits = []
    for d in ("k3gen", "model"):
        for p in (root / d).rglob("*.py"):
            for i, line in enumerate(p.read_text().splitlines(), 1):
                if "target" in line and pat.search(line):
                    hits.append(f"{p.relative_to(root)}:{i}: {line.strip()}")
    assert not hits, "\n".join(hits)


def test_target_features():
    assert SM90.recipes == (ScaleRecipe.FP32, ScaleRecipe.UE8M0) and SM103.recipes == (ScaleRecipe.UE8M0,)
    assert all(t.tma for t in TARGETS.values())
    assert set(SM100.menu) == {"kv_cache_write", "kda_verify"} and SM90.menu == SM103.menu == K3_MENU
    # Digests see name and arch only: the features never move a committed file.
    assert SM90.canonical() == {"name": "sm90", "arch": "sm_90a"}


def test_recipe_is_a_serving_option():
    assert check_serving(SM90, ServingOptions(kv=KvDtype.BF16, recipe=ScaleRecipe.UE8M0)).recipe is ScaleRecipe.UE8M0
    assert check_serving(SM103, ServingOptions(kv=KvDtype.BF16)).recipe is ScaleRecipe.UE8M0
    with _raises(TargetError, "recipe='fp32'", "ue8m0", "sm103-nvfp4"):
        check_serving(SM103, ServingOptions(kv=KvDtype.BF16, recipe=ScaleRecipe.FP32))
    with _raises(SpecError, "recipe='int8'"):
        check_serving(SM90, ServingOptions(kv=KvDtype.BF16, recipe="int8"))


def _ops(specs):
    from collections import Counter
    return Counter(s.op for s in specs)


@pytest.mark.parametrize("kv,drafts", [(KvDtype.BF16, 0), (KvDtype.FP8, 3), (KvDtype.NVFP4, 3)])
def test_model_specs_k3_tp8(kv, drafts):
    specs = model_specs(SM103, "k3", 8, serving=ServingOptions(kv=kv, ssm=SsmDtype.BF16, max_drafts=drafts))
    assert len({s.digest() for s in specs}) == len(specs)
    by = {(s.op, getattr(s, "heads", None)) for s in specs}
    assert {("kda_decode", 12), ("kda_prefill", 12), ("mla_q_absorb", 12), ("mla_vb_gate", 12)} <= by
    assert (("kda_verify", 12) in by) == bool(drafts)
    gemms = {(s.n, s.k) for s in specs if s.op == "fp8_block_gemm"}
    # qkvg, the fused f_a|b (128 + 12 padded to 16), KDA o_proj, the MLA A-projection
    # [q_a 1536 | c_kv 512 | k_pe 64 | pad 64 | gate 12 * 128], Q-B, MLA o_proj; the FFN (issue 21): the
    # latent down/up, the shared experts' [gate | up] (2 x 768) and down, the dense MLP's (2 x 4224) and down.
    assert gemms == {(6144, 7168), (144, 7168), (7168, 1536), (1536 + 640 + 1536, 7168), (2304, 1536),
                     (3584, 7168), (7168, 3584), (1536, 7168), (7168, 768), (8448, 7168), (7168, 4224)}
    # act_quant only for o_proj's and Q-B's input: attn_res, glu_act and routed_expert_norm quantize the rest
    assert {s.k for s in specs if s.op == "act_quant_fp8"} == {1536}
    assert {s.inter for s in specs if s.op == "glu_act"} == {768, 4224}
    assert sorted((s.hidden, s.max_sources, s.delta.value) for s in specs if s.op == "attn_res") == [
        (3584, 1, "none"), (7168, 9, "bf16"), (7168, 9, "fp32"), (7168, 9, "none")]
    assert [(s.experts, s.top_k) for s in specs if s.op == "moe_route"] == [(896, 16)]
    # The target's UE8M0 recipe everywhere a spec has one (the W4A16 experts have none: BF16 activations).
    assert all(getattr(s, "recipe", None) in (None, ScaleRecipe.UE8M0) for s in specs)
    assert {s.recipe for s in specs if s.op in ("fp8_block_gemm", "act_quant_fp8")} == {ScaleRecipe.UE8M0}
    assert {(s.weights.value, s.act.value) for s in specs if s.op == "moe_experts"} == {("mxfp4", "bf16"), ("nvfp4", "bf16")}
    attn = sorted(s.tokens for s in specs if s.op == "mla_decode")
    assert attn == ([1] if kv is KvDtype.NVFP4 or not drafts else [1, 1 + drafts])
    kvw = [s for s in specs if s.op == "kv_cache_write"]
    assert len(kvw) == 1 and kvw[0].max_drafts == (drafts if kv is KvDtype.NVFP4 else 0)


def test_model_specs_tp_and_presets():
    tp1 = {(s.n, s.k) for s in model_specs(SM90, "k3", 1) if s.op == "fp8_block_gemm"}
    assert (4 * 96 * 128, 7168) in tp1 and (7168, 96 * 128) in tp1 and (-(-(128 + 96) // 16) * 16, 7168) in tp1
    with _raises(SpecError, "tp=5", "kda_heads=96"):
        model_specs(SM90, "k3", 5)
    # No q LoRA (Kimi-Linear-48B): a plain q_proj GEMM, no mla_q_absorb; another LoRA width has no kernel.
    kl = model_specs(SM90, "kimi_linear_48b", 1)
    assert not any(s.op == "mla_q_absorb" for s in kl)
    assert {(32 * 192, 2304), (640 + 32 * 128, 2304)} <= {(s.n, s.k) for s in kl if s.op == "fp8_block_gemm"}
    with _raises(SpecError, "q_lora=1024", "1536"):
        model_specs(SM90, dataclasses.replace(get_model("k3"), q_lora=1024), 1)
    with _raises(SpecError, "model='nope'", "k3", "small"):
        model_specs(SM90, "nope")
    with _raises(ConfigError, "/some/where/config.json", "no such file"):
        get_model("/some/where/config.json")
    with _raises(SpecError, "ep=0"):
        model_specs(SM90, "small", ep=0)
    with _raises(TargetError, "op='kda_decode'", "sm100-mxfp4"):
        model_specs(SM100, "small", serving=ServingOptions(kv=KvDtype.BF16))


def test_committed_trees_are_the_default_models_plus_extras():
    for t in (SM90, SM103, SM107):
        tree = {s.digest() for s in build_specs(t)}
        for tp in DEFAULT_TPS:
            for o in serving_sweep(t, drafts=DEFAULT_DRAFTS):
                for s in model_specs(t, DEFAULT_MODEL, tp, serving=o):
                    # M = 7 verify at one CTA per SM (sm_90a) is built on demand, not committed.
                    assert s.digest() in tree or (s.op == "kda_verify" and s.blocks_per_sm == 1), s.file_stem
    narrowed = build_specs(SM90, KvDtype.FP8, SsmDtype.BF16)
    assert {getattr(s, "kv", KvDtype.FP8) for s in narrowed} == {KvDtype.FP8}
    assert {getattr(s, "ssm", SsmDtype.BF16) for s in narrowed} == {SsmDtype.BF16}
    assert [s.canonical() for s in build_specs(SM100)] == [s.canonical() for s in build_specs(SM100)]
    assert len(build_specs(SM100)) == 7      # the frozen list


def test_spec_menu_finds_by_fields():
    menu = SpecMenu(model_specs(SM90, "small", 1, serving=ServingOptions(kv=KvDtype.FP8, max_drafts=3)))
    assert menu.find("mla_decode", tokens=4).tokens == 4
    assert menu.find("act_quant_fp8", k=1536).k == 1536
    assert menu.find("fp8_block_gemm", n=12 * 192, k=1536) == menu.find("mla_q_absorb", heads=12).gemm_spec
    with _raises(SpecError, "kda_decode", "h12-bounded-fp32"):
        menu.find("kda_decode", heads=24)
