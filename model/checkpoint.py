"""The K3 NVFP4 checkpoint format (nvidia/Kimi-K3-NVFP4, ModelOpt MIXED_PRECISION, with the
published moonshotai/Kimi-K3 tensor names): names and shapes, typed errors, and a writer of small
random checkpoints in exactly that format (safetensors shards + `model.safetensors.index.json` +
`config.json` + `hf_quant_config.json`).

Facts (tools_tmp/k3_facts.md; its sources: SGLang models/kimi_k3.py, vLLM models/kimi_k3/nvidia/,
Model-Optimizer qtensor/{nvfp4,fp8}_tensor.py, tokenspeed quantization/modelopt_mixed.py):
- Names below `language_model.model.` (layer numbers 0-based), `language_model.lm_head.weight`
  outside it (k3_facts 2.1).
- FP8_PB_WO attention projections (k3_facts 4): `<name>.weight` float8_e4m3fn [N, K] unpadded and
  `<name>.weight_scale` FP32 stored 4-D [ceil(N/128), 1, ceil(K/128), 1] (tokenspeed
  `modelopt_block_scale_to_2d`; a 2-D [ceil(N/128), ceil(K/128)] grid is read too), the
  dequantization multiplier of each 128x128 tile. KDA: q/k/v/g_proj (D x hidden), f_a_proj
  (128 x hidden), b_proj (H x hidden), f_b_proj (D x 128), o_proj (hidden x D); the low-rank
  output gate (Kimi-Linear) g_a_proj (128 x hidden) and g_b_proj (D x 128) instead of g_proj.
  MLA: q_a_proj, q_b_proj (per head [nope 128 | rope 64] rows), kv_a_proj_with_mqa ([c_kv 512 |
  k_pe 64] rows), kv_b_proj (per head [k_nope 128 | v 128] rows, SGLang's post_load_weights
  split), g_proj (only with `mla_use_output_gate`), o_proj.
- NVFP4 routed experts `block_sparse_moe.experts.E.w{1,3}` [I, W] (gate, up) and `w2` [W, I]
  (W = the latent width, or hidden without a latent): `weight` uint8 [N, K/2] (E2M1 pairs, even
  element low), `weight_scale` float8_e4m3fn [N, K/16] (row-major, unswizzled), `weight_scale_2`
  FP32 [] and `input_scale` FP32 [] (1.0: the card's "converted to NVFP4 using input_scale=1.0");
  x = e2m1 * e4m3(scale) * weight_scale_2 (k3_facts 4).
- BF16: norms (input/post_attention_layernorm, the AttnRes `self_attention_res_norm`/`mlp_res_norm`
  [hidden] and pseudo-queries `*_res_proj` [1, hidden], model-level `output_attn_res_*`), MLA
  q_a/kv_a_layernorm, the router `block_sparse_moe.gate.weight`, `routed_expert_down_proj`
  [latent, hidden], `routed_expert_norm` [latent], `routed_expert_up_proj` [hidden, latent],
  shared experts (one MLP of moe_inter * num_shared_experts), the dense MLP `mlp.*_proj`,
  embeddings, lm_head (k3_facts 2.1-2.6; whether the NVFP4 repo quantizes the shared experts or
  the latent projections was not found: the card names only the routed experts, so BF16).
- FP32: conv taps `{q,k,v}_conv1d.weight` [D, 1, 4], `A_log` [a_log_pad] (K3: [128], the first H
  real) or [1, 1, H, 1] (Kimi-Linear, transformers 5.23), `dt_bias` [D], `o_norm.weight` [128],
  `gate.e_score_correction_bias` [E] (k3_facts 2.2, 2.4: "F32 in both header dumps").
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from k3gen.errors import K3genError

from model.config import ModelConfig

PREFIX = "language_model.model."
LM_HEAD = "language_model.lm_head.weight"
INDEX = "model.safetensors.index.json"
QUANT_CONFIG = "hf_quant_config.json"
BLOCK = 128
NVFP4_BLOCK = 16
MODELOPT_VERSION = "0.45.0"          # the card of nvidia/Kimi-K3-NVFP4 (k3_facts 4)


class CheckpointError(K3genError):
    """The checkpoint cannot be loaded: names the tensor and what is wrong with it."""


class MissingTensorError(CheckpointError, KeyError):
    def __str__(self) -> str:  # KeyError would quote the message
        return self.args[0]


class UnexpectedTensorError(CheckpointError, KeyError):
    """Tensors of the language model that the config does not describe (a config/checkpoint mismatch)."""

    def __str__(self) -> str:
        return self.args[0]


class TensorShapeError(CheckpointError, ValueError):
    pass


class BadValueError(CheckpointError, ValueError):
    """NaN/Inf values, or a scale that is not positive."""


class UnsupportedCheckpointError(CheckpointError, NotImplementedError):
    """A valid checkpoint feature this runtime does not run yet (names the tensor or field)."""


class CheckpointFormatError(CheckpointError):
    """A folder that holds none of the layouts this runtime reads (names what it found)."""


def open_shard(folder, shard: str, files: dict, opener):
    """The open safetensors handle of `shard` (opened once into `files`, by `opener` such as
    safetensors.safe_open), or a CheckpointError when the index names a shard that is not there."""
    if shard not in files:
        p = Path(folder) / shard
        if not p.is_file():
            raise CheckpointError(f"shard {shard} named by {INDEX} is missing")
        files[shard] = opener(str(p), framework="pt")
    return files[shard]


# -- names and shapes ------------------------------------------------------------------------------
@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]
    dtype: torch.dtype
    kind: str          # "fp8_weight", "fp8_scale", "fp4_weight", "fp4_scale", "fp4_global", "plain"
    alt: tuple[tuple[int, ...], ...] = ()   # other stored shapes the reader accepts (same values)

    def shape_ok(self, shape) -> bool:
        return tuple(shape) == self.shape or tuple(shape) in self.alt


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _fp8(out: dict, name: str, n: int, k: int) -> None:
    nb, kb = _cdiv(n, BLOCK), _cdiv(k, BLOCK)
    out[f"{name}.weight"] = TensorInfo((n, k), torch.float8_e4m3fn, "fp8_weight")
    out[f"{name}.weight_scale"] = TensorInfo((nb, 1, kb, 1), torch.float32, "fp8_scale", alt=((nb, kb),))


def _fp4(out: dict, name: str, n: int, k: int) -> None:
    out[f"{name}.weight"] = TensorInfo((n, k // 2), torch.uint8, "fp4_weight")
    out[f"{name}.weight_scale"] = TensorInfo((n, k // NVFP4_BLOCK), torch.float8_e4m3fn, "fp4_scale")
    out[f"{name}.weight_scale_2"] = TensorInfo((), torch.float32, "fp4_global")
    out[f"{name}.input_scale"] = TensorInfo((), torch.float32, "fp4_global")


def _plain(out: dict, name: str, shape, dtype=torch.bfloat16, alt=()) -> None:
    out[name] = TensorInfo(tuple(shape), dtype, "plain", tuple(alt))


def _attn_res(out: dict, p: str, hid: int) -> None:
    _plain(out, p + "_norm.weight", (hid,))
    _plain(out, p + "_proj.weight", (1, hid))


def _kda(t: dict, a: str, cfg: ModelConfig) -> None:
    H, hid = cfg.kda_heads, cfg.hidden
    D = H * cfg.kda_head_dim
    for n in ("q_proj", "k_proj", "v_proj"):
        _fp8(t, a + n, D, hid)
    if cfg.kda_out_gate == "full":
        _fp8(t, a + "g_proj", D, hid)
    else:
        _fp8(t, a + "g_a_proj", cfg.kda_head_dim, hid)
        _fp8(t, a + "g_b_proj", D, cfg.kda_head_dim)
    _fp8(t, a + "f_a_proj", cfg.kda_head_dim, hid)
    _fp8(t, a + "f_b_proj", D, cfg.kda_head_dim)
    _fp8(t, a + "b_proj", H, hid)
    _fp8(t, a + "o_proj", hid, D)
    for n in ("q_conv1d", "k_conv1d", "v_conv1d"):
        _plain(t, a + n + ".weight", (D, 1, cfg.conv_size), torch.float32)
    # Either storage of A_log is read (SGLang's _a_log_weight_loader takes [pad] or 4-D).
    a_log = [(cfg.a_log_pad,)] if cfg.a_log_pad else []
    a_log.append((1, 1, H, 1))
    _plain(t, a + "A_log", a_log[0], torch.float32, alt=a_log[1:])
    _plain(t, a + "dt_bias", (D,), torch.float32)
    _plain(t, a + "o_norm.weight", (cfg.kda_head_dim,), torch.float32)


def _mla(t: dict, a: str, cfg: ModelConfig) -> None:
    H, hid = cfg.mla_heads, cfg.hidden
    if cfg.q_lora is None:
        _fp8(t, a + "q_proj", H * (cfg.qk_nope + cfg.qk_rope), hid)
    else:
        _fp8(t, a + "q_a_proj", cfg.q_lora, hid)
        _plain(t, a + "q_a_layernorm.weight", (cfg.q_lora,))
        _fp8(t, a + "q_b_proj", H * (cfg.qk_nope + cfg.qk_rope), cfg.q_lora)
    _fp8(t, a + "kv_a_proj_with_mqa", cfg.kv_lora + cfg.qk_rope, hid)
    _plain(t, a + "kv_a_layernorm.weight", (cfg.kv_lora,))
    _fp8(t, a + "kv_b_proj", H * (cfg.qk_nope + cfg.v_head), cfg.kv_lora)
    if cfg.mla_out_gate:
        _fp8(t, a + "g_proj", H * cfg.v_head, hid)
    _fp8(t, a + "o_proj", hid, H * cfg.v_head)


def _moe(t: dict, m: str, cfg: ModelConfig) -> None:
    hid, W, I = cfg.hidden, cfg.expert_width, cfg.moe_inter
    _plain(t, m + "gate.weight", (cfg.experts, hid))
    _plain(t, m + "gate.e_score_correction_bias", (cfg.experts,), torch.float32)
    if cfg.moe_latent is not None:
        _plain(t, m + "routed_expert_down_proj.weight", (W, hid))
        _plain(t, m + "routed_expert_up_proj.weight", (hid, W))
        if cfg.latent_norm:
            _plain(t, m + "routed_expert_norm.weight", (W,))
    for e in range(cfg.experts):
        _fp4(t, f"{m}experts.{e}.w1", I, W)
        _fp4(t, f"{m}experts.{e}.w3", I, W)
        _fp4(t, f"{m}experts.{e}.w2", W, I)
    if cfg.shared_experts:
        si = cfg.shared_inter
        _plain(t, m + "shared_experts.gate_proj.weight", (si, hid))
        _plain(t, m + "shared_experts.up_proj.weight", (si, hid))
        _plain(t, m + "shared_experts.down_proj.weight", (hid, si))


def expected_tensors(cfg: ModelConfig) -> dict[str, TensorInfo]:
    """Every tensor of the checkpoint of `cfg` (TP1), by full name."""
    t: dict[str, TensorInfo] = {}
    hid = cfg.hidden
    _plain(t, PREFIX + "embed_tokens.weight", (cfg.vocab, hid))
    _plain(t, PREFIX + "norm.weight", (hid,))
    if not cfg.tie_embeddings:
        _plain(t, LM_HEAD, (cfg.vocab, hid))
    if cfg.attn_res_block is not None:
        _attn_res(t, PREFIX + "output_attn_res", hid)
    for i in range(cfg.layers):
        p = f"{PREFIX}layers.{i}."
        _plain(t, p + "input_layernorm.weight", (hid,))
        _plain(t, p + "post_attention_layernorm.weight", (hid,))
        if cfg.attn_res_block is not None:
            _attn_res(t, p + "self_attention_res", hid)
            _attn_res(t, p + "mlp_res", hid)
        (_kda if cfg.kind(i) == "kda" else _mla)(t, p + "self_attn.", cfg)
        if cfg.is_dense(i):
            m = p + "mlp."
            _plain(t, m + "gate_proj.weight", (cfg.dense_inter, hid))
            _plain(t, m + "up_proj.weight", (cfg.dense_inter, hid))
            _plain(t, m + "down_proj.weight", (hid, cfg.dense_inter))
        else:
            _moe(t, p + "block_sparse_moe.", cfg)
    return t


def quant_config(cfg: ModelConfig) -> dict:
    """hf_quant_config.json in ModelOpt's nested form (tokenspeed's modelopt_mixed test fixture,
    k3_facts 4): one FP8_PB_WO entry per attention module, one NVFP4 entry per layer's
    `block_sparse_moe.experts` (no per-expert entries), the BF16 modules excluded. The exact
    kv_cache_quant_algo of nvidia/Kimi-K3-NVFP4 was not found: null, as in the fixture."""
    layers, exclude = {}, ["language_model.lm_head"]
    for name, info in expected_tensors(cfg).items():
        if info.kind == "fp8_weight":
            layers[name[: -len(".weight")]] = {"quant_algo": "FP8_PB_WO"}
    for i in range(cfg.layers):
        p = f"{PREFIX}layers.{i}."
        if cfg.is_dense(i):
            exclude.append(p + "mlp")
            continue
        m = p + "block_sparse_moe."
        layers[m + "experts"] = {"quant_algo": "NVFP4", "group_size": NVFP4_BLOCK}
        exclude.append(m + "gate")
        if cfg.shared_experts:
            exclude.append(m + "shared_experts")
        if cfg.moe_latent is not None:
            exclude += [m + "routed_expert_down_proj", m + "routed_expert_up_proj"]
    return {"producer": {"name": "modelopt", "version": MODELOPT_VERSION},
            "quantization": {"quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": None,
                             "quantized_layers": layers, "exclude_modules": exclude}}


def config_json(cfg: ModelConfig) -> dict:
    """The HF config.json dict of `cfg` in the published field names (k3_facts 1; what
    k3gen/hf_config.py reads back into the same ModelConfig): kimi_k3 with the text backbone in
    `text_config`, or a top-level kimi_linear config."""
    lac = {"kda_layers": [i + 1 for i in cfg.kda_layer_ids], "full_attn_layers": list(cfg.mla_layers),
           "head_dim": cfg.kda_head_dim, "num_heads": cfg.kda_heads, "short_conv_kernel_size": cfg.conv_size,
           "use_full_rank_gate": cfg.kda_out_gate == "full"}
    if cfg.gate_lower_bound is not None:
        lac["gate_lower_bound"] = cfg.gate_lower_bound
    t = {"model_type": "kimi_linear", "_name_or_path": cfg.name, "num_hidden_layers": cfg.layers,
         "hidden_size": cfg.hidden, "vocab_size": cfg.vocab, "rms_norm_eps": cfg.eps,
         "tie_word_embeddings": cfg.tie_embeddings, "hidden_act": cfg.act, "linear_attn_config": lac,
         "num_attention_heads": cfg.mla_heads, "num_key_value_heads": cfg.mla_heads, "q_lora_rank": cfg.q_lora,
         "kv_lora_rank": cfg.kv_lora, "qk_nope_head_dim": cfg.qk_nope, "qk_rope_head_dim": cfg.qk_rope,
         "v_head_dim": cfg.v_head, "mla_use_nope": True, "mla_use_output_gate": cfg.mla_out_gate,
         "num_experts": cfg.experts, "num_experts_per_token": cfg.top_k, "num_shared_experts": cfg.shared_experts,
         "moe_intermediate_size": cfg.moe_inter, "intermediate_size": cfg.dense_inter,
         "moe_router_activation_func": "sigmoid", "topk_method": "noaux_tc", "use_grouped_topk": True,
         "num_expert_group": cfg.n_group, "topk_group": cfg.topk_group, "moe_renormalize": cfg.renormalize,
         "routed_scaling_factor": cfg.routed_scale, "dtype": "bfloat16"}
    dense = [k == "dense" for k in cfg.mlp_kinds]
    fk = dense.index(False) if False in dense else len(dense)
    if any(dense[fk:]):
        t["mlp_layer_types"] = ["dense" if d else "sparse" for d in dense]
    else:
        t.update(first_k_dense_replace=fk, moe_layer_freq=1)
    if cfg.act == "situ":
        t.update(activation_situ_beta=cfg.situ_beta, activation_situ_linear_beta=cfg.situ_linear_beta)
    if cfg.moe_latent is not None:
        t.update(routed_expert_hidden_size=cfg.moe_latent, latent_moe_use_norm=cfg.latent_norm)
    if cfg.attn_res_block is not None:
        t["attn_res_block_size"] = cfg.attn_res_block
    if cfg.family == "kimi_k3":
        if cfg.a_log_pad != 128:
            raise UnsupportedCheckpointError(f"a kimi_k3 config.json implies A_log padded to 128, "
                                             f"not {cfg.a_log_pad} (k3gen/hf_config.py)")
        return {"model_type": "kimi_k3", "architectures": ["KimiK3ForConditionalGeneration"],
                "tie_word_embeddings": cfg.tie_embeddings, "text_config": t}
    if cfg.a_log_pad is not None:
        raise UnsupportedCheckpointError(f"a kimi_linear config.json implies A_log [1, 1, H, 1], not padded to "
                                         f"{cfg.a_log_pad}")
    return {**t, "architectures": ["KimiLinearForCausalLM"]}


# -- quantizers used by the writer (k3gen's bit-level references) ---------------------------------
def quantize_fp8_pb(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP32 [N, K] -> (float8_e4m3fn codes, FP32 [N/128, K/128] tile multipliers amax/448).
    torch's float8 cast rounds to nearest even (the act_quant_fp8 reference relies on the same)."""
    n, k = w.shape
    nb, kb = _cdiv(n, BLOCK), _cdiv(k, BLOCK)
    t = torch.zeros(nb * BLOCK, kb * BLOCK)
    t[:n, :k] = w.float()
    t = t.view(nb, BLOCK, kb, BLOCK)
    s = torch.div(t.abs().amax(dim=(1, 3)), torch.full((nb, kb), 448.0))
    s = torch.where(s == 0, torch.ones_like(s), s)
    codes = torch.div(t, s[:, None, :, None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return codes.view(nb * BLOCK, kb * BLOCK)[:n, :k].contiguous(), s


# RNE decision points of E2M1 magnitudes (ties to the even code): a value counts past a strict
# threshold only above it, so those thresholds move up one FP32 ulp and bucketize counts <=.
_E2M1_BOUNDS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=torch.float32)
_E2M1_BOUNDS[0::2] = torch.nextafter(_E2M1_BOUNDS[0::2], torch.tensor(10.0))


def quantize_nvfp4_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FP32 [N, K] -> (packed uint8 [N, K/2], float8_e4m3fn [N, K/16], FP32 weight_scale_2 []):
    block scale = E4M3(amax / 6 / weight_scale_2), codes = E2M1(x / (scale * weight_scale_2)),
    both round-to-nearest-even (what reference.quant.nvfp4_quantize computes, vectorized for size)."""
    n, k = w.shape
    ws2 = (w.abs().amax().float() / (6.0 * 448.0)).clamp(min=2.0 ** -100)
    xb = w.float().reshape(n, k // NVFP4_BLOCK, NVFP4_BLOCK)
    sc = (xb.abs().amax(-1) / 6.0 / ws2).clamp(max=448.0).to(torch.float8_e4m3fn)
    d = sc.float() * ws2
    q = xb / torch.where(d == 0, torch.ones_like(d), d)[..., None]
    code = torch.bucketize(q.abs(), _E2M1_BOUNDS, right=True).to(torch.uint8)
    code = torch.where(d[..., None] == 0, torch.zeros_like(code), code | torch.where(q < 0, 8, 0).to(torch.uint8))
    code = code.reshape(n, k)
    return (code[:, 0::2] | (code[:, 1::2] << 4)).contiguous(), sc, ws2.reshape(())


# Independent decoders (ml_dtypes, not k3gen's quantizers) define what a loaded tensor must equal.
def decode_fp8_pb(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    import ml_dtypes
    v = codes.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    grid = scales.numpy().reshape(_cdiv(v.shape[0], BLOCK), _cdiv(v.shape[1], BLOCK))   # 4-D or 2-D storage
    s = np.repeat(np.repeat(grid, BLOCK, 0), BLOCK, 1)[: v.shape[0], : v.shape[1]]
    return torch.from_numpy(v * s)


def decode_nvfp4(packed: torch.Tensor, scales: torch.Tensor, ws2: torch.Tensor) -> torch.Tensor:
    import ml_dtypes
    p = packed.numpy()
    nib = np.stack([p & 0xF, p >> 4], -1).reshape(p.shape[0], -1).astype(np.uint8)
    v = nib.view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    s = scales.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    return torch.from_numpy(v * np.repeat(s, NVFP4_BLOCK, 1) * np.float32(ws2.item()))


# -- writer ----------------------------------------------------------------------------------------
def _random_plain(name: str, info: TensorInfo, cfg: ModelConfig, g: torch.Generator) -> torch.Tensor:
    shape = info.shape
    if name.endswith("A_log"):
        a = torch.zeros(shape)
        a.view(-1)[: cfg.kda_heads] = torch.log(torch.rand(cfg.kda_heads, generator=g) * 15 + 1)
        return a
    if name.endswith("dt_bias"):
        return torch.randn(shape, generator=g) * 0.5
    if name.endswith("e_score_correction_bias"):
        return torch.randn(shape, generator=g) * 0.1
    if "norm" in name.rsplit(".", 2)[-2] or name.endswith("norm.weight"):
        return (1.0 + torch.randn(shape, generator=g) * 0.1).to(info.dtype)
    if "conv1d" in name:
        return (torch.randn(shape, generator=g) * 0.5).to(info.dtype)
    if name.endswith("embed_tokens.weight"):
        return torch.randn(shape, generator=g).to(info.dtype)
    fan_in = shape[-1]
    return (torch.randn(shape, generator=g) * fan_in ** -0.5 * _init_gain(name)).to(info.dtype)


# A random model is only a meaningful test of numerics if it is not chaotic. With unit-gain
# projections every layer adds as much as the residual stream holds, so a 1e-3 relative
# difference in one GEMM (the wgmma FP8 accumulation) grows through FP8 activation re-quantization
# (a tiny input change flips E4M3 codes: sqrt(delta * ulp) ~ 1e-2) and MoE top-k flips into ~15%
# of the logits by layer 8, and unit-RMS logits over the vocabulary have top-2 margins of ~0.14
# (top-1 is then a coin toss). Trained models write small updates into the residual stream and
# have confident logits: the residual-writing projections get the 1/sqrt(2 * layers)-style gain of
# GPT-2's init. Top-1 agreement is scale-free, so the LM head also needs the shape of a trained
# one: a bigram part (row pi(t) = the embedding of token t, so the next-token logit of pi(current)
# stands out by a few logit RMS and p(top-1) is ~0.5, as in a trained LM on predictable text)
# plus a random part, with a gain giving logits of RMS ~4. The layers still move that margin: the
# residual stream carries the embedding plus 8 updates of ~1/4 of it.
RESIDUAL_GAIN = 0.25
LOGIT_GAIN = 4.0
BIGRAM = 0.15
# The latent's input projection `routed_expert_down_proj` reads the stream; it is no writer.
_RESIDUAL_WRITERS = (".o_proj.weight", "mlp.down_proj.weight", "shared_experts.down_proj.weight",
                     "routed_expert_up_proj.weight")
# AttnRes pseudo-queries: sharp mixes make some tokens' inputs mostly one small layer output (the
# embedding's share drops) and the router's top-k then flips on rounding noise. Measured on tiny
# (CPU): at unit gain 1% noise on the MLA outputs moved the logits by 9%, at 0.5 by 0.7%. On the
# H200 (small, kernel vs reference path, teacher-forced, 2026-12-02): gain 0.5 top-1 0.88-0.91 and
# KL 0.11-0.12; gain 0.1 top-1 0.97-0.98 and KL 0.025-0.028. (The CPU speculative == greedy failure
# once seen at 0.1 was a router flip on the reference path's row-dependent FP32 GEMMs, gone since
# RefOps multiplies in FP64: model/ops.py.)
QUERY_GAIN = 0.1


def _init_gain(name: str) -> float:
    if name.endswith("_res_proj.weight"):
        return QUERY_GAIN
    return RESIDUAL_GAIN if name.endswith(_RESIDUAL_WRITERS) else 1.0


def _short_cycles(v: int, g: torch.Generator) -> torch.Tensor:
    """A random permutation of range(v) made of cycles of 3 to 8 tokens."""
    order = torch.randperm(v, generator=g).tolist()
    perm, i = list(range(v)), 0
    while i < v:
        n = min(int(torch.randint(3, 9, (1,), generator=g)), v - i)
        cyc = order[i:i + n]
        for a, b in zip(cyc, cyc[1:] + cyc[:1]):
            perm[a] = b
        i += n
    return torch.tensor(perm)


def _random_lm_head(embed: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """[vocab, hidden] BF16: LOGIT_GAIN * (BIGRAM * embed[pi^-1] + N(0, 1)) / sqrt(hidden), so that
    the bigram favours next(t) = pi(t). pi is made of short cycles (3 to 8 tokens): greedy walks of
    a trained LM on repetitive text fall into loops that the n-gram drafter predicts, and the
    speculative tests need drafts accepted; a uniform random pi has cycles of ~vocab/2 tokens."""
    v, hid = embed.shape
    perm = _short_cycles(v, g)
    w = torch.empty(v, hid)
    w[perm] = embed.float() * BIGRAM
    w += torch.randn(v, hid, generator=g)
    return (w * LOGIT_GAIN * hid ** -0.5).to(embed.dtype).contiguous()


def random_nvfp4_codes(n: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A random NVFP4 weight drawn in the stored format itself: uniform E2M1 code bytes, E4M3
    block scales in [0.5, 1.5), weight_scale_2 giving an RMS of about k^-0.5 (uniform codes have
    an RMS of sqrt(68.5 / 8)). The same tensors as `quantize_nvfp4_weight` returns, without
    quantizing a float matrix first: the experts are the bulk of a checkpoint and the quantizer
    costs seconds per layer on a CI CPU."""
    packed = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.int32).to(torch.uint8)
    sc = (0.5 + torch.rand(n, k // NVFP4_BLOCK, generator=g)).to(torch.float8_e4m3fn)
    ws2 = torch.tensor(k ** -0.5 / math.sqrt(68.5 / 8), dtype=torch.float32)
    return packed, sc, ws2


def random_tensors(cfg: ModelConfig, seed: int = 0, truth: bool = True, fp4: str = "quantize"):
    """(stored tensors by name, FP32 values every quantized weight must load as: decoded
    independently with ml_dtypes; empty with truth=False). fp4="quantize" quantizes Gaussian
    expert weights (`quantize_nvfp4_weight`), fp4="codes" draws them in the stored format."""
    if fp4 not in ("quantize", "codes"):
        raise ValueError(f"fp4={fp4!r}: 'quantize' or 'codes'")
    g = torch.Generator().manual_seed(seed)
    info = expected_tensors(cfg)
    stored, truth_d = {}, {}
    for name, ti in info.items():
        if name == LM_HEAD:
            stored[name] = _random_lm_head(stored[PREFIX + "embed_tokens.weight"], g)
        elif ti.kind == "plain":
            stored[name] = _random_plain(name, ti, cfg, g).contiguous()
        elif ti.kind == "fp8_weight":
            base = name[: -len(".weight")]
            w = torch.randn(ti.shape, generator=g) * ti.shape[1] ** -0.5 * _init_gain(name)
            stored[name], sc = quantize_fp8_pb(w)
            stored[base + ".weight_scale"] = sc.reshape(info[base + ".weight_scale"].shape)
            if truth:
                truth_d[base] = decode_fp8_pb(stored[name], stored[base + ".weight_scale"])
        elif ti.kind == "fp4_weight":
            base = name[: -len(".weight")]
            n, k = ti.shape[0], ti.shape[1] * 2
            if fp4 == "codes":
                p, s, s2 = random_nvfp4_codes(n, k, g)
            else:
                p, s, s2 = quantize_nvfp4_weight(torch.randn(n, k, generator=g) * k ** -0.5)
            stored[name], stored[base + ".weight_scale"], stored[base + ".weight_scale_2"] = p, s, s2
            stored[base + ".input_scale"] = torch.tensor(1.0)       # the card: input_scale=1.0
            if truth:
                truth_d[base] = decode_nvfp4(p, s, s2)
    return stored, truth_d


def write_checkpoint(tensors: dict[str, torch.Tensor], out: Path, cfg: ModelConfig,
                     shard_bytes: int = 64 << 20) -> Path:
    """Write `tensors` as safetensors shards of about `shard_bytes` + the index json +
    config.json (`config_json`) + hf_quant_config.json (`quant_config`)."""
    from safetensors.torch import save_file
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        t = tensors[name]
        nb = t.numel() * t.element_size()
        if shards[-1] and size + nb > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nb
    weight_map, total = {}, 0
    for i, sh in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(sh, str(out / fname), metadata={"format": "pt"})
        for name, t in sh.items():
            weight_map[name] = fname
            total += t.numel() * t.element_size()
    (out / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                        indent=1, sort_keys=True))
    (out / "config.json").write_text(json.dumps(config_json(cfg), indent=1, sort_keys=True))
    (out / QUANT_CONFIG).write_text(json.dumps(quant_config(cfg), indent=1, sort_keys=True))
    return out


def write_random_checkpoint(cfg: ModelConfig, out: Path, seed: int = 0, shard_bytes: int = 64 << 20,
                            truth: bool = False, fp4: str = "quantize"):
    """A random checkpoint of `cfg`; returns (folder, FP32 truth of every quantized weight or {})."""
    stored, truth = random_tensors(cfg, seed, truth, fp4)
    return write_checkpoint(stored, out, cfg, shard_bytes), truth


def total_params(cfg: ModelConfig) -> int:
    return sum(math.prod(i.shape) * (2 if i.kind == "fp4_weight" else 1)
               for i in expected_tensors(cfg).values() if i.kind in ("plain", "fp8_weight", "fp4_weight"))
