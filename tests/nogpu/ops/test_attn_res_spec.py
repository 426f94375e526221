"""attn_res on the CPU: spec validation and derived geometry, the reference against model/arch's
Attention Residuals formula and model/layers.rms_norm, its row sum order, the FP8 outputs being
act_quant_fp8 of the BF16 row, the source-buffer protocol against model/arch.AttnResStream, and
the kernel compiling (sm90, sm103, sm107) without local memory."""
from __future__ import annotations

import numpy
import pytest
import torch

from k3gen.errors import SpecError
from k3gen.ir.dtypes import ScaleRecipe
from k3gen.ops import spec_from_canonical
from k3gen.ops.act_quant_fp8.reference import act_quant_fp8
from k3gen.ops.attn_res.reference import attn_res, mix, norm, ordered_sum, partial_update, rstd
from k3gen.ops.attn_res.spec import AttnResSpec, ResDelta, slices_for
from k3gen.ops.mla_q_absorb.reference import rms_norm_bf16
from k3gen.pipeline.build import build_one
from k3gen.targets import TARGETS
from model import arch

SM90, SM103 = TARGETS["sm90"], TARGETS["sm103-nvfp4"]


@pytest.mark.parametrize("kw,field", [
    (dict(hidden=100), "hidden"), (dict(hidden=0), "hidden"), (dict(hidden=7168.0), "hidden"),
    (dict(hidden=128 * 8 * 33), "hidden"), (dict(hidden=7168, max_sources=0), "max_sources"),
    (dict(hidden=7168, max_sources=17), "max_sources"), (dict(hidden=7168, eps=0.0), "eps"),
    (dict(hidden=7168, eps=1), "eps"), (dict(hidden=7168, fp8=False, recipe=ScaleRecipe.FP32), "recipe"),
    (dict(hidden=7168, recipe="fp32"), "recipe"), (dict(hidden=7168, delta="bf16"), "delta"),
    (dict(hidden=7168, fp8=1), "fp8"),
])
def test_bad_fields_raise(kw, field):
    with pytest.raises(SpecError) as e:
        AttnResSpec(target=SM90, **kw)
    assert e.value.field == field


@pytest.mark.parametrize("hidden,slices,threads", [(7168, 8, 224), (1024, 8, 32), (2304, 2, 288), (128, 1, 32),
                                                    (1152, 1, 288), (32768, 8, 1024)])
def test_geometry_depends_on_hidden_alone(hidden, slices, threads):
    s = AttnResSpec(target=SM90, hidden=hidden)
    assert (s.slices, s.threads) == (slices, threads) == (slices_for(hidden), hidden // slices // 4)
    assert s.grid(5) == (5 * slices, 1, 1)


def test_recipe_defaults_to_the_target_and_round_trips():
    assert AttnResSpec(target=SM90, hidden=7168).recipe is ScaleRecipe.FP32
    assert AttnResSpec(target=SM103, hidden=7168).recipe is ScaleRecipe.UE8M0
    assert AttnResSpec(target=SM90, hidden=7168, fp8=False).recipe is None
    for s in (AttnResSpec(target=SM90, hidden=7168, delta=ResDelta.BF16),
              AttnResSpec(target=SM90, hidden=1024, max_sources=4, fp8=False, eps=1e-6)):
        assert spec_from_canonical(s.canonical(), SM90) == s
    assert AttnResSpec(target=SM90, hidden=7168, fp8=False, delta=ResDelta.FP32).slug() == "h7168-n9-bf16-dfp32"


def _sources(n, M, h, seed):
    g = torch.Generator().manual_seed(seed)
    # per-source magnitudes over several octaves, like block sums of growing depth
    V = torch.randn(n, M, h, generator=g) * torch.exp(torch.empty(n, M, 1).uniform_(-2, 3, generator=g))
    proj = torch.randn(h, generator=g) * 0.05
    nw = 1 + 0.2 * torch.randn(h, generator=g)
    ln_w = (1 + 0.1 * torch.randn(h, generator=g)).bfloat16()
    return V, arch.AttnResWeights(proj=proj.reshape(1, h), norm=nw), ln_w


def test_rstd_rounds_every_step_correctly():
    """1 / sqrt(ss / hidden + eps) with IEEE steps, as the GPU computes it (numpy's FP32 division and
    sqrt are correctly rounded). torch's own FP32 sqrt on the CPU is not always: the reference
    differed from the H200 kernel in the last bit of some rows until it took the root in float64."""
    g = torch.Generator().manual_seed(4)
    ss = torch.rand(300000, generator=g) * torch.exp(torch.empty(300000).uniform_(-10, 15, generator=g))
    f32 = numpy.float32
    want = f32(1) / numpy.sqrt(ss.numpy() / f32(7168) + f32(1e-5))
    assert torch.equal(rstd(ss, 7168, 1e-5), torch.from_numpy(want))


def test_ordered_sum_is_a_sum():
    g = torch.Generator().manual_seed(0)
    y = torch.randn(6, 7168, generator=g).abs()
    for slices in (8, 4, 1):
        got = ordered_sum(y, slices).double()
        assert torch.allclose(got, y.double().sum(-1), rtol=2e-6)
    # the order is fixed: a permutation of the columns changes the bits of some row sums
    perm = torch.randperm(7168, generator=g)
    assert not torch.equal(ordered_sum(y, 8), ordered_sum(y[:, perm], 8))


@pytest.mark.parametrize("h,n,M", [(7168, 9, 3), (7168, 1, 2), (1024, 4, 5), (2304, 3, 2)])
def test_reference_is_model_arch_mix_then_rms_norm(h, n, M):
    V, w, ln_w = _sources(n, M, h, seed=h + n)
    ref = attn_res(V, w.query(), ln_w)
    want = arch.attn_res_mix(list(V), w, 1e-5)
    err = (ref["mixed"].double() - want.double()).norm() / want.double().norm()
    assert err < 2e-6, err                    # FP32, another summation order
    if n == 1:
        assert torch.equal(ref["mixed"], V[0])    # softmax over one source is exactly 1
    out_want = rms_norm_bf16(want, ln_w, 1e-5)
    diff = (ref["out"].float() - out_want.float()).abs()
    assert float(diff.max()) <= 2 ** -7 * float(out_want.float().abs().max())    # a BF16 ulp at most
    assert (ref["out"] != out_want).float().mean() < 0.01


def test_rows_are_invariant_in_the_reference():
    V, w, ln_w = _sources(5, 7, 2304, seed=3)
    full = attn_res(V, w.query(), ln_w, recipe=ScaleRecipe.FP32)
    for m in (0, 3, 6):
        one = attn_res(V[:, m:m + 1], w.query(), ln_w, recipe=ScaleRecipe.FP32)
        for k in full:
            assert torch.equal(one[k][0], full[k][m]), k


@pytest.mark.parametrize("recipe", tuple(ScaleRecipe), ids=lambda r: r.value)
def test_fp8_outputs_are_act_quant_fp8_of_the_bf16_row(recipe):
    V, w, ln_w = _sources(9, 4, 7168, seed=5)
    V[:, 1, :128] = 0.0                       # a zero group in the normed row
    ref = attn_res(V, w.query(), ln_w, recipe=recipe)
    codes, scales = act_quant_fp8(ref["out"], recipe)
    assert torch.equal(ref["codes"], codes) and torch.equal(ref["scales"], scales)
    assert ref["codes"].shape == (4, 7168) and ref["scales"].shape == (4, 56)


def test_norm_is_layers_rms_norm_up_to_the_sum_order():
    g = torch.Generator().manual_seed(9)
    x = torch.randn(8, 7168, generator=g) * 3
    w = (1 + 0.1 * torch.randn(7168, generator=g)).bfloat16()
    a, b = norm(x, w, 1e-5), rms_norm_bf16(x, w, 1e-5)
    assert (a.float() - b.float()).abs().max() <= 2 ** -7 * b.float().abs().max()


def test_source_buffer_protocol_reproduces_attn_res_stream():
    """The buffer protocol of the spec (the partial sum at n - 1; a block-start layer seals by
    starting source n with its attention output; every other output accumulates) gives, at every
    mix of a 10-layer stream with blocks of 3, exactly the sources AttnResStream mixes."""
    h, M, block, layers = 256, 3, 3, 10
    g = torch.Generator().manual_seed(11)
    embed = torch.randn(M, h, generator=g)
    stream = arch.AttnResStream(embed, block, 1e-5)
    buf = torch.full((6, M, h), float("nan"))
    buf[0] = embed
    n = 1

    def same_sources():
        want = torch.stack(stream.blocks + [stream.partial])
        assert want.shape[0] == n and torch.equal(buf[:n], want)

    for layer in range(layers):
        same_sources()                                   # the attention input's sources
        out_a = torch.randn(M, h, generator=g).bfloat16()
        stream.add_attn(layer, out_a)
        if layer % block == 0:
            buf[n] = partial_update(None, out_a, seal=True)
            n += 1
        else:
            buf[n - 1] = partial_update(buf[n - 1], out_a, seal=False)
        same_sources()                                   # the FFN input's sources
        out_f = torch.randn(M, h, generator=g) * 0.5
        stream.add_ffn(out_f)
        buf[n - 1] = partial_update(buf[n - 1], out_f, seal=False)
    same_sources()                                       # the output query's sources
    assert n == 1 + -(-layers // block)
    w = arch.AttnResWeights(proj=torch.randn(1, h, generator=g), norm=torch.ones(h))
    x = mix(buf[:n], w.query(), 1e-5)
    assert torch.allclose(x, stream.output(w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("target", ["sm90", "sm103-nvfp4", "sm107-nvfp4"])
@pytest.mark.parametrize("kw", [dict(hidden=7168), dict(hidden=7168, recipe=ScaleRecipe.UE8M0),
                                dict(hidden=7168, fp8=False, delta=ResDelta.BF16),
                                dict(hidden=1024, max_sources=4, delta=ResDelta.FP32), dict(hidden=2304)],
                         ids=lambda kw: "-".join(f"{k}{v}" for k, v in kw.items()))
def test_kernel_compiles_without_local_memory(target, kw):
    if "recipe" in kw and target != "sm90":
        kw = {**kw, "recipe": ScaleRecipe.UE8M0}
    r = build_one(AttnResSpec(target=TARGETS[target], **kw))
    (x,) = r.resources
    assert x["function"] == "k3gen_attn_res"
    assert x["local"] == 0 and x["stack"] == 0 and x["registers"] <= 128, x
    assert not any(op.startswith(("LDL", "STL")) for op in x["sass"]), x["sass"]
