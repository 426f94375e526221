"""mla_decode: absorbed MLA attention over the paged latent KV cache (SPEC.md sections 4 and 5).

Kernel contract (shared by every variant, the reference and the launcher):

- `q[B, T, H, 576]` BF16 (per head `[q_lat 512 | q_pe 64]`, the mla_q_absorb output of T tokens),
  contiguous. Query row r = t * H + h of sequence b.
- `lengths[B]` int32: tokens in the cache of sequence b, the T new ones included (T <= length).
  Bottom-right causal: query token t sees positions 0 .. length - T + t.
- Row of position p: page `block_table[b, p // page]`, slot `p % page`; KV formats of KvLayout.
  FP8 and NVFP4 rows are dequantized exactly as `reference.kv_cache_write.gather_rows` does; NVFP4
  positions of the live incomplete 16-token tile (`length // 16 * 16 .. length - 1`) come from the
  BF16 HP tail ring `hp_tail[ring_slot[b], p % ring]`.
- `s = (q . row) * softmax_scale` (1/sqrt(192)), softmax in FP32, `o_lat = sum p * row[:512]`,
  BF16 `out[B, T, H, 512]`.

Bad indices (every schedule; checked on the device and recorded in the error word of
k3gen/runtime/faults.py, no host sync):

- `lengths[b]` outside `[T, block_table.shape[1] * page]` (fault `length`): clamped to
  `[0, block_table.shape[1] * page]`; a query token that then sees no position outputs zeros.
- A tile's page id outside `[0, num_pages)` (`page`) or its column past the table (`table`): its rows
  read as zero rows (score 0, value 0: the output stays finite and in bounds, not the valid answer).
- NVFP4 `ring_slot[b]` outside `[0, num_slots)` (`ring`): the live HP-tail rows read as zeros.

Every kernel splits a sequence's KV into 64-token tiles (TILE_TOKENS) and a CTA covers a group of
query rows over one split of those tiles. With more than one split the CTAs write FP32 partial
outputs + log-sum-exp into a workspace and a second entry (`k3gen_mla_decode_combine`) merges them.
The split count is chosen on the host (`plan_splits`) from the batch shape only, so a captured graph
stays valid when lengths change; each CTA derives its token range from the device lengths.

`schedule` names the kernel (the variants of variants.py: "tcgen05_tm", "tcgen05", "wgmma_qm",
"wgmma", "mma"); "auto", the default, is resolved when the spec is built to the first variant that
can implement it, so the canonical spec and the file name name the kernel it gets. Each variant's geometry (query rows per
CTA, threads, shared-memory plan) is `spec.impl.plan(spec)`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import sympy

from k3gen.errors import SpecError
from k3gen.ir.checks import check_enum_fields, check_kv_on_target, default_scale_layout
from k3gen.ir.dims import sym
from k3gen.ir.dtypes import Fp8ScaleGranularity, KvDtype, ScaleLayout
from k3gen.ir.layouts import MLA_LATENT, MLA_ROW, PAGE_TOKENS, KvLayout
from k3gen.ir.spec import OpSpec, register_op
from k3gen.ops.kv_cache_write.spec import kv_format_slug

TILE_TOKENS = 64              # KV tokens per tile (every variant)
MAX_TOKENS = 8
SOFTMAX_SCALE = 192 ** -0.5


@register_op("mla_decode")
@dataclass(frozen=True, kw_only=True)
class MlaDecodeSpec(OpSpec):
    heads: int                            # per rank: 6, 12, 24, 48, 96; 1..128
    tokens: int = 1                       # T query tokens per sequence (1 decode, 1 + M verify)
    kv: KvDtype = KvDtype.BF16
    fp8_scales: Fp8ScaleGranularity = Fp8ScaleGranularity.PER_TOKEN_128
    scale_layout: ScaleLayout | None = None  # NVFP4 only; defaults to the target's layout
    max_drafts: int = 0                   # NVFP4 HP tail ring = 16 + max_drafts rows
    m_tiles: int | None = None            # 16-row query tiles per CTA; default: the variant's
    schedule: str = "auto"                # a variant of variants.py, or "auto"

    variant_field: ClassVar[str] = "schedule"

    def resolve(self) -> None:
        if self.scale_layout is None:
            object.__setattr__(self, "scale_layout", default_scale_layout(self))

    def validate(self) -> None:
        if not isinstance(self.heads, int) or isinstance(self.heads, bool) or not 1 <= self.heads <= 128:
            raise SpecError("heads", self.heads, "1..128")
        if not isinstance(self.tokens, int) or isinstance(self.tokens, bool) or not 1 <= self.tokens <= MAX_TOKENS:
            raise SpecError("tokens", self.tokens, f"1..{MAX_TOKENS}")
        check_enum_fields(self, (("kv", KvDtype),))
        check_kv_on_target(self)
        impl = self.impl
        # The row-tile default depends on the chosen kernel, so it is filled once the variant is known.
        if self.m_tiles is None:
            object.__setattr__(self, "m_tiles", impl.default_m_tiles(self))
        allowed = impl.m_tiles_allowed(self)
        if self.m_tiles not in allowed:
            raise SpecError("m_tiles", self.m_tiles, list(allowed), f"schedule {self.schedule!r}: {impl.m_tiles_why}")
        self.layout  # page and draft checks live in KvLayout
        plan = impl.plan(self)
        if plan.smem_bytes > plan.smem_limit:
            raise SpecError("m_tiles", self.m_tiles, "a smaller value",
                            f"{plan.smem_bytes} B of shared memory > {plan.smem_limit}")

    @property
    def layout(self) -> KvLayout:
        return KvLayout(kv=self.kv, page=PAGE_TOKENS[self.kv], fp8_scales=self.fp8_scales,
                        scale_layout=self.scale_layout, max_drafts=self.max_drafts)

    @property
    def page(self) -> int:
        return PAGE_TOKENS[self.kv]

    @property
    def softmax_scale(self) -> float:
        return SOFTMAX_SCALE

    def slug(self) -> str:
        s = f"h{self.heads}-t{self.tokens}-{self.kv.value}" + kv_format_slug(self.kv, self.fp8_scales,
                                                                            self.scale_layout, self.max_drafts)
        if self.m_tiles != self.impl.default_m_tiles(self):
            s += f"-mt{self.m_tiles}"
        if self.schedule != "mma":
            s += f"-{self.schedule}"
        return s

    # -- estimates --------------------------------------------------------------------------
    def kv_bytes(self):
        """KV bytes read for B sequences of L tokens (sympy over B, L): the bench's byte count.
        NVFP4 adds the HP tail rows of the live tile (7.5 on average)."""
        B, L = sym("B"), sym("L")
        b = B * L * self.layout.bytes_per_token
        if self.kv is KvDtype.NVFP4:
            b += B * sympy.Rational(15, 2) * MLA_ROW * 2
        return b

    def bytes_moved(self):
        B, L = sym("B"), sym("L")
        qo = B * self.tokens * self.heads * (MLA_ROW + MLA_LATENT) * 2
        meta = B * 4 * (1 + L / self.page)
        return self.kv_bytes() + qo + meta

    def flops(self):
        B, L = sym("B"), sym("L")
        return 2 * B * L * self.tokens * self.heads * (MLA_ROW + MLA_LATENT)


def choose_splits(batch: int, max_len: int, heads: int, sm_count: int, tokens: int = 1,
                  rows_per_cta: int | None = None, max_splits: int = 132) -> int:
    """KV splits per (sequence, row group): enough CTAs for about one wave of `sm_count` CTA slots
    (SMs x the plan's ctas_per_sm: the pipeline takes most of the shared memory), at least 2 KV
    tiles per split.

    Depends only on the batch size and the largest length, so a graph captured with it stays
    valid for any lengths up to that maximum (each CTA splits its own sequence's tiles on the
    device).
    """
    if rows_per_cta is None:
        rows_per_cta = 16 if heads * tokens <= 16 else 32
    base = batch * -(-heads * tokens // rows_per_cta)
    if base == 0 or base * 2 > sm_count:
        return 1
    tiles = -(-max_len // TILE_TOKENS)
    n = int(max(1, min(sm_count // base, tiles // 2, max_splits)))
    # Each CTA takes ceil(tiles / n) tiles, so no more splits than that needs: 512 tiles over 132
    # splits would leave 4 CTAs empty (still launched, still merged; the sweep is in bench/NOTES.md).
    per = -(-tiles // n)
    return -(-tiles // per)


def plan_splits(lengths, heads: int, sm_count: int, tokens: int = 1, rows_per_cta: int | None = None) -> int:
    """choose_splits for a batch given by its lengths (a sequence or a CPU tensor)."""
    vals = [int(x) for x in (lengths.tolist() if hasattr(lengths, "tolist") else lengths)]
    return choose_splits(len(vals), max(vals, default=0), heads, sm_count, tokens, rows_per_cta)
