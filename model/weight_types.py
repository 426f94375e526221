"""K3Model's weights in the formats the layers and kernels take: FP8 block projections (`Fp8Linear`,
fused and padded as the enumerator's GEMM shapes say), routed experts kept packed as stored
(`ExpertWeights`: NVFP4, MXFP4 or BF16), FP32 Attention Residuals, per layer and for the model.
model/formats/assemble.py builds them from any checkpoint layout; model/weights.py re-exports them
with the loaders (a leaf module, so that the loaders' modules can import it without a cycle).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from k3gen.ir.dtypes import ScaleRecipe
from k3gen.ops.fp8_block_gemm.reference import dequantize_weights
from k3gen.ops.kda_decode.reference import KdaWeights
# The fused projections' row layouts are the enumerator's (its GEMM shapes): one source.
from k3gen.targets import MLA_A_PAD as KV_A_PAD  # noqa: F401  (the MLA A-projection's kv_a rows)

from model.arch import AttnResWeights
from model.config import ModelConfig


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
class GluWeights:
    """A gated MLP down(act(gate(x), up(x))) in the FP8 kernels' formats: `gate_up` the fused
    [gate | up] block weight, each part `width` rows (the real `inter` rows, zero rows up to a
    whole 128-row tile, so up starts on a tile and glu_act reads gate | up at columns 0 | width);
    `down` [hidden, width] with zero columns past `inter` (a RowParallel at TP > 1: this rank's
    share of the intermediate). The zero rows give act(0, 0) = 0 (SiTU and SiLU), so the padding is exact."""
    gate_up: Fp8Linear
    down: Fp8Linear
    inter: int

    @property
    def width(self) -> int:
        return self.gate_up.n // 2


@dataclass
class MoeWeights:
    router: torch.Tensor                    # [E, hidden] FP32 (BF16 values)
    bias: torch.Tensor                      # [E] FP32 correction bias (selection only)
    experts: ExpertWeights                  # packed, [w1 | w3] stacked as w13
    latent_down: Fp8Linear | None           # [latent, hidden] (routed_expert_down_proj); None: no latent
    latent_up: Fp8Linear | None             # [hidden, latent] (routed_expert_up_proj)
    latent_norm: torch.Tensor | None        # [latent] BF16 (routed_expert_norm), None without latent_moe_use_norm
    shared: GluWeights | None               # the shared experts as one MLP of shared_inter; None: none


@dataclass
class DenseMlpWeights(GluWeights):
    """The dense MLP (layer 0 of K3)."""


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


__all__ = ["Fp8Linear", "GluWeights", "ExpertWeights", "KdaLayerWeights", "MlaLayerWeights", "MoeWeights", "DenseMlpWeights",
           "LayerWeights", "ModelWeights", "KdaWeights", "AttnResWeights", "KV_A_PAD"]
