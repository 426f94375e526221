"""moe_route: the noaux_tc sigmoid router of a MoE layer and the token/expert permutation the
grouped expert GEMM reads, on the GPU without a host sync (SPEC.md section 1, issue 21).

Kernel contract (shared by the template, include/k3gen/moe/route.cuh, the reference and the launcher):

- In: logits[T, E] FP32 (unit inner stride, any row stride; 16-byte aligned rows when E % 128 == 0),
  bias[E] FP32 (the e_score_correction_bias), T dynamic (T * k < 2^31).
- Scores: s = 1 / (1 + e) in FP32 with e = FP32(exp(-x)) evaluated in FP64 and rounded once (so
  the kernel and the CPU reference agree bit for bit); choice = s + bias (FP32).
- Groups (n_group > 1): experts form n_group contiguous groups of E / n_group; a group's rank is the
  sum of its two best choice values (its best alone for groups of one); the topk_group best groups
  are kept, ties to the lower group index; the choice of every other expert is -inf.
- Top-k: the k largest choice values, ties to the LOWER expert index, in that order: slot j of
  token t holds its j-th pick (ids[t, j] int32).
- Weights: w_j = s_j (unbiased); with renormalize, w_j = s_j / (((s_0 + s_1) + ...) + s_{k-1} + 1e-20)
  (the sum in slot order, FP32, IEEE division); then w_j * routed_scale (FP32).
- Grouped order: the T * k token slots (flat index t * k + j) sorted by expert, within an expert by
  token (a token picks an expert at most once, so by flat index too). counts[E] int32; offsets[E + 1]
  int32, the exclusive prefix sum (offsets[E] = T * k); perm[p] = the flat slot at position p of the
  grouped order; inv[t * k + j] = its position (inv[perm[p]] == p). perm and inv are buffers of
  T_max * k (the worst case, allocated once); a call writes their first T * k entries.
- Inputs are finite (NaN logits give an unspecified routing; K3GEN_VALIDATE=1 rejects them).

Launch: `k3gen_moe_route` (grid ceil(T / 4), 128 threads: one warp per token) writes ids and
weights; `k3gen_moe_route_sort` (grid ceil(E / 32), 512 threads, programmatic dependent launch: it
starts under the top-k grid and waits for it before reading) reads the ids back and writes
counts, offsets, perm and inv. Every CTA of the sort histograms all T * k slots in shared memory
(integer atomics: the counts do not depend on their order), scans them, and places the slots of its
32 experts in token order, 1024 tokens at a time.
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass

from k3gen.errors import SpecError
from k3gen.ir.dims import sym
from k3gen.ir.dtypes import FP32, INT32
from k3gen.ir.spec import OpSpec, register_op

MAX_EXPERTS = 1024      # 32 per lane of the top-k warp (one 32-bit taken-mask per lane)
MAX_TOP_K = 32          # one lane per slot
MAX_GROUPS = 32         # one bit per group in the kept-group mask
TOKENS_PER_CTA = 4      # top-k: warps per CTA
TOPK_THREADS = 32 * TOKENS_PER_CTA
SORT_THREADS = 512
SORT_EXPERTS = 32       # experts per sort CTA
SORT_TILE = 1024        # tokens per shared-memory tile of the sort
MAX_SLOTS = 2 ** 31     # T * k bound of the 32-bit slot indices


def _posint(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


@register_op("moe_route")
@dataclass(frozen=True, kw_only=True)
class MoeRouteSpec(OpSpec):
    experts: int                 # E: routed experts (K3: 896)
    top_k: int                   # k (K3: 16)
    n_group: int = 1
    topk_group: int = 1
    renormalize: bool = True
    routed_scale: float = 1.0

    def validate(self) -> None:
        if not _posint(self.experts) or self.experts > MAX_EXPERTS:
            raise SpecError("experts", self.experts, f"1..{MAX_EXPERTS}", "at most 32 per lane of one warp")
        if not _posint(self.top_k) or self.top_k > min(MAX_TOP_K, self.experts):
            raise SpecError("top_k", self.top_k, f"1..{min(MAX_TOP_K, self.experts)}", "one lane per slot")
        if not _posint(self.n_group) or self.n_group > MAX_GROUPS or self.experts % self.n_group:
            raise SpecError("n_group", self.n_group, f"divisors of {self.experts} up to {MAX_GROUPS}")
        if not _posint(self.topk_group) or self.topk_group > self.n_group:
            raise SpecError("topk_group", self.topk_group, f"1..{self.n_group}")
        if self.topk_group * self.group_size < self.top_k:
            raise SpecError("topk_group", self.topk_group,
                            f">= {-(-self.top_k // self.group_size)}",
                            f"the kept groups must hold top_k={self.top_k} experts")
        if not isinstance(self.renormalize, bool):
            raise SpecError("renormalize", self.renormalize, [True, False])
        if isinstance(self.routed_scale, bool) or not isinstance(self.routed_scale, float) \
                or not math.isfinite(self.routed_scale) or self.routed_scale <= 0.0:
            raise SpecError("routed_scale", self.routed_scale, "a finite float > 0")
        self.impl  # noqa: B018  (a kernel for this target, or SpecError with each variant's reason)

    # -- kernel contract --------------------------------------------------------------------
    @property
    def group_size(self) -> int:
        return self.experts // self.n_group

    @property
    def vec(self) -> int:
        """Logits per lane load: one 16-byte load when E is a multiple of 128."""
        return 4 if self.experts % 128 == 0 else 1

    @property
    def scale_literal(self) -> str:
        """routed_scale as the C++ float the kernel multiplies by (the FP32 value the reference uses)."""
        return f"{struct.unpack('f', struct.pack('f', self.routed_scale))[0]!r}f"

    def topk_grid(self, t: int) -> tuple[int, int, int]:
        return (-(-t // TOKENS_PER_CTA), 1, 1)

    def sort_grid(self) -> tuple[int, int, int]:
        return (-(-self.experts // SORT_EXPERTS), 1, 1)

    def slug(self) -> str:
        s = f"e{self.experts}-k{self.top_k}"
        if self.n_group > 1:
            s += f"-g{self.n_group}t{self.topk_group}"
        if not self.renormalize:
            s += "-raw"
        if self.routed_scale != 1.0:
            s += f"-s{self.routed_scale:g}"
        return s

    # -- estimates --------------------------------------------------------------------------
    def bytes_moved(self):
        """Per T tokens: logits and bias in; ids, weights, perm, inv, counts and offsets out."""
        T = sym("T")
        E, k = self.experts, self.top_k
        return T * E * int(FP32.bytes) + E * int(FP32.bytes) + T * k * 4 * int(INT32.bytes) \
            + (2 * E + 1) * int(INT32.bytes)

    def flops(self):
        """Per logit: the sigmoid (~20 FP64 operations), the bias add, ~k comparisons."""
        T = sym("T")
        return T * self.experts * (22 + self.top_k)
