"""kda_decode: one KDA (Kimi Delta Attention) decode step for a batch of sequences, one new
token each: short conv + SiLU, q/k L2 norm, f_b projection + forget gate, the delta-rule update
of the recurrent state pool in place, o = S^T q and the gated RMSNorm, in one kernel.

Kernel contract (shared by the template, the reference and the launcher). D = heads * 128.

Inputs (BF16 unless stated; a "row stride" is in elements, the inner dim is unit-stride):
- `qkvg[B, >= 4D]`: the fused projection row of each sequence, sections `q | k | v | g_out` of
  D each (layout "qkvg"), any row stride. q, k, v are raw (pre-conv); g_out is the output gate.
- `fa[B, 128]`: the f_a projection output, any row stride (it may be a view of a `[f_a | b]` row).
- `beta_logit[B, H]`: any row stride.
- `slots[B]` int32: state slot of each sequence. Slot -1 marks a padded row: its output
  is zeros and no state or conv window is touched. Other negative slots and slots >= num_slots are
  bad input: the kernel treats them like padding (never dereferenced) and records fault `slot` in
  the error word (k3gen/runtime/faults.py); K3GEN_VALIDATE=1 raises PageIndexError on the host.
Weights:
- `conv_w[3D, 4]` BF16, rows in q|k|v channel order, tap 0 oldest, no bias.
- `fb_w[D, 128]` BF16 (nn.Linear layout: out x in); fb_weight=BF16 is the only format so far.
- `dt_bias[D]`, `a_log[H]`, `norm_w[128]` FP32 (the loader narrows A_log's padded 128 entries
  and upcasts; one norm weight is shared by all heads).
State (StatePoolLayout, updated in place at `slots[b]`):
- `ssm[num_slots, H, 128(V), 128(K)]` FP32 or BF16 (stores S^T; recurrence always in FP32, BF16
  stored round-to-nearest-even).
- `conv[num_slots, 3D, 3]` BF16: the last 3 raw inputs per channel, oldest first; shifted by one.
Output: `out[B, H, 128]` BF16, contiguous.
Alignment: ssm, fb_w and dt_bias 16 bytes (vector loads, bulk copies), conv_w 8 bytes; the
activation rows need only 2-byte alignment.

Math per (b, h), FP32: y = SiLU(sum_j w[c, j] x_{t-3+j}[c]); q <- q / sqrt(|q|^2 + 1e-6) / sqrt(128);
k <- k / sqrt(|k|^2 + 1e-6); beta = sigmoid(b); z = fb_w[h] @ fa + dt_bias[h]; BOUNDED:
g = -5 sigmoid(exp(A_log[h]) z), SOFTPLUS: g = -exp(A_log[h]) softplus(z); S <- diag(e^g) S;
u = beta (v - S^T k); S <- S + k u^T; o = S^T q; out = o rsqrt(mean(o^2) + 1e-5) norm_w sigmoid(g_out).

Launch: grid (split, H, B) with a thread-block cluster of `split` CTAs along x (split in
{1, 2, 4, 8} <= max_split, chosen by the launcher at run time): the split CTAs of one
(sequence, head) each own 128/split rows of the state and share the forget gate and the RMSNorm
sum through distributed shared memory.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

from k3gen.errors import SpecError
from k3gen.ir.checks import check_enum_fields, check_heads, check_ssm_on_target
from k3gen.ir.dims import sym
from k3gen.ir.dtypes import BF16, FP32, INT32, GateKind, SsmDtype
from k3gen.ir.layouts import CONV_TAPS, KDA_DK, KDA_DV, StatePoolLayout
from k3gen.ir.spec import OpSpec, register_op


class FbWeight(str, enum.Enum):
    """Storage of the f_b projection weight [D, 128]."""
    BF16 = "bf16"

    def __str__(self) -> str:
        return self.value


class QkvgLayout(str, enum.Enum):
    """How the fused projection output of one sequence is laid out."""
    QKVG = "qkvg"   # one row [q | k | v | g_out], D each, any row stride

    def __str__(self) -> str:
        return self.value


SPLITS = (1, 2, 4, 8)
BOUNDED_LOWER = -5.0
NORM_EPS = 1e-5
L2_EPS = 1e-6
# FP32 operations of one token of one head in the fused step (kda_prefill and kda_verify run it too).
FLOPS_PER_TOKEN_HEAD = (3 * KDA_DK * CONV_TAPS * 2          # conv
                        + KDA_DK * KDA_DK * 2                # f_b
                        + KDA_DV * KDA_DK * 7                # decay, two dots, rank-1 update
                        + KDA_DV * 8 + KDA_DK * 8)           # norms, gate, output gating


class KdaState:
    """Sizes of the per-head recurrent state that the three KDA specs (fields `heads`, `ssm`) share."""

    @property
    def d(self) -> int:
        return self.heads * KDA_DK

    @property
    def pool(self) -> StatePoolLayout:
        return StatePoolLayout(heads=self.heads, ssm=self.ssm)

    @property
    def state_bytes_per_head(self) -> int:
        return KDA_DV * KDA_DK * (4 if self.ssm is SsmDtype.FP32 else 2)


@register_op("kda_decode")
@dataclass(frozen=True, kw_only=True)
class KdaDecodeSpec(KdaState, OpSpec):
    heads: int                               # per rank: 96, 48, 24, 12, 6 (any positive count)
    gate: GateKind = GateKind.BOUNDED
    ssm: SsmDtype = SsmDtype.FP32
    fb_weight: FbWeight = FbWeight.BF16
    row_layout: QkvgLayout = QkvgLayout.QKVG
    head_dim_k: int = KDA_DK
    head_dim_v: int = KDA_DV
    conv_width: int = CONV_TAPS
    threads: int = 256                       # 8 warps; a half-warp streams one state row
    max_split: int = 8                       # largest cluster of CTAs sharing one (seq, head)
    min_blocks: int = 2                      # __launch_bounds__ min CTAs per SM (caps registers)

    def validate(self) -> None:
        check_heads(self.heads, 65535, "heads are grid.y")
        check_enum_fields(self, (("gate", GateKind), ("ssm", SsmDtype), ("fb_weight", FbWeight),
                                 ("row_layout", QkvgLayout)))
        if self.head_dim_k != KDA_DK:
            raise SpecError("head_dim_k", self.head_dim_k, [KDA_DK], "the kernel is written for K = 128")
        if self.head_dim_v != KDA_DV:
            raise SpecError("head_dim_v", self.head_dim_v, [KDA_DV], "the kernel is written for V = 128")
        if self.conv_width != CONV_TAPS:
            raise SpecError("conv_width", self.conv_width, [CONV_TAPS], "the conv window keeps 3 inputs")
        check_ssm_on_target(self)
        if self.threads != 256:
            raise SpecError("threads", self.threads, [256],
                            "one thread per q/k conv channel, a half-warp per state row")
        if self.max_split not in SPLITS:
            raise SpecError("max_split", self.max_split, list(SPLITS), "portable cluster sizes")
        if self.min_blocks not in (1, 2):
            raise SpecError("min_blocks", self.min_blocks, [1, 2])
        self.impl  # noqa: B018  (a spec no kernel can implement is rejected here, with each kernel's reason)

    def slug(self) -> str:
        s = f"h{self.heads}-{self.gate.value}-{self.ssm.value}"
        if self.fb_weight is not FbWeight.BF16:
            s += f"-fb{self.fb_weight.value}"
        if self.max_split != 8:
            s += f"-x{self.max_split}"
        if self.min_blocks != 2:
            s += f"-mb{self.min_blocks}"
        return s

    # -- estimates --------------------------------------------------------------------------
    def bytes_moved(self):
        """Fewest bytes through device memory for B sequences (sympy over B): state and conv
        window read + written, the inputs read once, the output written once, weights read once."""
        B = sym("B")
        H, D = self.heads, self.d
        state = 2 * B * H * self.state_bytes_per_head
        conv = 2 * B * 3 * D * (CONV_TAPS - 1) * BF16.bytes
        acts = B * (4 * D + KDA_DK + H) * BF16.bytes + B * INT32.bytes
        out = B * D * BF16.bytes
        weights = (3 * D * CONV_TAPS + D * KDA_DK) * BF16.bytes + (D + H + KDA_DV) * FP32.bytes
        return state + conv + acts + out + weights

    def flops(self):
        return sym("B") * self.heads * FLOPS_PER_TOKEN_HEAD
