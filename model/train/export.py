"""Trained canonical tensors -> a checkpoint in the official moonshotai/Kimi-K3 layout
(compressed-tensors `mxfp4-pack-quantized` routed experts, BF16 elsewhere, the F32 tensors K3 keeps
F32), and back: `read_canonical` gives the FP32 values a checkpoint stores, by canonical name, for
`Fp32Reference` and the training module. K3Model reads the same folder through
model/formats/detect.py `load_model_weights`.

The experts are packed with the k3gen packer (model/formats/ct_mxfp4.py `mx_scale_bytes`/`mx_pack`:
the OCP floor rule for the UE8M0 scale) from their BF16 rounding; the training module's
quantization-aware mode (model/train/net.py) applies the same round trip.
"""
from __future__ import annotations

import copy
import json
from pathlib import Path

import torch

from model.checkpoint import INDEX, CheckpointError
from model.config import ModelConfig, config_from_dict

PACKER = "k3gen"
WRAP = "language_model."
SHARD = "model-00001-of-00001.safetensors"


def export_checkpoint(tensors: dict[str, torch.Tensor], cfg: ModelConfig, config: dict, folder,
                      metadata: dict | None = None) -> Path:
    """Write `tensors` (canonical names, any float dtype) as an official-layout checkpoint of `cfg`
    into `folder`: one safetensors shard, its index, config.json = `config` (a kimi_k3 config dict
    describing cfg) with the MXFP4 quantization_config. Returns the folder."""
    from safetensors.torch import save_file
    from model.formats.ct_mxfp4 import _DTYPES, decode_mxfp4, mx_pack, mx_scale_bytes, official_tensors, \
        quantization_config
    config = copy.deepcopy(config)
    (config.get("text_config") or config)["quantization_config"] = quantization_config()
    if config_from_dict(config, cfg.name) != cfg:
        raise CheckpointError("export: the config dict does not describe the model's config")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    out: dict[str, torch.Tensor] = {}
    for name, spec in official_tensors(cfg).items():
        c = name[len(WRAP):]
        if spec.kind == "ue8m0":
            continue
        if spec.kind == "packed":
            base = c.removesuffix(".weight_packed") + ".weight"
            w = tensors[base].detach().cpu().to(torch.bfloat16)
            sb = mx_scale_bytes(w, PACKER)
            out[name] = mx_pack(w, sb, PACKER).contiguous()
            out[name.replace("weight_packed", "weight_scale")] = sb.contiguous()
            if not torch.isfinite(decode_mxfp4(out[name], sb)).all():
                raise CheckpointError(f"export: {base} is not finite after MXFP4 packing")
            continue
        t = tensors[c].detach().cpu().float()
        if tuple(t.shape) != spec.shape:
            raise CheckpointError(f"export: {c} has shape {list(t.shape)}, the layout wants {list(spec.shape)}")
        out[name] = t.to(_DTYPES[spec.dtype]).contiguous()
    meta = {"format": "pt", **({k: str(v) for k, v in (metadata or {}).items()})}
    save_file(out, str(folder / SHARD), metadata=meta)
    total = sum(t.numel() * t.element_size() for t in out.values())
    (folder / INDEX).write_text(json.dumps({"metadata": {"total_size": total},
                                            "weight_map": {n: SHARD for n in out}}, indent=1))
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder


def read_canonical(folder, cfg: ModelConfig | None = None) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(config, FP32 canonical tensors) of an official-layout checkpoint: the stored values, the
    experts decoded from MXFP4. Read through model/formats/ct_mxfp4.py's reader (its checks)."""
    from model.formats.ct_mxfp4 import CtMxfp4Checkpoint, decode_mxfp4
    c = CtMxfp4Checkpoint(folder, cfg)
    out = {}
    try:
        for name, spec in c.specs.items():
            if spec.kind == "ue8m0":
                continue
            if spec.kind == "packed":
                base = name.removesuffix(".weight_packed")
                out[base[len(WRAP):] + ".weight"] = decode_mxfp4(c.read(name), c.read(base + ".weight_scale"))
            else:
                out[name[len(WRAP):]] = c.read(name).float()
    finally:
        c.close()
    return c.cfg, out


def save_fp32(tensors: dict[str, torch.Tensor], path) -> None:
    """The FP32 master weights by canonical name (not a published layout: the MXFP4-cost baseline)."""
    from safetensors.torch import save_file
    save_file({n: t.detach().float().cpu().contiguous() for n, t in tensors.items()}, str(path))


def load_fp32(path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return load_file(str(path))


__all__ = ["export_checkpoint", "read_canonical", "save_fp32", "load_fp32", "PACKER"]
