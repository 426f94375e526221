"""A trained module -> the official MXFP4 checkpoint (model/train/export.py) -> the project's loaders:
the folder is detected as moonshotai/Kimi-K3's layout, stores exactly what the quantization-aware
forward reads (BF16 tensors as their BF16 rounding, experts as their MXFP4 round trip, F32 tensors
as they are), and `Fp32Reference` over what the reader returns gives the logits of the module in
QAT mode. K3Model's loader (`load_model_weights`) reads the same values where it keeps them as
stored (routed experts, norms, embedding, LM head)."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from numerics import rel_rms

from k3gen.ir.dtypes import ScaleRecipe
from model.checkpoint import CheckpointError, INDEX
from model.config import config_from_dict
from model.formats.detect import CT_MXFP4, detect_format, load_model_weights
from model.reference import Fp32Reference, canonical_from_weights
from model.train.config import acc_config
from model.train.export import export_checkpoint, read_canonical
from model.train.net import K3Train, mxfp4_round_trip, stored_dtypes

CFG = config_from_dict(acc_config())


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    net = K3Train(CFG, seed=7, chunk=16, sub=8)
    g = torch.Generator().manual_seed(8)
    with torch.no_grad():
        for n, p in net.p.items():
            if n.endswith(("res_proj/weight", "e_score_correction_bias")):
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    folder = export_checkpoint(net.tensors(), CFG, acc_config(), tmp_path_factory.mktemp("ck") / "checkpoint",
                               metadata={"trained_steps": 0})
    return net, folder


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_layout_is_the_official_one(exported):
    _, folder = exported
    assert detect_format(folder) == CT_MXFP4
    d = json.loads((folder / "config.json").read_text())
    assert d["text_config"]["quantization_config"]["format"] == "mxfp4-pack-quantized"
    idx = json.loads((folder / INDEX).read_text())["weight_map"]
    with safe_open(str(folder / next(iter(idx.values()))), "pt") as f:
        e = "language_model.model.layers.1.block_sparse_moe.experts.3.w1."
        assert f.get_tensor(e + "weight_packed").dtype == torch.uint8
        assert f.get_tensor(e + "weight_scale").shape == (CFG.moe_inter, CFG.expert_width // 32)
        assert f.get_tensor("language_model.model.layers.0.self_attn.q_proj.weight").dtype == torch.bfloat16
        assert f.get_tensor("language_model.model.layers.0.self_attn.A_log").dtype == torch.float32
        assert f.metadata()["trained_steps"] == "0"


def test_stored_values_are_the_qat_forwards(exported):
    net, folder = exported
    cfg, stored = read_canonical(folder)
    assert cfg.layers == CFG.layers and set(stored) == set(net.shapes)
    kinds = stored_dtypes(CFG)
    assert set(kinds.values()) == {"bf16", "f32", "mxfp4"}
    net.qat = True
    for n in net.shapes:
        assert torch.equal(stored[n], net.w(n).detach()), n
    e = "model.layers.2.block_sparse_moe.experts.5.w2.weight"
    assert torch.equal(stored[e], mxfp4_round_trip(net.tensors()[e]))
    assert not torch.equal(stored[e], net.tensors()[e])       # the MXFP4 rounding did happen


def test_checkpoint_logits_equal_the_trained_modules(exported):
    net, folder = exported
    _, stored = read_canonical(folder)
    toks = torch.randint(0, CFG.vocab, (1, 33), generator=torch.Generator().manual_seed(2))
    want = Fp32Reference(CFG, stored).prefill(toks[0])
    net.qat = True
    with torch.no_grad():
        got = net(toks)[0]
    assert rel_rms(got, want) < 2e-5
    net.qat = False
    with torch.no_grad():
        master = net(toks)[0]
    assert rel_rms(master, want) > 1e-3              # what storing BF16 + MXFP4 changes (a random net)


def test_k3model_loader_reads_the_same_values(exported):
    _, folder = exported
    _, stored = read_canonical(folder)
    w = load_model_weights(folder, recipe=ScaleRecipe.FP32)
    assert w.layers[1].ffn.experts.fmt == "mxfp4"
    _, loaded = canonical_from_weights(w)
    exact = [n for n in stored if ".experts." in n or "norm" in n or n in ("model.embed_tokens.weight",
                                                                          "lm_head.weight")]
    assert len(exact) > 3 * CFG.experts * 3
    for n in exact:
        assert torch.equal(loaded[n], stored[n]), n
    # the FP8 projections: one E4M3 rounding with 128x128 tile scales of the stored BF16
    q = "model.layers.0.self_attn.q_proj.weight"
    assert 0 < rel_rms(loaded[q], stored[q]) < 0.05


def test_export_refuses_what_it_cannot_write(exported, tmp_path):
    net, _ = exported
    t = net.tensors()
    other = acc_config()
    other["text_config"]["hidden_size"] = 384
    with pytest.raises(CheckpointError, match="does not describe"):
        export_checkpoint(t, CFG, other, tmp_path / "a")
    bad = dict(t)
    bad["model.norm.weight"] = torch.ones(CFG.hidden + 1)
    with pytest.raises(CheckpointError, match="model.norm.weight has shape"):
        export_checkpoint(bad, CFG, acc_config(), tmp_path / "b")
    bad = dict(t)
    bad["model.layers.1.block_sparse_moe.experts.0.w3.weight"] = torch.full((CFG.moe_inter, CFG.expert_width),
                                                                            float("inf"))
    with pytest.raises(CheckpointError, match="not finite"):
        export_checkpoint(bad, CFG, acc_config(), tmp_path / "c")
