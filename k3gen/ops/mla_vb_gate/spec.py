"""mla_vb_gate: the fused V-B projection and output gate of MLA decode (SPEC.md section 4, step 5).

    out[b, h, d] = BF16( (sum_c o_lat[b, h, c] * W_UV[h][d, c]) * sigmoid(gate[b, h * 128 + d]) )

FP32 math. o_lat [B, H, 512] BF16 contiguous (the attention output), W_UV [H, 128, 512] BF16 with
unit inner strides and any head stride (k3gen's kv_b row order: per head [k_nope 128 | v 128], so
kv_b.view(H, 256, 512)[:, 128:] is a valid W_UV), gate [B, >= H * 128] BF16 with unit inner stride
and any row stride (the gate slice of the A-projection output), out [B, H, 128] BF16 contiguous.

Launch: grid (H, ceil(B / 8)), 256 threads; a CTA stages 8 tokens' latent vectors of its head in
shared memory and streams W_UV[h] once for them (each warp owns 16 output dims).
"""
from __future__ import annotations

from dataclasses import dataclass

from k3gen.errors import SpecError
from k3gen.ir.dims import sym
from k3gen.ir.layouts import MLA_LATENT
from k3gen.ir.spec import OpSpec, register_op

V_HEAD = 128
BATCH_TILE = 8
THREADS = 256


@register_op("mla_vb_gate")
@dataclass(frozen=True, kw_only=True)
class MlaVbGateSpec(OpSpec):
    heads: int

    def validate(self) -> None:
        if not isinstance(self.heads, int) or isinstance(self.heads, bool) or not 1 <= self.heads <= 65535:
            raise SpecError("heads", self.heads, "1..65535", "grid.x")
        self.impl  # noqa: B018  (a kernel for this target, or SpecError with each variant's reason)

    def grid(self, b: int) -> tuple[int, int, int]:
        return (self.heads, -(-b // BATCH_TILE), 1)

    def slug(self) -> str:
        return f"h{self.heads}"

    def bytes_moved(self):
        B = sym("B")
        H = self.heads
        return H * V_HEAD * MLA_LATENT * 2 + B * H * (MLA_LATENT + 2 * V_HEAD) * 2

    def flops(self):
        B = sym("B")
        return 2 * B * self.heads * V_HEAD * MLA_LATENT + 4 * B * self.heads * V_HEAD
