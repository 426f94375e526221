"""Every validation error of the targets and specs: its type and a message naming field, value
and allowed set."""
import pytest

from k3gen.errors import SpecError, TargetError
from k3gen.ir.dtypes import KvDtype, ScaleLayout, SsmDtype
from k3gen.ir.layouts import KvLayout
from k3gen.ops.kv_cache_write.spec import KvCacheWriteSpec
from k3gen.targets import ServingOptions, TARGETS, build_specs, check_serving, get_target

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
