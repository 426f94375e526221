"""Tensor and layout specs: the paged MLA KV formats, the HP tail ring, recurrent-state pools.

Shapes are tuples of sympy expressions so that index math, pool sizes and the byte estimates
of benchmarks and capacity planning all come from one place.
"""
from __future__ import annotations

from dataclasses import dataclass

import sympy

from k3gen.errors import SpecError
from k3gen.ir.dims import sym
from k3gen.ir.dtypes import (BF16, E4M3, FP32, INT32, Fp8ScaleGranularity, KvDtype, ScalarType,
                     ScaleLayout, SsmDtype)

MLA_LATENT = 512
MLA_ROPE = 64
MLA_ROW = MLA_LATENT + MLA_ROPE          # 576 values per cached token
NVFP4_BLOCK = 16
NVFP4_TILE_TOKENS = 16
KDA_DK = KDA_DV = 128
CONV_TAPS = 4

PAGE_TOKENS = {KvDtype.BF16: 64, KvDtype.FP8: 64, KvDtype.NVFP4: 128}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple
    dtype: ScalarType
    doc: str = ""

    @property
    def numel(self) -> sympy.Expr:
        return sympy.Mul(*[sympy.sympify(s) for s in self.shape])

    @property
    def nbytes(self) -> sympy.Expr:
        return self.numel * sympy.Rational(self.dtype.bits, 8)

    def concrete_shape(self, **dims) -> tuple[int, ...]:
        subs = {sym(k): v for k, v in dims.items()}
        out = []
        for s in self.shape:
            e = sympy.sympify(s).subs(subs)
            if e.free_symbols:
                raise SpecError(f"{self.name}.shape", str(s), "values for " + ", ".join(
                    sorted(str(x) for x in e.free_symbols)))
            out.append(int(e))
        return tuple(out)


def swizzle_128x4_offset(r, c, cols: int):
    """Byte offset of scale (row r, column c) in the 128x4 swizzled layout of Blackwell's
    block-scaled MMA. Works on ints and on torch/numpy integer arrays alike."""
    col_groups = -(-cols // 4)
    return (c % 4) + (c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + (r // 128) * 128 * col_groups * 4


@dataclass(frozen=True, kw_only=True)
class KvLayout:
    """One paged MLA KV format. Pages hold `page` tokens; page ids index every paged tensor."""
    kv: KvDtype
    page: int
    fp8_scales: Fp8ScaleGranularity = Fp8ScaleGranularity.PER_TOKEN_128
    scale_layout: ScaleLayout = ScaleLayout.LINEAR
    max_drafts: int = 0   # M: the HP tail ring holds 16 + M rows

    def __post_init__(self):
        want = PAGE_TOKENS[self.kv]
        if self.page != want:
            raise SpecError("page", self.page, [want], f"{self.kv} KV pages hold {want} tokens")
        if not 0 <= self.max_drafts <= 7:
            raise SpecError("max_drafts", self.max_drafts, "0..7")

    # -- derived facts ----------------------------------------------------------------------
    @property
    def ring(self) -> int:
        return NVFP4_TILE_TOKENS + self.max_drafts

    @property
    def fp8_groups(self) -> int:
        """Per-token scale groups of the FP8 per-128 format: 4 latent groups + 1 rope group."""
        return MLA_LATENT // 128 + 1

    @property
    def nvfp4_scale_cols(self) -> int:
        """Columns of the logical per-row scale matrix: 32 latent tile blocks + 4 rope blocks."""
        return (MLA_LATENT + MLA_ROPE) // NVFP4_BLOCK

    def tensors(self) -> dict[str, TensorSpec]:
        """The paged tensors, by name, with sympy shapes over `num_pages` (and `num_slots`)."""
        P, S, pg = sym("num_pages"), sym("num_slots"), self.page
        if self.kv is KvDtype.BF16:
            return {"kv": TensorSpec("kv", (P, pg, MLA_ROW), BF16, "rows of 576 BF16")}
        if self.kv is KvDtype.FP8:
            t = {"kv_codes": TensorSpec("kv_codes", (P, pg, MLA_ROW), E4M3, "E4M3 codes")}
            if self.fp8_scales is Fp8ScaleGranularity.PER_TOKEN_128:
                t["kv_scales"] = TensorSpec("kv_scales", (P, pg, self.fp8_groups), FP32,
                                            "FP32 scale per token per 128 latent dims, + 1 for rope")
            return t
        t = {"kv_codes": TensorSpec("kv_codes", (P, pg, MLA_ROW // 2), E4M3,
                                    "E2M1 pairs, even element in the low nibble")}
        if self.scale_layout is ScaleLayout.LINEAR:
            t["tile_scales"] = TensorSpec("tile_scales", (P, pg // NVFP4_TILE_TOKENS,
                                          MLA_LATENT // NVFP4_BLOCK), E4M3, "16x16 latent tile scales")
            t["rope_scales"] = TensorSpec("rope_scales", (P, pg, MLA_ROPE // NVFP4_BLOCK), E4M3,
                                          "per-token rope scales per 16 dims")
        else:
            cols4 = -(-self.nvfp4_scale_cols // 4) * 4
            t["scales"] = TensorSpec("scales", (P, pg * cols4), E4M3,
                                     "per-row scale matrix [128, 36] per page, 128x4 swizzled")
        t["hp_tail"] = TensorSpec("hp_tail", (S, self.ring, MLA_ROW), BF16,
                                  "BF16 ring of the newest rows, indexed by position % ring")
        return t

    def paged_tensors(self) -> dict[str, TensorSpec]:
        return {k: v for k, v in self.tensors().items() if k != "hp_tail"}

    @property
    def bytes_per_page(self) -> sympy.Expr:
        return sum((t.nbytes for t in self.paged_tensors().values()), sympy.Integer(0)).subs(
            sym("num_pages"), 1)

    @property
    def bytes_per_token(self) -> sympy.Expr:
        return self.bytes_per_page / self.page

    @property
    def bytes_per_seq_fixed(self) -> sympy.Expr:
        """Per-sequence bytes independent of length (the HP tail)."""
        t = self.tensors().get("hp_tail")
        return t.nbytes.subs(sym("num_slots"), 1) if t else sympy.Integer(0)

    def canonical(self) -> dict:
        d = {"kv": self.kv.value, "page": self.page}
        if self.kv is KvDtype.FP8:
            d["fp8_scales"] = self.fp8_scales.value
        if self.kv is KvDtype.NVFP4:
            d["scale_layout"] = self.scale_layout.value
            d["max_drafts"] = self.max_drafts
        return d


@dataclass(frozen=True, kw_only=True)
class StatePoolLayout:
    """KDA recurrent state pools, V-first: ssm[slot, H, V, K] with K contiguous (stores S^T)."""
    heads: int
    ssm: SsmDtype = SsmDtype.FP32
    max_drafts: int = 0

    def __post_init__(self):
        if self.heads < 1:
            raise SpecError("heads", self.heads, "a positive head count")
        if not 0 <= self.max_drafts <= 7:
            raise SpecError("max_drafts", self.max_drafts, "0..7")

    def tensors(self) -> dict[str, TensorSpec]:
        S, H, D = sym("num_slots"), self.heads, self.heads * KDA_DK
        sdt = FP32 if self.ssm is SsmDtype.FP32 else BF16
        t = {
            "ssm": TensorSpec("ssm", (S, H, KDA_DV, KDA_DK), sdt, "state S^T per head"),
            "conv": TensorSpec("conv", (S, 3 * D, CONV_TAPS - 1), BF16, "last 3 raw q|k|v inputs"),
        }
        if self.max_drafts:
            M = self.max_drafts
            t["draft_rec"] = TensorSpec("draft_rec", (S, M, H, KDA_DV, KDA_DK), FP32,
                                        "FP32 state after each draft")
            t["conv_ext"] = TensorSpec("conv_ext", (S, 3 * D, CONV_TAPS - 1 + M), FP32,
                                       "extended conv window for verify")
            t["pending"] = TensorSpec("pending", (S,), INT32, "accepted drafts of the last step")
        return t

    @property
    def bytes_per_slot(self) -> sympy.Expr:
        return sum((t.nbytes for t in self.tensors().values()), sympy.Integer(0)).subs(
            sym("num_slots"), 1)

    def canonical(self) -> dict:
        return {"heads": self.heads, "ssm": self.ssm.value, "max_drafts": self.max_drafts}
