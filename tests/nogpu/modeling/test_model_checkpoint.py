"""The K3 NVFP4 checkpoint: write a random one, load it, compare with what was written (decoded
independently through ml_dtypes); the loader's conversions; its typed errors on bad input."""
from __future__ import annotations

import functools
import json

import pytest
import torch

from k3gen.ir.dtypes import ScaleRecipe
from k3gen.ops.fp8_block_gemm.reference import dequantize_weights
from model.checkpoint import (INDEX, PREFIX, BadValueError, CheckpointError, MissingTensorError, TensorShapeError,
                              expected_tensors, random_tensors, write_checkpoint)
from model.config import tiny_config
from model.weights import KV_A_PAD, load_weights

CFG = tiny_config()


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
    assert stored[a + "A_log"].shape == (128,) and (stored[a + "A_log"][CFG.kda_heads:] == 0).all()
    e = PREFIX + "layers.2.block_sparse_moe.experts.3.w1"
    assert stored[e + ".weight"].dtype == torch.uint8 and stored[e + ".weight"].shape == (128, 64)
    assert stored[e + ".weight_scale"].dtype == torch.float8_e4m3fn and stored[e + ".weight_scale"].shape == (128, 8)
    assert stored[e + ".weight_scale_2"].shape == ()


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
    assert torch.equal(kda.kda.a_log, stored[a + "A_log"][:H])
    conv = torch.cat([stored[a + n + ".weight"].reshape(D, 4) for n in ("q_conv1d", "k_conv1d", "v_conv1d")])
    assert torch.equal(kda.kda.conv_w, conv)
    m = w.layers[1].attn
    a = PREFIX + "layers.1.self_attn."
    ap = m.a_proj.dequant()
    torch.testing.assert_close(ap[:1536], truth[a + "q_a_proj"], rtol=0, atol=0)
    torch.testing.assert_close(ap[1536:1536 + 576], truth[a + "kv_a_proj_with_mqa"], rtol=0, atol=0)
    assert (ap[1536 + 576:1536 + KV_A_PAD] == 0).all()
    torch.testing.assert_close(ap[1536 + KV_A_PAD:], truth[a + "g_proj"], rtol=0, atol=0)
    kvb = truth[a + "kv_b_proj"].view(CFG.mla_heads, 256, 512)
    assert torch.equal(m.w_uk, kvb[:, :128].to(torch.bfloat16)) and torch.equal(m.w_uv, kvb[:, 128:].to(torch.bfloat16))
    moe = w.layers[2].ffn
    e = PREFIX + "layers.2.block_sparse_moe.experts."
    for x in range(CFG.experts):
        assert torch.equal(moe.w1_dequant[x], truth[f"{e}{x}.w1"].to(torch.bfloat16))
        assert torch.equal(moe.w2_dequant[x], truth[f"{e}{x}.w2"].to(torch.bfloat16))


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
], ids=["missing", "shape", "dtype", "nan-scale", "zero-scale", "neg-global", "neg-block", "nan-block",
        "nan-code", "inf-norm"])
def test_loader_errors(tmp_path, mutate, err, match):
    d = _broken(tmp_path, mutate)
    with pytest.raises(err, match=match):
        load_weights(d, CFG)


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
    moe = w.layers[2].ffn
    for x in range(CFG.experts):
        for n in ("w1", "w2", "w3"):
            assert torch.equal(getattr(moe, n + "_dequant")[x], truth[f"{e}{x}.{n}"].to(torch.bfloat16))
    w1 = truth[e + "0.w1"]
    assert 0.5 < float(w1.pow(2).mean().sqrt()) * w1.shape[1] ** 0.5 < 2.0
