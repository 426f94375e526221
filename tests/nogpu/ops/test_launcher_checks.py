"""The launchers' input checks on the CPU (issue 27: typed errors on every call path that is not
captured; the prefill launchers since issue 30: dropping mla_prefill's k_pe check fails the
exhaustive test of both its cases): each op's real entry point is called with well-formed CPU
tensors, which must fail only at the device check (so nothing else was wrong and nothing touched
CUDA first), then with one argument broken (dtype, rank, the fixed last dim), which must raise
SpecError before the device check, naming that argument for a wrong dtype. Hypothesis draws the
broken argument and the size of the change; the exhaustive variant walks every (argument,
mutation) pair once."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from k3gen.errors import SpecError
from k3gen.ir.dtypes import ScaleRecipe
from k3gen.runtime.launcher import launcher_class
from k3gen.targets import TARGETS

SM90 = TARGETS["sm90"]
T = 5                                     # tokens / rows of every case


def _moe_route():
    from k3gen.ops.moe_route.spec import MoeRouteSpec
    spec = MoeRouteSpec(target=SM90, experts=32, top_k=4)
    L = launcher_class(spec.op)(spec)
    args = {"logits": torch.zeros(T, 32), "bias": torch.zeros(32), "ws": L.workspace(8, device="cpu")}
    return L, args, {}


def _moe_experts(weights: str, act: str):
    from k3gen.ops.moe_experts.spec import ActFormat, MoeExpertsSpec, WeightFormat
    fmt = WeightFormat(weights)
    kw = dict(hidden=512, inter=256, experts=8, top_k=2, weights=fmt)
    if act == "fp8":
        kw.update(act=ActFormat.FP8, recipe=ScaleRecipe.FP32)
    spec = MoeExpertsSpec(target=SM90, **kw)
    L = launcher_class(spec.op)(spec)
    E, W, I, k, g = 8, 512, 256, 2, spec.group
    u8 = dict(dtype=torch.uint8)
    args = {"x": torch.zeros(T, W, dtype=torch.bfloat16) if act == "bf16" else torch.zeros(T, W, **u8),
            "w13": torch.zeros(E, 2 * I, W // 2, **u8), "s13": torch.zeros(E, 2 * I, W // g, **u8),
            "w2": torch.zeros(E, W, I // 2, **u8), "s2": torch.zeros(E, W, I // g, **u8),
            "route": {"ids": torch.zeros(T, k, dtype=torch.int32), "weights": torch.zeros(T, k),
                      "offsets": torch.zeros(E + 1, dtype=torch.int32), "perm": torch.zeros(T * k, dtype=torch.int32)},
            "out": torch.zeros(T, W, dtype=torch.bfloat16)}
    kwargs = {}
    if fmt is WeightFormat.NVFP4:
        kwargs.update(gs13=torch.ones(E, 2), gs2=torch.ones(E, 1))
    if act == "fp8":
        kwargs["x_scales"] = torch.ones(T, W // 128)
    return L, args, kwargs


def _fp8_block_gemm():
    from k3gen.ops.fp8_block_gemm.spec import Fp8BlockGemmSpec
    spec = Fp8BlockGemmSpec(target=SM90, n=256, k=512)
    L = launcher_class(spec.op)(spec)
    u8 = dict(dtype=torch.uint8)
    args = {"x_codes": torch.zeros(T, 512, **u8), "x_scales": torch.ones(T, 4),
            "w_codes": torch.zeros(256, 512, **u8), "w_scales": torch.ones(2, 4),
            "out": torch.zeros(T, 256, dtype=torch.bfloat16)}
    return L, args, {}


def _glu_act():
    from k3gen.ops.glu_act.spec import GluActSpec
    spec = GluActSpec(target=SM90, inter=384, recipe=ScaleRecipe.FP32)
    L = launcher_class(spec.op)(spec)
    args = {"gu": torch.zeros(T, 768, dtype=torch.bfloat16), "codes": torch.zeros(T, 384, dtype=torch.uint8),
            "scales": torch.ones(T, 3)}
    return L, args, {}


def _attn_res():
    from k3gen.ops.attn_res.spec import AttnResSpec
    spec = AttnResSpec(target=SM90, hidden=7168)
    L = launcher_class(spec.op)(spec)
    h = 7168
    args = {"src": torch.zeros(9, T, h), "n": 3, "query": torch.zeros(h), "norm_w": torch.ones(h, dtype=torch.bfloat16),
            "out": torch.zeros(T, h, dtype=torch.bfloat16)}
    kwargs = {"codes": torch.zeros(T, h, dtype=torch.uint8), "scales": torch.ones(T, h // 128)}
    return L, args, kwargs


def _mla_vb_gate():
    from k3gen.ops.mla_vb_gate.spec import MlaVbGateSpec
    spec = MlaVbGateSpec(target=SM90, heads=12)
    L = launcher_class(spec.op)(spec)
    bf = dict(dtype=torch.bfloat16)
    args = {"o_lat": torch.zeros(T, 12, 512, **bf), "w_uv": torch.zeros(12, 128, 512, **bf),
            "gate": torch.zeros(T, 12 * 128, **bf), "out": torch.zeros(T, 12, 128, **bf)}
    return L, args, {}


def _mla_q_absorb():
    from k3gen.ops.mla_q_absorb.spec import MlaQAbsorbSpec
    spec = MlaQAbsorbSpec(target=SM90, heads=12, recipe=ScaleRecipe.FP32)
    L = launcher_class(spec.op)(spec)
    bf = dict(dtype=torch.bfloat16)
    n = 12 * 192
    args = {"q_a": torch.zeros(T, 1536, **bf), "norm_w": torch.ones(1536, **bf),
            "wqb_codes": torch.zeros(n, 1536, dtype=torch.uint8), "wqb_scales": torch.ones(n // 128, 12),
            "w_uk": torch.zeros(12, 128, 512, **bf), "out": torch.zeros(T, 12, 576, **bf)}
    return L, args, {"workspace": L.workspace(8, device="cpu")}


def _kv_cache_write(kv: str):
    from k3gen.ir.dtypes import KvDtype
    from k3gen.ops.kv_cache_write.reference import alloc_cache
    from k3gen.ops.kv_cache_write.spec import KvCacheWriteSpec
    spec = KvCacheWriteSpec(target=SM90, kv=KvDtype(kv), max_drafts=3 if kv == "nvfp4" else 0)
    L = launcher_class(spec.op)(spec)
    i32 = dict(dtype=torch.int32)
    args = {"rows": torch.zeros(T, 576, dtype=torch.bfloat16), "cu_rows": torch.tensor([0, 2, T], **i32),
            "start_pos": torch.zeros(2, **i32), "block_table": torch.zeros(2, 4, **i32),
            "cache": alloc_cache(spec.layout, 8, 2)}
    kwargs = {"max_rows_per_seq": 3}
    if spec.kv is KvDtype.NVFP4:
        kwargs["ring_slot"] = torch.zeros(2, **i32)
    return L, args, kwargs


def _kda_decode(ssm: str):
    from k3gen.ir.dtypes import SsmDtype
    from k3gen.ops.kda_decode.spec import KdaDecodeSpec
    spec = KdaDecodeSpec(target=SM90, heads=4, ssm=SsmDtype(ssm))
    L = launcher_class(spec.op)(spec)
    H, D, S = 4, 4 * 128, 3
    bf = dict(dtype=torch.bfloat16)
    args = {"qkvg": torch.zeros(T, 4 * D, **bf), "fa": torch.zeros(T, 128, **bf), "beta_logit": torch.zeros(T, H, **bf),
            "ssm": torch.zeros(S, H, 128, 128, dtype=torch.float32 if ssm == "fp32" else torch.bfloat16),
            "conv": torch.zeros(S, 3 * D, 3, **bf), "slots": torch.zeros(T, dtype=torch.int32),
            "conv_w": torch.zeros(3 * D, 4, **bf), "fb_w": torch.zeros(D, 128, **bf), "dt_bias": torch.zeros(D),
            "a_log": torch.zeros(H), "norm_w": torch.ones(128), "out": torch.zeros(T, H, 128, **bf)}
    return L, args, {}


def _kda_verify(ssm: str):
    from k3gen.ir.dtypes import SsmDtype
    from k3gen.ops.kda_verify.spec import KdaVerifySpec
    M = 3
    spec = KdaVerifySpec(target=SM90, heads=4, drafts=M, ssm=SsmDtype(ssm))
    L = launcher_class(spec.op)(spec)
    H, D, S, B = 4, 4 * 128, 3, 2
    bf = dict(dtype=torch.bfloat16)
    n = B * (1 + M)
    args = {"qkvg": torch.zeros(n, 4 * D, **bf), "fa": torch.zeros(n, 128, **bf), "beta_logit": torch.zeros(n, H, **bf),
            "ssm": torch.zeros(S, H, 128, 128, dtype=torch.float32 if ssm == "fp32" else torch.bfloat16),
            "draft_rec": torch.zeros(S, M, H, 128, 128), "conv_ext": torch.zeros(S, 3 * D, 3 + M),
            "pending": torch.zeros(S, dtype=torch.int32), "slots": torch.zeros(B, dtype=torch.int32),
            "conv_w": torch.zeros(3 * D, 4, **bf), "fb_w": torch.zeros(D, 128, **bf), "dt_bias": torch.zeros(D),
            "a_log": torch.zeros(H), "norm_w": torch.ones(128), "out": torch.zeros(B, 1 + M, H, 128, **bf)}
    return L, args, {}


def _kda_prefill(ssm: str):
    from k3gen.ir.dtypes import SsmDtype
    from k3gen.ops.kda_prefill.spec import KdaPrefillSpec
    spec = KdaPrefillSpec(target=SM90, heads=4, ssm=SsmDtype(ssm))
    L = launcher_class(spec.op)(spec)
    H, D, S, B = 4, 4 * 128, 3, 2
    bf, i32 = dict(dtype=torch.bfloat16), dict(dtype=torch.int32)
    args = {"qkvg": torch.zeros(T, 4 * D, **bf), "fa": torch.zeros(T, 128, **bf), "beta_logit": torch.zeros(T, H, **bf),
            "cu_seqlens": torch.tensor([0, 2, T], **i32), "slots": torch.zeros(B, **i32),
            "resume": torch.zeros(B, **i32),
            "ssm": torch.zeros(S, H, 128, 128, dtype=torch.float32 if ssm == "fp32" else torch.bfloat16),
            "conv": torch.zeros(S, 3 * D, 3, **bf), "conv_w": torch.zeros(3 * D, 4, **bf),
            "fb_w": torch.zeros(D, 128, **bf), "dt_bias": torch.zeros(D), "a_log": torch.zeros(H),
            "norm_w": torch.ones(128), "out": torch.zeros(T, H, 128, **bf)}
    return L, args, {}


def _mla_prefill(out: str):
    from k3gen.ops.mla_prefill.spec import MlaPrefillSpec, OutDtype
    spec = MlaPrefillSpec(target=SM90, heads=6, out_dtype=OutDtype(out))
    L = launcher_class(spec.op)(spec)
    H = 6
    bf, i32 = dict(dtype=torch.bfloat16), dict(dtype=torch.int32)
    args = {"q": torch.zeros(T, H, 192, **bf), "k_nope": torch.zeros(T + 3, H, 128, **bf),
            "k_pe": torch.zeros(T + 3, 64, **bf), "v": torch.zeros(T + 3, H, 128, **bf),
            "cu_seqlens_q": torch.tensor([0, 2, T], **i32), "cu_seqlens_k": torch.tensor([0, 5, T + 3], **i32),
            "out": torch.zeros(T, H, 128, dtype=torch.float32 if out == "fp32" else torch.bfloat16), "max_seqlen_q": 3}
    return L, args, {}


def _mla_decode(kv: str):
    from k3gen.ir.dtypes import KvDtype
    from k3gen.ops.kv_cache_write.reference import alloc_cache
    from k3gen.ops.mla_decode.spec import MlaDecodeSpec
    nv = kv == "nvfp4"
    spec = MlaDecodeSpec(target=SM90, heads=12, tokens=1, kv=KvDtype(kv), **({"max_drafts": 3} if nv else {}))
    L = launcher_class(spec.op)(spec)
    bf, i32 = dict(dtype=torch.bfloat16), dict(dtype=torch.int32)
    args = {"q": torch.zeros(T, 1, 12, 576, **bf), "cache": alloc_cache(spec.layout, 8, T),
            "block_table": torch.zeros(T, 4, **i32), "lengths": torch.ones(T, **i32),
            "out": torch.zeros(T, 1, 12, 512, **bf)}
    return L, args, ({"ring_slot": torch.zeros(T, **i32)} if nv else {})


CASES = {"moe_route": _moe_route, "moe_experts-mxfp4-bf16": lambda: _moe_experts("mxfp4", "bf16"),
         "moe_experts-nvfp4-bf16": lambda: _moe_experts("nvfp4", "bf16"),
         "moe_experts-mxfp4-fp8": lambda: _moe_experts("mxfp4", "fp8"),
         "fp8_block_gemm": _fp8_block_gemm, "glu_act": _glu_act, "attn_res": _attn_res,
         "mla_vb_gate": _mla_vb_gate, "mla_q_absorb": _mla_q_absorb,
         "kv_cache_write-bf16": lambda: _kv_cache_write("bf16"), "kv_cache_write-fp8": lambda: _kv_cache_write("fp8"),
         "kv_cache_write-nvfp4": lambda: _kv_cache_write("nvfp4"),
         "kda_decode-fp32": lambda: _kda_decode("fp32"), "kda_decode-bf16": lambda: _kda_decode("bf16"),
         "mla_decode-bf16": lambda: _mla_decode("bf16"), "mla_decode-nvfp4": lambda: _mla_decode("nvfp4"),
         "kda_verify-fp32": lambda: _kda_verify("fp32"), "kda_verify-bf16": lambda: _kda_verify("bf16"),
         "kda_prefill-fp32": lambda: _kda_prefill("fp32"), "kda_prefill-bf16": lambda: _kda_prefill("bf16"),
         "mla_prefill-fp32": lambda: _mla_prefill("fp32"), "mla_prefill-bf16": lambda: _mla_prefill("bf16")}
OTHER_DTYPE = {torch.float32: torch.float16, torch.bfloat16: torch.float16, torch.uint8: torch.int8,
               torch.int32: torch.int64}
MUTATIONS = ("dtype", "rank", "last+1", "last-1")
# Arguments whose last dim is a lower bound (a longer row is read as a strided view: q_a [B, >= 1536],
# gate [B, >= H 128], qkvg [B, >= 4D]): growing it is no error; block_table's pages per sequence are any number.
AT_LEAST = {"q_a", "gate", "qkvg"}
FREE_LAST = {"block_table"}


def _paths(args: dict, kwargs: dict) -> list[tuple]:
    """(where, key[, inner key]) of every tensor argument."""
    out = []
    for where, d in (("args", args), ("kwargs", kwargs)):
        for k, v in d.items():
            if torch.is_tensor(v):
                out.append((where, k))
            elif isinstance(v, dict):
                out += [(where, k, j) for j, t in v.items() if torch.is_tensor(t)]
    return out


def _call(L, args, kwargs):
    return L(*args.values(), **kwargs)


def _mutated(t: torch.Tensor, how: str, delta: int = 1) -> torch.Tensor | None:
    if how == "dtype":
        return torch.zeros(t.shape, dtype=OTHER_DTYPE[t.dtype])
    if how == "rank":
        return t.unsqueeze(0)
    n = t.shape[-1] + (delta if how == "last+1" else -delta)
    return None if n < 1 else torch.zeros(*t.shape[:-1], n, dtype=t.dtype)


def _with(args, kwargs, path, new):
    a, kw = dict(args), dict(kwargs)
    d = a if path[0] == "args" else kw
    if len(path) == 2:
        d[path[1]] = new
    else:
        d[path[1]] = {**d[path[1]], path[2]: new}
    return a, kw


def _get(args, kwargs, path):
    d = args if path[0] == "args" else kwargs
    return d[path[1]] if len(path) == 2 else d[path[1]][path[2]]


def _expect_rejected(L, args, kwargs, path, how):
    if (how == "last+1" and path[-1] in AT_LEAST) or (how.startswith("last") and path[-1] in FREE_LAST):
        return
    with pytest.raises(SpecError) as e:
        _call(L, args, kwargs)
    assert e.value.field != "device", f"{path} {how}: reached the device check ({e.value})"
    if how == "dtype":
        assert path[-1] in str(e.value), f"{path} {how}: the error does not name it: {e.value}"


@pytest.mark.parametrize("case", sorted(CASES))
def test_well_formed_cpu_inputs_fail_only_at_the_device_check(case):
    L, args, kwargs = CASES[case]()
    with pytest.raises(SpecError) as e:
        _call(L, args, kwargs)
    assert e.value.field == "device", str(e.value)


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_broken_argument_is_rejected_before_the_device(case):
    L, args, kwargs = CASES[case]()
    paths = _paths(args, kwargs)
    assert len(paths) >= 3
    for path in paths:
        for how in MUTATIONS:
            new = _mutated(_get(args, kwargs, path), how)
            if new is not None:
                _expect_rejected(L, *_with(args, kwargs, path, new), path, how)


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_random_breakage_is_rejected_before_the_device(data):
    case = data.draw(st.sampled_from(sorted(CASES)))
    L, args, kwargs = CASES[case]()
    path = data.draw(st.sampled_from(_paths(args, kwargs)))
    how = data.draw(st.sampled_from(MUTATIONS))
    new = _mutated(_get(args, kwargs, path), how, data.draw(st.integers(1, 64)))
    if new is not None:
        _expect_rejected(L, *_with(args, kwargs, path, new), path, how)
