"""Model presets as config.json dicts (field names and K3's values as the published
moonshotai/Kimi-K3 config.json has them, quoted by SGLang/vLLM's loaders), read by the same code as a checkpoint's config
(k3gen/hf_config.py): `k3` is the published Kimi K3 text backbone (SPEC.md section 1), `small`
and `tiny` have its structure at test sizes, `kimi_linear_48b` is Kimi-Linear-48B-A3B."""
from __future__ import annotations

import copy


def _lists(layers: int, mla: list[int]) -> dict:
    return {"kda_layers": [n for n in range(1, layers + 1) if n not in mla], "full_attn_layers": list(mla)}


def _k3_text(layers: int, mla: list[int], hidden: int, vocab: int, heads: int, experts: int, top_k: int,
             shared: int, moe_inter: int, dense_inter: int, latent: int, block: int) -> dict:
    return {
        "model_type": "kimi_linear", "num_hidden_layers": layers, "hidden_size": hidden, "vocab_size": vocab,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "hidden_act": "situ",
        "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
        "linear_attn_config": {**_lists(layers, mla), "head_dim": 128, "num_heads": heads,
                               "short_conv_kernel_size": 4, "gate_lower_bound": -5.0,
                               "use_full_rank_gate": True},
        "num_attention_heads": heads, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "mla_use_nope": True, "mla_use_output_gate": True,
        "num_experts": experts, "num_experts_per_token": top_k, "num_shared_experts": shared,
        "moe_intermediate_size": moe_inter, "intermediate_size": dense_inter, "first_k_dense_replace": 1,
        "moe_router_activation_func": "sigmoid", "num_expert_group": 1, "topk_group": 1, "moe_renormalize": True,
        "routed_scaling_factor": 1.0, "topk_method": "noaux_tc", "routed_expert_hidden_size": latent, "latent_moe_use_norm": True,
        "attn_res_block_size": block,
    }


def _k3(text: dict) -> dict:
    return {"model_type": "kimi_k3", "architectures": ["KimiK3ForConditionalGeneration"], "text_config": text}


PRESETS: dict[str, dict] = {
    # 93 layers, MLA at 4, 8, ..., 92 and 93 (1-based).
    "k3": _k3(_k3_text(93, list(range(4, 93, 4)) + [93], 7168, 163840, 96, 896, 16, 2, 3072, 33792, 3584, 12)),
    # K3's structure at test size: AttnRes blocks of 3 layers (three blocks over 8), latent MoE, SiTU.
    "small": _k3(_k3_text(8, [4, 8], 1024, 2048, 12, 32, 4, 1, 256, 2048, 512, 3)),
    "tiny": _k3(_k3_text(4, [2, 4], 256, 512, 2, 8, 2, 1, 128, 512, 128, 2)),
    # moonshotai/Kimi-Linear-48B-A3B-Instruct: softplus gate, SiLU, no latent, no AttnRes, low-rank
    # KDA output gate, no MLA output gate, q_lora_rank null (a plain q_proj: model_specs lists its GEMM, no mla_q_absorb).
    "kimi_linear_48b": {
        "model_type": "kimi_linear", "num_hidden_layers": 27, "hidden_size": 2304, "vocab_size": 163840,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "hidden_act": "silu",
        "linear_attn_config": {**_lists(27, [4, 8, 12, 16, 20, 24, 27]), "head_dim": 128, "num_heads": 32,
                               "short_conv_kernel_size": 4},
        "num_attention_heads": 32, "q_lora_rank": None, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "mla_use_nope": True,
        "num_experts": 256, "num_experts_per_token": 8, "num_shared_experts": 1, "moe_intermediate_size": 1024,
        "intermediate_size": 9216, "first_k_dense_replace": 1, "moe_router_activation_func": "sigmoid",
        "num_expert_group": 1, "topk_group": 1, "moe_renormalize": True, "routed_scaling_factor": 2.446,
    },
}


def preset_dict(name: str) -> dict:
    """A copy of a preset's config.json dict (what a checkpoint writer stores as config.json)."""
    return copy.deepcopy(PRESETS[name])


def preset_fields(name: str) -> dict:
    """The `ModelConfig` fields of a preset."""
    from k3gen.hf_config import config_fields
    return config_fields(preset_dict(name), name=name, src=f"preset {name}")
