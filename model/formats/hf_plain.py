"""Reader of plain (unquantized BF16/FP16/FP32) safetensors checkpoints as transformers'
`save_pretrained` writes them: one `model.safetensors`, or shards listed by
`model.safetensors.index.json`. Returns the canonical dict of model/reference.py
(`canonical_shapes`) as FP32 tensors, checked by name against the shapes derived from the config.

Name mapping into canonical names:
- kimi_k3 checkpoints wrap the text model in `language_model.` (`language_model.model.layers.N.`,
  `language_model.lm_head`): the prefix is stripped. `language_model.layers.` (no `model.`) is
  read as `model.layers.`, the fallback SGLang's and vLLM's K3 loaders map the same way
  (/work/tools_tmp/k3_facts.md section 2). The vision tower and projector are not the text
  model's and are skipped.
- transformers 5.23 saves the dense layer-0 MLP as `model.layers.N.block_sparse_moe.{gate,up,down}_proj`:
  its conversion_mapping.py "kimi_linear" entry renames `.block_sparse_moe.` -> `.mlp.` on load
  (`WeightRenaming(source_patterns=r"\\.block_sparse_moe\\.", target_patterns=r"\\.mlp\\.")`, meant for
  the MoE), and `save_pretrained` applies the reverse to every `.mlp.` module, the dense one
  included. On a dense layer those names are mapped back to `mlp.`.

Errors (model.checkpoint's types, each naming the tensor): a canonical tensor absent ->
MissingTensorError; a tensor the config does not use -> UnexpectedTensorError; a shape other
than the config's -> TensorShapeError; NaN/Inf -> BadValueError; a non-float dtype (e.g. the
packed uint8 of a quantized checkpoint) or an inconsistent index -> CheckpointError.
Shards are opened and read one at a time.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from model.checkpoint import (BadValueError, CheckpointError, MissingTensorError, TensorShapeError,
                              UnexpectedTensorError)
from model.config import ModelConfig, config_from_json
from model.reference import canonical_shapes, check_shape

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_SKIP = ("vision_tower.", "mm_projector.", "language_model.vision_tower.", "language_model.mm_projector.")
_DENSE_QUIRK = re.compile(r"^model\.layers\.(\d+)\.block_sparse_moe\.((?:gate|up|down)_proj\.weight)$")


def canonical_name(name: str, cfg: ModelConfig) -> str | None:
    """The canonical name of a stored tensor name, or None for tensors outside the text model."""
    if name.startswith(_SKIP):
        return None
    if name.startswith("language_model."):
        name = name[len("language_model."):]
        if name.startswith("layers."):
            name = "model." + name
    m = _DENSE_QUIRK.match(name)
    if m and int(m.group(1)) < cfg.layers and cfg.is_dense(int(m.group(1))):
        name = f"model.layers.{m.group(1)}.mlp.{m.group(2)}"
    return name


def _shards(folder: Path) -> list[tuple[str, set[str] | None]]:
    """(file name, stored names the index assigns to it, None without an index), in order."""
    idx = folder / INDEX
    if idx.is_file():
        try:
            wm = json.loads(idx.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{idx}: not a safetensors index ({e})") from e
        files: dict[str, set[str]] = {}
        for name, f in wm.items():
            files.setdefault(f, set()).add(name)
        return [(f, files[f]) for f in sorted(files)]
    if (folder / SINGLE).is_file():
        return [(SINGLE, None)]
    raise CheckpointError(f"{folder}: neither {INDEX} nor {SINGLE}")


def read_hf_plain(folder, cfg: ModelConfig | None = None) -> dict[str, torch.Tensor]:
    """The canonical FP32 tensors of the plain checkpoint in `folder` (cfg: from its config.json
    by default)."""
    from safetensors import safe_open
    folder = Path(folder)
    cfg = config_from_json(folder) if cfg is None else cfg
    want = canonical_shapes(cfg)
    out: dict[str, torch.Tensor] = {}
    for fname, listed in _shards(folder):
        path = folder / fname
        if not path.is_file():
            raise CheckpointError(f"shard {fname} named by {INDEX} is missing")
        with safe_open(str(path), framework="pt") as f:
            keys = set(f.keys())
            if listed is not None:
                for name in sorted(listed - keys):
                    raise MissingTensorError(f"{name}: listed in {INDEX} for {fname}, absent from it")
                for name in sorted(keys - listed):
                    raise CheckpointError(f"{name}: in {fname} but {INDEX} does not list it there")
            for name in sorted(keys):
                canon = canonical_name(name, cfg)
                if canon is None:
                    continue
                if canon not in want:
                    raise UnexpectedTensorError(f"{name}: not a tensor of this config ({cfg.name})")
                if canon in out:
                    raise CheckpointError(f"{name}: stored twice (as {canon})")
                check_shape(cfg, name, tuple(f.get_slice(name).get_shape()), want[canon])
                t = f.get_tensor(name)
                if t.dtype not in _FLOATS:
                    raise CheckpointError(f"{name}: dtype {t.dtype} is not a plain float tensor "
                                          "(a quantized checkpoint needs its own reader in model/formats/)")
                t = t.to(torch.float32)
                if not bool(torch.isfinite(t).all()):
                    raise BadValueError(f"{name}: {int((~torch.isfinite(t)).sum())} non-finite values")
                out[canon] = t
    missing = [n for n in want if n not in out]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise MissingTensorError(f"{missing[0]}: missing{more}")
    return out


__all__ = ["read_hf_plain", "canonical_name", "UnexpectedTensorError", "INDEX"]
