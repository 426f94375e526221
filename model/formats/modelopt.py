"""The ModelOpt NVFP4 layout (model/checkpoint.py's format: nvidia/Kimi-K3-NVFP4 with the published
names): a reader that checks every tensor against the config (names, shapes, dtypes, values,
hf_quant_config.json), its `assemble.Source`, and `load_weights`, the TP1 entry point the older
callers use (model/formats/detect.py `load_model_weights` takes any layout).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from k3gen.ir.dtypes import ScaleRecipe

from model.checkpoint import (open_shard, INDEX, NVFP4_BLOCK, QUANT_CONFIG, BadValueError, CheckpointError,
                              MissingTensorError, TensorShapeError, UnexpectedTensorError, UnsupportedCheckpointError,
                              expected_tensors)
from model.config import ModelConfig
from model.formats.assemble import FULL, assemble
from model.formats.sources import Closing, slice_fp8, take, bounds, WRAP
from model.weight_types import ExpertWeights, ModelWeights, _grid


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


class ModeloptSource(Closing):
    expert_fmt = "nvfp4"

    def __init__(self, folder, cfg: ModelConfig, opener=None):
        self.cfg = cfg
        self.r = CheckpointReader(folder, cfg, opener=opener)
        self.r.check_names()
        self.r.check_quant_config()
        self._track(self.r.weight_map, cfg.layers)

    def _close_shard(self, shard: str) -> None:
        self.r.close(shard)

    def linear(self, name, rows=FULL, cols=FULL):
        s = WRAP + name
        info = self.r.expected.get(s + ".weight")
        if info is not None and info.kind == "fp8_weight":
            c = self.r.get(s + ".weight").view(torch.uint8)
            return slice_fp8(c, _grid(self.r.get(s + ".weight_scale"), c), rows, cols)
        return take(self.r.get(s + ".weight"), rows, cols)

    def tensor(self, name, *index):
        return take(self.r.get(WRAP + name), *index)

    def experts(self, moe, ids, inter):
        """Stacked [E_r, ...] in the stored NVFP4 form, w1|w3 as w13 rows (no dequantization)."""
        cfg, get = self.cfg, self.r.get
        W, (i0, i1) = cfg.expert_width, bounds(inter, cfg.moe_inter)
        Il, E = i1 - i0, len(ids)
        w13 = torch.empty(E, 2 * Il, W // 2, dtype=torch.uint8)
        s13 = torch.empty(E, 2 * Il, W // NVFP4_BLOCK, dtype=torch.float8_e4m3fn)
        g13 = torch.empty(E, 2)
        w2 = torch.empty(E, W, Il // 2, dtype=torch.uint8)
        s2 = torch.empty(E, W, Il // NVFP4_BLOCK, dtype=torch.float8_e4m3fn)
        g2 = torch.empty(E, 1)
        for j, e in enumerate(ids):
            x = f"{WRAP}{moe}experts.{e}."
            for w in ("w1", "w3", "w2"):
                get(x + w + ".input_scale")                 # validated, then unused by the math
            for half, w in ((0, "w1"), (1, "w3")):
                w13[j, half * Il:(half + 1) * Il] = get(x + w + ".weight")[i0:i1]
                s13[j, half * Il:(half + 1) * Il] = get(x + w + ".weight_scale")[i0:i1]
                g13[j, half] = get(x + w + ".weight_scale_2").float()
            w2[j] = get(x + "w2.weight")[:, i0 // 2:i1 // 2]
            s2[j] = get(x + "w2.weight_scale")[:, i0 // NVFP4_BLOCK:i1 // NVFP4_BLOCK]
            g2[j, 0] = get(x + "w2.weight_scale_2").float()
        return ExpertWeights(fmt="nvfp4", w13=w13, w13_scale=s13, w13_global=g13, w2=w2, w2_scale=s2, w2_global=g2)


def load_weights(folder, cfg: ModelConfig, recipe: ScaleRecipe = ScaleRecipe.FP32) -> ModelWeights:
    """Read and convert every tensor of the ModelOpt NVFP4 checkpoint of `cfg` (CPU tensors, TP1;
    `.to(device)` moves them). model/formats/detect.py `load_model_weights` takes any layout."""
    return assemble(ModeloptSource(Path(folder), cfg), recipe)


__all__ = ["CheckpointReader", "ModeloptSource", "load_weights"]
