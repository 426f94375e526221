"""config.json ingestion (k3gen/hf_config.py): a config written by transformers' own
KimiLinearConfig, the presets, and a typed error for each missing or contradictory field."""
import copy
import json

import pytest

from k3gen.hf_config import ConfigError, config_fields
from k3gen.ir.dtypes import GateKind
from k3gen.presets import preset_dict
from k3gen.targets import get_model
from model.config import ModelConfig, config_from_dict, config_from_json, get_config


def _hf_config_dir(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.KimiLinearConfig(
        vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=5,
        num_attention_heads=2, num_key_value_heads=2, n_shared_experts=1, routed_scaling_factor=2.446,
        kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128, n_group=2,
        topk_group=1, num_experts_per_tok=2, num_local_experts=8, first_k_dense_replace=2,
        linear_attn_config={"head_dim": 128, "num_heads": 2, "short_conv_kernel_size": 4,
                            "kda_layers": [1, 2, 4], "full_attn_layers": [3, 5]},
        pad_token_id=None, bos_token_id=None, eos_token_id=None)
    cfg.save_pretrained(tmp_path)
    return tmp_path


def test_transformers_written_config(tmp_path):
    c = config_from_json(_hf_config_dir(tmp_path))
    assert c.family == "kimi_linear"
    assert c.layer_kinds == ("kda", "kda", "mla", "kda", "mla") and c.mla_layers == (3, 5)
    assert c.mlp_kinds == ("dense", "dense", "moe", "moe", "moe")
    assert (c.experts, c.top_k, c.shared_experts, c.n_group, c.topk_group) == (8, 2, 1, 2, 1)
    assert (c.moe_inter, c.dense_inter, c.shared_inter) == (128, 512, 128)
    assert c.routed_scale == pytest.approx(2.446) and c.renormalize
    # Kimi-Linear's variants come from the config: softplus gate, SiLU, no latent, no AttnRes.
    assert c.kda_gate is GateKind.SOFTPLUS and c.gate_lower_bound is None
    assert c.act == "silu" and c.moe_latent is None and c.attn_res_block is None and not c.mla_out_gate
    assert get_model(str(tmp_path / "config.json")) == c.kernel_shape()


def test_k3_preset_is_the_published_shape():
    c = get_config("k3")
    assert c.family == "kimi_k3" and c.layers == 93 and len(c.mla_layer_ids) == 24 and len(c.kda_layer_ids) == 69
    assert c.mla_layers[-2:] == (92, 93) and c.mla_layers[0] == 4
    assert c.mlp_kinds[0] == "dense" and set(c.mlp_kinds[1:]) == {"moe"}
    assert (c.experts, c.top_k, c.shared_experts, c.moe_inter, c.dense_inter) == (896, 16, 2, 3072, 33792)
    assert (c.moe_latent, c.latent_norm, c.act, c.attn_res_block) == (3584, True, "situ", 12)
    assert c.kda_gate is GateKind.BOUNDED and c.gate_lower_bound == -5.0 and c.a_log_pad == 128
    assert c.mla_out_gate and c.q_lora == 1536


@pytest.mark.parametrize("name", ["k3", "small", "tiny", "kimi_linear_48b"])
def test_presets_round_trip_through_json(tmp_path, name):
    (tmp_path / "config.json").write_text(json.dumps(preset_dict(name)))
    assert config_from_json(tmp_path) == ModelConfig(**{**config_fields(preset_dict(name)), "name": tmp_path.name})


def _edit(d, path, value):
    d = copy.deepcopy(d)
    t = d["text_config"]
    *head, last = path
    for k in head:
        t = t[k]
    if value is KeyError:
        del t[last]
    else:
        t[last] = value
    return d


@pytest.mark.parametrize("path,value,needle", [
    (("hidden_size",), KeyError, "hidden_size: missing"),
    (("num_experts",), KeyError, "num_experts: missing (also looked for n_routed_experts"),
    (("linear_attn_config", "kda_layers"), [1, 2, 3], "layers [5, 6, 7] are in neither"),
    (("linear_attn_config", "kda_layers"), [1, 2, 3, 4, 5, 6, 7], "layer 4 is listed as both"),
    (("linear_attn_config", "full_attn_layers"), [4, 9], "layer 9 is not in 1..8"),
    (("layer_types",), ["linear_attention"] * 8, "contradicts linear_attn_config"),
    (("mlp_layer_types",), ["sparse"] * 8, "contradicts first_k_dense_replace=1"),
    (("hidden_act",), "gelu", "'gelu' is not one of"),
    (("num_hidden_layers",), 0, "not an int >= 1"),
    (("moe_router_activation_func",), "softmax", "only the sigmoid router"),
])
def test_bad_config_names_the_field(path, value, needle):
    d = _edit(preset_dict("small"), path, value)
    with pytest.raises(ConfigError, match=None) as e:
        config_from_dict(d)
    assert needle in str(e.value), str(e.value)


def test_bad_top_level(tmp_path):
    with pytest.raises(ConfigError, match="model_type"):
        config_from_dict({"model_type": "llama"})
    with pytest.raises(ConfigError, match="text_config"):
        config_from_dict({"model_type": "kimi_k3"})
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not JSON"):
        config_from_json(tmp_path)
    with pytest.raises(ConfigError, match="no such file"):
        config_from_json(tmp_path / "nothing")
