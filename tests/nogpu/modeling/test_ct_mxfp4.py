"""The official K3 layout (compressed-tensors mxfp4-pack-quantized experts): writer, streaming
reader, TP/EP slicing, typed errors. Decoding is checked against an independent decoder
(ml_dtypes float4_e2m1fn values times 2^(byte - 127)), never against the module's own code."""
from __future__ import annotations

import json
import shutil
import weakref

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from k3gen.ir.dtypes import ScaleRecipe
from model.checkpoint import INDEX, PREFIX, BadValueError, MissingTensorError, TensorShapeError
from model.config import get_config
from model.formats import ct_mxfp4 as C
from model.weights import Fp8Linear
from helpers import CountingShard

CFG = get_config("tiny")
SHARDS = 5


# -- independent decoder ---------------------------------------------------------------------------
def ref_decode(packed: torch.Tensor, scale: torch.Tensor) -> np.ndarray:
    p = packed.numpy()
    nib = np.stack([p & 0xF, p >> 4], -1).reshape(*p.shape[:-1], -1).astype(np.uint8)
    v = nib.view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    s = np.ldexp(np.float32(1.0), scale.numpy().astype(np.int32) - 127).astype(np.float32)
    return v * np.repeat(s, 32, axis=-1)


def raw(folder, name):
    shard = json.loads((folder / INDEX).read_text())["weight_map"][name]
    with safe_open(str(folder / shard), framework="pt") as f:
        return f.get_tensor(name)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return C.write_official_checkpoint(CFG, tmp_path_factory.mktemp("k3_official"), seed=3, shards=SHARDS)


# -- layout -----------------------------------------------------------------------------------------
def test_layout_and_config(ckpt):
    idx = json.loads((ckpt / INDEX).read_text())["weight_map"]
    assert len(set(idx.values())) == SHARDS
    assert set(idx) == set(C.official_tensors(CFG))
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["text_config"]["quantization_config"]["format"] == "mxfp4-pack-quantized"
    e = f"{PREFIX}layers.1.block_sparse_moe.experts.7."
    I, W = CFG.moe_inter, CFG.expert_width
    want = {e + "w1.weight_packed": ((I, W // 2), torch.uint8), e + "w3.weight_scale": ((I, W // 32), torch.uint8),
            e + "w2.weight_packed": ((W, I // 2), torch.uint8), e + "w2.weight_scale": ((W, I // 32), torch.uint8),
            f"{PREFIX}layers.0.self_attn.A_log": ((128,), torch.float32),
            f"{PREFIX}layers.0.self_attn.dt_bias": ((CFG.kda_heads * 128,), torch.float32),
            f"{PREFIX}layers.0.self_attn.q_conv1d.weight": ((CFG.kda_heads * 128, 1, 4), torch.float32),
            f"{PREFIX}layers.1.block_sparse_moe.gate.e_score_correction_bias": ((CFG.experts,), torch.float32),
            f"{PREFIX}layers.1.block_sparse_moe.routed_expert_down_proj.weight": ((W, CFG.hidden), torch.bfloat16),
            f"{PREFIX}layers.3.mlp_res_proj.weight": ((1, CFG.hidden), torch.bfloat16),
            f"{PREFIX}output_attn_res_proj.weight": ((1, CFG.hidden), torch.bfloat16),
            f"{PREFIX}layers.0.mlp.gate_proj.weight": ((CFG.dense_inter, CFG.hidden), torch.bfloat16),
            "language_model.lm_head.weight": ((CFG.vocab, CFG.hidden), torch.bfloat16)}
    for n, (shape, dt) in want.items():
        t = raw(ckpt, n)
        assert (tuple(t.shape), t.dtype) == (shape, dt), n
    a = raw(ckpt, f"{PREFIX}layers.2.self_attn.A_log")
    assert (a[CFG.kda_heads:] == 0).all() and (a[:CFG.kda_heads] != 0).all()


# -- (a) decoding ------------------------------------------------------------------------------------
def test_known_answer_nibble_order():
    # byte 0x2F: low nibble 0xF = -6 is the even element, high nibble 0x2 = +1.0; scale 2^(128-127).
    packed = torch.tensor([[0x2F] * 16], dtype=torch.uint8)
    scale = torch.tensor([[128]], dtype=torch.uint8)
    assert ref_decode(packed, scale)[0, :2].tolist() == [-12.0, 2.0]
    assert C.decode_mxfp4(packed, scale)[0, :2].tolist() == [-12.0, 2.0]


def test_reader_experts_decode_bit_exact(ckpt):
    r = C.CtMxfp4Checkpoint(ckpt)
    I = CFG.moe_inter
    for i in (1, 3):
        L = r.layer(i)
        ex = L.experts
        assert ex.fmt == "mxfp4" and ex.w13.dtype == torch.uint8 and ex.w13_global is None
        w13_bf, w2_bf = ex.dequant()
        for e in range(CFG.experts):
            base = f"{PREFIX}layers.{i}.block_sparse_moe.experts.{e}."
            p1, s1 = raw(ckpt, base + "w1.weight_packed"), raw(ckpt, base + "w1.weight_scale")
            p3, s3 = raw(ckpt, base + "w3.weight_packed"), raw(ckpt, base + "w3.weight_scale")
            p2, s2 = raw(ckpt, base + "w2.weight_packed"), raw(ckpt, base + "w2.weight_scale")
            assert torch.equal(ex.w13[e, :I], p1) and torch.equal(ex.w13[e, I:], p3)
            assert torch.equal(ex.w13_scale[e, :I], s1) and torch.equal(ex.w13_scale[e, I:], s3)
            assert torch.equal(ex.w2[e], p2) and torch.equal(ex.w2_scale[e], s2)
            want13 = np.concatenate([ref_decode(p1, s1), ref_decode(p3, s3)])
            want2 = ref_decode(p2, s2)
            assert np.array_equal(C.decode_mxfp4(ex.w13[e], ex.w13_scale[e]).numpy(), want13)
            assert np.array_equal(C.decode_mxfp4(ex.w2[e], ex.w2_scale[e]).numpy(), want2)
            # e2m1 * 2^k is exact in BF16: the model's dequant must give the same values.
            assert np.array_equal(w13_bf[e].float().numpy(), want13)
            assert np.array_equal(w2_bf[e].float().numpy(), want2)


@pytest.mark.parametrize("packer", ["k3gen", "compressed-tensors"])
def test_writer_packing_is_rne_of_the_weights(packer):
    """The writer's codes are RNE(w / scale) on the E2M1 grid (saturating at 6), packed even-low:
    checked with ml_dtypes' own float4 conversion."""
    if packer == "compressed-tensors":
        pytest.importorskip("compressed_tensors")
    w = (torch.randn(64, 256, generator=torch.Generator().manual_seed(5)) * 0.1).to(torch.bfloat16)
    sb = C.mx_scale_bytes(w, packer)
    packed = C.mx_pack(w, sb, packer)
    s = np.ldexp(np.float32(1.0), sb.numpy().astype(np.int32) - 127).astype(np.float32)
    q = np.clip(w.float().numpy() / np.repeat(s, 32, axis=-1), -6, 6)
    want = q.astype(ml_dtypes.float4_e2m1fn).astype(np.float32) * np.repeat(s, 32, axis=-1)
    assert np.array_equal(ref_decode(packed, sb), want)


# -- (b) TP / EP slices --------------------------------------------------------------------------------
_COL = {"q_proj", "k_proj", "v_proj", "g_proj", "b_proj", "f_b_proj", "dt_bias", "A_log", "q_b_proj", "kv_b_proj",
        "gate_proj", "up_proj"}
_ROW = {"o_proj", "down_proj"}


def _rule(key: str) -> str:
    """How a TP1 tensor is split (k3_facts.md section 5): by heads / intermediate rows, by columns, or replicated."""
    leaf = key.rsplit(".", 1)[-1]
    if leaf in _COL or leaf.endswith("_conv1d"):
        return "col"
    if leaf in _ROW:
        return "row"
    return "rep"


def _arr(v):
    return (v.codes, v.scales) if isinstance(v, Fp8Linear) else (v,)


@pytest.mark.parametrize("recipe", [None, ScaleRecipe.FP32, ScaleRecipe.UE8M0])
def test_tp2_ep2_concat_equals_tp1(ckpt, recipe):
    r = C.CtMxfp4Checkpoint(ckpt)
    H = CFG.kda_heads
    for i in range(CFG.layers):
        full = r.layer(i, recipe=recipe)
        parts = [r.layer(i, recipe=recipe, tp=(k, 2), ep=(k, 2)) for k in range(2)]
        assert set(parts[0].tensors) == set(full.tensors)
        for key, v in full.tensors.items():
            rule = _rule(key)
            if recipe is not None and isinstance(v, Fp8Linear) and rule != "rep":
                # Quantizing a slice equals slicing the TP1 tiles only where the split is
                # 128-aligned; b_proj (H rows) and q_b (192 per head) re-tile per rank.
                rows = v.n // 2 if rule == "col" else v.k // 2
                if rows % 128:
                    continue
            for j, want in enumerate(_arr(v)):
                got = [_arr(p.tensors[key])[j] for p in parts]
                if rule == "rep":
                    assert all(torch.equal(g, want) for g in got), key
                else:
                    assert torch.equal(torch.cat(got, dim=0 if rule == "col" else 1), want), (i, key, rule)
        if full.kind == "kda":
            stored = raw(ckpt, f"{PREFIX}layers.{i}.self_attn.A_log")
            assert torch.equal(full.tensors["self_attn.A_log"], stored[:H])
        if full.experts is not None:
            assert [p.expert_ids for p in parts] == [range(0, 4), range(4, 8)]
            for f in ("w13", "w13_scale", "w2", "w2_scale"):
                assert torch.equal(torch.cat([getattr(p.experts, f) for p in parts]), getattr(full.experts, f)), f


def test_expert_tp_split_by_intermediate(ckpt):
    r = C.CtMxfp4Checkpoint(ckpt)
    I = CFG.moe_inter
    full = r.layer(2).experts
    parts = [r.layer(2, tp=(k, 2), expert_tp=True).experts for k in range(2)]
    for f in ("w13", "w13_scale"):
        t = [getattr(p, f) for p in parts]
        w1 = torch.cat([x[:, : I // 2] for x in t], dim=1)
        w3 = torch.cat([x[:, I // 2:] for x in t], dim=1)
        assert torch.equal(torch.cat([w1, w3], dim=1), getattr(full, f)), f
    for f in ("w2", "w2_scale"):
        assert torch.equal(torch.cat([getattr(p, f) for p in parts], dim=2), getattr(full, f)), f


def test_fp8_projection_is_quantized_source(ckpt):
    """An FP8 projection decodes to within one E4M3 step of the BF16 source (UE8M0: power-of-two scales)."""
    r = C.CtMxfp4Checkpoint(ckpt)
    src = raw(ckpt, f"{PREFIX}layers.0.self_attn.q_proj.weight").float()
    for recipe in (ScaleRecipe.FP32, ScaleRecipe.UE8M0):
        q = r.layer(0, recipe=recipe).tensors["self_attn.q_proj"]
        assert isinstance(q, Fp8Linear) and q.recipe is recipe and q.codes.dtype == torch.uint8
        err = (q.dequant() - src).abs().max().item()
        assert 0 < err <= src.abs().max().item() / 8
    assert r.layer(0, recipe=None).tensors["self_attn.q_proj"].dtype == torch.bfloat16


# -- (c) streaming: bytes of tensors read from safetensors alive at once --------------------------------
class _Live:
    """Counts the storage bytes of every tensor the reader gets from safetensors while it is alive
    (a weakref finalizer per tensor). Host memory the reader holds from the checkpoint is exactly
    those tensors (safe_open itself only maps the file); tracemalloc cannot see torch's allocator."""

    def __init__(self):
        self.live = self.peak = self.total = 0
        self.open = self.max_open = 0

    def add(self, t):
        nb = t.untyped_storage().nbytes()
        self.live += nb
        self.total += nb
        self.peak = max(self.peak, self.live)
        weakref.finalize(t, self._drop, nb)
        return t

    def _drop(self, nb):
        self.live -= nb

    def opener(self, path, framework):
        self.open += 1
        self.max_open = max(self.max_open, self.open)
        return CountingShard(path, framework, self.add, self._closed)

    def _closed(self):
        self.open -= 1


def test_streaming_peak_memory(ckpt):
    specs = C.official_tensors(CFG)
    nbytes = {n: raw(ckpt, n).untyped_storage().nbytes() for n in specs}
    idx = json.loads((ckpt / INDEX).read_text())["weight_map"]
    shard_bytes = {}
    for n, s in idx.items():
        shard_bytes[s] = shard_bytes.get(s, 0) + nbytes[n]
    total = sum(nbytes.values())
    live = _Live()
    r = C.CtMxfp4Checkpoint(ckpt, opener=live.opener)
    assert live.total == 0       # opening reads headers only
    for L in r.iter_layers(recipe=ScaleRecipe.FP32):
        del L                    # the consumer moves each layer away before the next is read
    r.top()
    # Every tensor read exactly once; alive at once: at most one shard plus one tensor, and far
    # below the checkpoint (a reader that loads a shard or the whole file first fails this).
    assert live.total == total
    assert live.peak <= max(shard_bytes.values()) + max(nbytes.values())
    assert live.peak <= total / 3
    # Shards open at once: only those a layer's tensors span (not the whole checkpoint).
    span = {}
    for n, s in idx.items():
        li = C.layer_of(n)
        li = CFG.layers if li is None else li
        lo, hi = span.get(s, (li, li))
        span[s] = (min(lo, li), max(hi, li))
    need = max(sum(lo <= i <= hi for lo, hi in span.values()) for i in range(CFG.layers + 1))
    assert live.max_open <= need < SHARDS
    # EP: a rank reads only its own experts' bytes.
    ex = sum(b for n, b in nbytes.items() if ".experts." in n)
    live2 = _Live()
    r2 = C.CtMxfp4Checkpoint(ckpt, opener=live2.opener)
    for L in r2.iter_layers(recipe=None, ep=(1, 2)):
        del L
    assert live2.total == total - ex // 2 - sum(nbytes[n] for n in specs if C.layer_of(n) is None)


# -- (d) bad input ------------------------------------------------------------------------------------
def _copy(src, dst, tensors=None, index=None, config=None):
    shutil.copytree(src, dst)
    wm = json.loads((dst / INDEX).read_text())
    if tensors:
        for name, fn in tensors.items():
            shard = wm["weight_map"].get(name) or sorted(set(wm["weight_map"].values()))[0]
            d = load_file(str(dst / shard))
            fn(d, name)
            save_file(d, str(dst / shard), metadata={"format": "pt"})
            if name in d:
                wm["weight_map"][name] = shard
    if index:
        index(wm["weight_map"])
    (dst / INDEX).write_text(json.dumps(wm))
    if config:
        c = json.loads((dst / "config.json").read_text())
        config(c["text_config"]["quantization_config"])
        (dst / "config.json").write_text(json.dumps(c))
    return dst


def _set(value):
    def fn(d, n):
        d[n] = value(d.get(n))
    return fn


def _poison(v, flat=0):
    def fn(d, n):
        t = d[n].clone()
        t.view(-1)[flat] = v
        d[n] = t
    return fn


L0, L1, L2 = (f"{PREFIX}layers.{i}." for i in range(3))
_OPEN_CASES = {
    "missing": ({L2 + "self_attn.dt_bias": lambda d, n: d.pop(n)}, lambda m: m.pop(L2 + "self_attn.dt_bias"),
                MissingTensorError, L2 + "self_attn.dt_bias"),
    "missing_in_shard": ({L0 + "self_attn.o_norm.weight": lambda d, n: d.pop(n)}, None, MissingTensorError,
                         L0 + "self_attn.o_norm.weight"),
    "unexpected": ({L0 + "self_attn.bogus.weight": _set(lambda _: torch.zeros(4, dtype=torch.bfloat16))}, None,
                   C.UnexpectedTensorError, L0 + "self_attn.bogus.weight"),
    "mis_shaped": ({L0 + "self_attn.q_proj.weight": _set(lambda t: torch.zeros(t.shape[0] + 1, t.shape[1],
                                                                               dtype=t.dtype))},
                   None, TensorShapeError, L0 + "self_attn.q_proj.weight"),
    "wrong_dtype": ({L1 + "block_sparse_moe.experts.3.w2.weight_scale": _set(lambda t: t.float())}, None,
                    TensorShapeError, L1 + "block_sparse_moe.experts.3.w2.weight_scale"),
    "a_log_unpadded": ({L2 + "self_attn.A_log": _set(lambda t: t[:CFG.kda_heads].clone())}, None, TensorShapeError,
                       L2 + "self_attn.A_log"),
}


@pytest.mark.parametrize("case", sorted(_OPEN_CASES))
def test_bad_checkpoint_at_open(ckpt, tmp_path, case):
    tensors, index, err, name = _OPEN_CASES[case]
    bad = _copy(ckpt, tmp_path / case, tensors, index)
    with pytest.raises(err, match=name.replace(".", r"\.")):
        C.CtMxfp4Checkpoint(bad)


_READ_CASES = {
    "nan_bf16": (L0 + "self_attn.g_proj.weight", _poison(float("nan"), 7), 0),
    "inf_f32": (L2 + "self_attn.dt_bias", _poison(float("inf"), 3), 2),
    "nan_f32_conv": (L2 + "self_attn.k_conv1d.weight", _poison(float("nan"), 0), 2),
    "ue8m0_nan": (L1 + "block_sparse_moe.experts.5.w2.weight_scale", _poison(255, 11), 1),
}


@pytest.mark.parametrize("case", sorted(_READ_CASES))
def test_bad_values_at_read(ckpt, tmp_path, case):
    name, fn, layer = _READ_CASES[case]
    bad = _copy(ckpt, tmp_path / case, {name: fn})
    r = C.CtMxfp4Checkpoint(bad)
    with pytest.raises(BadValueError, match=name.replace(".", r"\.")):
        r.layer(layer, recipe=ScaleRecipe.FP32)
    if case == "ue8m0_nan":   # EP rank 0 owns experts 0..3 and never reads expert 5
        r.layer(layer, ep=(0, 2))


@pytest.mark.parametrize("case", ["format", "group_format", "group_size", "absent"])
def test_bad_quant_config(ckpt, tmp_path, case):
    def edit(q):
        if case == "format":
            q["format"] = "nvfp4-pack-quantized"
        elif case == "group_format":
            q["config_groups"]["group_0"]["format"] = "nvfp4-pack-quantized"
        elif case == "group_size":
            q["config_groups"]["group_0"]["weights"]["group_size"] = 16
        else:
            q.clear()
    bad = _copy(ckpt, tmp_path / case, config=edit)
    with pytest.raises(C.QuantConfigError, match="group_size" if case == "group_size" else "quantization_config|format"):
        C.CtMxfp4Checkpoint(bad)


# -- (e) compressed-tensors agrees ----------------------------------------------------------------------
def test_compressed_tensors_decompressor_agrees(ckpt):
    pytest.importorskip("compressed_tensors")
    comp, scheme = C._ct_compressor()
    for e in (0, 6):
        for w in ("w1", "w2"):
            base = f"{PREFIX}layers.3.block_sparse_moe.experts.{e}.{w}."
            p, s = raw(ckpt, base + "weight_packed"), raw(ckpt, base + "weight_scale")
            out = comp.decompress({"weight_packed": p, "weight_scale": s}, scheme)
            assert np.array_equal(out["weight"].float().numpy(), ref_decode(p, s))


def _plus_zero(p: torch.Tensor) -> torch.Tensor:
    """Nibble 0x8 (-0) -> 0x0: the one place the packers differ. compressed-tensors codes an
    input that rounds to zero as +0 (also -0.0 itself); k3gen keeps the sign, as the hardware
    cvt.rn.satfinite.e2m1x2.f32 does. Both decode to the value 0."""
    lo, hi = p & 0xF, p >> 4
    lo, hi = torch.where(lo == 8, 0, lo), torch.where(hi == 8, 0, hi)
    return (lo | (hi << 4)).to(torch.uint8)


def test_compressed_tensors_packer_matches_k3gen_at_ties():
    pytest.importorskip("compressed_tensors")
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, 0.0, 0.1, 5.9, 6.0, 0.26, 2.4, 4.5, 1.0])
    x = torch.cat([ties, -ties]).repeat(8, 4)                     # [8, 128]
    sb0 = torch.full((8, 4), 126, dtype=torch.uint8)              # scale 1/2: codes see x / 0.5
    g = (torch.randn(32, 512, generator=torch.Generator().manual_seed(9)) * 0.05).to(torch.bfloat16)
    for w, sb in (((x * 0.5).to(torch.bfloat16), sb0), (g, C.mx_scale_bytes(g, "compressed-tensors"))):
        ct, k3 = C.mx_pack(w, sb, "compressed-tensors"), C.mx_pack(w, sb, "k3gen")
        assert np.array_equal(ref_decode(ct, sb), ref_decode(k3, sb))
        assert torch.equal(_plus_zero(ct), _plus_zero(k3))
    # the tie row: RNE takes the even code at every midpoint (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2,
    # 2.5 -> 2, 3.5 -> 4, 5 -> 4), 7 saturates at 6; decoded values carry the 1/2 scale
    tie = ref_decode(C.mx_pack((x * 0.5).to(torch.bfloat16), sb0, "compressed-tensors"), sb0)
    assert tie[0, :8].tolist() == [0.0, 0.5, 0.5, 1.0, 1.0, 2.0, 2.0, 3.0]
