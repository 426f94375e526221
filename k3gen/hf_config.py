"""Reading a Hugging Face `config.json`: `kimi_k3` (the text part in `text_config`) and plain
`kimi_linear`, into the fields of model/config.py's `ModelConfig` (`config_fields`) and the shape
k3gen's enumerator reads (`model_shape`). Every field the model uses is read here and nowhere
else; a missing or contradictory field raises `ConfigError` naming it. It lives in k3gen so that
`k3gen build --model config.json` needs no model import (the layer rule).

Field names are the published ones: `transformers==5.23.0`'s `KimiLinearConfig` (what its
`save_pretrained` writes, e.g. `num_experts`, `num_experts_per_token`, `moe_renormalize`,
`num_expert_group`, `linear_attn_config.{kda_layers, full_attn_layers, head_dim, num_heads,
short_conv_kernel_size}`, `mlp_layer_types`) and its aliases (`n_routed_experts`,
`num_local_experts`, `num_experts_per_tok`, `norm_topk_prob`, `n_group`, `n_shared_experts`,
`first_k_dense_replace`). K3's own fields (SPEC.md section 1) are named in `_K3_FIELDS`.
"""
from __future__ import annotations

import json
from pathlib import Path

from k3gen.errors import K3genError
from k3gen.ir.dtypes import GateKind


class ConfigError(K3genError, ValueError):
    """A config.json that cannot describe a model this runtime runs: names the field."""

    def __init__(self, field: str, msg: str, source: str = "config.json"):
        self.field = field
        super().__init__(f"{source}: {field}: {msg}")


# Aliases in the order they are tried: transformers 5.23 writes the first, the others are what
# Moonshot's own configs and older transformers releases use (configuration_kimi_linear.py).
_ALIASES = {
    "experts": ("num_experts", "n_routed_experts", "num_local_experts"),
    "top_k": ("num_experts_per_token", "num_experts_per_tok"),
    "shared_experts": ("num_shared_experts", "n_shared_experts"),
    "renormalize": ("moe_renormalize", "norm_topk_prob"),
    "n_group": ("num_expert_group", "n_group"),
}

# K3 additions (absent in a kimi_linear config, which then runs without them). The names are the
# published config's, as SGLang's configs/kimi_linear.py and models/kimi_k3.py and vLLM's
# models/kimi_k3/nvidia/{model,kda}.py read them.
_K3_FIELDS = {
    "attn_res_block": "attn_res_block_size",
    "moe_latent": "routed_expert_hidden_size",
    "latent_norm": "latent_moe_use_norm",
    "mla_out_gate": "mla_use_output_gate",
    "gate_lower_bound": "gate_lower_bound",          # in linear_attn_config
    "full_rank_gate": "use_full_rank_gate",          # in linear_attn_config
    "situ_beta": "activation_situ_beta",
    "situ_linear_beta": "activation_situ_linear_beta",
}

_ACTS = ("silu", "situ")


def _get(d: dict, names, src: str, default=...):
    names = (names,) if isinstance(names, str) else names
    for n in names:
        if n in d and d[n] is not None:
            return d[n]
    if default is ...:
        raise ConfigError(names[0], "missing" + (f" (also looked for {', '.join(names[1:])})" if len(names) > 1 else ""),
                          src)
    return default


def _int(d, names, src, default=..., lo: int = 1) -> int:
    v = _get(d, names, src, default)
    if v is None:
        return v
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ConfigError(names if isinstance(names, str) else names[0], f"{v!r} is not an int >= {lo}", src)
    return v


def _layer_kinds(t: dict, L: int, src: str) -> tuple[str, ...]:
    """Per 0-based layer "kda" or "mla", from the 1-based lists in `linear_attn_config` (and
    `layer_types` where both are given: they must agree)."""
    lac = t.get("linear_attn_config") or {}
    kinds: list[str | None] = [None] * L
    if "kda_layers" in lac or "full_attn_layers" in lac:
        for key, kind in (("kda_layers", "kda"), ("full_attn_layers", "mla")):
            for n in _get(lac, key, src + " linear_attn_config"):
                if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= L:
                    raise ConfigError(f"linear_attn_config.{key}", f"layer {n!r} is not in 1..{L}", src)
                if kinds[n - 1] is not None:
                    raise ConfigError(f"linear_attn_config.{key}", f"layer {n} is listed as both KDA and MLA", src)
                kinds[n - 1] = kind
        missing = [i + 1 for i, k in enumerate(kinds) if k is None]
        if missing:
            raise ConfigError("linear_attn_config", f"layers {missing} are in neither kda_layers nor full_attn_layers",
                              src)
    lt = t.get("layer_types")
    if lt is not None:
        names = {"linear_attention": "kda", "full_attention": "mla"}
        if len(lt) != L or any(x not in names for x in lt):
            raise ConfigError("layer_types", f"expected {L} of {sorted(names)}", src)
        from_types = [names[x] for x in lt]
        if kinds[0] is not None and from_types != kinds:
            raise ConfigError("layer_types", "contradicts linear_attn_config.kda_layers/full_attn_layers", src)
        kinds = from_types
    if kinds[0] is None:
        raise ConfigError("linear_attn_config.kda_layers", "missing (the layer kinds are read, never derived)", src)
    return tuple(kinds)


def _mlp_kinds(t: dict, L: int, src: str) -> tuple[str, ...]:
    mt = t.get("mlp_layer_types")
    fk = t.get("first_k_dense_replace")
    if mt is not None:
        if len(mt) != L or any(x not in ("dense", "sparse") for x in mt):
            raise ConfigError("mlp_layer_types", f"expected {L} of dense/sparse", src)
        kinds = tuple("dense" if x == "dense" else "moe" for x in mt)
        if fk is not None and kinds != tuple("dense" if i < fk else "moe" for i in range(L)):
            raise ConfigError("mlp_layer_types", f"contradicts first_k_dense_replace={fk}", src)
        return kinds
    fk = _int(t, "first_k_dense_replace", src, default=1, lo=0)
    freq = _int(t, "moe_layer_freq", src, default=1)
    return tuple("dense" if i < fk or (i - fk) % freq else "moe" for i in range(L))


def text_config(d: dict, src: str = "config.json") -> tuple[str, dict]:
    """(model_type, the text backbone's dict) of a top-level config."""
    mt = d.get("model_type")
    if mt == "kimi_k3":
        t = d.get("text_config")
        if not isinstance(t, dict):
            raise ConfigError("text_config", "a kimi_k3 config holds its text backbone there; missing", src)
        return mt, t
    if mt == "kimi_linear":
        return mt, d
    raise ConfigError("model_type", f"{mt!r} is not kimi_k3 or kimi_linear", src)


def config_fields(d: dict, name: str | None = None, src: str = "config.json") -> dict:
    """The `ModelConfig` fields of a config.json dict (kimi_k3 or kimi_linear)."""
    family, t = text_config(d, src)
    lac = t.get("linear_attn_config") or {}
    L = _int(t, "num_hidden_layers", src)
    act = _get(t, "hidden_act", src)
    if act not in _ACTS:
        raise ConfigError("hidden_act", f"{act!r} is not one of {list(_ACTS)}", src)
    bound = lac.get(_K3_FIELDS["gate_lower_bound"])
    kda_heads = _int(lac, "num_heads", src + " linear_attn_config", default=None) or _int(t, "linear_num_heads", src)
    kda_dim = _int(lac, "head_dim", src + " linear_attn_config", default=None) or _int(t, "linear_head_dim", src,
                                                                                        default=128)
    conv = (_int(lac, "short_conv_kernel_size", src + " linear_attn_config", default=None)
            or _int(t, "linear_conv_kernel_dim", src, default=4))
    experts = _int(t, _ALIASES["experts"], src)
    n_group = _int(t, _ALIASES["n_group"], src, default=1)
    topk_group = _int(t, "topk_group", src, default=n_group)
    moe_latent = _int(t, _K3_FIELDS["moe_latent"], src, default=None)
    mla_gate = t.get(_K3_FIELDS["mla_out_gate"], False)
    topk_method = t.get("topk_method", "noaux_tc")
    if topk_method != "noaux_tc":
        raise ConfigError("topk_method", f"{topk_method!r}: only noaux_tc (top-k on scores + correction bias)", src)
    router_act = t.get("moe_router_activation_func", "sigmoid")
    if router_act != "sigmoid":
        raise ConfigError("moe_router_activation_func", f"{router_act!r}: only the sigmoid router is implemented", src)
    if t.get("mla_use_nope", True) is not True and family == "kimi_k3":
        raise ConfigError("mla_use_nope", "K3's MLA never rotates (no RoPE); false is not supported", src)
    tie = bool(t.get("tie_word_embeddings", d.get("tie_word_embeddings", False)))
    return dict(
        name=name or t.get("_name_or_path") or family, family=family, layers=L,
        layer_kinds=_layer_kinds(t, L, src), mlp_kinds=_mlp_kinds(t, L, src),
        hidden=_int(t, "hidden_size", src), vocab=_int(t, "vocab_size", src),
        eps=float(_get(t, "rms_norm_eps", src, default=1e-5)), tie_embeddings=tie,
        kda_heads=kda_heads, kda_head_dim=kda_dim, conv_size=conv,
        kda_gate=GateKind.BOUNDED if bound is not None else GateKind.SOFTPLUS,
        gate_lower_bound=None if bound is None else float(bound),
        kda_out_gate="full" if lac.get(_K3_FIELDS["full_rank_gate"], False) else "low_rank",
        # A storage fact of the published checkpoints: K3 stores A_log [128] with the first H
        # real (SGLang kimi_k3 _a_log_weight_loader); Kimi-Linear [1, 1, H, 1] (transformers 5.23).
        a_log_pad=128 if family == "kimi_k3" else None,
        mla_heads=_int(t, "num_attention_heads", src), q_lora=_int(t, "q_lora_rank", src, default=None),
        kv_lora=_int(t, "kv_lora_rank", src), qk_nope=_int(t, "qk_nope_head_dim", src),
        qk_rope=_int(t, "qk_rope_head_dim", src), v_head=_int(t, "v_head_dim", src), mla_out_gate=bool(mla_gate),
        experts=experts, top_k=_int(t, _ALIASES["top_k"], src),
        shared_experts=_int(t, _ALIASES["shared_experts"], src, default=0, lo=0),
        moe_inter=_int(t, "moe_intermediate_size", src), dense_inter=_int(t, "intermediate_size", src),
        n_group=n_group, topk_group=topk_group, renormalize=bool(_get(t, _ALIASES["renormalize"], src, default=True)),
        routed_scale=float(_get(t, "routed_scaling_factor", src, default=1.0)),
        moe_latent=moe_latent, latent_norm=bool(t.get(_K3_FIELDS["latent_norm"], False)) and moe_latent is not None,
        act=act, situ_beta=float(t.get(_K3_FIELDS["situ_beta"], 4.0)),
        situ_linear_beta=float(t.get(_K3_FIELDS["situ_linear_beta"], 25.0)),
        attn_res_block=_int(t, _K3_FIELDS["attn_res_block"], src, default=None),
    )


def read_config(path) -> tuple[dict, str, str]:
    """(dict, name, source) of a config.json file or of a checkpoint folder holding one."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise ConfigError("config.json", "no such file", str(p))
    try:
        d = json.loads(p.read_text())
    except ValueError as e:
        raise ConfigError("config.json", f"not JSON ({e})", str(p)) from e
    if not isinstance(d, dict):
        raise ConfigError("config.json", "not a JSON object", str(p))
    return d, p.parent.name, str(p)

