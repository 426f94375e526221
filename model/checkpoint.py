"""The K3 NVFP4 checkpoint format: tensor names and shapes, typed errors, and a writer of small
random checkpoints in exactly that format (safetensors shards + `model.safetensors.index.json`).

Format (names below `language_model.model.`; layer numbers 0-based as in HF checkpoints):
- FP8 "FP8_PB_WO" projections: `<name>.weight` float8_e4m3fn [N, K] and `<name>.weight_scale`
  FP32 [ceil(N/128), ceil(K/128)], the dequantization multiplier of each 128x128 tile.
  KDA: q_proj, k_proj, v_proj, g_proj (D x hidden), f_a_proj (128 x hidden), b_proj (H x hidden),
  o_proj (hidden x D). MLA: q_a_proj, q_b_proj (per head [nope 128 | rope 64] rows),
  kv_a_proj_with_mqa ([c_kv 512 | k_pe 64] rows), kv_b_proj (per head [k_nope 128 | v 128] rows:
  k3gen's stated choice, SPEC.md section 4), g_proj, o_proj.
- NVFP4 routed experts `block_sparse_moe.experts.E.w{1,3}` [inter, latent] and `w2` [latent, inter]:
  `weight` uint8 [N, K/2] (E2M1 pairs, even element low), `weight_scale` float8_e4m3fn [N, K/16],
  `weight_scale_2` FP32 [] (ModelOpt convention: x = e2m1 * e4m3(scale) * weight_scale_2).
- BF16: conv taps `{q,k,v}_conv1d.weight` [D, 1, 4], `f_b_proj.weight` [D, 128], norms, router
  `block_sparse_moe.gate.weight`, the latent projections, shared experts, the dense MLP,
  embeddings and `lm_head` (outside `model.`). FP32: `A_log` [a_log_pad] (the first H real),
  `dt_bias` [D], `gate.e_score_correction_bias` [E].
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
BLOCK = 128
NVFP4_BLOCK = 16


class CheckpointError(K3genError):
    """The checkpoint cannot be loaded: names the tensor and what is wrong with it."""


class MissingTensorError(CheckpointError, KeyError):
    def __str__(self) -> str:  # KeyError would quote the message
        return self.args[0]


class TensorShapeError(CheckpointError, ValueError):
    pass


class BadValueError(CheckpointError, ValueError):
    """NaN/Inf values, or a scale that is not positive."""


# -- names and shapes ------------------------------------------------------------------------------
@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]
    dtype: torch.dtype
    kind: str          # "fp8_weight", "fp8_scale", "fp4_weight", "fp4_scale", "fp4_global", "plain"


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _fp8(out: dict, name: str, n: int, k: int) -> None:
    out[f"{name}.weight"] = TensorInfo((n, k), torch.float8_e4m3fn, "fp8_weight")
    out[f"{name}.weight_scale"] = TensorInfo((_cdiv(n, BLOCK), _cdiv(k, BLOCK)), torch.float32, "fp8_scale")


def _fp4(out: dict, name: str, n: int, k: int) -> None:
    out[f"{name}.weight"] = TensorInfo((n, k // 2), torch.uint8, "fp4_weight")
    out[f"{name}.weight_scale"] = TensorInfo((n, k // NVFP4_BLOCK), torch.float8_e4m3fn, "fp4_scale")
    out[f"{name}.weight_scale_2"] = TensorInfo((), torch.float32, "fp4_global")


def _plain(out: dict, name: str, shape, dtype=torch.bfloat16) -> None:
    out[name] = TensorInfo(tuple(shape), dtype, "plain")


def expected_tensors(cfg: ModelConfig) -> dict[str, TensorInfo]:
    """Every tensor of the checkpoint of `cfg` (TP1), by full name."""
    t: dict[str, TensorInfo] = {}
    hid = cfg.hidden
    _plain(t, PREFIX + "embed_tokens.weight", (cfg.vocab, hid))
    _plain(t, PREFIX + "norm.weight", (hid,))
    _plain(t, LM_HEAD, (cfg.vocab, hid))
    for i in range(cfg.layers):
        p = f"{PREFIX}layers.{i}."
        _plain(t, p + "input_layernorm.weight", (hid,))
        _plain(t, p + "post_attention_layernorm.weight", (hid,))
        a = p + "self_attn."
        if cfg.kind(i) == "kda":
            H = cfg.kda_heads
            D = H * 128
            for n in ("q_proj", "k_proj", "v_proj", "g_proj"):
                _fp8(t, a + n, D, hid)
            _fp8(t, a + "f_a_proj", 128, hid)
            _fp8(t, a + "b_proj", H, hid)
            _fp8(t, a + "o_proj", hid, D)
            _plain(t, a + "f_b_proj.weight", (D, 128))
            for n in ("q_conv1d", "k_conv1d", "v_conv1d"):
                _plain(t, a + n + ".weight", (D, 1, 4))
            _plain(t, a + "A_log", (cfg.a_log_pad,) if cfg.a_log_pad else (1, 1, H, 1), torch.float32)
            _plain(t, a + "dt_bias", (D,), torch.float32)
            _plain(t, a + "o_norm.weight", (128,))
        else:
            H = cfg.mla_heads
            _fp8(t, a + "q_a_proj", cfg.q_lora, hid)
            _plain(t, a + "q_a_layernorm.weight", (cfg.q_lora,))
            _fp8(t, a + "q_b_proj", H * (cfg.qk_nope + cfg.qk_rope), cfg.q_lora)
            _fp8(t, a + "kv_a_proj_with_mqa", cfg.kv_lora + cfg.qk_rope, hid)
            _plain(t, a + "kv_a_layernorm.weight", (cfg.kv_lora,))
            _fp8(t, a + "kv_b_proj", H * (cfg.qk_nope + cfg.v_head), cfg.kv_lora)
            _fp8(t, a + "g_proj", H * cfg.v_head, hid)
            _fp8(t, a + "o_proj", hid, H * cfg.v_head)
        if cfg.is_dense(i):
            m = p + "mlp."
            _plain(t, m + "gate_proj.weight", (cfg.dense_inter, hid))
            _plain(t, m + "up_proj.weight", (cfg.dense_inter, hid))
            _plain(t, m + "down_proj.weight", (hid, cfg.dense_inter))
            continue
        m = p + "block_sparse_moe."
        _plain(t, m + "gate.weight", (cfg.experts, hid))
        _plain(t, m + "gate.e_score_correction_bias", (cfg.experts,), torch.float32)
        _plain(t, m + "latent_down.weight", (cfg.moe_latent, hid))
        _plain(t, m + "latent_up.weight", (hid, cfg.moe_latent))
        for e in range(cfg.experts):
            _fp4(t, f"{m}experts.{e}.w1", cfg.moe_inter, cfg.moe_latent)
            _fp4(t, f"{m}experts.{e}.w3", cfg.moe_inter, cfg.moe_latent)
            _fp4(t, f"{m}experts.{e}.w2", cfg.moe_latent, cfg.moe_inter)
        si = cfg.shared_inter * cfg.shared_experts
        _plain(t, m + "shared_experts.gate_proj.weight", (si, hid))
        _plain(t, m + "shared_experts.up_proj.weight", (si, hid))
        _plain(t, m + "shared_experts.down_proj.weight", (hid, si))
    return t


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
    s = np.repeat(np.repeat(scales.numpy(), BLOCK, 0), BLOCK, 1)[: v.shape[0], : v.shape[1]]
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
        a[: cfg.kda_heads] = torch.log(torch.rand(cfg.kda_heads, generator=g) * 15 + 1)
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
_RESIDUAL_WRITERS = ("o_proj.weight", "down_proj.weight", "latent_up.weight")


def _init_gain(name: str) -> float:
    return RESIDUAL_GAIN if name.endswith(_RESIDUAL_WRITERS) else 1.0


def _random_lm_head(embed: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """[vocab, hidden] BF16: LOGIT_GAIN * (BIGRAM * embed[pi^-1] + N(0, 1)) / sqrt(hidden)."""
    v, hid = embed.shape
    perm = torch.randperm(v, generator=g)
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
            stored[name], stored[base + ".weight_scale"] = quantize_fp8_pb(w)
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
            if truth:
                truth_d[base] = decode_nvfp4(p, s, s2)
    return stored, truth_d


def write_checkpoint(tensors: dict[str, torch.Tensor], out: Path, cfg: ModelConfig,
                     shard_bytes: int = 64 << 20) -> Path:
    """Write `tensors` as safetensors shards of about `shard_bytes` + the index json + config."""
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
    (out / "hf_quant_config.json").write_text(json.dumps({"quantization": {
        "quant_algo": "MIXED_PRECISION", "attention": "FP8_PB_WO", "experts": "NVFP4",
        "group_size": NVFP4_BLOCK, "fp8_block": [BLOCK, BLOCK]}}, indent=1, sort_keys=True))
    return out


def config_json(cfg: ModelConfig) -> dict:
    import dataclasses
    d = dataclasses.asdict(cfg)
    return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}


def write_random_checkpoint(cfg: ModelConfig, out: Path, seed: int = 0, shard_bytes: int = 64 << 20,
                            truth: bool = False, fp4: str = "quantize"):
    """A random checkpoint of `cfg`; returns (folder, FP32 truth of every quantized weight or {})."""
    stored, truth = random_tensors(cfg, seed, truth, fp4)
    return write_checkpoint(stored, out, cfg, shard_bytes), truth


def total_params(cfg: ModelConfig) -> int:
    return sum(math.prod(i.shape) * (2 if i.kind == "fp4_weight" else 1)
               for i in expected_tensors(cfg).values() if i.kind in ("plain", "fp8_weight", "fp4_weight"))
