"""The official moonshotai/Kimi-K3 checkpoint layout (compressed-tensors `mxfp4-pack-quantized`
routed experts, BF16 elsewhere): a writer of small random checkpoints in that layout and a
streaming reader with TP / EP slicing.

Layout (k3_facts.md sections 1.4, 2, 3; names below `language_model.model.layers.N.`):
- KDA `self_attn.{q,k,v,g}_proj` [D, hidden], `f_a_proj` [128, hidden], `f_b_proj` [D, 128],
  `b_proj` [H, hidden], `o_proj` [hidden, D] BF16; `{q,k,v}_conv1d.weight` [D, 1, 4], `A_log`
  [128] (padded, first H real), `dt_bias` [D], `o_norm.weight` [128] F32.
- MLA `self_attn.q_a_proj`, `q_a_layernorm`, `q_b_proj` (per head [nope 128 | rope 64] rows),
  `kv_a_proj_with_mqa`, `kv_a_layernorm`, `kv_b_proj` (per head [k_nope 128 | v 128] rows),
  `g_proj`, `o_proj`, all BF16.
- Layer 0 `mlp.{gate,up,down}_proj` BF16; MoE `block_sparse_moe.gate.weight` BF16 +
  `gate.e_score_correction_bias` F32, `routed_expert_{down_proj,up_proj,norm}` and
  `shared_experts.*` BF16, routed experts `experts.E.w{1,3}` [I, W] / `w2` [W, I] as
  `weight_packed` uint8 [N, K/2] (E2M1 pairs, even element in the low nibble) + `weight_scale`
  uint8 UE8M0 [N, K/32] (value = e2m1 * 2^(byte - 127)).
- Per layer `input_layernorm`, `post_attention_layernorm`, `self_attention_res_{norm,proj}`,
  `mlp_res_{norm,proj}`; top level `embed_tokens`, `norm`, `output_attn_res_{norm,proj}` and
  `language_model.lm_head.weight`.

Reader choices: the attention projections are quantized at load to FP8 128x128 tiles with the
caller's recipe, except `kv_b_proj` (kept BF16: the model dequantizes it to the absorbed W_UK /
W_UV anyway, so an FP8 round trip would only add error) and `f_b_proj` (BF16: the fused KDA
kernel applies it itself). `f_a_proj`, MLA `q_a_proj` / `kv_a_proj_with_mqa`, the router, the
latent projections and embed / LM head are replicated across TP ranks (vLLM kimi_k3 loads
f_a replicated and the MLA A-projection with disable_tp; k3_facts.md section 5).
"""
from __future__ import annotations

import copy
import json
import re
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import torch

from k3gen import numerics as Q
from k3gen.errors import SpecError
from k3gen.ir.dtypes import ScaleRecipe
from k3gen.ops.fp8_block_gemm.reference import quantize_weights
from model.checkpoint import (open_shard, INDEX, LM_HEAD, PREFIX, BadValueError, CheckpointError, MissingTensorError,
                              TensorShapeError, UnexpectedTensorError)
from model.config import ModelConfig
from model.weight_types import ExpertWeights, Fp8Linear

QUANT_FORMAT = "mxfp4-pack-quantized"
GROUP = 32
# SGLang / vLLM kimi_k3 map this older prefix onto the canonical one (WeightsMapper).
_ALIAS = ("language_model.layers.", PREFIX + "layers.")
# Tensors of the vision tower / projector share the official checkpoint; the text reader skips them.
_OTHER_TOWERS = ("vision_tower.", "mm_projector.", "language_model.vision_tower.", "language_model.mm_projector.")
_DTYPES = {"BF16": torch.bfloat16, "F32": torch.float32, "U8": torch.uint8}
_LAYER_RE = re.compile(r"layers\.(\d+)\.")


class QuantConfigError(CheckpointError):
    """config.json's quantization_config is not the one this reader decodes."""


def quantization_config() -> dict:
    """`text_config.quantization_config` of moonshotai/Kimi-K3 (k3_facts.md section 1.4)."""
    weights = {"actorder": None, "block_structure": None, "dynamic": False, "group_size": GROUP, "num_bits": 4,
               "observer": "minmax", "observer_kwargs": {}, "scale_dtype": "torch.uint8", "strategy": "group",
               "symmetric": True, "type": "float", "zp_dtype": None}
    return {"config_groups": {"group_0": {"format": QUANT_FORMAT, "targets": ["Linear"], "input_activations": None,
                                          "output_activations": None, "weights": weights}},
            "format": QUANT_FORMAT, "global_compression_ratio": None,
            "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
                       "re:.*lm_head.*", "re:.*vision_tower.*", "re:.*mm_projector.*"],
            "kv_cache_scheme": None, "quant_method": "compressed-tensors", "quantization_status": "compressed"}


def check_quant_config(d: dict) -> dict:
    """The quantization_config of a config.json dict (inside text_config, or lifted to the top as
    SGLang's KimiK3Config does), checked to be MXFP4 pack-quantized with groups of 32."""
    q = (d.get("text_config") or {}).get("quantization_config") or d.get("quantization_config")
    if not isinstance(q, dict):
        raise QuantConfigError("config.json: no quantization_config (text_config or top level)")
    if q.get("quant_method", "compressed-tensors") != "compressed-tensors":
        raise QuantConfigError(f"quantization_config.quant_method={q.get('quant_method')!r}, expected compressed-tensors")
    groups = q.get("config_groups") or {}
    if q.get("format") != QUANT_FORMAT:
        raise QuantConfigError(f"quantization_config.format={q.get('format')!r}, expected {QUANT_FORMAT!r}")
    if not groups:
        raise QuantConfigError("quantization_config.config_groups is empty")
    for g, v in groups.items():
        w = v.get("weights") or {}
        fmt = v.get("format", q["format"])
        if fmt != QUANT_FORMAT:
            raise QuantConfigError(f"config_groups.{g}.format={fmt!r}, expected {QUANT_FORMAT!r}")
        for k, want in (("group_size", GROUP), ("num_bits", 4), ("type", "float"), ("strategy", "group"),
                        ("symmetric", True)):
            if w.get(k) != want:
                raise QuantConfigError(f"config_groups.{g}.weights.{k}={w.get(k)!r}, expected {want!r}")
    return q


# -- names and shapes ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Spec:
    shape: tuple[int, ...]
    dtype: str            # safetensors dtype string: BF16, F32, U8
    kind: str             # "plain", "packed" (E2M1 pairs), "ue8m0" (scale bytes)


def official_tensors(cfg: ModelConfig) -> dict[str, Spec]:
    """Every tensor of the official layout for `cfg` (TP1), by full name, in layer order."""
    if cfg.kda_out_gate != "full" or cfg.q_lora is None:
        raise SpecError("kda_out_gate/q_lora", (cfg.kda_out_gate, cfg.q_lora), [("full", "an int")],
                        "the official K3 layout (full-rank KDA gate, MLA q_a/q_b)")
    t: dict[str, Spec] = {}
    hid = cfg.hidden

    def bf(name, *shape):
        t[name] = Spec(tuple(shape), "BF16", "plain")

    def f32(name, *shape):
        t[name] = Spec(tuple(shape), "F32", "plain")

    def mx(name, n, k):
        t[name + ".weight_packed"] = Spec((n, k // 2), "U8", "packed")
        t[name + ".weight_scale"] = Spec((n, k // GROUP), "U8", "ue8m0")

    for i in range(cfg.layers):
        p = f"{PREFIX}layers.{i}."
        for n in ("input_layernorm", "post_attention_layernorm"):
            bf(p + n + ".weight", hid)
        if cfg.attn_res_block is not None:
            for n in ("self_attention_res", "mlp_res"):
                bf(p + n + "_norm.weight", hid)
                bf(p + n + "_proj.weight", 1, hid)
        a = p + "self_attn."
        if cfg.kind(i) == "kda":
            H = cfg.kda_heads
            D = H * cfg.kda_head_dim
            for n in ("q_proj", "k_proj", "v_proj", "g_proj"):
                bf(a + n + ".weight", D, hid)
            bf(a + "f_a_proj.weight", cfg.kda_head_dim, hid)
            bf(a + "f_b_proj.weight", D, cfg.kda_head_dim)
            bf(a + "b_proj.weight", H, hid)
            for n in ("q_conv1d", "k_conv1d", "v_conv1d"):
                f32(a + n + ".weight", D, 1, cfg.conv_size)
            f32(a + "A_log", *((cfg.a_log_pad,) if cfg.a_log_pad else (1, 1, H, 1)))
            f32(a + "dt_bias", D)
            f32(a + "o_norm.weight", cfg.kda_head_dim)
            bf(a + "o_proj.weight", hid, D)
        else:
            H = cfg.mla_heads
            bf(a + "q_a_proj.weight", cfg.q_lora, hid)
            bf(a + "q_a_layernorm.weight", cfg.q_lora)
            bf(a + "q_b_proj.weight", H * (cfg.qk_nope + cfg.qk_rope), cfg.q_lora)
            bf(a + "kv_a_proj_with_mqa.weight", cfg.kv_lora + cfg.qk_rope, hid)
            bf(a + "kv_a_layernorm.weight", cfg.kv_lora)
            bf(a + "kv_b_proj.weight", H * (cfg.qk_nope + cfg.v_head), cfg.kv_lora)
            if cfg.mla_out_gate:
                bf(a + "g_proj.weight", H * cfg.v_head, hid)
            bf(a + "o_proj.weight", hid, H * cfg.v_head)
        if cfg.is_dense(i):
            m = p + "mlp."
            bf(m + "gate_proj.weight", cfg.dense_inter, hid)
            bf(m + "up_proj.weight", cfg.dense_inter, hid)
            bf(m + "down_proj.weight", hid, cfg.dense_inter)
            continue
        m = p + "block_sparse_moe."
        bf(m + "gate.weight", cfg.experts, hid)
        f32(m + "gate.e_score_correction_bias", cfg.experts)
        W, I = cfg.expert_width, cfg.moe_inter
        if cfg.moe_latent is not None:
            bf(m + "routed_expert_down_proj.weight", W, hid)
            bf(m + "routed_expert_up_proj.weight", hid, W)
            if cfg.latent_norm:
                bf(m + "routed_expert_norm.weight", W)
        for e in range(cfg.experts):
            mx(f"{m}experts.{e}.w1", I, W)
            mx(f"{m}experts.{e}.w3", I, W)
            mx(f"{m}experts.{e}.w2", W, I)
        if cfg.shared_experts:
            si = cfg.shared_inter
            bf(m + "shared_experts.gate_proj.weight", si, hid)
            bf(m + "shared_experts.up_proj.weight", si, hid)
            bf(m + "shared_experts.down_proj.weight", hid, si)
    bf(PREFIX + "embed_tokens.weight", cfg.vocab, hid)
    bf(PREFIX + "norm.weight", hid)
    if cfg.attn_res_block is not None:
        bf(PREFIX + "output_attn_res_norm.weight", hid)
        bf(PREFIX + "output_attn_res_proj.weight", 1, hid)
    bf(LM_HEAD, cfg.vocab, hid)
    return t


def _nbytes(s: Spec) -> int:
    n = 1
    for d in s.shape:
        n *= d
    return n * (2 if s.dtype == "BF16" else 4 if s.dtype == "F32" else 1)


def layer_of(name: str) -> int | None:
    m = _LAYER_RE.search(name)
    return int(m.group(1)) if m else None


# -- MXFP4 packing ---------------------------------------------------------------------------------
def _ct_compressor():
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    w = quantization_config()["config_groups"]["group_0"]["weights"]
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**w))
    return BaseCompressor.get_value_from_registry(QUANT_FORMAT), scheme


def mx_scale_bytes(w: torch.Tensor, packer: str) -> torch.Tensor:
    """UE8M0 bytes [N, K/32] of BF16/FP32 w [N, K]. "compressed-tensors": its observer's rule
    (`generate_mx_scales`: amax rounded to a power of two, exponent minus floor(log2 6) = 2, which
    may saturate a few values at 6); "k3gen": numerics.mxfp4_scale's OCP floor rule."""
    amax = w.float().reshape(w.shape[0], -1, GROUP).abs().amax(-1)
    if packer == "compressed-tensors":
        from compressed_tensors.quantization.utils.mxfp_utils import generate_mx_scales
        e = generate_mx_scales(amax.clamp(min=2.0 ** -120))
        return e.clamp(0, 254).to(torch.uint8)
    if packer == "k3gen":
        return Q.mxfp4_scale(amax, rounding="floor")
    raise ValueError(f"packer={packer!r}: 'compressed-tensors' or 'k3gen'")


def mx_pack(w: torch.Tensor, scale_bytes: torch.Tensor, packer: str) -> torch.Tensor:
    """E2M1 codes of w / 2^(byte - 127) (RNE, saturating at 6), packed [N, K/2], even element low."""
    s = torch.exp2(scale_bytes.float() - 127.0)
    if packer == "compressed-tensors":
        comp, scheme = _ct_compressor()
        out = comp.compress({"weight": w.to(torch.bfloat16), "weight_scale": s.to(torch.bfloat16)}, scheme)
        if not torch.equal(out["weight_scale"], scale_bytes):   # its log2 encoder must give our bytes back
            raise AssertionError("compressed-tensors re-encoded the UE8M0 scales differently")
        return out["weight_packed"]
    if packer == "k3gen":
        q = Q.e2m1_quantize_step(w.float().reshape(w.shape[0], -1, GROUP), s[..., None])
        return Q.pack_e2m1(q.flatten(-2))
    raise ValueError(f"packer={packer!r}: 'compressed-tensors' or 'k3gen'")


def decode_mxfp4(packed: torch.Tensor, scale_bytes: torch.Tensor) -> torch.Tensor:
    """FP32 [..., K] of packed uint8 [..., K/2] and UE8M0 bytes [..., K/32]."""
    return Q.mxfp4_dequantize(packed, scale_bytes, GROUP)


def default_packer() -> str:
    try:
        _ct_compressor()
        return "compressed-tensors"
    except ImportError:
        return "k3gen"


# -- writer ----------------------------------------------------------------------------------------
_RESIDUAL_WRITERS = ("o_proj.weight", "down_proj.weight", "routed_expert_up_proj.weight")


def _gen(seed: int, name: str) -> torch.Generator:
    # Per-tensor streams: any shard (and any test) regenerates a tensor without the others.
    return torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}".encode()))


def _random_plain(name: str, s: Spec, cfg: ModelConfig, g: torch.Generator) -> torch.Tensor:
    dt = _DTYPES[s.dtype]
    if name.endswith("A_log"):
        a = torch.zeros(s.shape).flatten()
        a[: cfg.kda_heads] = torch.log(torch.rand(cfg.kda_heads, generator=g) * 15 + 1)
        return a.reshape(s.shape)
    if name.endswith(("dt_bias", "e_score_correction_bias")):
        return torch.randn(s.shape, generator=g) * 0.5
    if name.endswith(("norm.weight", "layernorm.weight")):
        return (1.0 + 0.1 * torch.randn(s.shape, generator=g)).to(dt)
    if "conv1d" in name:
        return (0.5 * torch.randn(s.shape, generator=g)).to(dt)
    if name.endswith("embed_tokens.weight"):
        return torch.randn(s.shape, generator=g).to(dt)
    gain = 0.25 if name.endswith(_RESIDUAL_WRITERS) else 1.0
    return (torch.randn(s.shape, generator=g) * s.shape[-1] ** -0.5 * gain).to(dt)


def random_tensor(cfg: ModelConfig, seed: int, name: str, packer: str, specs: dict | None = None) -> torch.Tensor:
    """The stored tensor `name` of the random checkpoint (seed); an expert's `weight_scale` and
    `weight_packed` come from the same BF16 draw, so either can be regenerated alone."""
    specs = specs or official_tensors(cfg)
    s = specs[name]
    if s.kind == "plain":
        return _random_plain(name, s, cfg, _gen(seed, name)).contiguous()
    base = name.rsplit(".", 1)[0]
    n, k = specs[base + ".weight_packed"].shape[0], specs[base + ".weight_packed"].shape[1] * 2
    w = (torch.randn(n, k, generator=_gen(seed, base)) * k ** -0.5).to(torch.bfloat16)
    sb = mx_scale_bytes(w, packer)
    return (sb if s.kind == "ue8m0" else mx_pack(w, sb, packer)).contiguous()


def write_official_checkpoint(cfg: ModelConfig, folder, seed: int = 0, shards: int = 4, config: dict | None = None,
                              packer: str | None = None) -> Path:
    """A random checkpoint of `cfg` in the official layout: `shards` safetensors files of about
    equal size (tensors in layer order; one too large for its share takes a shard of its own),
    `model.safetensors.index.json`, and config.json = `config` (default: the preset dict named
    cfg.name) with `text_config.quantization_config` set. Written one shard at a time."""
    from safetensors.torch import save_file
    from k3gen.presets import PRESETS, preset_dict
    from model.config import config_from_dict
    packer = packer or default_packer()
    if config is None:
        if cfg.name not in PRESETS:
            raise ValueError(f"cfg {cfg.name!r} is not a preset: pass its config.json dict")
        config = preset_dict(cfg.name)
    config = copy.deepcopy(config)
    (config.get("text_config") or config)["quantization_config"] = quantization_config()
    if config_from_dict(config, cfg.name) != cfg:
        raise ValueError("config does not describe cfg")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    specs = official_tensors(cfg)
    total = sum(_nbytes(s) for s in specs.values())
    groups: list[list[str]] = [[] for _ in range(max(1, shards))]
    before = 0
    for name, s in specs.items():
        groups[min(len(groups) - 1, before * len(groups) // total)].append(name)
        before += _nbytes(s)
    groups = [g for g in groups if g]
    weight_map = {}
    for j, names in enumerate(groups):
        fname = f"model-{j + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file({n: random_tensor(cfg, seed, n, packer, specs) for n in names}, str(folder / fname),
                  metadata={"format": "pt"})
        weight_map.update({n: fname for n in names})
    (folder / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder


# -- reader ----------------------------------------------------------------------------------------
@dataclass
class LayerTensors:
    """One layer on one rank. `tensors` is keyed by the checkpoint suffix after `layers.N.` (e.g.
    "self_attn.q_proj"; weights lose their ".weight"): Fp8Linear for the FP8 projections (BF16
    tensors with recipe=None), plain tensors otherwise. `experts` holds this rank's routed experts
    `expert_ids` in their stored MXFP4 form."""
    index: int
    kind: str
    mlp: str
    tensors: dict[str, torch.Tensor | Fp8Linear] = field(default_factory=dict)
    experts: ExpertWeights | None = None
    expert_ids: range | None = None


def _split(n: int, part: tuple[int, int], what: str, align: int = 1) -> slice:
    r, w = part
    if not 0 <= r < w:
        raise SpecError("rank", part, "0 <= rank < world")
    if n % w or (n // w) % align:
        raise SpecError(what, n, f"divisible by {w}" + (f" into multiples of {align}" if align > 1 else ""))
    k = n // w
    return slice(r * k, (r + 1) * k)


_FULL = slice(None)


class CtMxfp4Checkpoint:
    """Reads an official-layout checkpoint tensor by tensor (safetensors `safe_open` slices: a
    rank reads only its own rows / columns / experts). Names, shapes and dtypes of every tensor
    are checked against the config at open time from the shard headers; values (NaN/Inf, UE8M0
    byte 255) when a tensor is read. `opener` replaces safetensors.safe_open (tests count bytes)."""

    def __init__(self, folder, cfg: ModelConfig | None = None, opener=None):
        from k3gen.hf_config import read_config
        from model.config import config_from_dict
        from safetensors import safe_open
        self.folder = Path(folder)
        d, name, _ = read_config(self.folder)
        self.quant = check_quant_config(d)
        self.cfg = cfg or config_from_dict(d, name)
        self._open = opener or safe_open
        idx = self.folder / INDEX
        if not idx.is_file():
            raise CheckpointError(f"{idx}: no safetensors index")
        try:
            raw = json.loads(idx.read_text())["weight_map"]
        except (ValueError, KeyError) as e:
            raise CheckpointError(f"{idx}: not a safetensors index ({e})") from e
        self.specs = official_tensors(self.cfg)
        self.weight_map: dict[str, str] = {}
        self._stored: dict[str, str] = {}          # canonical name -> name inside the shard
        for n, shard in raw.items():
            if n.startswith(_OTHER_TOWERS):
                continue
            c = _ALIAS[1] + n[len(_ALIAS[0]):] if n.startswith(_ALIAS[0]) else n
            if c not in self.specs:
                raise UnexpectedTensorError(f"tensor {n!r} is not a tensor of {self.cfg.name} (official K3 layout)")
            self.weight_map[c], self._stored[c] = shard, n
        for n in self.specs:
            if n not in self.weight_map:
                raise MissingTensorError(f"tensor {n!r} is missing from the checkpoint index")
        self._files: dict[str, object] = {}
        self._check_headers()

    def _file(self, shard: str):
        return open_shard(self.folder, shard, self._files, self._open)

    def close(self, shard: str | None = None) -> None:
        for s in [shard] if shard else list(self._files):
            f = self._files.pop(s, None)
            if f is not None and hasattr(f, "__exit__"):
                f.__exit__(None, None, None)

    def _check_headers(self) -> None:
        by_shard: dict[str, list[str]] = {}
        for n, s in self.weight_map.items():
            by_shard.setdefault(s, []).append(n)
        for shard, names in by_shard.items():
            f = self._file(shard)
            keys = set(f.keys())
            for n in names:
                if self._stored[n] not in keys:
                    raise MissingTensorError(f"tensor {n!r} is not in shard {shard}")
                sl, want = f.get_slice(self._stored[n]), self.specs[n]
                if tuple(sl.get_shape()) != want.shape or sl.get_dtype() != want.dtype:
                    raise TensorShapeError(f"tensor {n!r} is {sl.get_dtype()} {tuple(sl.get_shape())}, "
                                           f"expected {want.dtype} {want.shape}")
            self.close(shard)

    def read(self, name: str, *index: slice) -> torch.Tensor:
        """Tensor `name` (canonical), sliced by `index` along its leading dims, value-checked."""
        spec = self.specs[name]
        t = self._file(self.weight_map[name]).get_slice(self._stored[name])[tuple(index) or _FULL]
        if spec.kind == "ue8m0":
            if (t == 255).any():
                raise BadValueError(f"scale {name!r} holds the UE8M0 NaN byte 255")
        elif t.is_floating_point() and not torch.isfinite(t).all():
            raise BadValueError(f"tensor {name!r} holds NaN/Inf")
        return t

    # -- assembly --
    def top(self) -> dict[str, torch.Tensor]:
        """Embedding, final norm, output AttnRes query and LM head (replicated on every rank)."""
        out = {}
        for n in self.specs:
            if layer_of(n) is None:
                out[n[len(PREFIX):] if n.startswith(PREFIX) else n[len("language_model."):]] = self.read(n)
        return {k.removesuffix(".weight"): v for k, v in out.items()}

    def layer(self, i: int, recipe: ScaleRecipe | None = ScaleRecipe.FP32, tp: tuple[int, int] = (0, 1),
              ep: tuple[int, int] = (0, 1), expert_tp: bool = False) -> LayerTensors:
        """Layer i for TP rank tp = (rank, world) and EP rank ep; recipe None keeps the attention
        projections BF16. expert_tp splits each routed expert's intermediate by tp as well."""
        cfg = self.cfg
        p = f"{PREFIX}layers.{i}."
        out = LayerTensors(i, cfg.kind(i), "dense" if cfg.is_dense(i) else "moe")
        T = out.tensors

        def put(suffix, *index, fp8=False):
            t = self.read(p + suffix, *index)
            key = suffix.removesuffix(".weight")
            T[key] = _fp8(t, recipe) if fp8 and recipe is not None else t

        for n in self.specs:
            if n.startswith(p) and n[len(p):].startswith(("input_layernorm", "post_attention_layernorm",
                                                          "self_attention_res", "mlp_res")):
                put(n[len(p):])
        a = "self_attn."
        if out.kind == "kda":
            H, hd = cfg.kda_heads, cfg.kda_head_dim
            hs = _split(H, tp, "kda_heads")
            rows = slice(hs.start * hd, hs.stop * hd)
            for n in ("q_proj", "k_proj", "v_proj", "g_proj"):
                put(a + n + ".weight", rows, fp8=True)
            put(a + "f_a_proj.weight", fp8=True)
            put(a + "b_proj.weight", hs, fp8=True)
            put(a + "f_b_proj.weight", rows)
            for n in ("q_conv1d", "k_conv1d", "v_conv1d"):
                put(a + n + ".weight", rows)
            # A_log: narrow the padded storage to the first H entries, then split by heads
            # (SGLang kimi_k3 _a_log_weight_loader): entries past H are never read.
            if cfg.a_log_pad:
                put(a + "A_log", hs)
            else:
                put(a + "A_log", _FULL, _FULL, hs)
                T[a + "A_log"] = T[a + "A_log"].reshape(-1)
            put(a + "dt_bias", rows)
            put(a + "o_norm.weight")
            put(a + "o_proj.weight", _FULL, rows, fp8=True)
        else:
            H = cfg.mla_heads
            hs = _split(H, tp, "mla_heads")

            def rows(per):
                return slice(hs.start * per, hs.stop * per)

            put(a + "q_a_proj.weight", fp8=True)
            put(a + "q_a_layernorm.weight")
            put(a + "q_b_proj.weight", rows(cfg.qk_nope + cfg.qk_rope), fp8=True)
            put(a + "kv_a_proj_with_mqa.weight", fp8=True)
            put(a + "kv_a_layernorm.weight")
            put(a + "kv_b_proj.weight", rows(cfg.qk_nope + cfg.v_head))
            if cfg.mla_out_gate:
                put(a + "g_proj.weight", rows(cfg.v_head), fp8=True)
            put(a + "o_proj.weight", _FULL, rows(cfg.v_head), fp8=True)
        if out.mlp == "dense":
            r = _split(cfg.dense_inter, tp, "dense_inter")
            put("mlp.gate_proj.weight", r)
            put("mlp.up_proj.weight", r)
            put("mlp.down_proj.weight", _FULL, r)
            return out
        m = "block_sparse_moe."
        put(m + "gate.weight")
        put(m + "gate.e_score_correction_bias")
        for n in ("routed_expert_down_proj", "routed_expert_up_proj", "routed_expert_norm"):
            if p + m + n + ".weight" in self.specs:
                put(m + n + ".weight")
        if cfg.shared_experts:
            r = _split(cfg.shared_inter, tp, "shared_inter")
            put(m + "shared_experts.gate_proj.weight", r)
            put(m + "shared_experts.up_proj.weight", r)
            put(m + "shared_experts.down_proj.weight", _FULL, r)
        es = _split(cfg.experts, ep, "experts")
        out.expert_ids = range(es.start, es.stop)
        inter = _split(cfg.moe_inter, tp if expert_tp else (0, 1), "moe_inter", align=GROUP)
        out.experts = self.experts(p + m, out.expert_ids, inter)
        return out

    def experts(self, m: str, ids: range, inter: slice) -> ExpertWeights:
        """Experts `ids` of MoE prefix m, intermediate rows `inter` (whole groups of 32), stacked
        [E_r, ...] in their packed form; each stored tensor is read once and copied into the
        preallocated stack (no BF16 copy is ever made)."""
        W = self.cfg.expert_width
        ri = slice(*inter.indices(self.cfg.moe_inter)[:2])
        if ri.start % GROUP or ri.stop % GROUP:
            raise SpecError("moe_inter slice", (ri.start, ri.stop), f"whole groups of {GROUP}")
        Il = ri.stop - ri.start
        cols_b = slice(ri.start // 2, ri.stop // 2)
        cols_s = slice(ri.start // GROUP, ri.stop // GROUP)
        E = len(ids)
        w13 = torch.empty(E, 2 * Il, W // 2, dtype=torch.uint8)
        s13 = torch.empty(E, 2 * Il, W // GROUP, dtype=torch.uint8)
        w2 = torch.empty(E, W, Il // 2, dtype=torch.uint8)
        s2 = torch.empty(E, W, Il // GROUP, dtype=torch.uint8)
        for j, e in enumerate(ids):
            x = f"{m}experts.{e}."
            for half, w in ((0, "w1"), (1, "w3")):     # w13 rows [w1 gate | w3 up] (SGLang gate_up_interleaved=False)
                w13[j, half * Il:(half + 1) * Il] = self.read(x + w + ".weight_packed", ri)
                s13[j, half * Il:(half + 1) * Il] = self.read(x + w + ".weight_scale", ri)
            w2[j] = self.read(x + "w2.weight_packed", _FULL, cols_b)
            s2[j] = self.read(x + "w2.weight_scale", _FULL, cols_s)
        return ExpertWeights(fmt="mxfp4", w13=w13, w13_scale=s13, w13_global=None, w2=w2, w2_scale=s2, w2_global=None)

    def iter_layers(self, **kw):
        """Layers 0..L-1 in order (keyword arguments as `layer`), closing each shard once no later
        layer has a tensor in it: with the writer's layer-ordered shards this streams the
        checkpoint one shard at a time."""
        last: dict[str, int] = {}
        for n, s in self.weight_map.items():
            li = layer_of(n)
            last[s] = max(last.get(s, -1), self.cfg.layers if li is None else li)
        for i in range(self.cfg.layers):
            yield self.layer(i, **kw)
            for s, l in last.items():
                if l <= i:
                    self.close(s)


def _fp8(t: torch.Tensor, recipe: ScaleRecipe) -> Fp8Linear:
    codes, scales = quantize_weights(t.float(), recipe)
    return Fp8Linear(codes, scales, recipe)


__all__ = ["CtMxfp4Checkpoint", "LayerTensors", "QuantConfigError", "UnexpectedTensorError", "check_quant_config",
           "decode_mxfp4", "official_tensors", "quantization_config", "random_tensor", "write_official_checkpoint",
           "mx_pack", "mx_scale_bytes", "QUANT_FORMAT", "GROUP"]
