"""fp8_block_gemm: y[M, N] = x[M, K] @ W[N, K]^T with FP8 block scales, BF16 out (SPEC.md section 6).

Kernel contract (shared by ops/fp8_block_gemm/{template.cu.j2, cute_kernel.py, reference.py,
launcher.py}):

- x_codes[M, K] E4M3 bytes (uint8), row-major contiguous; x_scales[M, ceil(K/128)]: one scale per
  token per 128 columns (the output of act_quant_fp8; a partial last group when K % 128 != 0).
- w_codes[N, K] E4M3 bytes, row-major contiguous; w_scales[ceil(N/128), ceil(K/128)]: one scale
  per 128x128 weight tile (partial tiles at the N and K edges).
- Scales follow the spec's recipe: FP32 values, or UE8M0 bytes (uint8, value 2^(b-127)). The two
  tensors must use the same recipe: a launcher built for one rejects the other's dtype, and
  `check_activations` rejects an act_quant_fp8 spec of the other recipe. Mixing them gives
  garbage (SPEC.md section 6), so this is an error at the IR level, not a runtime surprise.
- out[M, N] BF16 row-major contiguous: sum over 128-column blocks kb of
  (sum_k x[m, k] w[n, k] in FP32) * (x_scale[m, kb] * w_scale[n / 128, kb]), rounded once to BF16.
- N static, a multiple of 8 (16-byte output rows); K static, a multiple of 16 (16-byte copies and
  TMA row strides); neither needs to be a multiple of 128. M dynamic, >= 0 (M = 1 included).

The kernels are the variants (variants.py), chosen by the target's MMA unit (`spec.mma` names the
chosen one):

"tcgen05" (CuTe DSL, ops/fp8_block_gemm/cute_kernel.py): a CTA owns TC_TILE_N = 128 weight rows
(one scale block, the MMA's M side) and `bm` tokens (the MMA's N side, bm in TC_BM_CHOICES; the
UE8M0 block-scaled MMA needs bm >= 64, the FP32 recipe's register promotion bm <= 64), a `stages`
deep ring; 288 threads; grid = (1, ceil(M / bm), ceil(N / 128)), no clusters (cp.async loads;
sm_100a only). "tcgen05_tma" (sm_103a / sm_107a, same module): the same CTA tile loaded by TMA
(kernel parameters after the five tensors: the W and x tensor maps and x's coordinate tensor,
`Fp8BlockGemmKernel.tma_params`), and the wgmma kernel's cluster split-K: `plan` with the token
tile fixed at bm, rank r owns `k_range(r, split, KB)`, partials summed through DSMEM in rank order;
stages * 128 >= 4 bm (the partial reuses the W ring).

"wgmma" (NVRTC, include/k3gen/gemm/fp8_wgmma.cuh): 12 warps (2 consumer warpgroups + 1 TMA
producer warpgroup), a CTA owns BN90 = 128 weight rows and `nt` tokens, nt in NT_CHOICES chosen per
launch from M (`nt_for`); grid = (split, ceil(M / nt), ceil(N / 128)), clusters (split, 1, 1).
Kernel arguments: the W and x TMA tensor maps (by value; `tma_boxes` gives their geometry), x/w
scales, out, M, nt, then the streaming workspace (FP32 partials, int32 counters; null in the
cluster mode). Streaming mode (`Plan.ctas` > 0, opt-in with `ctas=`; measured
slower than the one-wave cluster split on the K3 shapes): grid (ctas, 1, 1), no cluster; CTA c owns items [c L / G, (c + 1) L / G) of
the (token tile, weight tile, K block) list (`stream_segments` replays the walk), split tiles are
summed from workspace slots in CTA order by the last arriver. `plan` computes everything on the
host (graph-safe). This kernel sizes its token tile and ring per launch: `bm` and `stages` do not
change it (they stay validated, so a spec means the same on every target).
"""
from __future__ import annotations

from dataclasses import dataclass

from k3gen.errors import SpecError
from k3gen.ir.dims import sym
from k3gen.ir.dtypes import BF16, FP32, UE8M0, ScaleRecipe
from k3gen.arch.sm90 import SW128_KMAJOR, encode_desc
from k3gen.ir.spec import OpSpec, register_op

BLOCK = 128            # scale granularity along N (weights) and K (both operands)
BM_CHOICES = (16, 32, 64)            # bm the wgmma variant accepts (and ignores)
STAGE_CHOICES = (3, 4, 5, 6)
MAX_SPLIT = 8          # portable cluster size
# tcgen05 variant (mirrors ops/fp8_block_gemm/cute_kernel.py).
TC_TILE_N = 128        # weight rows per CTA: the tcgen05 MMA's M
TC_BM_CHOICES = (32, 64, 128)
TC_THREADS = 288       # 4 loader warps, 4 epilogue warps, 1 MMA warp

# wgmma variant (mirrors the constants of include/k3gen/gemm/fp8_wgmma.cuh; the template asserts
# the shared-memory sizes agree).
BN90 = 128             # weight rows per CTA: one scale tile, two m64 consumer warpgroups
THREADS90 = 12 * 32    # 2 consumer warpgroups + 1 producer warpgroup (one TMA lane)
NT_CHOICES = (8, 16, 32, 64, 128)   # token columns per CTA (wgmma N)
RING_BYTES = 192 * 1024             # TMA ring budget (one CTA per SM; 227 KB is the sm_90 cap)
MAX_STAGES90 = 8
ALIGN90 = 1024
SPLIT90_MAX = 4                     # cluster split-K of the wgmma variant (see choose_split90)
PF_MAX = 64                         # L2 prefetch distance cap (K blocks) of Plan.pf
# Streaming mode (one persistent CTA per SM walking a contiguous range of the (tile, K block) list)
# is opt-in (`ctas=`): on the H200 it measured 5-15% slower than a one-wave cluster split on every
# K3 shape (sweep 2026-11-29 23:48; e.g. o_proj TP1 M = 1: 29.6 us vs 26.9 us at split 2).


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def nt_for(m: int) -> int:
    """Smallest token tile covering min(M, 128): M = 1 pads to 8 columns, M > 128 uses 128-token tiles."""
    for nt in NT_CHOICES:
        if m <= nt:
            return nt
    return NT_CHOICES[-1]


def choose_split90(n: int, k: int, m: int, sms: int, max_split: int = SPLIT90_MAX) -> int:
    """CTAs per output tile along K for the wgmma variant (one CTA per SM): the largest split, up to
    SPLIT90_MAX, whose grid is one wave. Measured on the H200 (sweep 2026-11-29 23:48, every split
    1..8 on o_proj/kda_qkvg/q_b/o_proj-TP8 at M 1..128): a second, partial wave costs ~1.5x, and
    splits past 4 lose to the rank-ordered DSMEM reduction (split 7: 37.6 us vs split 2: 26.9 us
    on o_proj TP1 at M = 1).

    Row-invariant within one token tile (M <= 128): the split, hence each output's K reduction
    order, depends on N and K alone, so a row gets the same bits in a decode batch (M = B) as in a
    verify batch (M = B (1 + drafts)), which lossless speculative decoding needs (issue 27; the
    split-K partials are summed in rank order, and the token tile width does not change a
    column's accumulation). The price: q_b TP8 keeps split 4 where split 2 measured 8% faster at
    M = 128 (below)."""
    nt = nt_for(max(m, 1))
    if m <= NT_CHOICES[-1]:
        return choose_split_tiles(k, cdiv(n, BN90), NT_CHOICES[0], sms, max_split)
    return choose_split_tiles(k, cdiv(n, BN90) * cdiv(m, nt), nt, sms, max_split)


def k_range(rank, split, kb):
    """K blocks [kb0, kb0 + nk) of split rank `rank`: the wgmma kernel's `rank * KB / split`, also
    traced by the tcgen05 TMA kernel (ints or DSL Int32 alike)."""
    kb0 = rank * kb // split
    return kb0, (rank + 1) * kb // split - kb0


def choose_split_tiles(k: int, tiles: int, nt: int, sms: int, max_split: int = SPLIT90_MAX) -> int:
    """choose_split90 given the output tile count and token tile (shared by both cluster kernels)."""
    split = max(1, min(max_split, cdiv(k, BLOCK), sms // tiles))
    # Short K (<= 16 blocks): the split-K reduction is amortized over few blocks per CTA. H200
    # sweeps 2026-11-30 (PDL on): o_proj TP8 (56 tiles, 12 blocks) runs fastest unsplit at every M
    # (M32 5.71 vs 6.64 us at split 2, M128 9.51 vs 10.32); q_b TP8 (18 tiles) keeps split 4 at
    # M <= 8 (3.42 vs 4.37 us unsplit) but wants 2 from nt = 32 up (M128 7.92 vs 8.69 at 4).
    if cdiv(k, BLOCK) <= 16:
        if tiles >= 48:
            return 1
        if nt >= 32:
            return min(split, 2)
    return split


def work_items(n: int, k: int, m: int) -> int:
    """Length of the streaming mode's work list: (token tile, weight tile, K block), K fastest."""
    return max(1, cdiv(m, nt_for(max(m, 1)))) * cdiv(n, BN90) * cdiv(k, BLOCK)


def stream_ranges(items: int, ctas: int) -> list[tuple[int, int]]:
    """The kernel's static split of the work list: CTA c owns [c L / G, (c + 1) L / G)."""
    return [(c * items // ctas, (c + 1) * items // ctas) for c in range(ctas)]


def stream_owner(x: int, items: int, ctas: int) -> int:
    """The CTA whose range holds item x (the kernel's owner_of)."""
    return -(-(x + 1) * ctas // items) - 1


def stream_segments(items: int, ctas: int, kb: int) -> list[dict]:
    """Every segment (one tile's K blocks inside one CTA's range) as the kernel walks them, with the
    workspace slot and counter it uses; slot/counter are None for a segment that owns its whole
    tile (stored directly). Used by the CPU tests to prove coverage and uniqueness."""
    segs = []
    for c, (x0, x1) in enumerate(stream_ranges(items, ctas)):
        x = x0
        while x < x1:
            tile, kb0 = divmod(x, kb)
            nk = min(kb - kb0, x1 - x)
            whole = nk == kb
            segs.append({"cta": c, "tile": tile, "kb0": kb0, "nk": nk,
                         "slot": None if whole else 2 * c + (0 if x == x0 else 1),
                         "counter": None if whole else stream_owner(tile * kb, items, ctas),
                         "nseg": stream_owner(tile * kb + kb - 1, items, ctas) - stream_owner(tile * kb, items, ctas) + 1})
            x += nk
    return segs


@dataclass(frozen=True)
class Plan:
    """One launch of the wgmma variant: all host-side, so a captured graph replays it unchanged.
    ctas > 0 selects the streaming mode (grid (ctas, 1, 1), no cluster, workspace); else the
    cluster split-K mode with `split` CTAs per tile."""
    nt: int
    split: int
    grid: tuple[int, int, int]
    smem: int
    ctas: int = 0
    pf: int = 0        # L2 prefetch distance of the weight stream in K blocks (0: off)


@register_op("fp8_block_gemm")
@dataclass(frozen=True, kw_only=True)
class Fp8BlockGemmSpec(OpSpec):
    n: int                                # output features (weight rows), static
    k: int                                # input features, static
    recipe: ScaleRecipe | None = None     # defaults to the target's GEMM scale recipe
    bm: int = 64                          # tcgen05: tokens per CTA (the MMA N side)
    stages: int = 4                       # tcgen05: operand ring depth in 128-column K blocks

    def resolve(self) -> None:
        if self.recipe is None:
            object.__setattr__(self, "recipe", self.target.scale_recipe)

    def validate(self) -> None:
        for name, v, mult in (("n", self.n, 8), ("k", self.k, 16)):
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0 or v % mult:
                raise SpecError(name, v, f"positive multiples of {mult}", "16-byte rows")
        if self.n * self.k >= 2 ** 31:
            raise SpecError("n*k", self.n * self.k, "< 2^31", "32-bit weight offsets per row block")
        if not isinstance(self.recipe, ScaleRecipe):
            raise SpecError("recipe", self.recipe, [r.value for r in ScaleRecipe])
        if self.lowering == "cute":
            allowed = tuple(b for b in TC_BM_CHOICES
                            if (b >= 64 if self.recipe is ScaleRecipe.UE8M0 else b <= 64))
            if self.bm not in allowed:
                raise SpecError("bm", self.bm, allowed, f"tcgen05 MMA N, {self.recipe.value} recipe")
            if self.mma == "tcgen05_tma" and self.stages * BLOCK < 4 * self.bm:
                raise SpecError("stages", self.stages, f">= {4 * self.bm // BLOCK}",
                                f"the split-K partial (128 x bm FP32) reuses the W ring (bm {self.bm})")
        elif self.bm not in BM_CHOICES:
            raise SpecError("bm", self.bm, BM_CHOICES, "the wgmma kernel picks its token tile per launch")
        if self.stages not in STAGE_CHOICES:
            raise SpecError("stages", self.stages, STAGE_CHOICES)

    # -- pairing ---------------------------------------------------------------------------
    def check_activations(self, act) -> None:
        """Raise SpecError unless `act` (an ActQuantFp8Spec) produces what this GEMM reads."""
        if act.recipe is not self.recipe:
            raise SpecError("act.recipe", act.recipe.value, [self.recipe.value],
                            f"activations must use the GEMM's scale recipe ({self.slug()})")
        if act.k != self.k:
            raise SpecError("act.k", act.k, [self.k], "activation columns = GEMM K")

    # -- kernel contract --------------------------------------------------------------------
    @property
    def k_blocks(self) -> int:
        return cdiv(self.k, BLOCK)

    @property
    def n_blocks(self) -> int:
        return cdiv(self.n, BLOCK)

    @property
    def scale_dtype(self):
        return FP32 if self.recipe is ScaleRecipe.FP32 else UE8M0

    @property
    def mma(self) -> str:
        """The chosen variant: "tcgen05_tma" / "tcgen05" (CuTe DSL) or "wgmma" (NVRTC)."""
        return self.impl.name

    @property
    def threads(self) -> int:
        return TC_THREADS if self.lowering == "cute" else THREADS90

    # -- wgmma variant ------------------------------------------------------------------------
    nt_choices = NT_CHOICES
    ring_bytes = RING_BYTES
    max_stages = MAX_STAGES90
    desc_fields = SW128_KMAJOR
    desc_probe_addr = 0x1C420          # a 1024-aligned shared address plus one 32-byte K step

    @property
    def desc_probe_value(self) -> int:
        return encode_desc(self.desc_probe_addr)

    @staticmethod
    def stages_nt(nt: int) -> int:
        return min(MAX_STAGES90, RING_BYTES // (BN90 * BLOCK + nt * BLOCK))

    @staticmethod
    def smem_bytes_nt(nt: int) -> int:
        s = Fp8BlockGemmSpec.stages_nt(nt)
        # the ring, full + empty barriers, and one FP32 scale slot of nt tokens per stage
        return ALIGN90 + s * (BN90 * BLOCK + nt * BLOCK + 16 + 4 * nt)

    def max_smem_bytes(self) -> int:
        return max(self.smem_bytes_nt(nt) for nt in NT_CHOICES)

    def tma_boxes(self, m: int, nt: int) -> dict:
        """Geometry of the two TMA tensor maps (innermost dimension first), E4M3 bytes, 128B swizzle,
        zero fill out of bounds: W [N, K] in min(N, 128) x 128 boxes, x [M, K] in min(M, nt) x 128
        boxes (a box never larger than the tensor; the kernel expects the same byte counts)."""
        return {"w": {"dims": (self.k, self.n), "strides": (self.k,), "box": (BLOCK, min(BN90, self.n))},
                "x": {"dims": (self.k, m), "strides": (self.k,), "box": (BLOCK, min(nt, m))}}

    def plan(self, m: int, sms: int, split: int | None = None, ctas: int | None = None, pf: int = 0) -> Plan:
        """`split` forces the cluster mode, `ctas` the (opt-in) streaming mode, capped at the work
        items; neither: the cluster mode with choose_split90. `pf` > 0: the producer also asks L2
        for the weight block pf K blocks ahead of each TMA load (experiment knob; useful past the
        ring depth stages_nt(nt))."""
        if not isinstance(pf, int) or isinstance(pf, bool) or not 0 <= pf <= PF_MAX:
            raise SpecError("pf", pf, f"0..{PF_MAX}", "L2 prefetch distance in K blocks")
        if self.mma == "tcgen05_tma":
            return self._plan_tma(m, sms, split, ctas, pf)
        nt = nt_for(m)
        if split is None and ctas:
            ctas = min(ctas, work_items(self.n, self.k, m))
            return Plan(nt, 1, (ctas, 1, 1), self.smem_bytes_nt(nt), ctas, pf)
        split = split or choose_split90(self.n, self.k, m, sms)
        return Plan(nt, split, (split, cdiv(m, nt), cdiv(self.n, BN90)), self.smem_bytes_nt(nt), 0, pf)

    def _plan_tma(self, m: int, sms: int, split: int | None, ctas: int | None, pf: int) -> Plan:
        """The wgmma cluster plan with the token tile fixed at bm: grid (split, ceil(M / bm),
        ceil(N / 128)), clusters (split, 1, 1) when split > 1. smem is the artifact's (CuTe sizes
        it while tracing), so 0 here."""
        if ctas:
            raise SpecError("ctas", ctas, [0], "the tcgen05 TMA kernel has the cluster split only")
        if pf:
            raise SpecError("pf", pf, [0], "no L2 prefetch in the tcgen05 TMA kernel")
        # Row-invariant like the wgmma plan (choose_split90): for M <= 128 the split is chosen for
        # the range's worst case (128 tokens), so it depends on (N, K) only and a decode row
        # (M = B) reduces in the same order as its verify row (M = B (1 + drafts)), one wave at
        # every M of the range.
        rows = NT_CHOICES[-1] if m <= NT_CHOICES[-1] else m
        tiles = cdiv(self.n, TC_TILE_N) * cdiv(rows, self.bm)
        split = split or choose_split_tiles(self.k, tiles, self.bm, sms)
        if not isinstance(split, int) or isinstance(split, bool) or not 1 <= split <= min(MAX_SPLIT, self.k_blocks):
            raise SpecError("split", split, f"1..{min(MAX_SPLIT, self.k_blocks)}", "cluster size <= K blocks")
        return Plan(self.bm, split, (split, cdiv(m, self.bm), cdiv(self.n, TC_TILE_N)), 0)

    @staticmethod
    def workspace_floats(max_ctas: int) -> int:
        """Streaming mode: two FP32 partial slots of the largest token tile per CTA."""
        return 2 * max_ctas * NT_CHOICES[-1] * BN90

    @staticmethod
    def workspace_counters(max_ctas: int) -> int:
        return max_ctas

    def grid(self, m: int) -> tuple[int, int, int]:
        """tcgen05 variant (wgmma: `plan`)."""
        return (1, cdiv(m, self.bm), cdiv(self.n, TC_TILE_N))

    def slug(self) -> str:
        s = f"n{self.n}-k{self.k}-{self.recipe.value}"
        if self.bm != 64:
            s += f"-bm{self.bm}"
        if self.stages != 4:
            s += f"-s{self.stages}"
        return s

    # -- estimates --------------------------------------------------------------------------
    def weight_bytes(self) -> int:
        return self.n * self.k + self.n_blocks * self.k_blocks * int(self.scale_dtype.bytes)

    def bytes_moved(self):
        """Bytes for M tokens (sympy over M): weights once, activations, output."""
        M = sym("M")
        return (self.weight_bytes() + M * (self.k + self.k_blocks * int(self.scale_dtype.bytes))
                + M * self.n * int(BF16.bytes))

    def flops(self):
        M = sym("M")
        return 2 * M * self.n * self.k

