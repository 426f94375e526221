"""moe_experts: the routed experts of a MoE layer on FP4 weights kept as loaded: gate_up grouped GEMM
with the gated activation fused, down grouped GEMM, and the weighted combine per token (SPEC.md
section 1, issue 21). Consumes exactly moe_route's outputs (k3gen/ops/moe_route/spec.py).

Kernel contract (shared by the template, include/k3gen/moe/experts*.cuh, the reference and the
launcher). W = hidden (K3: the 3584 latent), I = inter per rank, E = experts (local), k = top_k,
R = route_experts (the router's E; R >= E, the local experts are R's [base, base + E)):

- Weights, the layout model/weight_types.ExpertWeights holds as loaded (no repacking):
  w13 uint8 [E, 2I, W/2] E2M1 pairs (even element in the low nibble), rows [gate 0..I-1 | up];
  w2 uint8 [E, W, I/2]. MXFP4: s13 uint8 UE8M0 [E, 2I, W/32], s2 [E, W, I/32]; value =
  e2m1 * 2^(byte - 127). NVFP4: s13 E4M3 bytes (uint8 or float8_e4m3fn) [E, 2I, W/16], s2
  [E, W, I/16], gs13 FP32 [E, 2] (the gate's and the up's weight_scale_2), gs2 FP32 [E, 1];
  value = (e2m1 * e4m3) * global (the product e2m1 * e4m3 is exact, one FP32 rounding).
- Activations x: BF16 [T, W] (W4A16), or FP8 (W4A8): E4M3 codes uint8 [T, W] with per-token
  per-128-column scales [T, W/128] in the spec's recipe (FP32 values or UE8M0 bytes), the output
  of act_quant_fp8.
- Routing (moe_route): ids [T, k] int32, weights [T, k] FP32, offsets [R + 1] int32, perm [T k]
  int32 (grouped position -> flat slot t * k + j). Slot (t, j) is computed when ids[t, j] - base is
  in [0, E); other slots (other ranks' experts, bad ids) add nothing. Offsets are clamped to
  [0, T k] and perm entries outside [0, T k) are skipped: bad routing gives wrong sums, never an
  out-of-bounds access. Faults recorded in the error word (k3gen/runtime/faults.py): `expert` (an
  id outside [0, R): its slot adds nothing), `offsets` (an offset of the local experts outside
  [0, T k] or decreasing: clamped), `perm` (an entry of a local expert's position outside [0, T k):
  gate_up reads a clamped row, down drops it; other ranks' positions are never read).
- gate_up: for each routed slot, g = x . w_gate[e, i], u = x . w_up[e, i] (FP32 accumulation;
  NVFP4: times the expert's global), h = act(g, u) rounded to BF16, stored in grouped order
  h[p, i] (workspace [T_max k, I]). act: SiTU(beta, linear_beta) = beta tanh(g / beta) sigmoid(g)
  * linear_beta tanh(u / linear_beta) (K3: 4, 25), or SiLU(g) * u. The intermediate is BF16 in
  both activation formats (see the deviation note in variants.py).
- down: y[f, :] = w2[e] @ h[p] (FP32, NVFP4: times gs2[e]) into the FP32 partials at the flat
  slot f = perm[p] (workspace [T_max k, W]).
- combine: out[t, c] = sum over j = 0..k-1 in slot order of weights[t, j] * y[t k + j, c] (FP32
  FMA, one term at a time: deterministic, no atomics) for the computed slots; BF16 [T, W], and
  optionally the FP32 sum [T, W] (for the TP / EP reduction before routed_expert_norm).

Launch (all graph-safe; grids depend on T and the device only, never on the routing): gate_up grid
(mtiles13 / wm13, item_rows), down grid (mtiles2 / wm2, item_rows), combine grid (T, ceil(W / 1024)),
256 threads. An item is (expert, up to 8 * n_tiles consecutive grouped positions); a CTA scans the
clamped offsets once (no host sync) and walks items blockIdx.y, + gridDim.y, ... up to the list's
length; item_rows = min(max_items(T), the rows resident at once). PDL: the down kernel reads the
offsets and its weights before its dependency wait (gate_up triggers only after its own wait, so
whatever wrote the offsets before gate_up has completed), and h only after it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from k3gen.errors import SpecError
from k3gen.ir.dims import sym
from k3gen.ir.dtypes import ScaleRecipe, _StrEnum
from k3gen.ir.spec import OpSpec, register_op

CHUNK = 128             # K values a warp's quad covers per 16-byte load of each of its rows
SEG = 32                # K values one lane decodes per row per chunk (one 16-byte load)
MAX_KC = 8              # chunks a warp holds in registers (16 x 16 bytes in flight per lane)
MAX_WARPS = 8
MAX_EXPERTS = 1024      # moe_route's limit
MAX_TOP_K = 32
N_TILE = 8              # tokens per MMA (m16n8k16: tokens on N, weight rows on M)
N_TILE_CHOICES = (1, 2, 4)
COMBINE_THREADS = 256
COMBINE_COLS = 4 * COMBINE_THREADS
PROBE_THREADS = 256


class WeightFormat(_StrEnum):
    MXFP4 = "mxfp4"     # E2M1, group 32, UE8M0 (moonshotai/Kimi-K3)
    NVFP4 = "nvfp4"     # E2M1, group 16, E4M3 + FP32 global (nvidia/Kimi-K3-NVFP4)


class ActFormat(_StrEnum):
    BF16 = "bf16"       # W4A16
    FP8 = "fp8"         # W4A8: E4M3 per token per 128 columns


class GluAct(_StrEnum):
    SITU = "situ"       # K3 (hidden_act situ)
    SILU = "silu"       # Kimi-Linear


def _posint(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class GemmPlan:
    """One grouped GEMM of the op: `rows` weight rows per expert (16 per m-tile), K columns; a CTA
    of wm x wk warps owns wm m-tiles and splits K wk ways (kc chunks of 128 per warp, the partial
    sums added in warp order through shared memory)."""
    rows: int
    k: int
    mtiles: int
    wm: int
    wk: int
    kc: int
    persistent: bool = True   # CTAs walk items (False: a CTA per item; the FP8 gate_up, whose
                              # registers are at the 128 cap, spills with the loop's state)

    @property
    def chunks(self) -> int:
        return cdiv(self.k, CHUNK)

    @property
    def threads(self) -> int:
        return 32 * self.wm * self.wk

    @property
    def min_blocks(self) -> int:
        """__launch_bounds__ minimum CTAs per SM: 16 warps' worth, i.e. <= 128 registers a thread (ptxas
        left alone took 252 for the FP8 gate_up: one 8-warp CTA per SM, too few loads in flight)."""
        return max(1, 512 // self.threads)

    @property
    def grid_x(self) -> int:
        return self.mtiles // self.wm


def gemm_plan(rows: int, k: int, max_kc: int = MAX_KC, persistent: bool = True) -> GemmPlan:
    """Fewest K-split warps that keep <= MAX_KC chunks per warp (every weight byte of a warp is
    loaded before the first MMA: the bytes in flight per SM are what a memory-bound decode needs),
    then as many m-tiles per CTA as divide the expert's and fit 8 warps."""
    chunks = cdiv(k, CHUNK)
    wk = cdiv(chunks, max_kc)
    kc = cdiv(chunks, wk)
    mtiles = rows // 16
    wm = next(w for w in (4, 2, 1) if w * wk <= MAX_WARPS and mtiles % w == 0)
    return GemmPlan(rows, k, mtiles, wm, wk, kc, persistent)


@register_op("moe_experts")
@dataclass(frozen=True, kw_only=True)
class MoeExpertsSpec(OpSpec):
    weights: WeightFormat            # MXFP4 or NVFP4, packed as loaded
    hidden: int                      # W: the expert input/output width (K3: the 3584 latent)
    inter: int                       # I: intermediate per rank (K3 TP8: 384; EP8: 3072)
    experts: int                     # E: experts on this rank (K3 TP8: 896; EP8: 112)
    top_k: int                       # k (K3: 16)
    act: ActFormat = ActFormat.BF16
    recipe: ScaleRecipe | None = None   # FP8 activation scales (defaults to the target's); None for BF16
    route_experts: int | None = None    # R: the router's expert count (defaults to experts)
    glu: GluAct = GluAct.SITU
    situ_beta: float = 4.0
    situ_linear_beta: float = 25.0
    n_tiles: int = 4                 # 8-token MMA tiles per work item (a weight tile is read once per item)

    def resolve(self) -> None:
        if self.route_experts is None:
            object.__setattr__(self, "route_experts", self.experts)
        if self.act is ActFormat.FP8 and self.recipe is None:
            object.__setattr__(self, "recipe", self.target.scale_recipe)

    def validate(self) -> None:
        if not isinstance(self.weights, WeightFormat):
            raise SpecError("weights", self.weights, [f.value for f in WeightFormat])
        if not isinstance(self.act, ActFormat):
            raise SpecError("act", self.act, [f.value for f in ActFormat])
        if not isinstance(self.glu, GluAct):
            raise SpecError("glu", self.glu, [f.value for f in GluAct])
        if not _posint(self.hidden) or self.hidden % SEG:
            raise SpecError("hidden", self.hidden, f"positive multiples of {SEG}", "one 16-byte load per lane segment")
        if self.act is ActFormat.FP8 and self.hidden % CHUNK:
            raise SpecError("hidden", self.hidden, f"multiples of {CHUNK} with act=fp8", "whole 128-column scale groups")
        if not _posint(self.inter) or self.inter % SEG:
            raise SpecError("inter", self.inter, f"positive multiples of {SEG}", "the down GEMM's K segments")
        if not _posint(self.experts) or self.experts > MAX_EXPERTS:
            raise SpecError("experts", self.experts, f"1..{MAX_EXPERTS}")
        if not _posint(self.route_experts) or not self.experts <= self.route_experts <= MAX_EXPERTS:
            raise SpecError("route_experts", self.route_experts, f"{self.experts}..{MAX_EXPERTS}",
                            "the router's experts include this rank's")
        if not _posint(self.top_k) or self.top_k > min(MAX_TOP_K, self.route_experts):
            raise SpecError("top_k", self.top_k, f"1..{min(MAX_TOP_K, self.route_experts)}")
        if self.act is ActFormat.FP8:
            if not isinstance(self.recipe, ScaleRecipe):
                raise SpecError("recipe", self.recipe, [r.value for r in ScaleRecipe])
        elif self.recipe is not None:
            raise SpecError("recipe", self.recipe, [None], "BF16 activations carry no scales")
        for name in ("situ_beta", "situ_linear_beta"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, float) or not math.isfinite(v) or v <= 0.0:
                raise SpecError(name, v, "a finite float > 0")
        if self.n_tiles not in N_TILE_CHOICES:
            raise SpecError("n_tiles", self.n_tiles, N_TILE_CHOICES)
        self.impl  # noqa: B018  (a kernel for this target, or SpecError with each variant's reason)

    # -- kernel contract --------------------------------------------------------------------
    @property
    def group(self) -> int:
        """K values per weight scale."""
        return 32 if self.weights is WeightFormat.MXFP4 else 16

    @property
    def tokens_per_item(self) -> int:
        return N_TILE * self.n_tiles

    @property
    def gate_up(self) -> GemmPlan:
        return gemm_plan(2 * self.inter, self.hidden, persistent=self.act is not ActFormat.FP8)

    @property
    def down(self) -> GemmPlan:
        return gemm_plan(self.hidden, self.inter)

    def max_items(self, t: int) -> int:
        """Most work items T tokens can make: sum_e ceil(c_e / NB) <= (T k + (NB - 1) min(E, T k)) / NB."""
        n, nb = t * self.top_k, self.tokens_per_item
        return max(1, (n + (nb - 1) * min(self.experts, n)) // nb)

    @staticmethod
    def item_rows(plan: GemmPlan, items: int, sms: int | None) -> int:
        """grid.y: a CTA row per item, or with the device's SM count at most the rows that are
        resident at once (sms x min_blocks CTAs), each walking items y, y + rows, ... (persistent:
        the offsets are scanned once per CTA, not once per item)."""
        if sms is None or not plan.persistent:
            return items
        return max(1, min(items, sms * plan.min_blocks // plan.grid_x))

    def gate_up_grid(self, t: int, sms: int | None = None) -> tuple[int, int, int]:
        return (self.gate_up.grid_x, self.item_rows(self.gate_up, self.max_items(t), sms), 1)

    def down_grid(self, t: int, sms: int | None = None) -> tuple[int, int, int]:
        return (self.down.grid_x, self.item_rows(self.down, self.max_items(t), sms), 1)

    def combine_grid(self, t: int) -> tuple[int, int, int]:
        return (t, cdiv(self.hidden, COMBINE_COLS), 1)

    def slug(self) -> str:
        s = f"{self.weights.value}-{self.act.value}"
        if self.act is ActFormat.FP8:
            s += f"-{self.recipe.value}"
        s += f"-w{self.hidden}-i{self.inter}-e{self.experts}-k{self.top_k}"
        if self.route_experts != self.experts:
            s += f"-r{self.route_experts}"
        if self.glu is not GluAct.SITU:
            s += f"-{self.glu.value}"
        elif (self.situ_beta, self.situ_linear_beta) != (4.0, 25.0):
            s += f"-b{self.situ_beta:g}-{self.situ_linear_beta:g}"
        if self.n_tiles != 4:
            s += f"-n{self.n_tiles}"
        return s

    @staticmethod
    def float_literal(v: float) -> str:
        return f"{float(v)!r}f"

    # -- estimates --------------------------------------------------------------------------
    def weight_bytes_per_expert(self) -> int:
        """Packed codes + scales (+ globals) of one expert's w13 and w2."""
        W, I = self.hidden, self.inter
        codes = 3 * W * I // 2
        scales = 3 * W * I // self.group
        return codes + scales + (12 if self.weights is WeightFormat.NVFP4 else 0)

    def touched_weight_bytes(self, active_experts: int) -> int:
        return active_experts * self.weight_bytes_per_expert()

    def bytes_moved(self):
        """Per T tokens with every slot on a distinct expert (the decode case): the touched experts'
        weights, x, the intermediate and partials through memory, the output."""
        T = sym("T")
        W, I, k = self.hidden, self.inter, self.top_k
        x = W * (2 if self.act is ActFormat.BF16 else 1)
        return T * k * self.weight_bytes_per_expert() + T * x + T * k * (4 * I + 8 * W) + T * 2 * W

    def flops(self):
        T = sym("T")
        return T * self.top_k * 2 * 3 * self.hidden * self.inter
