"""k3gen.api.hf: transformers 5.23's own Kimi-Linear (the tiny FP32 model of tests/hf_tiny.py) with
k3gen's KDA, MLA decode and MoE routing swapped in, on the CPU (the k3gen:: ops run their FP32
references, so this checks the adapter's plumbing: layouts, absorption, cache positions, routing).

The bound is measured, not guessed: the adapter rounds the KDA inputs (q, k, v, decay, beta) and the
MLA latent rows and absorbed query to BF16, so the floor is transformers' own forward with its KDA
and attention inputs rounded to BF16 (`_bf16_floor`); the adapter must stay within 2x that floor on
the prefill and every cached decode step, with the same greedy tokens. The H200 twin is
tests/gpu/test_hf_adapter.py."""
from __future__ import annotations

import sys

import pytest
import torch

import hf_tiny
from numerics import rel_rms

from k3gen.errors import SpecError

transformers = pytest.importorskip("transformers")


def _rounded(fn):
    def call(*args, **kw):
        bf = lambda t: t.to(torch.bfloat16).to(t.dtype) if torch.is_tensor(t) and t.is_floating_point() else t  # noqa: E731
        args = [bf(x) for x in args]
        kw = {k: (bf(v) if k in ("g", "beta") else v) for k, v in kw.items()}
        return fn(*args, **kw)
    return call


def _bf16_floor(m, toks):
    """transformers' logits with the KDA functions' and the attention's tensor inputs rounded to BF16."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    import k3gen.api.hf as k3hf
    mod = sys.modules[k3hf.MODELING]
    saved = {n: getattr(mod, n) for n in k3hf.KDA_FUNCS}
    AttentionInterface.register("bf16_inputs", _rounded(sdpa_attention_forward))
    impl = m.config._attn_implementation
    try:
        for n, fn in saved.items():
            setattr(mod, n, _rounded(fn))
        m.config._attn_implementation = "bf16_inputs"
        for sub in m.modules():
            if hasattr(sub, "config") and sub.config is not m.config:
                sub.config._attn_implementation = "bf16_inputs"
        return hf_tiny.hf_logits(m, toks)
    finally:
        for n, fn in saved.items():
            setattr(mod, n, fn)
        m.config._attn_implementation = impl
        for sub in m.modules():
            if hasattr(sub, "config") and sub.config is not m.config:
                sub.config._attn_implementation = impl


@pytest.fixture(scope="module", params=sorted(hf_tiny.CASES))
def case(request):
    m = hf_tiny.build(hf_tiny.CASES[request.param], hf_tiny.SEEDS[request.param])
    toks = hf_tiny.tokens(hf_tiny.SEEDS[request.param])
    return request.param, m, toks, hf_tiny.hf_logits(m, toks)


def test_adapter_matches_transformers_within_the_bf16_floor(case):
    import k3gen.api.hf as k3hf
    name, m, toks, want = case
    floor = [rel_rms(f, w) for f, w in zip(_bf16_floor(m, toks), want)]
    with k3hf.install(m) as a:
        got = hf_tiny.hf_logits(m, toks)
        ran = dict(a.ran)
    errs = [rel_rms(g, w) for g, w in zip(got, want)]
    print(f"\n{name}: adapter vs transformers {['%.4f' % e for e in errs]}, BF16 floor {['%.4f' % f for f in floor]}, "
          f"ran {ran}")
    # Every part ran: 4 KDA layers x (1 prefill + DECODE steps), the MLA layer's cache and decode steps,
    # moe_route in every MoE layer and call.
    D = hf_tiny.DECODE
    assert ran["kda_chunk"] == 4 and ran["kda_recurrent"] == 4 * D
    assert ran["kv_cache_write"] == 1 + D and ran["mla_decode"] == D
    assert ran["moe_route"] == 4 * (1 + D)
    for step, (e, f) in enumerate(zip(errs, floor)):
        assert 0 < e <= 2 * max(f, 1e-4), (step, e, f)
    for g, w in zip(got, want):
        assert torch.equal(g.argmax(-1), w.argmax(-1))


def test_remove_restores_transformers_bitwise(case):
    import k3gen.api.hf as k3hf
    _, m, toks, want = case
    a = k3hf.install(m)
    a.remove()
    got = hf_tiny.hf_logits(m, toks)
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_a_wrong_absorption_is_caught(case, monkeypatch):
    """Mutation: W_UV read from W_UK's rows (a wrong kv_b slice) in the absorbed step moves the first
    decode step's logits far past the bound."""
    import k3gen.api.hf as k3hf
    _, m, toks, want = case
    orig = k3hf._absorbed_step

    def swapped(a, attn, c, x, mask):
        w = attn.kv_b_proj.weight
        H = attn.num_heads
        with torch.no_grad():
            saved = w.clone()
            v = w.view(H, 256, 512)
            v[:, 128:] = saved.view(H, 256, 512)[:, :128]
        try:
            return orig(a, attn, c, x, mask)
        finally:
            with torch.no_grad():
                w.copy_(saved)
    monkeypatch.setattr(k3hf, "_absorbed_step", swapped)
    with k3hf.install(m):
        got = hf_tiny.hf_logits(m, toks)
    assert rel_rms(got[1], want[1]) > 0.05


def test_typed_errors():
    import k3gen.api.hf as k3hf
    m = hf_tiny.build(1536, 0)
    with pytest.raises(SpecError, match="parts"):
        k3hf.install(m, parts=("kda", "rope"))
    with pytest.raises(SpecError, match="max_len"):
        k3hf.install(m, max_len=0)
    with pytest.raises(SpecError, match="model"):
        k3hf.install(torch.nn.Linear(2, 2))
    with k3hf.install(m):
        with pytest.raises(SpecError, match="install"):
            k3hf.install(m)
    toks = hf_tiny.tokens(0)
    with k3hf.install(m, max_len=8):
        with pytest.raises(SpecError, match="max_len"):
            hf_tiny.hf_logits(m, toks)
    with k3hf.install(m, parts=("mla",)), torch.no_grad():
        P = hf_tiny.PROMPT
        mask = torch.ones(1, P + 1, dtype=torch.long)
        mask[0, 0] = 0                       # a left-padded prompt: its prefill is transformers' own
        pkv = m(input_ids=toks[None, :P], attention_mask=mask[:, :P], use_cache=True).past_key_values
        with pytest.raises(SpecError, match="attention_mask"):
            m(input_ids=toks[None, P:P + 1], attention_mask=mask, past_key_values=pkv, use_cache=True)
    # A cache the adapter's does not continue: a second prompt restarts the adapter's caches, then
    # the first prompt's transformers cache comes back.
    with k3hf.install(m, parts=("mla",)), torch.no_grad():
        old = m(input_ids=toks[None, :4], use_cache=True).past_key_values
        m(input_ids=toks[None, 4:5], past_key_values=old, use_cache=True)
        m(input_ids=toks[None, :3], use_cache=True)
        with pytest.raises(SpecError, match="past_key_values"):
            m(input_ids=toks[None, 5:6], past_key_values=old, use_cache=True)


def test_specs_list_the_kernels_it_launches():
    import k3gen.api.hf as k3hf
    from k3gen.ir.dtypes import KvDtype
    m = hf_tiny.build(None, 10)
    s = k3hf.specs(m.config)
    assert [x.op for x in s["mla"]] == ["kv_cache_write", "mla_decode"]
    assert s["mla"][1].heads == m.config.num_attention_heads and s["mla"][1].kv is KvDtype.BF16
    r = s["moe"][0]
    assert (r.experts, r.top_k, r.n_group, r.topk_group, r.routed_scale) == (8, 2, 2, 1, 1.5)
    assert {x.op for x in s["kda"]} == {"kda_prefill", "kda_decode"}
    from tests.gpu.specs import hf_adapter
    bundled = {x.digest() for x in hf_adapter()}
    for q_lora in hf_tiny.CASES.values():
        got = [x for part in k3hf.specs(hf_tiny.build(q_lora, 0).config).values() for x in part]
        assert {x.digest() for x in got} <= bundled
