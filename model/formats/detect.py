"""Which published layout a checkpoint folder holds, and the one entry point that loads any of them
into K3Model's weights for a TP rank (`load_model_weights`).

Detection, first match wins:
1. `hf_quant_config.json` (ModelOpt's export writes it; nvidia/Kimi-K3-NVFP4): "modelopt-nvfp4".
2. config.json `quantization_config` (top level or in kimi_k3's `text_config`) of compressed-tensors
   with format `mxfp4-pack-quantized` (moonshotai/Kimi-K3): "ct-mxfp4". Any other quantization
   (e.g. RedHatAI's compressed-tensors FP8-BLOCK / NVFP4, a ModelOpt config without its
   hf_quant_config.json) is refused with UnsupportedCheckpointError naming its method and format.
3. No quantization and safetensors weights (`model.safetensors` or its index): "hf-plain", the
   unquantized `save_pretrained` layout (moonshotai/Kimi-Linear-48B-A3B-Instruct style).
Anything else: CheckpointFormatError naming what the folder holds.
"""
from __future__ import annotations

import json
from pathlib import Path

from k3gen.ir.dtypes import ScaleRecipe

from model.checkpoint import INDEX, QUANT_CONFIG, CheckpointFormatError, UnsupportedCheckpointError
from model.config import ModelConfig, config_from_json

MODELOPT, CT_MXFP4, HF_PLAIN = "modelopt-nvfp4", "ct-mxfp4", "hf-plain"
FORMATS = (MODELOPT, CT_MXFP4, HF_PLAIN)
SINGLE = "model.safetensors"


def _found(folder: Path) -> str:
    names = sorted(p.name for p in folder.iterdir())
    return ", ".join(names[:8]) + (f" (and {len(names) - 8} more)" if len(names) > 8 else "") if names else "nothing"


def detect_format(folder) -> str:
    """One of FORMATS for the checkpoint folder, or a typed error naming what is there."""
    from model.formats.ct_mxfp4 import QUANT_FORMAT
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointFormatError(f"{folder}: not a checkpoint folder"
                                    + (" (a file)" if folder.exists() else " (no such folder)"))
    if (folder / QUANT_CONFIG).is_file():
        return MODELOPT
    cfg_path = folder / "config.json"
    q = None
    if cfg_path.is_file():
        try:
            d = json.loads(cfg_path.read_text())
        except ValueError as e:
            raise CheckpointFormatError(f"{cfg_path}: not JSON ({e})") from e
        t = d.get("text_config") if isinstance(d.get("text_config"), dict) else {}
        q = t.get("quantization_config") or d.get("quantization_config")
    if q is not None:
        method = q.get("quant_method") if isinstance(q, dict) else None
        fmt = q.get("format") if isinstance(q, dict) else None
        if method == "compressed-tensors" and fmt == QUANT_FORMAT:
            return CT_MXFP4
        raise UnsupportedCheckpointError(
            f"{cfg_path}: quantization_config quant_method={method!r} format={fmt!r}; this runtime loads "
            f"compressed-tensors {QUANT_FORMAT!r} (moonshotai/Kimi-K3), ModelOpt NVFP4 with {QUANT_CONFIG} "
            "(nvidia/Kimi-K3-NVFP4) and unquantized save_pretrained checkpoints")
    if (folder / INDEX).is_file() or (folder / SINGLE).is_file():
        return HF_PLAIN
    raise CheckpointFormatError(
        f"{folder}: holds {_found(folder)}; expected {QUANT_CONFIG} (ModelOpt NVFP4), config.json with a "
        f"compressed-tensors quantization_config (MXFP4) or safetensors weights ({SINGLE} or {INDEX})")


def source(folder, cfg: ModelConfig, fmt: str | None = None, opener=None):
    """The reader of `folder` as an assemble.Source (fmt: detected when None)."""
    from model.formats import sources as S
    from model.formats.modelopt import ModeloptSource
    fmt = detect_format(folder) if fmt is None else fmt
    cls = {MODELOPT: ModeloptSource, CT_MXFP4: S.CtMxfp4Source, HF_PLAIN: S.HfPlainSource}.get(fmt)
    if cls is None:
        raise CheckpointFormatError(f"format {fmt!r}: one of {', '.join(FORMATS)}")
    return cls(Path(folder), cfg, opener=opener)


def load_model_weights(folder, cfg: ModelConfig | None = None, recipe: ScaleRecipe = ScaleRecipe.FP32,
                       rank: int = 0, world: int = 1, device="cpu", ep: int = 1, opener=None):
    """K3Model's weights (model/weights.py ModelWeights) of rank `rank` of `world` (routed experts
    over `ep` of them: model/dist.py Layout) from the checkpoint in `folder`, whatever its layout,
    streamed layer by layer to `device`; at world > 1 in model/shard.py's per-rank format, each rank
    reading only its share. cfg: the folder's config.json by default. `opener` replaces
    safetensors.safe_open (tests count the bytes read)."""
    from model.dist import Layout
    from model.formats.assemble import Rank, assemble
    from model.shard import RowParallel, check_shardable
    share = Rank(Layout(world, ep).place(rank), check_shardable, RowParallel)   # before anything is read
    cfg = config_from_json(folder) if cfg is None else cfg
    return assemble(source(folder, cfg, opener=opener), recipe, share, device)


__all__ = ["detect_format", "load_model_weights", "source", "FORMATS", "MODELOPT", "CT_MXFP4", "HF_PLAIN"]
