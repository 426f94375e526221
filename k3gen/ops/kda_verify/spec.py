"""kda_verify: the speculative-verify step of KDA with FP32 per-token draft records (SPEC.md
section 3): each sequence brings 1 + M tokens (the golden token, then M drafts; M static per
build), and one kernel runs the full fused step of kda_decode for all of them.

Kernel contract (shared by the template, the reference and the launcher). D = heads * 128,
T = 1 + M. Token t of sequence b is activation row b * T + t.

Inputs (BF16 unless stated; a "row stride" is in elements, the inner dim is unit-stride):
- `qkvg[B * T, >= 4D]` (sections q | k | v | g_out, raw pre-conv q, k, v), `fa[B * T, 128]`,
  `beta_logit[B * T, H]`: any row stride, as in kda_decode.
- `slots[B]` int32: pool slot of each sequence. -1: a padded row, whose T outputs are
  zeros and which touches nothing. Other negatives and slots >= num_slots are bad input, treated
  like padding, with fault `slot` in the error word (k3gen/runtime/faults.py; not in the frozen
  sm100-mxfp4 source, which predates it).
- weights `conv_w`, `fb_w`, `dt_bias`, `a_log`, `norm_w` exactly as kda_decode.
Pools (StatePoolLayout with max_drafts = M), read and written at `slots[b]`:
- `ssm[num_slots, H, 128, 128]` FP32 or BF16: the committed state (after the last golden token).
- `draft_rec[num_slots, M, H, 128, 128]` FP32 always: the state after each draft of the last step.
- `conv_ext[num_slots, 3D, 3 + M]` FP32: raw conv inputs; the window of the next step's golden
  token is columns P .. P+2.
- `pending[num_slots]` int32: P, the drafts accepted in the last step (0..M; out-of-range values
  are bad input: the kernel clamps them into 0..M and records fault `pending`).
Output: `out[B, T, H, 128]` BF16, contiguous (8-byte aligned).

Per live sequence: start state S = ssm[s] if P == 0 else draft_rec[s, P-1] (explicit FP32 loads
of records whatever the SSM dtype); window = conv_ext[s, :, P..P+2]; run the kda_decode step for
t = 0..M, each token on the state the previous one left rounded to the SSM storage dtype, exactly
as kda_decode stores and reloads it (BF16: round to nearest even after every token; FP32: no
rounding), with kda_decode's own per-token expressions (include/k3gen/kda/token_math.cuh), so that
verify + commit == serial decode bit for bit (SPEC.md section 3); then ssm[s] = state after token 0
(typed store), draft_rec[s, t-1] = the state after token t (t >= 1) in FP32 (with BF16 storage a
BF16 value, held exactly), and conv_ext[s, :, 0 .. 2+M] = (w1, w2, x_0, ..., x_M) where
(w0, w1, w2) was the start window, so the window after token t is columns t .. t+2. pending is not written: after sampling the host sets
pending[s] = max(accepted_tokens - 1, 0) (reference.commit), nothing is replayed, and a
rejected draft never changes the committed state.

Variants (`variant`, one template; variants.py): `nvfp4` (typed SSM loads/stores, FP32
records; with M <= 3 the cubin also carries the prefetch and split schedules) and `original` (the
FP32-only shared verify kernel of the original SM100 MXFP4 target, frozen there). `auto` is
resolved when the spec is built, so the canonical spec names the kernel.

Launch: grid (H, B), 256 threads, no cluster.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import ClassVar

from k3gen.errors import SpecError
from k3gen.ir.checks import check_enum_fields, check_heads, check_ssm_on_target
from k3gen.ir.dims import sym
from k3gen.ir.dtypes import BF16, FP32, INT32, GateKind, SsmDtype
from k3gen.ir.layouts import CONV_TAPS, KDA_DK, KDA_DV, StatePoolLayout
from k3gen.ir.spec import OpSpec, register_op
from k3gen.ops.kda_decode.spec import FLOPS_PER_TOKEN_HEAD, FbWeight, KdaState

MAX_DRAFTS = 7


class VerifyVariant(str, enum.Enum):
    AUTO = "auto"           # resolved at construction to the first variant that can (variants.py)
    ORIGINAL = "original"   # FP32-only shared verify kernel (sm100-mxfp4)
    NVFP4 = "nvfp4"         # typed SSM store, explicit FP32 records (NVFP4 targets, SM90)

    def __str__(self) -> str:
        return self.value


@register_op("kda_verify")
@dataclass(frozen=True, kw_only=True)
class KdaVerifySpec(KdaState, OpSpec):
    heads: int
    drafts: int                              # M, static per build: 1..7
    gate: GateKind = GateKind.BOUNDED
    ssm: SsmDtype = SsmDtype.FP32
    variant: VerifyVariant = VerifyVariant.AUTO
    fb_weight: FbWeight = FbWeight.BF16
    threads: int = 256
    min_blocks: int = 0                      # __launch_bounds__ min CTAs per SM; 0: blocks_per_sm

    variant_field: ClassVar[str] = "variant"

    def resolve(self) -> None:
        # The variants read these fields: reject a bad value by its own name first.
        check_enum_fields(self, (("gate", GateKind), ("ssm", SsmDtype), ("variant", VerifyVariant),
                                 ("fb_weight", FbWeight)))
        check_ssm_on_target(self)

    def validate(self) -> None:
        check_heads(self.heads, 1 << 20, "heads are grid.x")
        if isinstance(self.drafts, bool) or not isinstance(self.drafts, int) or not 1 <= self.drafts <= MAX_DRAFTS:
            raise SpecError("drafts", self.drafts, f"1..{MAX_DRAFTS}", "M drafts per verify step")
        if self.threads != 256:
            raise SpecError("threads", self.threads, [256], "8 state rows per half-warp")
        if self.min_blocks not in (0, 1, 2):
            raise SpecError("min_blocks", self.min_blocks, [0, 1, 2], "0 picks blocks_per_sm")

    # -- derived ----------------------------------------------------------------------------
    @property
    def tokens(self) -> int:
        return 1 + self.drafts

    @property
    def blocks_per_sm(self) -> int:
        """Two CTAs per SM (128 registers) hold every build without spills except M >= 4 on
        sm_90a, where staging the second chunk of tokens next to the 64 register rows needs more
        than 128 registers (ptxas of NVRTC 13.5): those take one CTA per SM."""
        if self.min_blocks:
            return self.min_blocks
        return 1 if self.tokens > 4 and self.target.sm < 100 else 2

    @property
    def pool(self) -> StatePoolLayout:
        return StatePoolLayout(heads=self.heads, ssm=self.ssm, max_drafts=self.drafts)

    def slug(self) -> str:
        s = f"h{self.heads}-m{self.drafts}-{self.gate.value}-{self.ssm.value}"
        if self.variant is VerifyVariant.ORIGINAL:
            s += "-orig"
        if self.min_blocks:
            s += f"-mb{self.min_blocks}"
        return s

    # -- estimates --------------------------------------------------------------------------
    def bytes_moved(self, from_records: bool = True):
        """Fewest bytes through device memory for B sequences (sympy over B): one start-state read
        (an FP32 record when `from_records`, else ssm in its dtype), one typed ssm write, M FP32
        record writes, 3 conv columns read and 3 + M written (FP32), the T token rows read once,
        T outputs written, weights read once."""
        B = sym("B")
        H, D, M, T = self.heads, self.d, self.drafts, self.tokens
        rec = KDA_DV * KDA_DK * 4
        state = B * H * ((rec if from_records else self.state_bytes_per_head) + self.state_bytes_per_head + M * rec)
        conv = B * 3 * D * ((CONV_TAPS - 1) + (CONV_TAPS - 1 + M)) * FP32.bytes
        acts = B * T * (4 * D + KDA_DK + H) * BF16.bytes + 2 * B * INT32.bytes
        out = B * T * D * BF16.bytes
        weights = (3 * D * CONV_TAPS + D * KDA_DK) * BF16.bytes + (D + H + KDA_DV) * FP32.bytes
        return state + conv + acts + out + weights

    def flops(self):
        return sym("B") * self.tokens * self.heads * FLOPS_PER_TOKEN_HEAD
