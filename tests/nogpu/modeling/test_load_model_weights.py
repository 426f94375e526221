"""load_model_weights (model/formats/detect.py): the layout of a folder detected with typed errors,
and the three published layouts loaded into K3Model through one assembly (model/formats/assemble.py)
for a TP rank, streamed layer by layer.

- official K3 MXFP4 (compressed-tensors): the same ModelWeights structure as the ModelOpt layout;
  every loaded value is the checkpoint's (FP8 projections exactly the recipe's quantization of the
  stored BF16, experts exactly their MXFP4 decode); K3Model's reference path against the FP32
  reference over the loaded weights;
- the tiny transformers Kimi-Linear (tests/hf_tiny.py) from its save_pretrained folder onto the
  FP8 kernel formats (softplus gate, the low-rank KDA gate folded, MLA without q LoRA and without
  output gate): K3Model's reference path against transformers' own forward, within a bound derived
  from the FP8 recipe's rounding (below);
- TP / EP slices against TP1; peak host memory while streaming a multi-shard checkpoint; the
  command line's --checkpoint.

The FP8 bound. One E4M3 rounding with a 128x128 tile scale leaves a relative RMS error eps on
Gaussian weights (measured here, ~0.026). How the network turns such roundings into logit error
is measured, not guessed: every weight the kernel path quantizes is multiplied by (1 + eps N(0,1))
in the oracle's own model and its logits moved by e_noise. K3Model's path rounds each FP8 GEMM's
weight once (~ e_noise) and its input activation once in the same format (another independent
~ e_noise; BF16 activations add ~2^-9 per op): expected sqrt(2) e_noise, bound 2 sqrt(2) e_noise
(a factor 2 for one draw's variance and the rounding's non-Gaussian shape; measured errors sit at
1.0-1.3 x sqrt(2) e_noise). Against the FP32 reference over the loaded weights only the
activation roundings remain: bound 2 e_noise. A wrong slice, fold or scale moves the logits by
O(1), far outside both.
"""
from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import hf_tiny
from numerics import rel_rms

from k3gen.errors import SpecError
from k3gen.ir.dtypes import ScaleRecipe
from k3gen.ops.fp8_block_gemm.reference import dequantize_weights, quantize_weights
from k3gen.presets import preset_dict
from model.cache import HybridCache
from model.checkpoint import (INDEX, CheckpointError, CheckpointFormatError,
                              UnsupportedCheckpointError, write_random_checkpoint)
from model.config import TargetConfig, config_from_dict, config_from_json, tiny_config
from model.formats import ct_mxfp4 as C
from model.formats.detect import CT_MXFP4, HF_PLAIN, MODELOPT, detect_format, load_model_weights
from model.model import K3Model
from model.ops import RefOps
from model.reference import Fp32Reference, canonical_from_weights
from model.weights import Fp8Linear, ModelWeights

CFG = tiny_config()
RECIPES = [ScaleRecipe.FP32, ScaleRecipe.UE8M0]
_fp8_name = hf_tiny.fp8_weight
_cat = hf_tiny.flat
eps_e4m3 = hf_tiny.eps_e4m3


# -- checkpoints -------------------------------------------------------------------------------------
def _stabilize(folder):
    """The random official checkpoint made non-chaotic for numeric comparisons: correction biases
    spaced beyond the router's sigmoid range (tests/hf_tiny.py says why) and the AttnRes
    pseudo-queries at 0.1 of their fan-in gain (model/checkpoint.py QUERY_GAIN's measurements)."""
    for f in sorted(folder.glob("*.safetensors")):
        t = load_file(str(f))
        for n in t:
            if n.endswith("e_score_correction_bias"):
                t[n] = torch.arange(t[n].numel(), 0, -1, dtype=torch.float32) * 2.0
            elif n.endswith("_res_proj.weight"):
                t[n] = (t[n].float() * 0.1).to(t[n].dtype)
        save_file(t, str(f), metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def official(tmp_path_factory):
    return C.write_official_checkpoint(CFG, tmp_path_factory.mktemp("official"), seed=3, shards=5)


@pytest.fixture(scope="module")
def modelopt(tmp_path_factory):
    return write_random_checkpoint(CFG, tmp_path_factory.mktemp("modelopt"), seed=7, shard_bytes=1 << 20,
                                   fp4="codes")[0]


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """case -> (folder, tokens, transformers' logits, the model) of the stable-routing tiny model."""
    pytest.importorskip("transformers")
    out = {}
    for case, q_lora in hf_tiny.CASES.items():
        m = hf_tiny.build(q_lora, hf_tiny.SEEDS[case], stable_routing=True)
        toks = hf_tiny.tokens(hf_tiny.SEEDS[case])
        d = tmp_path_factory.mktemp(f"hf_{case}")
        m.save_pretrained(d, max_shard_size="2MB")
        out[case] = (d, toks, hf_tiny.hf_logits(m, toks), m)
    return out


# -- running K3Model and the reference ----------------------------------------------------------------
def k3_logits(w: ModelWeights, toks, recipe) -> list[torch.Tensor]:
    P = hf_tiny.PROMPT
    cfg = w.cfg
    t = TargetConfig(path="reference", recipe=recipe)
    m = K3Model(w, t, HybridCache(cfg, t, num_slots=2, num_pages=8, max_seq_len=64, device="cpu"),
                ops=RefOps(recipe, gate=cfg.kda_gate))   # make_ops' RefOps takes the bounded gate only
    out = [m.prefill([0], [toks[:P].tolist()], all_logits=True).float()]
    return out + [m.decode([0], [int(x)])[0].float() for x in toks[P:]]


def ref_logits(cfg, tensors, toks, eps: float) -> list[torch.Tensor]:
    P = hf_tiny.PROMPT
    r = Fp32Reference(cfg, tensors, mla_norm_eps=eps)
    return [r.prefill(toks[:P])] + [r.decode(x) for x in toks[P:]]


def noisy(tensors: dict, eps: float, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {n: v * (1 + eps * torch.randn(v.shape, generator=g)) if _fp8_name(n) else v for n, v in tensors.items()}


# -- detection -----------------------------------------------------------------------------------------
def test_detect_format(official, modelopt, hf, tmp_path):
    assert detect_format(official) == CT_MXFP4 and detect_format(modelopt) == MODELOPT
    assert detect_format(hf["q_proj"][0]) == HF_PLAIN
    with pytest.raises(CheckpointFormatError, match="holds nothing"):
        detect_format(tmp_path)
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(CheckpointFormatError, match="notes.txt.*hf_quant_config.json"):
        detect_format(tmp_path)
    with pytest.raises(CheckpointFormatError, match="a file"):
        detect_format(tmp_path / "notes.txt")
    with pytest.raises(CheckpointFormatError, match="no such folder"):
        load_model_weights(tmp_path / "nope", CFG)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointFormatError, match="not JSON"):
        detect_format(tmp_path)
    # RedHatAI/Kimi-K3-FP8-BLOCK style: compressed-tensors, another format.
    bad = shutil.copytree(official, tmp_path / "fp8block")
    c = json.loads((bad / "config.json").read_text())
    c["text_config"]["quantization_config"]["format"] = "float-quantized"
    (bad / "config.json").write_text(json.dumps(c))
    with pytest.raises(UnsupportedCheckpointError, match="float-quantized"):
        load_model_weights(bad, CFG)
    # A quantized folder that lost its quantization config is read as plain and refused by dtype.
    (bad / "config.json").write_text(json.dumps(preset_dict("tiny")))
    with pytest.raises(CheckpointError, match="weight_packed"):
        load_model_weights(bad, CFG)


# -- the official MXFP4 layout ---------------------------------------------------------------------------
def _structure(obj, path="w"):
    """(path, kind) of every leaf: tensors by shape and dtype, FP8 linears by shape and recipe."""
    if isinstance(obj, torch.Tensor):
        return [(path, tuple(obj.shape), obj.dtype)]
    if isinstance(obj, Fp8Linear):
        return [(path, tuple(obj.codes.shape), tuple(obj.scales.shape), obj.recipe)]
    if isinstance(obj, list):
        return [x for i, v in enumerate(obj) for x in _structure(v, f"{path}[{i}]")]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [x for f in dataclasses.fields(obj) for x in _structure(getattr(obj, f.name), f"{path}.{f.name}")]
    return [(path, obj if isinstance(obj, (str, int, float, type(None), range)) else type(obj).__name__)]


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.value)
def test_mxfp4_and_modelopt_load_the_same_structure(official, modelopt, recipe):
    a, b = load_model_weights(official, CFG, recipe), load_model_weights(modelopt, CFG, recipe)
    sa, sb = _structure(a), _structure(b)
    assert [x[0] for x in sa] == [x[0] for x in sb]
    differ = {x[0] for x, y in zip(sa, sb) if x != y}
    # Only the routed experts' stored formats differ: fmt, the scale dtypes, NVFP4's globals.
    assert differ and all(".experts." in p for p in differ), sorted(differ)[:5]
    for la, lb in zip(a.layers, b.layers):
        if hasattr(la.ffn, "experts"):
            assert (la.ffn.experts.fmt, lb.ffn.experts.fmt) == ("mxfp4", "nvfp4")
            assert la.ffn.experts.w13.shape == lb.ffn.experts.w13.shape


def _raw(folder, name):
    from safetensors import safe_open
    shard = json.loads((folder / INDEX).read_text())["weight_map"][name]
    with safe_open(str(folder / shard), framework="pt") as f:
        return f.get_tensor(name)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.value)
def test_mxfp4_weights_are_the_checkpoints(official, recipe):
    """Every value K3Model computes with, back in canonical form, against the stored tensors:
    FP8 projections exactly the recipe's block quantization of the stored BF16, routed experts
    exactly their MXFP4 decode, the rest exactly the stored values (conv taps in BF16)."""
    w = load_model_weights(official, CFG, recipe)
    cfg, got = canonical_from_weights(w)
    assert cfg == CFG
    n_fp8 = 0
    for name, v in got.items():
        if ".experts." in name:
            base = "language_model." + name.removesuffix(".weight")
            want = C.decode_mxfp4(_raw(official, base + ".weight_packed"), _raw(official, base + ".weight_scale"))
        else:
            want = _raw(official, "language_model." + name).float()
            if _fp8_name(name):
                n_fp8 += 1
                want = dequantize_weights(*quantize_weights(want, recipe), recipe)
            elif "conv1d" in name:
                want = want.to(torch.bfloat16).float()
            elif name.endswith("A_log"):
                want = want[:cfg.kda_heads].reshape(v.shape)
        assert torch.equal(v, want.reshape(v.shape)), name
    # KDA q k v g f_a b o; MLA q_a q_b kv_a g o; the dense MLP's gate up down; per MoE layer the latent
    # down/up and the shared experts' gate up down
    assert n_fp8 == 2 * 7 + 2 * 5 + 3 + 3 * 5


@pytest.fixture(scope="module")
def stable_official(official, tmp_path_factory):
    return _stabilize(shutil.copytree(official, tmp_path_factory.mktemp("stable") / "ck"))


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.value)
def test_mxfp4_k3model_matches_its_fp32_reference(stable_official, recipe):
    """K3 as published (AttnRes, SiTU, latent MoE, bounded gate) from the official layout: the
    reference path against the FP32 reference over the very weights it loaded: the activation
    roundings only (bound in the module docstring)."""
    w = load_model_weights(stable_official, CFG, recipe)
    cfg, t = canonical_from_weights(w)
    toks = hf_tiny.tokens(5, CFG.vocab)
    ref = ref_logits(cfg, t, toks, cfg.eps)
    e_noise = rel_rms(_cat(ref_logits(cfg, noisy(t, eps_e4m3(recipe)), toks, cfg.eps)), _cat(ref))
    err = rel_rms(_cat(k3_logits(w, toks, recipe)), _cat(ref))
    print(f"official {recipe.value}: K3Model vs FP32 reference {err:.4f}, bound 2 x e_noise {2 * e_noise:.4f}")
    assert 0 < err <= 2 * e_noise and e_noise < 0.05


# -- the transformers Kimi-Linear, plain BF16/FP32 save_pretrained ------------------------------------------
@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.value)
@pytest.mark.parametrize("case", list(hf_tiny.CASES))
def test_hf_tiny_fp8_matches_transformers(hf, case, recipe):
    folder, toks, want, model = hf[case]
    cfg = config_from_json(folder)
    assert (cfg.kda_out_gate, cfg.mla_out_gate, cfg.q_lora) == ("low_rank", False, hf_tiny.CASES[case])
    w = load_model_weights(folder, cfg, recipe)
    eps = eps_e4m3(recipe)
    e_noise = rel_rms(_cat(hf_tiny.noise_logits(model, toks, eps)), _cat(want))
    got = k3_logits(w, toks, recipe)
    err = rel_rms(_cat(got), _cat(want))
    steps = [rel_rms(a, b) for a, b in zip(got, want)]
    ccfg, t = canonical_from_weights(w)
    act = rel_rms(_cat(got), _cat(ref_logits(ccfg, t, toks, cfg.eps)))
    print(f"{case} {recipe.value}: eps {eps:.4f}, e_noise {e_noise:.4f}; K3Model vs transformers {err:.4f} "
          f"(bound {2 * 2 ** 0.5 * e_noise:.4f}; per step {', '.join(f'{e:.3f}' for e in steps)}); "
          f"vs the FP32 reference of its weights {act:.4f} (bound {2 * e_noise:.4f})")
    assert 0.005 < e_noise < 0.1
    assert 0 < err <= 2 * 2 ** 0.5 * e_noise
    assert max(steps) <= 3 * 2 ** 0.5 * e_noise
    assert 0 < act <= 2 * e_noise


@pytest.mark.parametrize("case", list(hf_tiny.CASES))
def test_hf_tiny_weights_are_the_checkpoints(hf, case):
    """The loaded Kimi-Linear weights against transformers' parameters: FP8 projections within
    one E4M3 rounding (the folded gate against g_b @ g_a, the ungated MLA's o_proj undoubled),
    everything else the stored value rounded to BF16 (experts, norms, MLPs) or kept FP32."""
    folder, _, _, model = hf[case]
    cfg = config_from_json(folder)
    w = load_model_weights(folder, cfg, ScaleRecipe.FP32)
    _, got = canonical_from_weights(w)
    from model.formats.hf_plain import HfPlainCheckpoint
    stored = HfPlainCheckpoint(folder, cfg)
    eps = eps_e4m3(ScaleRecipe.FP32)
    for name, v in got.items():
        if name.endswith("g_proj.weight") and cfg.kind(int(name.split(".")[2])) == "kda":
            a = name.removesuffix("g_proj.weight")
            want = stored.read(a + "g_b_proj.weight").float() @ stored.read(a + "g_a_proj.weight").float()
        else:
            want = stored.read(name).float()
        if _fp8_name(name):
            assert rel_rms(v, want.reshape(v.shape)) <= 1.5 * eps, name
        elif name.endswith(("A_log", "dt_bias", "o_norm.weight", "e_score_correction_bias", "gate.weight")) \
                or "res_" in name:
            assert torch.equal(v, want.reshape(v.shape)), name
        else:
            assert torch.equal(v, want.to(torch.bfloat16).float().reshape(v.shape)), name
    assert not any(n.endswith("g_a_proj.weight") for n in got)


# -- TP / EP slices ---------------------------------------------------------------------------------------
def tiny4_dict() -> dict:
    """tiny with 4 KDA and 8 MLA heads and a 512 expert intermediate: shares of whole 128-row tiles at
    TP2 (q_b has 192 rows per head; tiny's 2 MLA heads do not split; the shared experts' FP8 [gate | up]
    splits by rows too; tests/nogpu/dist uses the same config)."""
    d = preset_dict("tiny")
    d["text_config"]["linear_attn_config"]["num_heads"] = 4
    d["text_config"]["num_attention_heads"] = 8
    d["text_config"]["moe_intermediate_size"] = 512
    return d


def _leaves(obj, path="w"):
    if isinstance(obj, torch.Tensor):
        return [(path, obj)]
    if isinstance(obj, Fp8Linear):
        return [(path + ":" + type(obj).__name__, obj.codes), (path + ".scales", obj.scales)]
    if isinstance(obj, list):
        return [x for i, v in enumerate(obj) for x in _leaves(v, f"{path}[{i}]")]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [x for f in dataclasses.fields(obj) for x in _leaves(getattr(obj, f.name), f"{path}.{f.name}")]
    return [(path, obj)]


@pytest.fixture(scope="module")
def tiny4(tmp_path_factory):
    cfg = config_from_dict(tiny4_dict(), "tiny4")
    off = C.write_official_checkpoint(cfg, tmp_path_factory.mktemp("t4_official"), seed=1, shards=3,
                                      config=tiny4_dict())
    mo = write_random_checkpoint(cfg, tmp_path_factory.mktemp("t4_modelopt"), seed=2, shard_bytes=2 << 20,
                                 fp4="codes")[0]
    return cfg, {"official": off, "modelopt": mo}


@pytest.fixture(scope="module")
def hf4(tmp_path_factory):
    """The transformers Kimi-Linear with 4 KDA and 4 MLA heads (q_proj: 2 x 192 rows per rank at TP2) and a
    256 expert intermediate (the shared experts' FP8 weights split on whole 128-row tiles at TP2)."""
    pytest.importorskip("transformers")
    out = {}
    for case, q_lora in hf_tiny.CASES.items():
        d = tmp_path_factory.mktemp(f"hf4_{case}")
        hf_tiny.build(q_lora, 7, kda_heads=4, mla_heads=4, moe_inter=256).save_pretrained(d, max_shard_size="2MB")
        out[f"hf-{case}"] = d
    return out


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.value)
@pytest.mark.parametrize("fmt", ["official", "modelopt", "hf-q_lora", "hf-q_proj"])
def test_rank_loads_are_shard_weights_of_the_whole(tiny4, hf4, fmt, recipe):
    """Each rank reads only its share, and gets bit for bit what model/shard.py's shard_weights
    cuts from the whole model (the per-rank format K3Model(par=) runs), at TP2 and TP2 x EP2:
    the official MXFP4 and ModelOpt layouts of K3, and the plain Kimi-Linear (softplus gate, folded
    low-rank gate, no MLA output gate; with q_a / q_b or a plain q_proj)."""
    from model.dist import Layout
    from model.shard import shard_weights
    cfg, folders = tiny4
    folders = {**folders, **hf4}
    if fmt.startswith("hf-"):
        cfg = config_from_json(folders[fmt])
    full = load_model_weights(folders[fmt], cfg, recipe)
    for world, ep in ((2, 1), (2, 2)):
        for rank in range(world):
            want = _leaves(shard_weights(full, Layout(world, ep).place(rank)))
            got = _leaves(load_model_weights(folders[fmt], cfg, recipe, rank=rank, world=world, ep=ep))
            assert [p for p, _ in got] == [p for p, _ in want]
            for (path, g), (_, w) in zip(got, want):
                same = torch.equal(g, w) if isinstance(g, torch.Tensor) else g == w
                assert same, (world, ep, rank, path)


def test_rank_load_errors(tiny4, official):
    from model.shard import ShardAlignmentError
    cfg, folders = tiny4
    with pytest.raises(SpecError, match="rank"):
        load_model_weights(folders["official"], cfg, rank=2, world=2)
    with pytest.raises(SpecError, match="ep"):
        load_model_weights(folders["official"], cfg, world=2, ep=3)
    with pytest.raises(SpecError, match="kda_heads"):
        load_model_weights(folders["official"], cfg, world=8)
    with pytest.raises(ShardAlignmentError, match="q_b"):          # tiny: one 192-row MLA head per rank
        load_model_weights(official, CFG, rank=0, world=2)
