"""kv_cache_write: append new MLA cache rows (576 per token) of a batch of sequences to paged KV.

Kernel contract (shared by the template, the reference and the launcher):

- `rows[N, 576]` BF16, the new rows of all sequences concatenated; sequence b owns rows
  `cu_rows[b] .. cu_rows[b+1]-1`, which go to positions `start_pos[b] + i`.
- Row address: page `block_table[b, p // page]`, slot `p % page`.
- BF16: copied. FP8 per-tensor: code = E4M3_satfinite(x / scale) with the static `scale` argument.
  FP8 per-token-128: 5 groups per token (4 x 128 latent, 1 x 64 rope), scale = amax / 448
  (FP32), code = E4M3_satfinite(x / scale), code 0 where scale == 0.
- NVFP4: tokens are grouped in 16-token tiles (position // 16). Latent dims 0..511 use one E4M3
  scale per 16-token x 16-dim tile, rope dims 512..575 one per token per 16 dims. Stored scale =
  E4M3_satfinite((amax / 6) * G) with G the FP32 global scale argument; dequant step
  d = float(stored) / G; code = E2M1_rn_satfinite(x / d), 0 where d == 0. A tile is quantized over
  its rows present so far (rows beyond the sequence end count as absent, not as zero rows of
  the page). Rows of the tile older than this call come from the HP tail ring
  `hp_tail[ring_slot[b], p % ring]`, which also receives every new row whose position is in the
  last `ring` positions of the sequence after this call.

Bad indices (checked on the device, recorded in the error word of k3gen/runtime/faults.py; the frozen
sm100-mxfp4 sources predate it and are unchanged):

- `cu_rows` range of sequence b outside `rows`, or decreasing (fault `rows`), `start_pos[b] < 0` or
  `start_pos[b] + n >= 2^31` (`start`), NVFP4 `ring_slot[b]` outside `[0, hp_tail.shape[0])` (`ring`):
  the sequence is skipped (nothing paged, nothing in its ring). A sequence of 0 rows is never a fault.
- A 16-token tile whose page column is past `block_table.shape[1]` (`table`) or whose page id is outside
  `[0, num_pages)` (`page`): its paged rows are skipped; the NVFP4 ring (the sequence's own) is still
  written. Rows past the tiles the grid covers (more than `max_rows_per_seq`, `rows`) are dropped.
"""
from __future__ import annotations

from dataclasses import dataclass

import sympy

from k3gen.errors import SpecError
from k3gen.ir.checks import check_enum_fields, check_kv_on_target, default_scale_layout
from k3gen.ir.dims import sym
from k3gen.ir.dtypes import BF16, INT32, Fp8ScaleGranularity, KvDtype, ScaleLayout
from k3gen.ir.layouts import MLA_ROW, NVFP4_TILE_TOKENS, PAGE_TOKENS, KvLayout
from k3gen.ir.spec import OpSpec, register_op


def kv_format_slug(kv: KvDtype, fp8_scales: Fp8ScaleGranularity, scale_layout: ScaleLayout, max_drafts: int) -> str:
    """The cache-format part of a kernel name, shared by the writer and mla_decode (the reader), so a
    writer and a reader of one cache format carry the same suffix."""
    if kv is KvDtype.FP8:
        return "-" + ("tensor" if fp8_scales is Fp8ScaleGranularity.PER_TENSOR else "tok128")
    if kv is KvDtype.NVFP4:
        return f"-{scale_layout.value}-m{max_drafts}"
    return ""


@register_op("kv_cache_write")
@dataclass(frozen=True, kw_only=True)
class KvCacheWriteSpec(OpSpec):
    kv: KvDtype
    page: int | None = None               # defaults to the format's page size; others are rejected
    fp8_scales: Fp8ScaleGranularity = Fp8ScaleGranularity.PER_TOKEN_128
    scale_layout: ScaleLayout | None = None  # NVFP4 only; defaults to the target's layout
    max_drafts: int = 0                   # NVFP4 HP tail ring = 16 + max_drafts rows
    threads: int = 128

    def resolve(self) -> None:
        check_enum_fields(self, (("kv", KvDtype),))
        if self.page is None:
            object.__setattr__(self, "page", PAGE_TOKENS[self.kv])
        if self.scale_layout is None:
            object.__setattr__(self, "scale_layout", default_scale_layout(self))

    def validate(self) -> None:
        check_kv_on_target(self)
        if self.threads not in (64, 128, 256):
            raise SpecError("threads", self.threads, [64, 128, 256])
        self.layout  # page-size and draft checks live in KvLayout
        self.impl  # noqa: B018  (a kernel for this target, or SpecError with each variant's reason)

    @property
    def layout(self) -> KvLayout:
        return KvLayout(kv=self.kv, page=self.page, fp8_scales=self.fp8_scales,
                        scale_layout=self.scale_layout, max_drafts=self.max_drafts)

    def slug(self) -> str:
        return f"{self.kv.value}-p{self.page}" + kv_format_slug(self.kv, self.fp8_scales, self.scale_layout,
                                                                 self.max_drafts)

    # -- estimates --------------------------------------------------------------------------
    def bytes_moved(self):
        """Expected bytes for B sequences appending T rows each at uniformly random positions
        (sympy over B, T)."""
        B, T = sym("B"), sym("T")
        lay = self.layout
        row = MLA_ROW * BF16.bytes
        rows_in = B * T * row
        meta = B * 3 * INT32.bytes
        if self.kv is not KvDtype.NVFP4:
            return rows_in + meta + B * T * lay.bytes_per_token
        # The live tile is re-quantized whole: on average 7.5 older rows of it come back from the
        # ring, and codes + scales are rewritten for them too; new rows also enter the ring.
        old = sympy.Rational(NVFP4_TILE_TOKENS - 1, 2)
        return rows_in + meta + B * (old * row + (T + old) * lay.bytes_per_token + T * row)

    def flops(self):
        B, T = sym("B"), sym("T")
        return B * T * MLA_ROW * 4
