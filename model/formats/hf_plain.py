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
Shards are opened and read one at a time;
`HfPlainCheckpoint` streams them (model/formats/sources.py feeds K3Model's loader from it).
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


_FLOAT_CODES = {"F32", "BF16", "F16"}


class HfPlainCheckpoint:
    """A plain checkpoint opened for streaming: every stored name mapped to its canonical name and
    checked against the config at open time from the shard headers (names, shapes, float dtypes,
    index vs files); values (NaN/Inf) when a tensor is read. `read` takes slices along the leading
    dims (safetensors `get_slice`: a TP rank reads only its rows / columns). `opener` replaces
    safetensors.safe_open (tests count the bytes read)."""

    def __init__(self, folder, cfg: ModelConfig | None = None, opener=None):
        from safetensors import safe_open
        self.folder = Path(folder)
        self.cfg = config_from_json(self.folder) if cfg is None else cfg
        self._open = opener or safe_open
        self.shapes = canonical_shapes(self.cfg)
        self.where: dict[str, tuple[str, str]] = {}          # canonical -> (shard, stored name)
        self._files: dict[str, object] = {}
        for fname, listed in _shards(self.folder):
            path = self.folder / fname
            if not path.is_file():
                raise CheckpointError(f"shard {fname} named by {INDEX} is missing")
            f = self._file(fname)
            keys = set(f.keys())
            if listed is not None:
                for name in sorted(listed - keys):
                    raise MissingTensorError(f"{name}: listed in {INDEX} for {fname}, absent from it")
                for name in sorted(keys - listed):
                    raise CheckpointError(f"{name}: in {fname} but {INDEX} does not list it there")
            for name in sorted(keys):
                canon = canonical_name(name, self.cfg)
                if canon is None:
                    continue
                if canon not in self.shapes:
                    raise UnexpectedTensorError(f"{name}: not a tensor of this config ({self.cfg.name})")
                if canon in self.where:
                    raise CheckpointError(f"{name}: stored twice (as {canon})")
                sl = f.get_slice(name)
                check_shape(self.cfg, name, tuple(sl.get_shape()), self.shapes[canon])
                if sl.get_dtype() not in _FLOAT_CODES:
                    raise CheckpointError(f"{name}: dtype {sl.get_dtype()} is not a plain float tensor "
                                          "(a quantized checkpoint needs its own reader in model/formats/)")
                self.where[canon] = (fname, name)
            self.close(fname)
        missing = [n for n in self.shapes if n not in self.where]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise MissingTensorError(f"{missing[0]}: missing{more}")

    @property
    def weight_map(self) -> dict[str, str]:
        return {n: s for n, (s, _) in self.where.items()}

    def _file(self, shard: str):
        if shard not in self._files:
            self._files[shard] = self._open(str(self.folder / shard), framework="pt")
        return self._files[shard]

    def close(self, shard: str | None = None) -> None:
        for s in [shard] if shard else list(self._files):
            f = self._files.pop(s, None)
            if f is not None and hasattr(f, "__exit__"):
                f.__exit__(None, None, None)

    def read(self, name: str, *index: slice) -> torch.Tensor:
        """Canonical tensor `name` in its stored dtype, sliced by `index` along its leading dims."""
        shard, stored = self.where[name]
        t = self._file(shard).get_slice(stored)[tuple(index) or slice(None)]
        if not bool(torch.isfinite(t).all()):
            raise BadValueError(f"{stored}: {int((~torch.isfinite(t)).sum())} non-finite values")
        return t


def read_hf_plain(folder, cfg: ModelConfig | None = None) -> dict[str, torch.Tensor]:
    """The canonical FP32 tensors of the plain checkpoint in `folder` (cfg: from its config.json
    by default)."""
    ck = HfPlainCheckpoint(folder, cfg)
    try:
        return {n: ck.read(n).to(torch.float32) for n in ck.shapes}
    finally:
        ck.close()


__all__ = ["HfPlainCheckpoint", "read_hf_plain", "canonical_name", "UnexpectedTensorError", "INDEX"]
