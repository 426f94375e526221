"""model/reference.py's FP32 reference against transformers 5.23's own Kimi-Linear forward (the
oracle, its PyTorch KDA path: runs on the CPU without FLA), through a real `save_pretrained`
checkpoint read by model/formats/hf_plain.py; plus K3-family properties transformers cannot check
(it has no kimi_k3: AttnRes, SiTU, latent MoE, bounded gate, output gates), and the reader's
typed errors."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import hf_tiny
from numerics import rel_rms

from model.checkpoint import BadValueError, MissingTensorError, TensorShapeError
from model.config import config_from_json, tiny_config
from model.formats.hf_plain import INDEX, UnexpectedTensorError, read_hf_plain
from model.reference import Fp32Reference, canonical_shapes

transformers = pytest.importorskip("transformers")

PROMPT, DECODE = hf_tiny.PROMPT, hf_tiny.DECODE
ORACLE_TOL = 1e-4      # FP32 vs FP32: op order (chunked WY vs sequential KDA) only
SELF_TOL = 1e-5
# transformers 5.23 builds q_a_layernorm / kv_a_layernorm as KimiLinearRMSNorm(rank) with its
# default eps 1e-6 (modeling_kimi_linear.py KimiLinearAttention.__init__), not rms_norm_eps.
HF_MLA_NORM_EPS = 1e-6


_random_like = hf_tiny.random_like


# -- the transformers oracle -----------------------------------------------------------------------
def _hf_model(q_lora, seed: int):
    return hf_tiny.build(q_lora, seed)


def _hf_logits(m, toks: torch.Tensor) -> list[torch.Tensor]:
    return hf_tiny.hf_logits(m, toks)


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    """case -> (checkpoint folder, prompt + decode tokens, transformers' logits)."""
    cases = {}
    for q_lora, seed in ((1536, 0), (None, 10)):
        m = _hf_model(q_lora, seed)
        toks = torch.randint(0, 512, (PROMPT + DECODE,), generator=torch.Generator().manual_seed(seed + 2))
        logits = _hf_logits(m, toks)
        tag = "q_lora" if q_lora else "q_proj"
        d = tmp_path_factory.mktemp(tag)
        m.save_pretrained(d)
        cases[tag] = (d, toks, logits)
        if q_lora:
            ds = tmp_path_factory.mktemp("sharded")
            m.save_pretrained(ds, max_shard_size="1MB")
            cases["sharded"] = (ds, toks, logits)
    return cases


@pytest.mark.parametrize("case", ["q_lora", "sharded", "q_proj"])
def test_reference_matches_transformers(oracle, case):
    folder, toks, hf = oracle[case]
    if case == "sharded":
        shards = set(json.loads((folder / INDEX).read_text())["weight_map"].values())
        assert len(shards) > 2, shards
    cfg = config_from_json(folder)
    assert cfg.q_lora == (None if case == "q_proj" else 1536)
    ref = Fp32Reference(cfg, read_hf_plain(folder, cfg), mla_norm_eps=HF_MLA_NORM_EPS)
    errs = [rel_rms(ref.prefill(toks[:PROMPT]), hf[0])]
    errs += [rel_rms(ref.decode(toks[PROMPT + j]), hf[1 + j]) for j in range(DECODE)]
    print(f"{case}: prefill rel-RMS {errs[0]:.2e}, decode " + ", ".join(f"{e:.2e}" for e in errs[1:]))
    assert all(e <= ORACLE_TOL for e in errs), errs


@pytest.mark.parametrize("case", ["q_lora", "q_proj"])
def test_hf_tiny_config_dict_is_what_transformers_saves(oracle, case):
    """tests/hf_tiny.py's config dict (what tests/gpu/specs.py enumerates the kernels from, without
    transformers) reads as the config.json transformers saved."""
    from k3gen.hf_config import config_fields, read_config
    saved = config_fields(*read_config(oracle[case][0]))
    mine = config_fields(hf_tiny.config_dict(hf_tiny.CASES[case]))
    assert {**mine, "name": None} == {**saved, "name": None}


def test_reader_maps_the_dense_mlp_save_quirk(oracle):
    from safetensors import safe_open
    folder = oracle["q_lora"][0]
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        stored = set(f.keys())
        gate = f.get_tensor("model.layers.0.block_sparse_moe.gate_proj.weight")
    # What transformers 5.23 writes (the mapping is exercised, not assumed) ...
    assert "model.layers.0.block_sparse_moe.gate_proj.weight" in stored
    assert "model.layers.0.mlp.gate_proj.weight" not in stored
    t = read_hf_plain(folder)
    # ... and what the reader returns.
    assert torch.equal(t["model.layers.0.mlp.gate_proj.weight"], gate)
    assert not any(n.startswith("model.layers.0.block_sparse_moe.") for n in t)
    assert set(t) == set(canonical_shapes(config_from_json(folder)))


# -- the K3 family (the tiny preset: AttnRes, SiTU, latent MoE, bounded gate, output gates) -------
def _k3_tensors(cfg, seed: int = 3) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    t = {n: _random_like(n, s, g) for n, s in canonical_shapes(cfg).items()}
    for n in t:
        if n.endswith("A_log"):
            t[n][cfg.kda_heads:] = 0          # K3 stores [128], the first H real
    return t


@pytest.fixture(scope="module")
def k3():
    cfg = tiny_config()
    assert cfg.attn_res_block and cfg.act == "situ" and cfg.moe_latent and cfg.latent_norm and cfg.mla_out_gate
    assert cfg.a_log_pad == 128 and cfg.kda_out_gate == "full"
    return cfg, _k3_tensors(cfg)


def test_k3_prefill_equals_token_by_token_decode(k3):
    cfg, t = k3
    toks = torch.randint(0, cfg.vocab, (PROMPT,), generator=torch.Generator().manual_seed(4))
    ref = Fp32Reference(cfg, t)
    full = ref.prefill(toks)
    steps = [ref.prefill(toks[:1])[0]] + [ref.decode(x) for x in toks[1:]]
    err = rel_rms(torch.stack(steps), full)
    print(f"K3 tiny: prefill vs decode rel-RMS {err:.2e}")
    assert err <= SELF_TOL
    # The last steps depend on the state: a fresh sequence of the same token differs.
    assert rel_rms(Fp32Reference(cfg, t).prefill(toks[-1:])[0], full[-1]) > 1e-2


def test_k3_attn_res_is_wired(k3):
    cfg, t = k3
    toks = torch.arange(8) * 37 % cfg.vocab
    with_res = Fp32Reference(cfg, t).prefill(toks)
    plain = Fp32Reference(dataclasses.replace(cfg, attn_res_block=None), t).prefill(toks)
    assert rel_rms(plain, with_res) > 1e-2


def test_k3_checkpoint_with_language_model_prefix(k3, tmp_path):
    """A kimi_k3 checkpoint (config.json with text_config, `language_model.` names, A_log [128])."""
    from safetensors.torch import save_file
    from k3gen.presets import preset_dict
    cfg, t = k3
    (tmp_path / "config.json").write_text(json.dumps(preset_dict("tiny")))
    stored = {"language_model." + n: v.to(torch.bfloat16) if v.dim() >= 2 else v for n, v in t.items()}
    names = sorted(stored)
    half = len(names) // 2
    files = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for f, ns in files.items():
        save_file({n: stored[n].contiguous() for n in ns}, str(tmp_path / f))
    (tmp_path / INDEX).write_text(json.dumps({"weight_map": {n: f for f, ns in files.items() for n in ns}}))
    got = read_hf_plain(tmp_path)
    assert set(got) == set(t)
    assert all(got[n].dtype == torch.float32 and torch.equal(got[n], stored["language_model." + n].float())
               for n in t)


# -- bad input ---------------------------------------------------------------------------------------
@pytest.fixture
def plain_ckpt(tmp_path, k3):
    from safetensors.torch import save_file
    from k3gen.presets import preset_dict
    cfg, t = k3
    (tmp_path / "config.json").write_text(json.dumps(preset_dict("tiny")))

    def write(mutate):
        d = dict(t)
        mutate(d)
        save_file({n: v.contiguous() for n, v in d.items()}, str(tmp_path / "model.safetensors"))
        return tmp_path
    return write


NAME = "model.layers.1.self_attn.kv_b_proj.weight"      # layer 1 is MLA in the tiny preset


def _one_nan(x: torch.Tensor) -> torch.Tensor:
    x = x.clone()
    x.view(-1)[7] = float("nan")
    return x


@pytest.mark.parametrize("mutate, error, says", [
    (lambda d: d.pop(NAME), MissingTensorError, "missing"),
    (lambda d: d.__setitem__(NAME, d[NAME][:-1]), TensorShapeError, "expected"),
    (lambda d: d.__setitem__(NAME, _one_nan(d[NAME])), BadValueError, "non-finite"),
    (lambda d: d.__setitem__("model.layers.1.self_attn.q_proj.weight", d[NAME].clone()), UnexpectedTensorError, "not a tensor"),
])
def test_reader_typed_errors(plain_ckpt, mutate, error, says):
    folder = plain_ckpt(mutate)
    with pytest.raises(error) as e:
        read_hf_plain(folder)
    named = "model.layers.1.self_attn.q_proj.weight" if error is UnexpectedTensorError else NAME
    assert named in str(e.value) and says in str(e.value)


def test_reference_rejects_bad_tensors(k3):
    cfg, t = k3
    for bad, error in (({NAME: None}, MissingTensorError), ({NAME: t[NAME][:-2]}, TensorShapeError),
                       ({NAME: t[NAME] * float("inf")}, BadValueError)):
        d = {**t, **bad}
        if d[NAME] is None:
            del d[NAME]
        with pytest.raises(error, match=NAME.replace(".", r"\.")):
            Fp32Reference(cfg, d)


# -- K3 features transformers cannot check: properties of their formulas ---------------------------
def test_k3_mla_output_gate_is_a_sigmoid(k3):
    """g_proj = 0 gates every head by sigmoid(0) = 1/2 exactly (the ungated layer halved)."""
    cfg, t = k3
    x = torch.randn(5, cfg.hidden, generator=torch.Generator().manual_seed(5))
    gated = Fp32Reference(cfg, {**t, "model.layers.1.self_attn.g_proj.weight": torch.zeros_like(
        t["model.layers.1.self_attn.g_proj.weight"])})._mla(1, x)
    plain = Fp32Reference(dataclasses.replace(cfg, mla_out_gate=False), t)._mla(1, x)
    assert rel_rms(gated, 0.5 * plain) <= SELF_TOL
    assert rel_rms(Fp32Reference(cfg, t)._mla(1, x), 0.5 * plain) > 1e-2


def test_k3_latent_norm_follows_the_experts(k3):
    """routed_expert_norm sits between the expert sum and routed_expert_up_proj: scaling every
    expert's w2 leaves the MoE output unchanged (RMSNorm is scale-free), and dropping the norm
    (latent_norm off) changes it."""
    cfg, t = k3
    x = torch.randn(6, cfg.hidden, generator=torch.Generator().manual_seed(6))
    def scaled(s):   # every expert's w2 times s; large s makes the norm's eps negligible
        return {n: v * s if n.startswith("model.layers.1.block_sparse_moe.experts.") and ".w2." in n else v
                for n, v in t.items()}
    base = Fp32Reference(cfg, scaled(8.0))._moe(1, x)
    assert rel_rms(Fp32Reference(cfg, scaled(64.0))._moe(1, x), base) <= SELF_TOL
    assert rel_rms(Fp32Reference(dataclasses.replace(cfg, latent_norm=False), scaled(8.0))._moe(1, x), base) > 1e-2


@pytest.mark.parametrize("gate", ["bounded", "softplus"])
def test_reference_kda_layer_equals_the_kda_op_reference(k3, gate):
    """The model reference's KDA layer against k3gen's kda_decode op reference (written apart
    from it, what the kernels are tested against), token by token from a zero state: the
    bounded gate's exp(A_log) and bound, which transformers cannot check, are covered here."""
    from k3gen.ir.dtypes import GateKind
    from k3gen.ops.kda_decode.reference import KdaWeights, kda_token_loop
    cfg, t = k3
    if gate == "softplus":
        cfg = dataclasses.replace(cfg, kda_gate=GateKind.SOFTPLUS, gate_lower_bound=None)
    ref = Fp32Reference(cfg, t)
    i = cfg.kda_layer_ids[0]
    a = f"model.layers.{i}.self_attn."
    H, D, T = cfg.kda_heads, cfg.kda_heads * 128, 6
    x = torch.randn(T, cfg.hidden, generator=torch.Generator().manual_seed(9))
    got = ref._kda(i, x)
    w = {n: v.float() for n, v in t.items()}
    qkvg = torch.cat([x @ w[a + n + ".weight"].T for n in ("q_proj", "k_proj", "v_proj", "g_proj")], -1)
    kw = KdaWeights(conv_w=torch.cat([w[a + n + "_conv1d.weight"].reshape(D, 4) for n in "qkv"]),
                    fb_w=w[a + "f_b_proj.weight"], dt_bias=w[a + "dt_bias"], a_log=w[a + "A_log"][:H],
                    norm_w=w[a + "o_norm.weight"])
    y, *_ = kda_token_loop(qkvg[None], (x @ w[a + "f_a_proj.weight"].T)[None], (x @ w[a + "b_proj.weight"].T)[None],
                           torch.zeros(1, H, 128, 128), torch.zeros(1, 3 * D, 3), kw, gate=cfg.kda_gate)
    want = y[0].reshape(T, D) @ w[a + "o_proj.weight"].T
    err = rel_rms(got, want)
    print(f"KDA layer ({gate}) vs op reference: rel-RMS {err:.2e}")
    assert err <= SELF_TOL
