"""K3Model's weights in the formats the layers and kernels take (`ModelWeights`: fused FP8 block
projections, packed routed experts, FP32 Attention Residuals), and the checked reader of the
ModelOpt NVFP4 layout (model/checkpoint.py's format: nvidia/Kimi-K3-NVFP4 with the published names).

Every layout is converted by one assembly, model/formats/assemble.py (fusions, paddings, the
recipe's FP8 re-quantization, Kimi-Linear's variants, TP slices, streaming to the device);
model/formats/detect.py `load_model_weights` picks the layout of a folder. `load_weights` below is
the ModelOpt entry point that the older callers use (TP1, CPU).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from k3gen.ir.dtypes import ScaleRecipe
from k3gen.ops.fp8_block_gemm.reference import dequantize_weights
from k3gen.ops.kda_decode.reference import KdaWeights
# The fused projections' row layouts are the enumerator's (its GEMM shapes): one source.
from k3gen.targets import MLA_A_PAD as KV_A_PAD  # noqa: F401  (the MLA A-projection's kv_a rows)

from model.arch import AttnResWeights
from model.checkpoint import (open_shard, INDEX, QUANT_CONFIG, BadValueError, CheckpointError, MissingTensorError,
                              TensorShapeError, UnexpectedTensorError, UnsupportedCheckpointError, expected_tensors)
from model.config import ModelConfig


# -- reading with checks ---------------------------------------------------------------------------
class CheckpointReader:
    def __init__(self, folder: Path, cfg: ModelConfig, opener=None):
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
        self._open = opener or safe_open

    def _file(self, shard: str):
        return open_shard(self.folder, shard, self._files, self._open)

    def close(self, shard: str) -> None:
        f = self._files.pop(shard, None)
        if f is not None and hasattr(f, "__exit__"):
            f.__exit__(None, None, None)

    def get(self, name: str) -> torch.Tensor:
        info = self.expected.get(name)
        if name not in self.weight_map:
            raise MissingTensorError(f"tensor {name!r} is missing from the checkpoint")
        f = self._file(self.weight_map[name])
        if name not in f.keys():
            raise MissingTensorError(f"tensor {name!r} is not in shard {self.weight_map[name]}")
        t = f.get_tensor(name)
        if info is not None:
            if not info.shape_ok(t.shape):
                want = " or ".join(str(x) for x in (info.shape, *info.alt))
                raise TensorShapeError(f"tensor {name!r} has shape {tuple(t.shape)}, expected {want}")
            if t.dtype != info.dtype:
                raise TensorShapeError(f"tensor {name!r} has dtype {t.dtype}, expected {info.dtype}")
            _check_values(name, t, info.kind)
        return t


    def check_names(self) -> None:
        """Every language-model tensor of the checkpoint is one `cfg` describes. Names outside
        `language_model.` (K3's vision_tower, mm_projector) are not this runtime's and are skipped."""
        extra = sorted(n for n in self.weight_map if n.startswith("language_model.") and n not in self.expected)
        if extra:
            more = f" (and {len(extra) - 5} more)" if len(extra) > 5 else ""
            raise UnexpectedTensorError(f"{len(extra)} tensors the config does not describe: "
                                        f"{', '.join(map(repr, extra[:5]))}{more}")

    def check_quant_config(self) -> None:
        """When hf_quant_config.json is present: ModelOpt MIXED_PRECISION with NVFP4 (group 16)
        experts and FP8_PB_WO attention, the only recipe this reader decodes."""
        p = self.folder / QUANT_CONFIG
        if not p.is_file():
            return
        try:
            q = json.loads(p.read_text())["quantization"]
            algo, layers = q["quant_algo"], q.get("quantized_layers", {})
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{p}: not ModelOpt's nested hf_quant_config ({e})") from e
        if algo != "MIXED_PRECISION":
            raise UnsupportedCheckpointError(f"{QUANT_CONFIG}: quant_algo {algo!r}, expected MIXED_PRECISION")
        for mod, spec in layers.items():
            want = {"quant_algo": "NVFP4", "group_size": 16} if mod.endswith(".experts") else {"quant_algo": "FP8_PB_WO"}
            if {k: spec.get(k) for k in want} != want:
                raise UnsupportedCheckpointError(f"{QUANT_CONFIG}: {mod!r} is {spec}, this reader decodes {want}")


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


def _grid(scale: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """The [ceil(N/128), ceil(K/128)] tile grid of a scale stored 4-D [nb, 1, kb, 1] (ModelOpt,
    tokenspeed modelopt_block_scale_to_2d) or 2-D (the reader's shape check admits only these)."""
    return scale.reshape(-(-codes.shape[0] // 128), -(-codes.shape[1] // 128))


def _e2m1_values(packed: torch.Tensor) -> torch.Tensor:
    """FP32 [..., 2K] from uint8 [..., K] E2M1 pairs (even element in the low nibble). Pure
    elementwise arithmetic on the codes' own device (no lookup table to move): graph-safe.
    Magnitude of code m (bits 0-2): m/2 for m < 2, else 2^(m//2 - 1) * (1 + (m & 1)/2); bit 3 the sign."""
    c = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2).to(torch.int32)
    m = c & 7
    e, frac = (m >> 1).float(), (m & 1).float()
    mag = torch.where(m < 2, frac * 0.5, torch.exp2(e - 1.0) * (1.0 + 0.5 * frac))
    return torch.where((c & 8) != 0, -mag, mag)


def _block_scale(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..., K] * scale [..., K/g] broadcast over groups of g."""
    g = x.shape[-1] // scale.shape[-1]
    return (x.unflatten(-1, (scale.shape[-1], g)) * scale.unsqueeze(-1)).flatten(-2)


@dataclass
class ExpertWeights:
    """The routed experts of one MoE layer, kept in their stored format (no BF16 stacks at load).

    fmt "nvfp4" (ModelOpt, nvidia/Kimi-K3-NVFP4): w13 uint8 [E, 2I, W/2] E2M1 pairs (even element
    in the low nibble), rows [w1 gate | w3 up]; w13_scale float8_e4m3fn [E, 2I, W/16];
    w13_global FP32 [E, 2] (weight_scale_2 of w1, of w3); w2 uint8 [E, W, I/2]; w2_scale
    float8_e4m3fn [E, W, I/16]; w2_global FP32 [E, 1]. Value = e2m1 * e4m3(scale) * global.
    fmt "mxfp4" (compressed-tensors, moonshotai/Kimi-K3): the same packing, scales uint8 UE8M0
    [E, 2I, W/32] / [E, W, I/32] (value = e2m1 * 2^(byte - 127)), globals None.
    fmt "bf16": w13 [E, 2I, W], w2 [E, W, I] BF16 values, scales and globals None.
    W = cfg.expert_width, I = cfg.moe_inter. (k3_facts.md sections 3 and 4.)"""
    fmt: str
    w13: torch.Tensor
    w13_scale: torch.Tensor | None
    w13_global: torch.Tensor | None
    w2: torch.Tensor
    w2_scale: torch.Tensor | None
    w2_global: torch.Tensor | None

    FORMATS = ("nvfp4", "mxfp4", "bf16")

    def __post_init__(self):
        if self.fmt not in self.FORMATS:
            raise ValueError(f"ExpertWeights.fmt={self.fmt!r}: one of {self.FORMATS}")

    @property
    def experts(self) -> int:
        return self.w13.shape[0]

    @property
    def inter(self) -> int:
        return self.w13.shape[1] // 2

    @property
    def width(self) -> int:
        return self.w2.shape[1]

    def dequant(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13 [E, 2I, W], w2 [E, W, I]) BF16 values, computed on the tensors' device with static
        shapes and no host sync (the torch expert path calls it inside a captured step; the
        result is transient)."""
        if self.fmt == "bf16":
            return self.w13.to(torch.bfloat16), self.w2.to(torch.bfloat16)
        if self.fmt == "nvfp4":
            I = self.inter
            # expand, not repeat_interleave: no output-size computation that could sync in capture
            g13 = self.w13_global.float()[:, :, None].expand(-1, 2, I).reshape(-1, 2 * I)   # [E, 2I]
            w13 = _block_scale(_e2m1_values(self.w13), self.w13_scale.float()) * g13[..., None]
            w2 = _block_scale(_e2m1_values(self.w2), self.w2_scale.float()) * self.w2_global.float()[..., None]
        else:
            w13 = _block_scale(_e2m1_values(self.w13), torch.exp2(self.w13_scale.float() - 127.0))
            w2 = _block_scale(_e2m1_values(self.w2), torch.exp2(self.w2_scale.float() - 127.0))
        return w13.to(torch.bfloat16), w2.to(torch.bfloat16)


@dataclass
class KdaLayerWeights:
    qkvg: Fp8Linear
    fab: Fp8Linear            # [f_a 128 | b H | zero pad]
    o_proj: Fp8Linear
    kda: KdaWeights           # conv_w, fb_w, dt_bias, a_log, norm_w in the kernels' formats


@dataclass
class MlaLayerWeights:
    a_proj: Fp8Linear              # [q_a 1536 | kv_a 576 + 64 zero | g H*128]; no q LoRA: [kv_a 576 + 64 | g]
    q_a_norm: torch.Tensor | None  # [1536] BF16 (None with q_proj)
    q_b: Fp8Linear | None
    kv_a_norm: torch.Tensor        # [512] BF16
    w_uk: torch.Tensor             # [H, 128, 512] BF16
    w_uv: torch.Tensor             # [H, 128, 512] BF16
    o_proj: Fp8Linear
    q_proj: Fp8Linear | None = None  # [H * 192, hidden]: MLA without a q LoRA (q_lora_rank null)


@dataclass
class MoeWeights:
    router: torch.Tensor                    # [E, hidden] FP32 (BF16 values)
    bias: torch.Tensor                      # [E] FP32 correction bias (selection only)
    experts: ExpertWeights                  # packed, [w1 | w3] stacked as w13
    latent_down: torch.Tensor | None        # [latent, hidden] BF16 (routed_expert_down_proj); None: no latent
    latent_up: torch.Tensor | None          # [hidden, latent] BF16 (routed_expert_up_proj)
    latent_norm: torch.Tensor | None        # [latent] BF16 (routed_expert_norm), None without latent_moe_use_norm
    shared_gate: torch.Tensor | None        # [shared_inter, hidden] BF16; None: no shared experts
    shared_up: torch.Tensor | None
    shared_down: torch.Tensor | None        # [hidden, shared_inter]


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
    attn_res: AttnResWeights | None = None  # pseudo-query of the attention input (None: plain residual)
    mlp_res: AttnResWeights | None = None   # of the FFN input


@dataclass
class ModelWeights:
    cfg: ModelConfig
    recipe: ScaleRecipe
    embed: torch.Tensor
    final_norm: torch.Tensor
    lm_head: torch.Tensor
    layers: list[LayerWeights]
    output_res: AttnResWeights | None = None  # the output query before the final norm

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
    """Read and convert every tensor of the ModelOpt NVFP4 checkpoint of `cfg` (CPU tensors, TP1;
    `.to(device)` moves them). model/formats/detect.py `load_model_weights` takes any layout."""
    from model.formats.assemble import assemble
    from model.formats.sources import ModeloptSource
    return assemble(ModeloptSource(Path(folder), cfg), recipe)
