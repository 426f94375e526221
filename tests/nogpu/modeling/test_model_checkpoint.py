"""The K3 NVFP4 checkpoint (nvidia/Kimi-K3-NVFP4's ModelOpt layout with the published names):
write a random one, load it, compare with what was written (decoded independently through
ml_dtypes); the names and shapes of the full K3 config against the published header dumps
(tools_tmp/k3_facts.md section 2); config.json / hf_quant_config.json; the loader's conversions;
its typed errors on bad input."""
from __future__ import annotations

import dataclasses
import functools
import json

import ml_dtypes
import numpy as np
import pytest
import torch

from k3gen.hf_config import config_fields
from k3gen.ir.dtypes import ScaleRecipe
from k3gen.ops.fp8_block_gemm.reference import dequantize_weights
from k3gen.presets import PRESETS, preset_dict
from model.checkpoint import (INDEX, LM_HEAD, PREFIX, BadValueError, CheckpointError, MissingTensorError,
                              TensorShapeError, UnexpectedTensorError, UnsupportedCheckpointError, config_json,
                              expected_tensors, random_tensors, write_checkpoint)
from model.config import config_from_json, get_config, tiny_config
from model.weights import KV_A_PAD, ExpertWeights, load_weights

CFG = tiny_config()
BF = torch.bfloat16


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    stored, truth = random_tensors(CFG, seed=7)
    d = write_checkpoint(stored, tmp_path_factory.mktemp("ckpt"), CFG, shard_bytes=1 << 20)
    return d, stored, truth


def test_format_index_and_dtypes(written):
    d, stored, _ = written
    idx = json.loads((d / INDEX).read_text())
    assert set(idx["weight_map"]) == set(expected_tensors(CFG)) == set(stored)
    assert len(set(idx["weight_map"].values())) > 1           # really sharded
    a = PREFIX + "layers.0.self_attn."
    assert stored[a + "q_proj.weight"].dtype == torch.float8_e4m3fn
    assert stored[a + "q_proj.weight_scale"].dtype == torch.float32
    assert stored[a + "q_proj.weight_scale"].shape == (2, 1, 2, 1)          # ModelOpt's 4-D grid
    assert stored[a + "f_b_proj.weight"].dtype == torch.float8_e4m3fn     # FP8_PB_WO in the NVFP4 repo
    assert stored[a + "b_proj.weight_scale"].shape == (1, 1, 2, 1)          # N = H = 2: one partial row tile
    assert stored[a + "q_conv1d.weight"].dtype == torch.float32
    assert stored[a + "A_log"].shape == (128,) and (stored[a + "A_log"][CFG.kda_heads:] == 0).all()
    e = PREFIX + "layers.2.block_sparse_moe.experts.3.w1"
    assert stored[e + ".weight"].dtype == torch.uint8 and stored[e + ".weight"].shape == (128, 64)
    assert stored[e + ".weight_scale"].dtype == torch.float8_e4m3fn and stored[e + ".weight_scale"].shape == (128, 8)
    assert stored[e + ".weight_scale_2"].shape == () and float(stored[e + ".input_scale"]) == 1.0
    for n in ("self_attention_res", "mlp_res"):
        assert stored[PREFIX + f"layers.3.{n}_proj.weight"].shape == (1, CFG.hidden)
    assert stored[PREFIX + "output_attn_res_norm.weight"].shape == (CFG.hidden,)
    assert stored[PREFIX + "layers.2.block_sparse_moe.routed_expert_norm.weight"].shape == (CFG.moe_latent,)


def test_config_and_quant_config_files(written):
    d, _, _ = written
    assert dataclasses.replace(config_from_json(d), name=CFG.name) == CFG
    q = json.loads((d / "hf_quant_config.json").read_text())
    assert q["producer"]["name"] == "modelopt"
    qq = q["quantization"]
    assert qq["quant_algo"] == "MIXED_PRECISION" and qq["kv_cache_quant_algo"] is None
    layers = qq["quantized_layers"]
    assert layers[PREFIX + "layers.2.block_sparse_moe.experts"] == {"quant_algo": "NVFP4", "group_size": 16}
    assert not any(".experts." in k for k in layers)                     # no per-expert entries
    assert layers[PREFIX + "layers.1.self_attn.kv_a_proj_with_mqa"] == {"quant_algo": "FP8_PB_WO"}
    assert layers[PREFIX + "layers.0.self_attn.g_proj"] == {"quant_algo": "FP8_PB_WO"}
    assert "language_model.lm_head" in qq["exclude_modules"]
    assert PREFIX + "layers.2.block_sparse_moe.gate" in qq["exclude_modules"]


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_config_json_reads_back(name):
    """The writer's config.json of a preset reads back as the preset (the published field names)."""
    want = config_fields(preset_dict(name), name=name)
    assert config_fields(config_json(get_config(name)), name=name) == want


def test_k3_names_and_shapes():
    """The full K3 config (16 of the 896 experts, to stay fast) gives the published header dumps'
    names and shapes (k3_facts 2.1-2.6) and the derived NVFP4 expert shapes (k3_facts 4)."""
    k3 = get_config("k3")
    t = expected_tensors(dataclasses.replace(k3, experts=16))
    sh = {n: (i.shape, i.dtype) for n, i in t.items()}
    f8, b16, f32, u8 = torch.float8_e4m3fn, torch.bfloat16, torch.float32, torch.uint8
    L0, L1, L3 = (PREFIX + f"layers.{i}." for i in (0, 1, 3))
    want = {
        PREFIX + "embed_tokens.weight": ((163840, 7168), b16), LM_HEAD: ((163840, 7168), b16),
        PREFIX + "output_attn_res_proj.weight": ((1, 7168), b16), PREFIX + "output_attn_res_norm.weight": ((7168,), b16),
        L0 + "self_attn.q_proj.weight": ((12288, 7168), f8), L0 + "self_attn.q_proj.weight_scale": ((96, 1, 56, 1), f32),
        L0 + "self_attn.g_proj.weight": ((12288, 7168), f8), L0 + "self_attn.f_b_proj.weight": ((12288, 128), f8),
        L0 + "self_attn.b_proj.weight_scale": ((1, 1, 56, 1), f32), L0 + "self_attn.A_log": ((128,), f32),
        L0 + "self_attn.q_conv1d.weight": ((12288, 1, 4), f32), L0 + "self_attn.o_norm.weight": ((128,), f32),
        L0 + "self_attn.dt_bias": ((12288,), f32), L0 + "mlp.gate_proj.weight": ((33792, 7168), b16),
        L0 + "mlp.down_proj.weight": ((7168, 33792), b16),
        L0 + "self_attention_res_proj.weight": ((1, 7168), b16), L0 + "mlp_res_norm.weight": ((7168,), b16),
        L3 + "self_attn.q_b_proj.weight": ((18432, 1536), f8), L3 + "self_attn.kv_a_proj_with_mqa.weight": ((576, 7168), f8),
        L3 + "self_attn.kv_a_proj_with_mqa.weight_scale": ((5, 1, 56, 1), f32),
        L3 + "self_attn.kv_b_proj.weight": ((24576, 512), f8), L3 + "self_attn.g_proj.weight": ((12288, 7168), f8),
        L3 + "self_attn.q_a_layernorm.weight": ((1536,), b16),
        L1 + "block_sparse_moe.gate.weight": ((16, 7168), b16),
        L1 + "block_sparse_moe.gate.e_score_correction_bias": ((16,), f32),
        L1 + "block_sparse_moe.routed_expert_down_proj.weight": ((3584, 7168), b16),
        L1 + "block_sparse_moe.routed_expert_norm.weight": ((3584,), b16),
        L1 + "block_sparse_moe.routed_expert_up_proj.weight": ((7168, 3584), b16),
        L1 + "block_sparse_moe.shared_experts.gate_proj.weight": ((6144, 7168), b16),
        L1 + "block_sparse_moe.shared_experts.down_proj.weight": ((7168, 6144), b16),
        L1 + "block_sparse_moe.experts.15.w3.weight": ((3072, 1792), u8),
        L1 + "block_sparse_moe.experts.15.w3.weight_scale": ((3072, 224), f8),
        L1 + "block_sparse_moe.experts.0.w2.weight": ((3584, 1536), u8),
        L1 + "block_sparse_moe.experts.0.w2.weight_scale": ((3584, 192), f8),
        L1 + "block_sparse_moe.experts.0.w1.weight_scale_2": ((), f32),
        L1 + "block_sparse_moe.experts.0.w1.input_scale": ((), f32),
    }
    assert {n: sh.get(n) for n in want} == want
    assert L0 + "block_sparse_moe.gate.weight" not in sh and L1 + "mlp.gate_proj.weight" not in sh
    assert not any(n.startswith(L0 + "self_attn.g_a") for n in sh)
    assert sum(n.endswith("self_attn.o_proj.weight") for n in sh) == 93
    assert sum(n.endswith(".A_log") for n in sh) == 69            # the KDA layers
    assert sum(n.endswith("_res_proj.weight") for n in sh) == 2 * 93 + 1


def test_round_trip(written):
    d, stored, truth = written
    w = load_weights(d, CFG)
    H, D = CFG.kda_heads, CFG.kda_heads * 128
    kda = w.layers[0].attn
    a = PREFIX + "layers.0.self_attn."
    want = torch.cat([truth[a + n] for n in ("q_proj", "k_proj", "v_proj", "g_proj")])
    torch.testing.assert_close(kda.qkvg.dequant(), want, rtol=0, atol=0)
    fab = kda.fab.dequant()
    assert fab.shape[0] % 16 == 0
    torch.testing.assert_close(fab[:128 + H], torch.cat([truth[a + "f_a_proj"], truth[a + "b_proj"]]), rtol=0, atol=0)
    assert (fab[128 + H:] == 0).all()
    torch.testing.assert_close(kda.o_proj.dequant(), truth[a + "o_proj"], rtol=0, atol=0)
    assert torch.equal(kda.kda.fb_w, truth[a + "f_b_proj"].to(BF))
    assert torch.equal(kda.kda.a_log, stored[a + "A_log"][:H])
    conv = torch.cat([stored[a + n + ".weight"].reshape(D, 4) for n in ("q_conv1d", "k_conv1d", "v_conv1d")])
    assert torch.equal(kda.kda.conv_w, conv.to(BF))
    m = w.layers[1].attn
    a = PREFIX + "layers.1.self_attn."
    ap = m.a_proj.dequant()
    torch.testing.assert_close(ap[:1536], truth[a + "q_a_proj"], rtol=0, atol=0)
    torch.testing.assert_close(ap[1536:1536 + 576], truth[a + "kv_a_proj_with_mqa"], rtol=0, atol=0)
    assert (ap[1536 + 576:1536 + KV_A_PAD] == 0).all()
    torch.testing.assert_close(ap[1536 + KV_A_PAD:], truth[a + "g_proj"], rtol=0, atol=0)
    kvb = truth[a + "kv_b_proj"].view(CFG.mla_heads, 256, 512)
    assert torch.equal(m.w_uk, kvb[:, :128].to(BF)) and torch.equal(m.w_uv, kvb[:, 128:].to(BF))
    moe = w.layers[2].ffn
    e = PREFIX + "layers.2.block_sparse_moe."
    ex = moe.experts
    assert ex.fmt == "nvfp4" and ex.w13.dtype == torch.uint8 and ex.w13.shape == (CFG.experts, 256, 64)
    assert ex.w13_scale.dtype == torch.float8_e4m3fn and ex.w13_global.shape == (CFG.experts, 2)
    w13, w2 = ex.dequant()
    for x in range(CFG.experts):
        assert torch.equal(ex.w13[x, 128:], stored[f"{e}experts.{x}.w3.weight"])       # [w1 | w3] rows
        assert torch.equal(w13[x, :128], truth[f"{e}experts.{x}.w1"].to(BF))
        assert torch.equal(w13[x, 128:], truth[f"{e}experts.{x}.w3"].to(BF))
        assert torch.equal(w2[x], truth[f"{e}experts.{x}.w2"].to(BF))
    # the latent projections: the recipe's FP8 block quantization of the stored BF16 (the FP8 GEMMs' weights)
    from k3gen.ops.fp8_block_gemm.reference import quantize_weights
    c, sc = quantize_weights(stored[e + "routed_expert_down_proj.weight"].float(), moe.latent_down.recipe)
    assert torch.equal(moe.latent_down.codes, c) and torch.equal(moe.latent_down.scales, sc)
    assert torch.equal(moe.latent_norm, stored[e + "routed_expert_norm.weight"])
    r = w.layers[3].mlp_res
    assert r.proj.dtype == torch.float32 and torch.equal(r.proj, stored[PREFIX + "layers.3.mlp_res_proj.weight"][0].float())
    assert torch.equal(w.output_res.norm, stored[PREFIX + "output_attn_res_norm.weight"].float())


def test_expert_weights_dequant_formats():
    """ExpertWeights.dequant against ml_dtypes decodes: NVFP4 (E4M3 per 16, per-expert w1/w3/w2
    globals) and MXFP4 (UE8M0 per 32)."""
    g = torch.Generator().manual_seed(3)
    E, I, W = 3, 64, 96
    p13 = torch.randint(0, 256, (E, 2 * I, W // 2), generator=g, dtype=torch.int32).to(torch.uint8)
    p2 = torch.randint(0, 256, (E, W, I // 2), generator=g, dtype=torch.int32).to(torch.uint8)

    def e2m1(p):
        n = np.stack([p.numpy() & 0xF, p.numpy() >> 4], -1).reshape(*p.shape[:-1], -1).astype(np.uint8)
        return n.view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    s13 = (0.25 + torch.rand(E, 2 * I, W // 16, generator=g)).to(torch.float8_e4m3fn)
    s2 = (0.25 + torch.rand(E, W, I // 16, generator=g)).to(torch.float8_e4m3fn)
    g13, g2 = torch.rand(E, 2, generator=g) + 0.1, torch.rand(E, 1, generator=g) + 0.1
    f8 = lambda s: s.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn).astype(np.float32)   # noqa: E731
    want13 = e2m1(p13) * np.repeat(f8(s13), 16, -1) * np.repeat(g13.numpy(), I, 1)[..., None]
    want2 = e2m1(p2) * np.repeat(f8(s2), 16, -1) * g2.numpy()[..., None]
    got13, got2 = ExpertWeights("nvfp4", p13, s13, g13, p2, s2, g2).dequant()
    assert torch.equal(got13, torch.from_numpy(want13).to(BF)) and torch.equal(got2, torch.from_numpy(want2).to(BF))
    b13 = torch.randint(110, 140, (E, 2 * I, W // 32), generator=g, dtype=torch.int32).to(torch.uint8)
    b2 = torch.randint(110, 140, (E, W, I // 32), generator=g, dtype=torch.int32).to(torch.uint8)
    ue = lambda b: b.numpy().view(ml_dtypes.float8_e8m0fnu).astype(np.float32)              # noqa: E731
    got13, got2 = ExpertWeights("mxfp4", p13, b13, None, p2, b2, None).dequant()
    assert torch.equal(got13, torch.from_numpy(e2m1(p13) * np.repeat(ue(b13), 32, -1)).to(BF))
    assert torch.equal(got2, torch.from_numpy(e2m1(p2) * np.repeat(ue(b2), 32, -1)).to(BF))
    bf = ExpertWeights("bf16", got13, None, None, got2, None, None).dequant()
    assert torch.equal(bf[0], got13) and torch.equal(bf[1], got2)
    with pytest.raises(ValueError, match="fmt"):
        ExpertWeights("fp8", p13, None, None, p2, None, None)


def test_ue8m0_requantization(written):
    d, _, truth = written
    w = load_weights(d, CFG, ScaleRecipe.UE8M0)
    lin = w.layers[0].attn.qkvg
    assert lin.scales.dtype == torch.uint8
    s = dequantize_weights(torch.zeros(128, 128, dtype=torch.uint8) + 0x38, lin.scales[:1, :1], ScaleRecipe.UE8M0)
    assert torch.isfinite(s).all()
    a = PREFIX + "layers.0.self_attn."
    want = torch.cat([truth[a + n] for n in ("q_proj", "k_proj", "v_proj", "g_proj")])
    err = (lin.dequant() - want).abs().max() / want.abs().max()
    assert 0 < err < 0.07          # re-rounded to power-of-two scales: close, not equal


@functools.lru_cache(maxsize=1)
def _clean():
    return random_tensors(CFG, seed=1)[0]


def _broken(tmp_path, mutate):
    stored = {k: v.clone() for k, v in _clean().items()}
    mutate(stored)
    return write_checkpoint(stored, tmp_path, CFG, shard_bytes=4 << 20)


A0 = PREFIX + "layers.0.self_attn."
E0 = PREFIX + "layers.2.block_sparse_moe.experts.0.w1"


@pytest.mark.parametrize("mutate,err,match", [
    (lambda s: s.pop(A0 + "k_proj.weight_scale"), MissingTensorError, "k_proj.weight_scale"),
    (lambda s: s.__setitem__(A0 + "dt_bias", torch.zeros(7)), TensorShapeError, "dt_bias"),
    (lambda s: s.__setitem__(A0 + "A_log", torch.zeros(128, dtype=torch.bfloat16)), TensorShapeError, "dtype"),
    (lambda s: s[A0 + "q_proj.weight_scale"].__setitem__((0, 0), float("nan")), BadValueError, "q_proj.weight_scale"),
    (lambda s: s[A0 + "o_proj.weight_scale"].__setitem__((0, 0), 0.0), BadValueError, "non-positive"),
    (lambda s: s[E0 + ".weight_scale_2"].fill_(-1.0), BadValueError, "weight_scale_2"),
    (lambda s: s[E0 + ".weight_scale"].view(torch.uint8).__setitem__((0, 0), 0xB8), BadValueError, "negative"),
    (lambda s: s[E0 + ".weight_scale"].view(torch.uint8).__setitem__((0, 0), 0x7F), BadValueError, "NaN"),
    (lambda s: s[A0 + "q_proj.weight"].view(torch.uint8).__setitem__((0, 0), 0xFF), BadValueError, "NaN codes"),
    (lambda s: s[PREFIX + "norm.weight"].__setitem__(0, float("inf")), BadValueError, "norm.weight"),
    (lambda s: s.__setitem__(A0 + "g_a_proj.weight", torch.zeros(128, 256)), UnexpectedTensorError, "g_a_proj"),
    (lambda s: s.__setitem__(A0 + "A_log", torch.zeros(3)), TensorShapeError, "A_log"),
    (lambda s: s.__setitem__(A0 + "q_proj.weight_scale", torch.ones(2, 2, 1)), TensorShapeError, "q_proj.weight_scale"),
    (lambda s: s[E0 + ".input_scale"].fill_(float("nan")), BadValueError, "input_scale"),
    (lambda s: s.pop(PREFIX + "layers.3.mlp_res_proj.weight"), MissingTensorError, "mlp_res_proj"),
    (lambda s: s.pop(PREFIX + "layers.2.block_sparse_moe.routed_expert_norm.weight"), MissingTensorError,
     "routed_expert_norm"),
], ids=["missing", "shape", "dtype", "nan-scale", "zero-scale", "neg-global", "neg-block", "nan-block",
        "nan-code", "inf-norm", "unexpected", "a_log-shape", "scale-3d", "nan-input-scale", "missing-attn-res",
        "missing-latent-norm"])
def test_loader_errors(tmp_path, mutate, err, match):
    d = _broken(tmp_path, mutate)
    with pytest.raises(err, match=match):
        load_weights(d, CFG)


def test_loader_reads_alternate_storage(tmp_path):
    """2-D FP8 scale grids and a [1, 1, H, 1] A_log load as the 4-D / padded forms do; tensors
    outside the language model (K3's vision tower) are not this runtime's and are skipped."""
    def alt(s):
        s[A0 + "q_proj.weight_scale"] = s[A0 + "q_proj.weight_scale"].reshape(2, 2).clone()
        s[A0 + "A_log"] = s[A0 + "A_log"][:CFG.kda_heads].reshape(1, 1, -1, 1).clone()
        s["vision_tower.patch_embed.weight"] = torch.zeros(4)
    ref = load_weights(_broken(tmp_path / "a", lambda s: None), CFG)
    got = load_weights(_broken(tmp_path / "b", alt), CFG)
    assert torch.equal(got.layers[0].attn.qkvg.scales, ref.layers[0].attn.qkvg.scales)
    assert torch.equal(got.layers[0].attn.kda.a_log, ref.layers[0].attn.kda.a_log)


def test_loader_refuses_what_it_cannot_run(tmp_path):
    d = _broken(tmp_path / "q", lambda s: None)
    q = json.loads((d / "hf_quant_config.json").read_text())
    q["quantization"]["quantized_layers"][PREFIX + "layers.2.block_sparse_moe.experts"]["group_size"] = 32
    (d / "hf_quant_config.json").write_text(json.dumps(q))
    with pytest.raises(UnsupportedCheckpointError, match="experts"):
        load_weights(d, CFG)
    wide = dataclasses.replace(CFG, q_lora=1024)
    d2 = write_checkpoint(random_tensors(wide, seed=1, truth=False)[0], tmp_path / "wide", wide)
    with pytest.raises(UnsupportedCheckpointError, match="q_lora_rank 1024"):
        load_weights(d2, wide)


def test_low_rank_gate_folds_into_the_fused_projection(tmp_path):
    """Kimi-Linear's g_b(g_a(x)) KDA gate loads as the D x hidden gate rows of qkvg: exactly the
    FP8 block quantization of g_b @ g_a (FP32 product of the stored weights' values)."""
    from k3gen.ops.fp8_block_gemm.reference import quantize_weights
    low = dataclasses.replace(CFG, kda_out_gate="low_rank")
    stored, truth = random_tensors(low, seed=1)
    d = write_checkpoint(stored, tmp_path / "low", low)
    assert (PREFIX + "layers.0.self_attn.g_b_proj.weight") in json.loads((d / INDEX).read_text())["weight_map"]
    D = CFG.kda_heads * 128
    for recipe in (ScaleRecipe.FP32, ScaleRecipe.UE8M0):
        w = load_weights(d, low, recipe)
        qkvg = w.layers[0].attn.qkvg
        codes, scales = quantize_weights(truth[A0 + "g_b_proj"] @ truth[A0 + "g_a_proj"], recipe)
        assert torch.equal(qkvg.codes[3 * D:], codes) and torch.equal(qkvg.scales[3 * D // 128:], scales)
        if recipe is ScaleRecipe.FP32:   # q | k | v stay the stored FP8 weights
            want = torch.cat([truth[A0 + n] for n in ("q_proj", "k_proj", "v_proj")])
            assert torch.equal(qkvg.dequant()[:3 * D], want)


def test_loader_errors_on_files(tmp_path):
    with pytest.raises(CheckpointError, match="index"):
        load_weights(tmp_path, CFG)
    d = _broken(tmp_path, lambda s: None)
    shard = sorted(p for p in d.iterdir() if p.suffix == ".safetensors")[0]
    shard.unlink()
    with pytest.raises(CheckpointError, match="missing"):
        load_weights(d, CFG)


def test_random_codes_writer_round_trip(tmp_path):
    """The writer's fast NVFP4 draw (codes and scales in the stored format, what
    write_random_checkpoint uses) loads as its ml_dtypes decode, at about unit-fan-in RMS."""
    from model.checkpoint import write_random_checkpoint
    d, truth = write_random_checkpoint(CFG, tmp_path, seed=2, truth=True, fp4="codes")
    w = load_weights(d, CFG)
    e = PREFIX + "layers.2.block_sparse_moe.experts."
    w13, w2 = w.layers[2].ffn.experts.dequant()
    I = CFG.moe_inter
    for x in range(CFG.experts):
        for n, got in (("w1", w13[x, :I]), ("w3", w13[x, I:]), ("w2", w2[x])):
            assert torch.equal(got, truth[f"{e}{x}.{n}"].to(torch.bfloat16))
    w1 = truth[e + "0.w1"]
    assert 0.5 < float(w1.pow(2).mean().sqrt()) * w1.shape[1] ** 0.5 < 2.0
