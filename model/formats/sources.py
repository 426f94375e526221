"""The three checkpoint layouts as `assemble.Source`s: each maps the canonical names the assembly
asks for onto its stored tensors, slices them for a TP rank and keeps its routed experts packed.

- `ModeloptSource` (model/formats/modelopt.py): nvidia/Kimi-K3-NVFP4 (ModelOpt MIXED_PRECISION).
- `CtMxfp4Source`: moonshotai/Kimi-K3 (compressed-tensors mxfp4-pack-quantized experts, BF16
  elsewhere), read by model/formats/ct_mxfp4.py's `CtMxfp4Checkpoint`.
- `HfPlainSource`: unquantized save_pretrained checkpoints (BF16/FP16/FP32; kimi_linear or
  kimi_k3), read by model/formats/hf_plain.py's `HfPlainCheckpoint`; experts stay as stored (BF16).

kimi_k3 checkpoints store the text model under `language_model.` (`language_model.model.layers.N.`,
`language_model.lm_head`): the quantized layouts add that prefix to the canonical names.
"""
from __future__ import annotations

import torch

from k3gen.ir.dtypes import ScaleRecipe
from k3gen.ops.fp8_block_gemm.reference import dequantize_weights

from model.config import ModelConfig
from model.formats.assemble import FULL, Source, last_layers
from model.weight_types import ExpertWeights, Fp8Linear

WRAP = "language_model."


def bounds(s: slice, n: int) -> tuple[int, int]:
    a, b, _ = s.indices(n)
    return a, b


def take(t: torch.Tensor, *index: slice) -> torch.Tensor:
    """t[index], copied when it is a strict part (a view would keep the whole stored tensor alive)."""
    v = t[tuple(index)] if index else t
    return v.clone() if v.numel() != t.numel() else v


def _tiles(a: int, b: int) -> slice | None:
    """The stored 128-tiles that rows a..b map onto, when they tile the slice the same way: the slice
    starts on a tile, or lies inside one tile. None: its tiles straddle stored ones."""
    if a % 128 == 0:
        return slice(a // 128, -(-b // 128))
    if a // 128 == (b - 1) // 128:
        return slice(a // 128, a // 128 + 1)
    return None


def slice_fp8(codes: torch.Tensor, grid: torch.Tensor, rows: slice, cols: slice) -> Fp8Linear | torch.Tensor:
    """A TP slice of a stored FP8 block weight: its codes and the tile scales covering them when the
    slice's tiles are stored tiles (K3's b_proj at TP8: 12 rows inside one tile, exact). Otherwise
    (a share that starts mid-tile and spans two stored tiles, e.g. q_b's 192 rows per head at an
    odd head count per rank) the slice's FP32 values, which the assembly re-quantizes with the
    recipe: one more FP8 rounding, of the size of the first."""
    r0, r1 = bounds(rows, codes.shape[0])
    c0, c1 = bounds(cols, codes.shape[1])
    tr, tc = _tiles(r0, r1), _tiles(c0, c1)
    if tr is None or tc is None:
        return dequantize_weights(codes, grid, ScaleRecipe.FP32)[r0:r1, c0:c1].contiguous()
    return Fp8Linear(take(codes, slice(r0, r1), slice(c0, c1)).contiguous(),
                     take(grid, tr, tc).contiguous(), ScaleRecipe.FP32)


class Closing(Source):
    """Shards closed once no later layer reads them (with layer-ordered shards: one at a time)."""

    def _track(self, weight_map: dict[str, str], layers: int) -> None:
        self._last = last_layers(weight_map, layers)

    def _close_shard(self, shard: str) -> None:
        raise NotImplementedError

    def release(self, layer: int) -> None:
        for s, last in list(self._last.items()):
            if last <= layer:
                self._close_shard(s)
                del self._last[s]

    def close(self) -> None:
        for s in list(self._last):
            self._close_shard(s)
        self._last.clear()


class CtMxfp4Source(Closing):
    def __init__(self, folder, cfg: ModelConfig, opener=None):
        from model.formats.ct_mxfp4 import CtMxfp4Checkpoint
        self.cfg = cfg
        self.expert_fmt = "mxfp4"
        self.c = CtMxfp4Checkpoint(folder, cfg, opener=opener)
        self._track(self.c.weight_map, cfg.layers)

    def _close_shard(self, shard: str) -> None:
        self.c.close(shard)

    def linear(self, name, rows=FULL, cols=FULL):
        return self.c.read(WRAP + name + ".weight", rows, cols)

    def tensor(self, name, *index):
        return self.c.read(WRAP + name, *index)

    def experts(self, moe, ids, inter):
        return self.c.experts(WRAP + moe, ids, inter)


class HfPlainSource(Closing):
    expert_fmt = "bf16"

    def __init__(self, folder, cfg: ModelConfig, opener=None):
        from model.formats.hf_plain import HfPlainCheckpoint
        self.cfg = cfg
        self.c = HfPlainCheckpoint(folder, cfg, opener=opener)
        self._track(self.c.weight_map, cfg.layers)

    def _close_shard(self, shard: str) -> None:
        self.c.close(shard)

    def linear(self, name, rows=FULL, cols=FULL):
        return self.c.read(name + ".weight", rows, cols)

    def tensor(self, name, *index):
        return self.c.read(name, *index)

    def experts(self, moe, ids, inter):
        """Stacked [E_r, 2 I_r, W] / [E_r, W, I_r] BF16 (their stored form: nothing to unpack)."""
        cfg = self.cfg
        W, (i0, i1) = cfg.expert_width, bounds(inter, cfg.moe_inter)
        Il, E = i1 - i0, len(ids)
        w13 = torch.empty(E, 2 * Il, W, dtype=torch.bfloat16)
        w2 = torch.empty(E, W, Il, dtype=torch.bfloat16)
        for j, e in enumerate(ids):
            x = f"{moe}experts.{e}."
            w13[j, :Il] = self.c.read(x + "w1.weight", slice(i0, i1))
            w13[j, Il:] = self.c.read(x + "w3.weight", slice(i0, i1))
            w2[j] = self.c.read(x + "w2.weight", FULL, slice(i0, i1))
        return ExpertWeights(fmt="bf16", w13=w13, w13_scale=None, w13_global=None, w2=w2, w2_scale=None,
                             w2_global=None)


__all__ = ["CtMxfp4Source", "HfPlainSource", "Closing", "slice_fp8", "take", "bounds", "WRAP"]
