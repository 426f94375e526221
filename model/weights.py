"""Loading a K3 NVFP4 checkpoint (model/checkpoint.py's format) into the formats the layers and
kernels take, with the conversions the target needs:

- `[q | k | v | g_out]` of a KDA layer fused into one FP8 block weight (each part is D = H*128
  rows, so the 128x128 tile scales concatenate exactly); `[f_a | b]` likewise (zero rows pad N to
  a multiple of 16 for the GEMM's 16-byte output rows).
- The MLA A-projection `[q_a 1536 | kv_a 576 (+64 zero rows) | g H*128]`: kv_a is padded to 640
  rows so that g starts on a tile boundary and every stored tile scale is kept as is.
- `kv_b` dequantized to BF16 and split per head into W_UK (rows 0..127) and W_UV (128..255).
- UE8M0 recipe: every FP8 weight re-quantized with power-of-two tile scales (SPEC.md section 6).
- NVFP4 experts dequantized to BF16 for the PyTorch expert path (`*_dequant` names say so).
- `A_log` narrowed to the first H entries of its padded storage.

TP1 only (the small configs and the CPU tests); TP slicing is not written yet.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from k3gen.ir.dtypes import ScaleRecipe
from k3gen import numerics as Q
from k3gen.ops.fp8_block_gemm.reference import dequantize_weights, quantize_weights
from k3gen.ops.kda_decode.reference import KdaWeights
# The fused projections' row layouts are the enumerator's (its GEMM shapes): one source.
from k3gen.targets import KDA_FAB_ALIGN, MLA_A_PAD as KV_A_PAD

from model.checkpoint import (INDEX, LM_HEAD, PREFIX, BadValueError, CheckpointError, MissingTensorError,
                         TensorShapeError, expected_tensors)
from model.config import ModelConfig


# -- reading with checks ---------------------------------------------------------------------------
class CheckpointReader:
    def __init__(self, folder: Path, cfg: ModelConfig):
        from safetensors import safe_open
        self.folder, self.cfg = Path(folder), cfg
        idx = self.folder / INDEX
        if not idx.is_file():
            raise CheckpointError(f"{idx}: no safetensors index (expected {INDEX})")
        try:
            self.weight_map: dict[str, str] = json.loads(idx.read_text())["weight_map"]
        except (ValueError, KeyError) as e:
            raise CheckpointError(f"{idx}: not a safetensors index ({e})") from e
        self.expected = expected_tensors(cfg)
        self._files: dict[str, object] = {}
        self._open = safe_open

    def _file(self, shard: str):
        if shard not in self._files:
            p = self.folder / shard
            if not p.is_file():
                raise CheckpointError(f"shard {shard} named by {INDEX} is missing")
            self._files[shard] = self._open(str(p), framework="pt")
        return self._files[shard]

    def get(self, name: str) -> torch.Tensor:
        info = self.expected.get(name)
        if name not in self.weight_map:
            raise MissingTensorError(f"tensor {name!r} is missing from the checkpoint")
        f = self._file(self.weight_map[name])
        if name not in f.keys():
            raise MissingTensorError(f"tensor {name!r} is not in shard {self.weight_map[name]}")
        t = f.get_tensor(name)
        if info is not None:
            if tuple(t.shape) != info.shape:
                raise TensorShapeError(f"tensor {name!r} has shape {tuple(t.shape)}, expected {info.shape}")
            if t.dtype != info.dtype:
                raise TensorShapeError(f"tensor {name!r} has dtype {t.dtype}, expected {info.dtype}")
            _check_values(name, t, info.kind)
        return t


def _check_values(name: str, t: torch.Tensor, kind: str) -> None:
    if kind == "fp8_weight":
        if ((t.view(torch.uint8) & 0x7F) == 0x7F).any():
            raise BadValueError(f"tensor {name!r} holds E4M3 NaN codes")
    elif kind in ("fp8_scale", "fp4_global"):
        if not torch.isfinite(t).all():
            raise BadValueError(f"scale {name!r} holds NaN/Inf")
        if (t <= 0).any():
            raise BadValueError(f"scale {name!r} holds a non-positive value ({float(t.min())})")
    elif kind == "fp4_scale":
        b = t.view(torch.uint8)
        if ((b & 0x7F) == 0x7F).any():
            raise BadValueError(f"scale {name!r} holds E4M3 NaN codes")
        # Zero is a legal block scale (an all-zero block); a negative one is not.
        if ((b & 0x80) != 0).any():
            raise BadValueError(f"scale {name!r} holds a non-positive (negative) value")
    elif t.is_floating_point() and not torch.isfinite(t.float()).all():
        raise BadValueError(f"tensor {name!r} holds NaN/Inf")


# -- kernel formats --------------------------------------------------------------------------------
@dataclass
class Fp8Linear:
    """An FP8 block-scaled weight in fp8_block_gemm's layout: codes uint8 [N, K], tile scales
    [ceil(N/128), ceil(K/128)] (FP32 values, or UE8M0 bytes for that recipe)."""
    codes: torch.Tensor
    scales: torch.Tensor
    recipe: ScaleRecipe
    _dequant: torch.Tensor | None = field(default=None, repr=False)

    @property
    def n(self) -> int:
        return self.codes.shape[0]

    @property
    def k(self) -> int:
        return self.codes.shape[1]

    def dequant(self) -> torch.Tensor:
        """FP32 values [N, K], computed once (the reference path multiplies with it)."""
        if self._dequant is None:
            self._dequant = dequantize_weights(self.codes, self.scales, self.recipe)
        return self._dequant

    def to(self, device) -> "Fp8Linear":
        return Fp8Linear(self.codes.to(device), self.scales.to(device), self.recipe,
                         None if self._dequant is None else self._dequant.to(device))


def _fp8_parts(r: CheckpointReader, names: list[str], recipe: ScaleRecipe, pad_rows: dict | None = None,
               pad_to: int = 1) -> Fp8Linear:
    """Concatenate FP8 weights along N (each part a whole number of 128-row tiles, or padded to
    `pad_rows[name]` rows with zeros); UE8M0 re-quantizes each part with power-of-two scales."""
    codes, scales = [], []
    for i, n in enumerate(names):
        c = r.get(n + ".weight").view(torch.uint8)
        s = r.get(n + ".weight_scale")
        rows = (pad_rows or {}).get(n, c.shape[0])
        last = i == len(names) - 1
        if rows % 128 and not last:
            raise CheckpointError(f"{n}: {rows} rows cannot be fused before another part (tile scales)")
        if recipe is ScaleRecipe.UE8M0:
            c, s = quantize_weights(dequantize_weights(c, s, ScaleRecipe.FP32), ScaleRecipe.UE8M0)
        if rows > c.shape[0]:
            c = torch.cat([c, torch.zeros(rows - c.shape[0], c.shape[1], dtype=c.dtype)])
        codes.append(c)
        scales.append(s)
    c, s = torch.cat(codes), torch.cat(scales)
    n = c.shape[0]
    if n % pad_to:
        c = torch.cat([c, torch.zeros(pad_to - n % pad_to, c.shape[1], dtype=c.dtype)])
        need = -(-c.shape[0] // 128)
        if need > s.shape[0]:  # the padding opened a new row tile: any finite scale serves zeros
            s = torch.cat([s, s[-1:].clone()])
    return Fp8Linear(c.contiguous(), s.contiguous(), recipe)


def _fp8(r, name, recipe) -> Fp8Linear:
    return _fp8_parts(r, [name], recipe)


_E2M1_PAIRS = torch.stack([Q.e2m1_decode(torch.arange(256, dtype=torch.uint8) & 0xF),
                           Q.e2m1_decode(torch.arange(256, dtype=torch.uint8) >> 4)], dim=-1)   # [256, 2]


def _nvfp4_dequant(r: CheckpointReader, name: str) -> torch.Tensor:
    """FP32 values of an NVFP4 weight: e2m1 * e4m3(scale) * weight_scale_2 (a byte -> pair table
    and torch's float8 decode: the expert tensors are the bulk of a checkpoint)."""
    p, s, s2 = r.get(name + ".weight"), r.get(name + ".weight_scale"), r.get(name + ".weight_scale_2")
    v = _E2M1_PAIRS[p.int()].reshape(p.shape[0], -1)
    d = s.float()
    return (v.reshape(*d.shape, -1) * d[..., None]).flatten(-2) * s2.float()


@dataclass
class KdaLayerWeights:
    qkvg: Fp8Linear
    fab: Fp8Linear            # [f_a 128 | b H | zero pad]
    o_proj: Fp8Linear
    kda: KdaWeights           # conv_w, fb_w, dt_bias, a_log, norm_w in the kernels' formats


@dataclass
class MlaLayerWeights:
    a_proj: Fp8Linear         # [q_a 1536 | kv_a 576 + 64 zero | g H*128]
    q_a_norm: torch.Tensor    # [1536] BF16
    q_b: Fp8Linear
    kv_a_norm: torch.Tensor   # [512] BF16
    w_uk: torch.Tensor        # [H, 128, 512] BF16
    w_uv: torch.Tensor        # [H, 128, 512] BF16
    o_proj: Fp8Linear


@dataclass
class MoeWeights:
    router: torch.Tensor      # [E, hidden] FP32 (BF16 values)
    bias: torch.Tensor        # [E] FP32 correction bias (selection only)
    latent_down: torch.Tensor  # [latent, hidden] BF16
    latent_up: torch.Tensor    # [hidden, latent] BF16
    w1_dequant: torch.Tensor   # [E, inter, latent] BF16, dequantized from NVFP4
    w3_dequant: torch.Tensor
    w2_dequant: torch.Tensor   # [E, latent, inter]
    shared_gate: torch.Tensor  # [S*inter, hidden] BF16
    shared_up: torch.Tensor
    shared_down: torch.Tensor


@dataclass
class DenseMlpWeights:
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    attn: KdaLayerWeights | MlaLayerWeights
    ffn: MoeWeights | DenseMlpWeights


@dataclass
class ModelWeights:
    cfg: ModelConfig
    recipe: ScaleRecipe
    embed: torch.Tensor
    final_norm: torch.Tensor
    lm_head: torch.Tensor
    layers: list[LayerWeights]

    def to(self, device) -> "ModelWeights":
        return _map_tensors(self, lambda t: t.to(device))


def _map_tensors(obj, fn):
    import dataclasses
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, Fp8Linear):
        return obj.to(fn(torch.empty(0)).device)
    if isinstance(obj, KdaWeights):
        return KdaWeights(*(fn(t) for t in (obj.conv_w, obj.fb_w, obj.dt_bias, obj.a_log, obj.norm_w)))
    if isinstance(obj, list):
        return [_map_tensors(x, fn) for x in obj]
    if dataclasses.is_dataclass(obj):
        return type(obj)(**{f.name: _map_tensors(getattr(obj, f.name), fn) for f in dataclasses.fields(obj)
                            if f.init})
    return obj


def load_weights(folder, cfg: ModelConfig, recipe: ScaleRecipe = ScaleRecipe.FP32) -> ModelWeights:
    """Read and convert every tensor of `cfg` (CPU tensors; `.to(device)` moves them)."""
    r = CheckpointReader(Path(folder), cfg)
    bf = torch.bfloat16
    layers = []
    for i in range(cfg.layers):
        p = f"{PREFIX}layers.{i}."
        a = p + "self_attn."
        if cfg.kind(i) == "kda":
            H = cfg.kda_heads
            D = H * 128
            conv = torch.cat([r.get(a + n + ".weight").reshape(D, 4) for n in ("q_conv1d", "k_conv1d", "v_conv1d")])
            kda = KdaWeights(conv_w=conv.to(bf).contiguous(), fb_w=r.get(a + "f_b_proj.weight").to(bf).contiguous(),
                             dt_bias=r.get(a + "dt_bias").float().contiguous(),
                             a_log=r.get(a + "A_log").float()[:H].contiguous(),
                             norm_w=r.get(a + "o_norm.weight").float().contiguous())
            attn = KdaLayerWeights(
                qkvg=_fp8_parts(r, [a + n for n in ("q_proj", "k_proj", "v_proj", "g_proj")], recipe),
                fab=_fp8_parts(r, [a + "f_a_proj", a + "b_proj"], recipe, pad_to=KDA_FAB_ALIGN),
                o_proj=_fp8(r, a + "o_proj", recipe), kda=kda)
        else:
            H = cfg.mla_heads
            kvb = dequantize_weights(r.get(a + "kv_b_proj.weight").view(torch.uint8),
                                     r.get(a + "kv_b_proj.weight_scale"), ScaleRecipe.FP32).to(bf)
            kvb = kvb.view(H, cfg.qk_nope + cfg.v_head, cfg.kv_lora)
            attn = MlaLayerWeights(
                a_proj=_fp8_parts(r, [a + "q_a_proj", a + "kv_a_proj_with_mqa", a + "g_proj"], recipe,
                                  pad_rows={a + "kv_a_proj_with_mqa": KV_A_PAD}),
                q_a_norm=r.get(a + "q_a_layernorm.weight").to(bf), q_b=_fp8(r, a + "q_b_proj", recipe),
                kv_a_norm=r.get(a + "kv_a_layernorm.weight").to(bf),
                w_uk=kvb[:, :cfg.qk_nope].contiguous(), w_uv=kvb[:, cfg.qk_nope:].contiguous(),
                o_proj=_fp8(r, a + "o_proj", recipe))
        if cfg.is_dense(i):
            m = p + "mlp."
            ffn = DenseMlpWeights(*(r.get(m + n + ".weight") for n in ("gate_proj", "up_proj", "down_proj")))
        else:
            m = p + "block_sparse_moe."
            ex = [f"{m}experts.{e}." for e in range(cfg.experts)]
            ffn = MoeWeights(
                router=r.get(m + "gate.weight").float(), bias=r.get(m + "gate.e_score_correction_bias").float(),
                latent_down=r.get(m + "latent_down.weight"), latent_up=r.get(m + "latent_up.weight"),
                w1_dequant=torch.stack([_nvfp4_dequant(r, e + "w1").to(bf) for e in ex]),
                w3_dequant=torch.stack([_nvfp4_dequant(r, e + "w3").to(bf) for e in ex]),
                w2_dequant=torch.stack([_nvfp4_dequant(r, e + "w2").to(bf) for e in ex]),
                shared_gate=r.get(m + "shared_experts.gate_proj.weight"),
                shared_up=r.get(m + "shared_experts.up_proj.weight"),
                shared_down=r.get(m + "shared_experts.down_proj.weight"))
        layers.append(LayerWeights(input_norm=r.get(p + "input_layernorm.weight"),
                                   post_norm=r.get(p + "post_attention_layernorm.weight"), attn=attn, ffn=ffn))
    return ModelWeights(cfg=cfg, recipe=recipe, embed=r.get(PREFIX + "embed_tokens.weight"),
                        final_norm=r.get(PREFIX + "norm.weight"), lm_head=r.get(LM_HEAD), layers=layers)
