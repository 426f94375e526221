"""load_model_weights streams: the host memory it holds while loading a multi-shard checkpoint of
16 layers stays within one layer plus bounded buffers, for each published layout (device "meta"
stands in for the GPU: what is moved there leaves the host); and `generate --checkpoint DIR`
runs K3Model from each layout, its config read from the folder.

What is counted: every host tensor storage alive at once, whether safetensors returned it (the
opener below wraps the reader's) or an operator made it (a TorchDispatchMode sees every op's
outputs); a storage counts once however many views of it exist, and until the last one dies
(weakref finalizers; tracemalloc cannot see torch's allocator).

The bound. While layer i is built the loader holds: the converted parts of layer i so far (FP8
codes take half the bytes of the BF16 they replace, packed experts and BF16 tensors their stored
bytes: at most the layer's stored bytes L), one stored tensor being converted (T) with its value
check (`isfinite`: an abs copy and three bool masks, < 3 T) and the conversion scratch of one
block of CHUNK_ELEMENTS (k3gen's bit-exact quantizer: under 64 bytes per element). So
peak <= L + 4 T + 64 CHUNK_ELEMENTS, with CHUNK_ELEMENTS set small here so that the bound is
about a quarter of the checkpoint, which a loader that holds the whole model on the host (the
`device="cpu"` run, asserted to exceed it) cannot meet.
"""
from __future__ import annotations

import json
import weakref

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from k3gen.ir.dtypes import ScaleRecipe
from k3gen.presets import preset_dict
from model.checkpoint import INDEX, write_random_checkpoint
from model.config import config_from_dict
from model.formats import assemble as A
from model.formats import ct_mxfp4 as C
from model.formats.ct_mxfp4 import layer_of
from model.formats.detect import load_model_weights
from model.reference import canonical_shapes
from helpers import CountingShard

CHUNK = 1 << 15


def tiny16_dict() -> dict:
    """The tiny preset at 16 layers (MLA every fourth): the checkpoint outweighs any one layer."""
    d = preset_dict("tiny")
    t = d["text_config"]
    t["num_hidden_layers"] = 16
    mla = [4, 8, 12, 16]
    t["linear_attn_config"].update(full_attn_layers=mla, kda_layers=[n for n in range(1, 17) if n not in mla])
    return d


CFG = config_from_dict(tiny16_dict(), "tiny16")


class HostBytes(TorchDispatchMode):
    """Peak bytes of host tensor storages alive at once (see the module docstring)."""

    def __init__(self):
        super().__init__()
        self.refs: dict[int, int] = {}
        self.sizes: dict[int, int] = {}
        self.live = self.peak = 0

    def add(self, t):
        if isinstance(t, torch.Tensor) and t.device.type == "cpu":
            st = t.untyped_storage()
            k = st.data_ptr()
            if k:
                if k in self.refs:
                    self.refs[k] += 1
                else:
                    self.refs[k], self.sizes[k] = 1, st.nbytes()
                    self.live += st.nbytes()
                    self.peak = max(self.peak, self.live)
                weakref.finalize(t, self._drop, k)
        return t

    def _drop(self, k):
        self.refs[k] -= 1
        if not self.refs[k]:
            del self.refs[k]
            self.live -= self.sizes.pop(k)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            self.add(t)
        return out

    def opener(self, path, framework):
        return CountingShard(path, framework, self.add)


def _write_plain(cfg, folder):
    """A kimi_k3 BF16 save_pretrained-style checkpoint of `cfg` (language_model. names, 6 shards)."""
    g = torch.Generator().manual_seed(4)
    t = {"language_model." + n: (torch.randn(s, generator=g) * 0.05).to(torch.bfloat16 if len(s) > 1 else torch.float32)
         for n, s in canonical_shapes(cfg).items()}
    names = sorted(t, key=lambda n: (layer_of(n) is None, layer_of(n) or 0, n))
    k = -(-len(names) // 6)
    wm = {}
    for j in range(6):
        f = f"model-{j + 1:05d}-of-00006.safetensors"
        save_file({n: t[n].contiguous() for n in names[j * k:(j + 1) * k]}, str(folder / f))
        wm.update({n: f for n in names[j * k:(j + 1) * k]})
    (folder / INDEX).write_text(json.dumps({"weight_map": wm}))
    (folder / "config.json").write_text(json.dumps(tiny16_dict()))
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return {"ct-mxfp4": C.write_official_checkpoint(CFG, tmp_path_factory.mktemp("mx"), seed=1, shards=6,
                                                    config=tiny16_dict()),
            "modelopt-nvfp4": write_random_checkpoint(CFG, tmp_path_factory.mktemp("mo"), seed=1,
                                                      shard_bytes=2 << 20, fp4="codes")[0],
            "hf-plain": _write_plain(CFG, tmp_path_factory.mktemp("plain"))}


def _stored_bytes(folder):
    wm = json.loads((folder / INDEX).read_text())["weight_map"]
    nb, shard, layer = {}, {}, {}
    for n, s in wm.items():
        with safe_open(str(folder / s), framework="pt") as f:
            sl = f.get_slice(n)
            shape, dt = sl.get_shape(), sl.get_dtype()
        b = {"BF16": 2, "F32": 4, "U8": 1, "F8_E4M3": 1}[dt]
        for d in shape:
            b *= d
        nb[n] = b
        shard[s] = shard.get(s, 0) + b
        li = layer_of(n)
        layer[li] = layer.get(li, 0) + b
    return nb, shard, layer


@pytest.mark.parametrize("fmt", ["ct-mxfp4", "modelopt-nvfp4", "hf-plain"])
def test_streaming_peak_host_memory(folders, fmt, monkeypatch):
    from model.formats.detect import detect_format
    folder = folders[fmt]
    assert detect_format(folder) == fmt
    monkeypatch.setattr(A, "CHUNK_ELEMENTS", CHUNK)
    nb, shard, layer = _stored_bytes(folder)
    total = sum(nb.values())
    assert len(shard) >= 5
    bound = max(layer.values()) + 4 * max(nb.values()) + 64 * CHUNK
    assert bound < total / 3, (bound, total)              # the bound says something at this size
    hb = HostBytes()
    with hb:
        w = load_model_weights(folder, CFG, ScaleRecipe.FP32, device="meta", opener=hb.opener)
    assert len(w.layers) == CFG.layers and w.layers[0].attn.qkvg.codes.device.type == "meta"
    print(f"{fmt}: peak {hb.peak / 1e6:.2f} MB of a {total / 1e6:.2f} MB checkpoint (largest shard "
          f"{max(shard.values()) / 1e6:.2f} MB, layer {max(layer.values()) / 1e6:.2f} MB); bound {bound / 1e6:.2f} MB")
    assert hb.live == 0                                   # nothing left on the host
    assert hb.peak <= bound
    # The counter sees a loader that keeps the model on the host: the same load onto the CPU.
    cpu = HostBytes()
    with cpu:
        w = load_model_weights(folder, CFG, ScaleRecipe.FP32, device="cpu", opener=cpu.opener)
    assert cpu.live > bound and cpu.peak > bound


# -- generate --checkpoint ------------------------------------------------------------------------------
def test_generate_from_each_layout(tmp_path, capsys):
    """`python -m model generate --checkpoint DIR` (the config from the folder) prints the tokens
    K3Model generates from the same folder's weights, for the MXFP4 and plain layouts."""
    import hf_tiny
    from model.cli import generate_main
    from model.config import config_from_json, get_config
    from model.generate import Generator, Request, build_model
    tiny = get_config("tiny")
    mx = C.write_official_checkpoint(tiny, tmp_path / "mx", seed=2, shards=3)
    folders = {"mx": mx}
    transformers = pytest.importorskip("transformers")
    assert transformers
    m = hf_tiny.build(None, 3)
    m.save_pretrained(tmp_path / "plain")
    folders["plain"] = tmp_path / "plain"
    for name, d in folders.items():
        rc = generate_main(["--checkpoint", str(d), "--path", "reference", "--prompt-ids", "5,6,7,5,6",
                            "--max-new", "4"])
        out = capsys.readouterr().out
        assert rc == 0, out
        printed = [line for line in out.splitlines() if line.startswith("[0] ")]
        cfg = config_from_json(d)
        model = build_model(cfg, "sm90", "bf16", "fp32", 0, "reference", str(d), 0, "cpu", 512, 1)
        want = Generator(model).generate([Request([5, 6, 7, 5, 6], 4)])[0].out
        assert printed == [f"[0] {want}"], (name, out)
        assert model.ops.gate is cfg.kda_gate
