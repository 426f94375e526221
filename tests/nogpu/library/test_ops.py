"""The `k3gen::` torch.library ops on the CPU (where each runs its op's FP32 reference): schemas,
declared mutations, fake implementations against the reference's outputs under FakeTensorMode,
torch.library.opcheck, and the typed errors of bad shapes (issue 24)."""
from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import k3gen.library as library
from k3gen.errors import SpecError
from k3gen.ir.dtypes import KvDtype, ScaleRecipe, SsmDtype
from library_inputs import cases

COMBOS = [(KvDtype.BF16, SsmDtype.FP32, ScaleRecipe.FP32), (KvDtype.NVFP4, SsmDtype.BF16, ScaleRecipe.FP32),
          (KvDtype.FP8, SsmDtype.FP32, ScaleRecipe.UE8M0)]
IDS = ["bf16-fp32", "nvfp4-bf16", "fp8-ue8m0"]
_CASES: dict = {}


def case_list(i: int):
    if i not in _CASES:
        kv, ssm, recipe = COMBOS[i]
        _CASES[i] = cases("cpu", heads=2, kv=kv, ssm=ssm, recipe=recipe, hidden=256, seed=i)
    return _CASES[i]


def by_op(i: int, op: str):
    return next(c for c in case_list(i) if c.op == op)


def _shapes(res):
    if res is None:
        return []
    res = [res] if isinstance(res, torch.Tensor) else list(res)
    return [(tuple(t.shape), t.dtype) for t in res]


def _fake_args(mode, args):
    def conv(a):
        if isinstance(a, torch.Tensor):
            return mode.from_tensor(a)
        if isinstance(a, list):
            return [conv(x) for x in a]
        return a
    return tuple(conv(a) for a in args)


def test_every_op_is_registered_with_a_handle_first():
    ops = {c.op for c in case_list(0)}
    assert ops == set(library.OPS)
    for name in library.OPS:
        schema = getattr(torch.ops.k3gen, name).default._schema
        first = schema.arguments[0]
        assert first.name == "handle" and str(first.type) == "str", schema
        if name.endswith("_out") or name == "kv_cache_write":
            assert len(schema.returns) == 0, schema
        else:
            assert len(schema.returns) >= 1, schema


@pytest.mark.parametrize("op", library.OPS)
def test_declared_mutations(op):
    """The schema's mutable arguments are exactly the state the op writes: pools, caches, draft
    records, the split workspace, `out`; nothing an engine passes read-only."""
    c = by_op(1, op)
    schema = c.overload._schema
    mutable = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
    assert mutable == set(c.mutated), (op, mutable)
    assert not {"slots", "pending", "cu_seqlens", "block_table", "lengths", "q", "rows"} & mutable


@pytest.mark.parametrize("op", library.OPS)
@pytest.mark.parametrize("i", range(len(COMBOS)), ids=IDS)
def test_fake_matches_the_reference(i, op):
    """The fake implementation's outputs (FakeTensorMode) have the shapes and dtypes the FP32
    reference returns on the same inputs, and those of the contract (library_inputs)."""
    c = by_op(i, op)
    args = tuple(a.clone() if isinstance(a, torch.Tensor) else [t.clone() for t in a] if isinstance(a, list)
                 else a for a in c.args)
    real = c.overload(*args)
    mode = FakeTensorMode()
    with mode:
        fake = c.overload(*_fake_args(mode, c.args))
    assert _shapes(real) == _shapes(fake) == [(tuple(s), d) for s, d in c.outs]


@pytest.mark.parametrize("op", library.OPS)
def test_opcheck(op):
    """torch.library.opcheck: schema (mutations declared, no aliasing), fake tensor, autograd
    registration absence, aot_dispatch static and dynamic."""
    torch.library.opcheck(by_op(1, op).overload, by_op(1, op).args)


def test_declared_mutations_happen():
    """The functional KDA ops write the pools they declare (live slots only) and return a fresh out."""
    c = by_op(0, "kda_decode")
    args = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in c.args)
    ssm0, conv0 = args[4].clone(), args[5].clone()
    out = c.overload(*args)
    slots = args[6]
    for s in range(ssm0.shape[0]):
        live = s in slots.tolist()
        assert (not torch.equal(args[4][s], ssm0[s])) == live and (not torch.equal(args[5][s], conv0[s])) == live
    assert out.data_ptr() not in {a.data_ptr() for a in args if isinstance(a, torch.Tensor)}
    assert (out[1] == 0).all()     # the padded row


BAD = [
    ("kda_decode", 1, lambda t: t[:, :100], "qkvg"),                    # row narrower than 4D
    ("kda_decode", 4, lambda t: t.to(torch.bfloat16), "ssm"),          # FP32 pool given as BF16 (bf16-fp32 combo)
    ("kda_decode", 6, lambda t: t.long(), "slots"),
    ("kda_verify", 7, lambda t: t[:-1], "pending"),
    ("kda_prefill", 4, lambda t: t[:-1], "cu_seqlens"),
    ("fp8_block_gemm", 3, lambda t: t.float(), "w_codes"),
    ("fp8_block_gemm", 4, lambda t: t.to(torch.uint8), "w_scales"),    # the other recipe's scale dtype
    ("mla_decode", 1, lambda t: t[..., :512], "q"),
    ("mla_decode", 7, lambda t: 0, "splits"),
    ("mla_vb_gate", 3, lambda t: t[:, :100], "gate"),
    ("mla_q_absorb", 1, lambda t: t[:, :1000], "q_a"),
    ("moe_route", 1, lambda t: t.double(), "logits"),
    ("moe_route", 2, lambda t: t[:-1], "bias"),
    ("moe_route_out", 3, lambda t: t[:2], "ids"),                     # a workspace of fewer tokens than T
    ("moe_route_out", 6, lambda t: t[:-1], "offsets"),
    ("attn_res", 1, lambda t: t.double(), "src"),
    ("attn_res", 2, lambda t: 0, "n"),
    ("attn_res", 2, lambda t: 5, "n"),                                 # > max_sources (4)
    ("attn_res", 5, lambda t: None, "delta"),                          # the spec fuses an FP32 delta
    ("attn_res", 5, lambda t: t.to(torch.bfloat16), "delta"),
    ("attn_res_out", 7, lambda t: None, "codes"),                      # an FP8 spec writes codes
    ("attn_res_out", 8, lambda t: t.to(torch.uint8), "scales"),        # the other recipe's scale dtype
    ("attn_res_out", 10, lambda t: t[:2], "delta"),                    # out's M rows, delta's 3
    ("moe_experts", 1, lambda t: t.float(), "x"),
    ("moe_experts", 3, lambda t: t.float(), "s13"),
    ("moe_experts", 6, lambda t: t.long(), "ids"),
    ("moe_experts", 9, lambda t: t[:-1], "perm"),
    ("moe_experts", 10, lambda t: torch.ones(32, 2), "gs13"),          # MXFP4 has no global scales
    ("moe_experts", 13, lambda t: 30, "expert_base"),
    ("moe_experts", 14, lambda t: None, "ws_h"),                       # ws_y without ws_h
    ("moe_experts_out", 14, lambda t: t[:5], "ws_h"),                  # fewer than T * top_k slots
    ("mla_prefill", 1, lambda t: t.float(), "q"),                       # FP32 queries
    ("mla_prefill", 3, lambda t: t[:, :32], "k_pe"),                    # a half rope key
    ("mla_prefill", 6, lambda t: t[:-1], "cu_seqlens_k"),               # offsets of another batch
    ("mla_prefill_out", 8, lambda t: t.bfloat16(), "out"),              # not the spec's out dtype
    ("glu_act", 1, lambda t: t[:, :384], "gu"),                         # not [gate | up] of the width
    ("glu_act_out", 3, lambda t: t[:, :1], "scales"),                   # one scale group short
    ("router_logits", 1, lambda t: t.float(), "x"),                     # FP32 rows
    ("router_logits", 2, lambda t: t[:4], "w"),                         # fewer experts than the spec's
    ("router_logits_out", 3, lambda t: t.bfloat16(), "out"),            # not FP32 logits
]


@pytest.mark.parametrize("op,arg,bad,needle", BAD, ids=[f"{b[0]}-{b[3]}" for b in BAD])
def test_bad_argument_is_a_typed_error(op, arg, bad, needle):
    c = by_op(0, op)
    args = list(c.args)
    args[arg] = bad(args[arg])
    with pytest.raises(SpecError, match=needle):
        c.overload(*args)
    mode = FakeTensorMode()     # the fake implementation raises the same error at trace time
    with pytest.raises(SpecError, match=needle), mode:
        c.overload(*_fake_args(mode, args))


def test_cache_list_and_ring_checked():
    c = by_op(1, "kv_cache_write")   # NVFP4: four cache tensors and a ring
    args = list(c.args)
    with pytest.raises(SpecError, match="cache"):
        c.overload(*args[:5], args[5][:3], *args[6:])
    args[6] = None
    with pytest.raises(SpecError, match="ring_slot"):
        c.overload(*args)


def test_a_handle_of_another_op_is_rejected():
    dec, vb = by_op(0, "kda_decode"), by_op(0, "mla_vb_gate")
    with pytest.raises(SpecError, match="handle"):
        vb.overload(dec.args[0], *vb.args[1:])
    with pytest.raises(SpecError, match="handle"):
        vb.overload("not json", *vb.args[1:])
