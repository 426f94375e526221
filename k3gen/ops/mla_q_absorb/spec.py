"""mla_q_absorb: the fused MLA query path of one decode step (SPEC.md section 4, step 2).

    qn  = BF16((q_a * rsqrt(mean(q_a^2) + eps)) * w_qa)           q_a = the 1536 q_a columns
    x   = per-token per-128 E4M3 quantization of qn (the spec's scale recipe, act_quant_fp8 rules)
    q   = BF16(fp8_block_gemm(x, W_qb))                            [B, H * 192], per head [nope 128 | pe 64]
    out[b, h] = [ BF16(q_nope[b, h] @ W_UK[h]) (512) | q_pe[b, h] (64) ]   -> BF16 [B, H, 576]

No rotation of the 64 rope dims (K3 is NoPE). W_UK[h] = the first 128 (k_nope) rows of head h's
256 rows of kv_b (k3gen's row order: per head [k_nope 128 | v 128]), dequantized to BF16; the
launcher takes any [H, 128, 512] view with unit inner strides, e.g. kv_b.view(H, 256, 512)[:, :128].

Lowering, first version: three launches from one launcher, in this order: `k3gen_mla_q_norm_quant`
(RMSNorm + quantization, this op's cubin), the fp8_block_gemm kernel of `gemm_spec`, and
`k3gen_mla_q_absorb` (absorption + pe copy, this op's cubin). Intermediates live in a workspace the
caller allocates once with `MlaQAbsorb.workspace(max_batch)`, so calls stay graph-safe. The output
is BF16 only; quantizing q for FP8/NVFP4 attention is left to the attention op.
"""
from __future__ import annotations

from dataclasses import dataclass

from k3gen.errors import SpecError
from k3gen.ir.dims import sym
from k3gen.ir.dtypes import ScaleRecipe
from k3gen.ir.layouts import MLA_LATENT, MLA_ROPE
from k3gen.ir.spec import OpSpec, register_op

Q_LORA = 1536
NOPE = 128
QK_HEAD = NOPE + MLA_ROPE          # 192 q_b rows per head
OUT_HEAD = MLA_LATENT + MLA_ROPE    # 576
BATCH_TILE = 8                      # tokens per absorb CTA (each W_UK element feeds 8 FMAs)


@register_op("mla_q_absorb")
@dataclass(frozen=True, kw_only=True)
class MlaQAbsorbSpec(OpSpec):
    heads: int                            # per rank: 6, 12, 24, 48, 96
    recipe: ScaleRecipe | None = None     # Q-B scale recipe; defaults to the target's
    eps: float = 1e-5

    def resolve(self) -> None:
        if self.recipe is None:
            object.__setattr__(self, "recipe", self.target.scale_recipe)

    def validate(self) -> None:
        if not isinstance(self.heads, int) or isinstance(self.heads, bool) or not 1 <= self.heads <= 128:
            raise SpecError("heads", self.heads, "1..128")
        if not isinstance(self.recipe, ScaleRecipe):
            raise SpecError("recipe", self.recipe, [r.value for r in ScaleRecipe])
        if not isinstance(self.eps, float) or not 0.0 < self.eps < 1.0:
            raise SpecError("eps", self.eps, "a float in (0, 1)")
        self.impl  # noqa: B018  (a kernel for this target, or SpecError with each variant's reason)

    @property
    def gemm_spec(self):
        """The Q-B projection this op launches (same target and recipe)."""
        from k3gen.ops.fp8_block_gemm.spec import Fp8BlockGemmSpec
        return Fp8BlockGemmSpec(target=self.target, n=self.heads * QK_HEAD, k=Q_LORA, recipe=self.recipe)

    @property
    def k_blocks(self) -> int:
        return Q_LORA // 128

    def slug(self) -> str:
        s = f"h{self.heads}-{self.recipe.value}"
        if self.eps != 1e-5:
            s += f"-eps{self.eps:g}"
        return s

    def bytes_moved(self):
        """Per B tokens: q_a, Q-B weights, W_UK, the output; the workspace round trips too."""
        B = sym("B")
        H = self.heads
        wqb = H * QK_HEAD * Q_LORA + H * QK_HEAD // 128 * self.k_blocks * 4
        work = B * (Q_LORA + self.k_blocks * 4) * 2 + B * H * QK_HEAD * 2 * 2
        return B * Q_LORA * 2 + Q_LORA * 2 + wqb + H * NOPE * MLA_LATENT * 2 + work + B * H * OUT_HEAD * 2

    def flops(self):
        B = sym("B")
        return 2 * B * self.heads * (QK_HEAD * Q_LORA + NOPE * MLA_LATENT)
