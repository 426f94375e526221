"""model/arch.py and K3Model's FFN / residual stream against FP64 NumPy oracles written here from
the formulas (SPEC.md section 1, tools_tmp/k3_facts.md sections 2.4-2.6 and 5): SiTU, the
noaux_tc grouped sigmoid router, the Attention Residuals mix, a whole AttnRes stream, the latent
MoE layer from the same dequantized weights, and K3Model._run's wiring of the stream."""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest
import torch

from model import arch
from model import layers as L
from model.cache import HybridCache
from model.checkpoint import PREFIX, decode_nvfp4, random_tensors, write_checkpoint
from model.config import TargetConfig, tiny_config
from model.model import K3Model
from model.weights import load_weights

EPS = 1e-5


def _bf(x) -> np.ndarray:
    """Round to BF16 (the model's rounding points), back to FP64."""
    return np.asarray(x, dtype=np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().double().numpy()


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def _situ(g, u, beta=4.0, lb=25.0):
    return beta * np.tanh(g / beta) * _sigmoid(g) * lb * np.tanh(u / lb)


def _rms(x, w=None):
    y = x / np.sqrt((x * x).mean(-1, keepdims=True) + EPS)
    return y if w is None else y * w


# -- SiTU --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("beta,lb", [(4.0, 25.0), (2.0, 10.0)])
def test_situ(beta, lb):
    g = torch.Generator().manual_seed(0)
    gate = torch.randn(4096, generator=g) * 8          # past both tanh knees
    up = torch.randn(4096, generator=g) * 60
    got = arch.situ(gate, up, beta, lb)
    assert got.dtype == torch.float32
    want = _situ(_np(gate), _np(up), beta, lb)
    np.testing.assert_allclose(_np(got), want, rtol=2e-6, atol=1e-6)
    cfg = SimpleNamespace(act="situ", situ_beta=beta, situ_linear_beta=lb)
    np.testing.assert_allclose(_np(arch.act_fn(cfg)(gate, up)), want, rtol=2e-6, atol=1e-6)
    silu = arch.act_fn(SimpleNamespace(act="silu"))(gate, up)
    np.testing.assert_allclose(_np(silu), _np(gate) * _sigmoid(_np(gate)) * _np(up), rtol=2e-6, atol=1e-5)


# -- router ------------------------------------------------------------------------------------------
def _route(logits, bias, n_group, topk_group, k, renorm, scale):
    s = _sigmoid(logits)
    choice = s + bias
    M, E = choice.shape
    ids = np.zeros((M, k), dtype=np.int64)
    for m in range(M):
        c = choice[m].copy()
        if n_group > 1:
            grp = c.reshape(n_group, E // n_group)
            gsc = np.sort(grp, axis=1)[:, -2:].sum(1)               # a group's two best biased scores
            keep = np.argsort(-gsc, kind="stable")[:topk_group]
            allowed = np.zeros(n_group, bool)
            allowed[keep] = True
            c = np.where(np.repeat(allowed, E // n_group), c, -np.inf)
        ids[m] = np.argsort(-c, kind="stable")[:k]
    w = np.take_along_axis(s, ids, 1)
    if renorm:
        w = w / w.sum(1, keepdims=True)
    return ids, w * scale


@pytest.mark.parametrize("n_group,topk_group,k,renorm,scale", [
    (1, 1, 6, True, 1.0), (4, 2, 4, True, 2.446), (8, 1, 3, False, 1.0), (4, 3, 5, False, 0.5)])
def test_route(n_group, topk_group, k, renorm, scale):
    g = torch.Generator().manual_seed(n_group * 10 + k)
    M, E = 64, 32
    logits = torch.randn(M, E, generator=g) * 2
    bias = torch.randn(E, generator=g) * 0.5         # large enough to change the choice
    cfg = SimpleNamespace(n_group=n_group, topk_group=topk_group, top_k=k, renormalize=renorm, routed_scale=scale)
    ids, w = arch.route(logits, bias, cfg)
    assert ids.dtype == torch.int64 and w.dtype == torch.float32
    want_ids, want_w = _route(_np(logits), _np(bias), n_group, topk_group, k, renorm, scale)
    order = np.argsort(ids.numpy(), 1)
    worder = np.argsort(want_ids, 1)
    np.testing.assert_array_equal(np.take_along_axis(ids.numpy(), order, 1), np.take_along_axis(want_ids, worder, 1))
    np.testing.assert_allclose(np.take_along_axis(_np(w), order, 1), np.take_along_axis(want_w, worder, 1), rtol=1e-6)
    # The features under test change the answer on this data (so the comparison means something).
    plain_ids, _ = _route(_np(logits), _np(bias) * 0, 1, 1, k, renorm, scale)
    assert (np.sort(plain_ids, 1) != np.sort(want_ids, 1)).any()
    if n_group > 1:
        ungrouped, _ = _route(_np(logits), _np(bias), 1, 1, k, renorm, scale)
        assert (np.sort(ungrouped, 1) != np.sort(want_ids, 1)).any()


# -- Attention Residuals -----------------------------------------------------------------------------
def _mix(sources, proj, norm):
    V = np.stack(sources)                                        # [N, M, hidden]
    score = _rms(V) @ (norm * proj)                              # [N, M]
    a = np.exp(score - score.max(0))
    a /= a.sum(0)
    return (a[..., None] * V).sum(0)


def _res_weights(g, hidden, scale=1.0):
    return arch.AttnResWeights(proj=torch.randn(1, hidden, generator=g) * scale * hidden ** -0.5,
                               norm=1 + 0.2 * torch.randn(hidden, generator=g))


def test_attn_res_mix():
    g = torch.Generator().manual_seed(1)
    hidden = 64
    src = [torch.randn(5, hidden, generator=g) * s for s in (1.0, 3.0, 0.2, 1.5)]
    w = _res_weights(g, hidden, scale=8.0)                       # peaked softmax
    got = arch.attn_res_mix(src, w, EPS)
    want = _mix([_np(s) for s in src], _np(w.proj).reshape(-1), _np(w.norm))
    np.testing.assert_allclose(_np(got), want, rtol=1e-5, atol=1e-5)
    assert np.abs(want - np.mean([_np(s) for s in src], 0)).max() > 0.1   # not a plain average


def _stream_oracle(embed, attn_fns, ffn_fns, qa, qf, qo, block):
    """From scratch at every use, by the docstring's rule: b_0 = embed, b_{n+1} = the sum of all
    outputs of the layers of block n; layer l in block c = l // block reads [b_0 .. b_c] plus the
    outputs of block c so far (nothing extra at a block start, where b_c is the block just done)."""
    outs: list[list[np.ndarray]] = []                            # per layer [attn_out, ffn_out]

    def sources(l, extra):
        c = l // block
        done = [embed] + [sum(sum(outs[j]) for j in range(n * block, (n + 1) * block)) for n in range(c)]
        part = [o for j in range(c * block, l) for o in outs[j]] + extra
        return done + ([sum(part)] if part else [])
    for l in range(len(attn_fns)):
        a = attn_fns[l](_mix(sources(l, []), *qa[l]))
        outs.append([a])
        f = ffn_fns[l](_mix(sources(l, [a]), *qf[l]))
        outs[l].append(f)
    return _mix(sources(len(attn_fns), []), *qo)


def test_attn_res_stream_7_layers_block_3():
    g = torch.Generator().manual_seed(2)
    hidden, M, L, block = 48, 3, 7, 3
    embed = torch.randn(M, hidden, generator=g)
    mats = [torch.randn(hidden, hidden, generator=g) * hidden ** -0.5 for _ in range(2 * L)]
    qa = [_res_weights(g, hidden, 4.0) for _ in range(L)]
    qf = [_res_weights(g, hidden, 4.0) for _ in range(L)]
    qo = _res_weights(g, hidden, 4.0)
    fn_t = [lambda x, A=A: torch.tanh(x @ A) * 0.7 for A in mats]
    fn_n = [lambda x, A=_np(A): np.tanh(x @ A) * 0.7 for A in mats]
    s = arch.AttnResStream(embed, block, EPS)
    for l in range(L):
        s.add_attn(l, fn_t[2 * l](s.inputs(qa[l])))
        s.add_ffn(fn_t[2 * l + 1](s.inputs(qf[l])))
    got = s.output(qo)
    assert len(s.blocks) == 3                                    # embed, layers 0-2, layers 3-5; 6 is the partial
    qn = lambda w: (_np(w.proj).reshape(-1), _np(w.norm))         # noqa: E731
    want = _stream_oracle(_np(embed), fn_n[0::2], fn_n[1::2], [qn(w) for w in qa], [qn(w) for w in qf], qn(qo), block)
    np.testing.assert_allclose(_np(got), want, rtol=1e-4, atol=1e-5)
    # The plain residual (block None) is the running sum whatever the queries.
    p = arch.AttnResStream(embed, None, EPS)
    h = _np(embed)
    for l in range(L):
        p.add_attn(l, fn_t[2 * l](p.inputs(qa[l])))
        h = h + fn_n[2 * l](h)
        p.add_ffn(fn_t[2 * l + 1](p.inputs(None)))
        h = h + fn_n[2 * l + 1](h)
    np.testing.assert_allclose(_np(p.output(None)), h, rtol=1e-4, atol=1e-5)


# -- K3Model: the latent MoE layer and the stream's wiring -------------------------------------------
NOLAT = dataclasses.replace(tiny_config(), moe_latent=None, latent_norm=False, act="silu", attn_res_block=None,
                            routed_scale=2.0, renormalize=False)


@pytest.fixture(scope="module", params=["k3", "nolatent"])
def tiny_model(request, tmp_path_factory):
    cfg = tiny_config() if request.param == "k3" else NOLAT
    stored, _ = random_tensors(cfg, seed=5, truth=False, fp4="codes")
    w = load_weights(write_checkpoint(stored, tmp_path_factory.mktemp(request.param), cfg), cfg)
    t = TargetConfig()
    return K3Model(w, t, HybridCache(cfg, t, num_slots=2, num_pages=4, max_seq_len=64)), stored


def _fp8(v: np.ndarray, recipe) -> np.ndarray:
    """The FP8 activation rounding of a GEMM input: act_quant_fp8 of the BF16 rows, dequantized."""
    from k3gen.ops.act_quant_fp8.reference import act_quant_fp8, dequantize
    t = torch.from_numpy(np.ascontiguousarray(v)).to(torch.bfloat16)
    return dequantize(*act_quant_fp8(t, recipe), recipe).double().numpy()


def test_moe_layer_matches_numpy(tiny_model):
    """K3Model._ffn on a MoE layer (reference path) against the formula in FP64 from the same
    weights: the routed experts decoded with ml_dtypes and rounded to BF16 as the model stores
    them, the router as stored, the latent and shared projections as the FP8 block values the
    model quantized them to at load (canonical_from_weights); the normed input from the stream's
    one-source mix; BF16 at the model's points (the normed input, every GEMM output, the expert and
    shared hidden, the normed expert sum) and the FP8 activation rounding at every FP8 GEMM input."""
    from model.ffn_ops import QAct
    from model.reference import canonical_from_weights
    m, st = tiny_model
    cfg = m.cfg
    rec = m.ops.recipe
    layer = 2
    assert not cfg.is_dense(layer)
    p = f"{PREFIX}layers.{layer}."
    mp = p + "block_sparse_moe."
    _, cw = canonical_from_weights(m.w)
    get = lambda n: st[n].double().numpy()                        # noqa: E731
    q = lambda n: cw[n.removeprefix("language_model.")].double().numpy()   # noqa: E731  (FP8 values)
    h = torch.randn(6, cfg.hidden, generator=torch.Generator().manual_seed(4)) * 3
    xn = m.ops.attn_res_mix(h[None].clone(), 1, None, m.w.layers[layer].post_norm, cfg.eps)
    assert isinstance(xn, QAct)
    got = m._ffn(layer, xn)
    act = (lambda a, b: _situ(a, b, cfg.situ_beta, cfg.situ_linear_beta)) if cfg.act == "situ" else \
        (lambda a, b: a * _sigmoid(a) * b)
    x = _bf(_rms(_np(h), get(p + "post_attention_layernorm.weight")))
    xq = _fp8(x, rec)
    s = _sigmoid(x @ get(mp + "gate.weight").T)
    ids = np.argsort(-(s + get(mp + "gate.e_score_correction_bias")), 1, kind="stable")[:, :cfg.top_k]
    wts = np.take_along_axis(s, ids, 1)
    if cfg.renormalize:
        wts = wts / wts.sum(1, keepdims=True)
    wts = wts * cfg.routed_scale
    lat = cfg.moe_latent is not None
    xl = _bf(xq @ q(mp + "routed_expert_down_proj.weight").T) if lat else x
    dec = lambda e, n: _bf(decode_nvfp4(*(st[f"{mp}experts.{e}.{n}.{k}"]           # noqa: E731
                                          for k in ("weight", "weight_scale", "weight_scale_2"))).numpy())
    y = np.zeros((h.shape[0], cfg.expert_width))
    for r in range(h.shape[0]):
        for e, we in zip(ids[r], wts[r]):
            hid = _bf(act(dec(e, "w1") @ xl[r], dec(e, "w3") @ xl[r]))
            y[r] += we * (dec(e, "w2") @ hid)
    y = _bf(_rms(y, get(mp + "routed_expert_norm.weight")) if cfg.latent_norm else y)
    out = _bf(_fp8(y, rec) @ q(mp + "routed_expert_up_proj.weight").T) if lat else y
    sh = mp + "shared_experts."
    hid = _bf(act(_bf(xq @ q(sh + "gate_proj.weight").T), _bf(xq @ q(sh + "up_proj.weight").T)))
    out = out + _bf(_fp8(hid, rec) @ q(sh + "down_proj.weight").T)
    err = np.abs(_np(got) - out).max() / np.abs(out).max()
    assert err < 3e-3, err          # a few BF16 ulps at rounding points where FP32 and FP64 round apart


def test_run_wires_the_stream(tiny_model, monkeypatch):
    """K3Model._run with stand-in attention/FFN (functions of their BF16 input) against the
    stream computed here: which pseudo-query at which point, input_layernorm /
    post_attention_layernorm on the mixed inputs, the output query, the final norm and lm_head."""
    m, st = tiny_model
    cfg = m.cfg
    g = torch.Generator().manual_seed(6)
    mats = [torch.randn(cfg.hidden, cfg.hidden, generator=g) * cfg.hidden ** -0.5 for _ in range(2 * cfg.layers)]
    attn = lambda i, lw, xn: torch.tanh(xn.x.double() @ mats[2 * i].double()).float()      # noqa: E731
    index = {id(lw.ffn): i for i, lw in enumerate(m.w.layers)}
    ffn = lambda ops, w, xn, cfg_: torch.tanh(xn.x.double() @ mats[2 * index[id(w)] + 1].double()).float()  # noqa: E731
    monkeypatch.setattr(L, "moe", ffn)
    monkeypatch.setattr(L, "dense_mlp", ffn)
    tokens = torch.tensor([3, 17, 400, 9, 255])
    got = m._run(tokens, attn)
    get = lambda n: st[n].double().numpy()                                                  # noqa: E731
    fn_a = [lambda x, i=i: np.tanh(_bf(_rms(x, get(f"{PREFIX}layers.{i}.input_layernorm.weight"))) @ _np(mats[2 * i]))
            for i in range(cfg.layers)]
    fn_f = [lambda x, i=i: np.tanh(_bf(_rms(x, get(f"{PREFIX}layers.{i}.post_attention_layernorm.weight")))
                                   @ _np(mats[2 * i + 1])) for i in range(cfg.layers)]
    embed = get(PREFIX + "embed_tokens.weight")[tokens.numpy()]
    if cfg.attn_res_block is None:
        hs = embed
        for i in range(cfg.layers):
            hs = hs + fn_a[i](hs)
            hs = hs + fn_f[i](hs)
    else:
        q = lambda n: (get(n + "_proj.weight").reshape(-1), get(n + "_norm.weight"))       # noqa: E731
        names = [f"{PREFIX}layers.{i}." for i in range(cfg.layers)]
        hs = _stream_oracle(embed, fn_a, fn_f, [q(p + "self_attention_res") for p in names],
                            [q(p + "mlp_res") for p in names],
                            q(PREFIX + "output_attn_res"), cfg.attn_res_block)
    want = _bf(_rms(hs, get(PREFIX + "norm.weight"))) @ get("language_model.lm_head.weight").T
    err = np.abs(_np(got) - want).max() / np.abs(want).max()
    assert err < 3e-3, err


@pytest.mark.parametrize("E,k,ng,tg,ren,scale", [(896, 16, 1, 1, True, 1.0), (256, 8, 8, 4, True, 2.5),
                                                 (64, 6, 1, 1, False, 1.5), (8, 2, 1, 1, True, 1.0)])
def test_route_is_the_moe_route_contract_bitwise(E, k, ng, tg, ren, scale):
    """The model's router (arch.route, what the PyTorch MoE path runs) picks the experts, in the
    same order, with the same FP32 weights as the moe_route op's reference, ties included (equal
    logits and biases on experts 3 and 5: the lower index wins)."""
    import types
    from k3gen.ops.moe_route.reference import combine_weights, select
    cfg = types.SimpleNamespace(n_group=ng, topk_group=tg, top_k=k, renormalize=ren, routed_scale=scale)
    g = torch.Generator().manual_seed(E)
    x = torch.randn(64, E, generator=g)
    x[:, 5] = x[:, 3]
    b = torch.randn(E, generator=g) * 0.1
    b[5] = b[3]
    ids, w = arch.route(x, b, cfg)
    rid, s = select(x, b, k, ng, tg)
    assert torch.equal(ids, rid)
    assert torch.equal(w, combine_weights(s.gather(1, rid), ren, scale))
    assert not ((ids == 5).any(-1) & ~(ids == 3).any(-1)).any()     # 5 never without its tie 3
