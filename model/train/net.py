"""The differentiable training forward of a K3 model: the function model/reference.py's
`Fp32Reference.prefill` computes, over a batch of full sequences [B, T], with autograd.

Parameters are the canonical tensors (model/reference.py `canonical_shapes`, the names the
checkpoint readers produce), so `tensors()` is what the export writes and what `Fp32Reference`
reads. What differs from the reference is only the order of FP32 operations: KDA runs in the
chunked form (model/train/kda_chunk.py), MLA as one causal attention over the sequence
(`scaled_dot_product_attention`), the routed experts densely (every expert on every token, weighted
by the router's renormalized weights, zero for experts not picked). AttnRes, SiTU and the router are
model/arch.py's own functions. The router picks its top-k with the noaux_tc rule (model/arch.py
`route`): the choice is not differentiable, the weights are (through the sigmoid scores).
`tests/nogpu/modeling/test_train_forward.py` checks the logits against `Fp32Reference.prefill`.

Quantization-aware mode (`qat = True`): the forward reads every weight as the export stores it
(BF16-stored tensors rounded to BF16, routed experts through the MXFP4 round trip of
model/train/export.py), with straight-through gradients, so the checkpoint computes what was trained.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from k3gen.ir.dtypes import GateKind
from model.arch import AttnResStream, AttnResWeights, act_fn, rms_norm_fp32, route
from model.config import ModelConfig
from model.reference import KDA_QK_EPS, canonical_shapes
from model.train.kda_chunk import kda_chunked

_RESIDUAL_WRITERS = ("o_proj.weight", "down_proj.weight", "routed_expert_up_proj.weight", ".w2.weight")


def _key(name: str) -> str:
    return name.replace(".", "/")


def stored_dtypes(cfg: ModelConfig) -> dict[str, str]:
    """Canonical name -> how the official layout stores it: "bf16", "f32" or "mxfp4"."""
    from model.formats.ct_mxfp4 import official_tensors
    out = {}
    for n, s in official_tensors(cfg).items():
        c = n[len("language_model."):]
        if s.kind == "plain":
            out[c] = "bf16" if s.dtype == "BF16" else "f32"
        elif c.endswith(".weight_packed"):
            out[c[:-len("_packed")]] = "mxfp4"
    return out


def init_tensor(name: str, shape: tuple[int, ...], cfg: ModelConfig, g: torch.Generator) -> torch.Tensor:
    """The initial value of a canonical tensor (FP32)."""
    if name.endswith("A_log"):
        return torch.zeros(shape)                                      # exp(A) = 1
    if name.endswith("dt_bias"):
        # g = -5 sigmoid(z): z spread over [-12, 1] gives decays from ~e^-3.7 per token to half-lives of 10^5.
        return torch.rand(shape, generator=g) * 13.0 - 12.0
    if name.endswith("e_score_correction_bias"):
        return torch.zeros(shape)
    if name.endswith("_res_proj.weight"):
        return torch.zeros(shape)                                      # AttnRes: a uniform mix at start
    if name.endswith(("norm.weight", "layernorm.weight")):
        return torch.ones(shape)
    if "conv1d" in name:
        w = (torch.rand(shape, generator=g) * 2 - 1) * 0.5               # nn.Conv1d's bound 1/sqrt(4)
        w[..., -1] += 1.0                                              # the current token passes through
        return w
    if name.endswith("embed_tokens.weight"):
        return torch.randn(shape, generator=g)
    gain = 0.5 if name.endswith(_RESIDUAL_WRITERS) else 1.0
    return torch.randn(shape, generator=g) * shape[-1] ** -0.5 * gain


def mxfp4_round_trip(w: torch.Tensor) -> torch.Tensor:
    """What the export stores of a routed expert's weight [N, K] (BF16, then MXFP4 group 32 with
    the k3gen packer), decoded to FP32."""
    from model.train.export import PACKER
    from model.formats.ct_mxfp4 import decode_mxfp4, mx_pack, mx_scale_bytes
    wb = w.detach().to(torch.bfloat16)
    sb = mx_scale_bytes(wb, PACKER)
    return decode_mxfp4(mx_pack(wb, sb, PACKER), sb)


class _Ste(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w, q):
        return q

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class K3Train(torch.nn.Module):
    """Canonical parameters of `cfg` and the batched training forward (module docstring)."""

    def __init__(self, cfg: ModelConfig, seed: int = 0, tensors: dict[str, torch.Tensor] | None = None,
                 chunk: int = 64, sub: int = 16):
        super().__init__()
        self.cfg, self.chunk, self.sub = cfg, chunk, sub
        self.shapes = canonical_shapes(cfg)
        self.stored = stored_dtypes(cfg) if cfg.kda_out_gate == "full" and cfg.q_lora is not None else {}
        g = torch.Generator().manual_seed(seed)
        self.p = torch.nn.ParameterDict()
        for n, s in self.shapes.items():
            v = tensors[n].detach().float().clone() if tensors is not None else init_tensor(n, s, cfg, g)
            self.p[_key(n)] = torch.nn.Parameter(v, requires_grad=not n.endswith("e_score_correction_bias"))
        self.act = act_fn(cfg)
        self.qat = False
        self.use_attn_res = cfg.attn_res_block is not None
        self.loads: list[torch.Tensor] = []       # per MoE layer, tokens per expert of the last forward

    # -- weights -------------------------------------------------------------------------------------
    def w(self, name: str) -> torch.Tensor:
        t = self.p[_key(name)]
        if not self.qat:
            return t
        kind = self.stored.get(name)
        if kind == "bf16":
            return _Ste.apply(t, t.detach().to(torch.bfloat16).float())
        if kind == "mxfp4":
            return _Ste.apply(t, mxfp4_round_trip(t).to(t.device))
        return t

    def _experts(self, m: str, which: str) -> torch.Tensor:
        """The routed experts' `which` weights stacked [E, N, K]; in QAT mode through the MXFP4 round
        trip of all of them at once (its groups run along K within a row, as per expert)."""
        t = torch.stack([self.p[_key(f"{m}experts.{e}.{which}.weight")] for e in range(self.cfg.experts)])
        if not self.qat:
            return t
        return _Ste.apply(t, mxfp4_round_trip(t.reshape(-1, t.shape[-1])).reshape(t.shape).to(t.device))

    def tensors(self) -> dict[str, torch.Tensor]:
        """The canonical FP32 tensors (detached copies on the CPU)."""
        return {n: self.p[_key(n)].detach().float().cpu().clone() for n in self.shapes}

    def matrices(self) -> list[torch.nn.Parameter]:
        """Parameters that take weight decay (2-D projections, not norms, queries or embeddings)."""
        out = []
        for n in self.shapes:
            t = self.p[_key(n)]
            if t.requires_grad and t.dim() == 2 and not n.endswith(("_res_proj.weight", "embed_tokens.weight")):
                out.append(t)
        return out

    # -- forward -------------------------------------------------------------------------------------
    def _res(self, prefix: str) -> AttnResWeights | None:
        if not self.use_attn_res:
            return None
        return AttnResWeights(proj=self.w(prefix + "_res_proj.weight"), norm=self.w(prefix + "_res_norm.weight"))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, T] -> logits [B, T, vocab] FP32 (each sequence from a fresh state)."""
        cfg = self.cfg
        self.loads = []
        x = F.embedding(tokens.long(), self.w("model.embed_tokens.weight"))
        stream = AttnResStream(x, cfg.attn_res_block if self.use_attn_res else None, cfg.eps)
        for i in range(cfg.layers):
            p = f"model.layers.{i}."
            h = rms_norm_fp32(stream.inputs(self._res(p + "self_attention")), self.w(p + "input_layernorm.weight"),
                              cfg.eps)
            stream.add_attn(i, self._kda(i, h) if cfg.kind(i) == "kda" else self._mla(i, h))
            h = rms_norm_fp32(stream.inputs(self._res(p + "mlp")), self.w(p + "post_attention_layernorm.weight"),
                              cfg.eps)
            stream.add_ffn(self._mlp(h, p + "mlp.") if cfg.is_dense(i) else self._moe(i, h))
        out = rms_norm_fp32(stream.output(self._res("model.output_attn")), self.w("model.norm.weight"), cfg.eps)
        head = "model.embed_tokens.weight" if cfg.tie_embeddings else "lm_head.weight"
        return out @ self.w(head).t()

    def _lin(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return x @ self.w(name).t()

    def _kda(self, i: int, x: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        a = f"model.layers.{i}.self_attn."
        B, T = x.shape[:2]
        H, K = cfg.kda_heads, cfg.kda_head_dim
        D, Wc = H * K, cfg.conv_size
        qkv = []
        for n in "qkv":
            raw = self._lin(x, f"{a}{n}_proj.weight").transpose(1, 2)          # [B, D, T]
            y = F.conv1d(F.pad(raw, (Wc - 1, 0)), self.w(f"{a}{n}_conv1d.weight"), groups=D)
            qkv.append(F.silu(y).transpose(1, 2).reshape(B, T, H, K))
        q, k, v = qkv
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + KDA_QK_EPS) * K ** -0.5
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + KDA_QK_EPS)
        beta = torch.sigmoid(self._lin(x, a + "b_proj.weight"))
        z = self._lin(self._lin(x, a + "f_a_proj.weight"), a + "f_b_proj.weight") + self.w(a + "dt_bias")
        z = z.reshape(B, T, H, K)
        A = self.w(a + "A_log").reshape(-1)[:H].reshape(1, 1, H, 1)
        if cfg.kda_gate is GateKind.BOUNDED:
            g = cfg.gate_lower_bound * torch.sigmoid(torch.exp(A) * z)
        else:
            g = -torch.exp(A) * F.softplus(z)
        o = kda_chunked(q, k, v, g, beta, self.chunk, self.sub)
        if cfg.kda_out_gate == "full":
            gate = self._lin(x, a + "g_proj.weight")
        else:
            gate = self._lin(self._lin(x, a + "g_a_proj.weight"), a + "g_b_proj.weight")
        y = rms_norm_fp32(o, self.w(a + "o_norm.weight"), cfg.eps) * torch.sigmoid(gate.reshape(B, T, H, K))
        return self._lin(y.reshape(B, T, D), a + "o_proj.weight")

    def _mla(self, i: int, x: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        a = f"model.layers.{i}.self_attn."
        B, T = x.shape[:2]
        H, nope, rope, vd = cfg.mla_heads, cfg.qk_nope, cfg.qk_rope, cfg.v_head
        if cfg.q_lora is None:
            q = self._lin(x, a + "q_proj.weight")
        else:
            qa = rms_norm_fp32(self._lin(x, a + "q_a_proj.weight"), self.w(a + "q_a_layernorm.weight"), cfg.eps)
            q = self._lin(qa, a + "q_b_proj.weight")
        q = q.reshape(B, T, H, nope + rope).transpose(1, 2)                    # [B, H, T, 192]
        kva = self._lin(x, a + "kv_a_proj_with_mqa.weight")
        ckv = rms_norm_fp32(kva[..., :cfg.kv_lora], self.w(a + "kv_a_layernorm.weight"), cfg.eps)
        kpe = kva[..., cfg.kv_lora:]                                           # NoPE: never rotated
        kvb = self.w(a + "kv_b_proj.weight").reshape(H, nope + vd, cfg.kv_lora)
        k_nope = torch.einsum("btc,hdc->bhtd", ckv, kvb[:, :nope])
        val = torch.einsum("btc,hdc->bhtd", ckv, kvb[:, nope:])
        k = torch.cat([k_nope, kpe[:, None].expand(B, H, T, rope)], dim=-1)
        o = F.scaled_dot_product_attention(q, k, val, is_causal=True, scale=1.0 / math.sqrt(nope + rope))
        o = o.transpose(1, 2)                                                  # [B, T, H, 128]
        if cfg.mla_out_gate:
            o = o * torch.sigmoid(self._lin(x, a + "g_proj.weight").reshape(B, T, H, vd))
        return self._lin(o.reshape(B, T, H * vd), a + "o_proj.weight")

    def _mlp(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        return self._lin(self.act(self._lin(x, prefix + "gate_proj.weight"), self._lin(x, prefix + "up_proj.weight")),
                         prefix + "down_proj.weight")

    def _moe(self, i: int, x: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        m = f"model.layers.{i}.block_sparse_moe."
        shape = x.shape
        xf = x.reshape(-1, shape[-1])
        ids, wts = route(self._lin(xf, m + "gate.weight"), self.w(m + "gate.e_score_correction_bias"), cfg)
        E = cfg.experts
        flat = ids.reshape(-1)      # tokens per expert (scatter_add: no host sync, shapes known ahead)
        self.loads.append(torch.zeros(E, device=x.device).scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.float32)))
        dense = torch.zeros(xf.shape[0], E, device=x.device, dtype=wts.dtype).scatter(1, ids, wts)
        lat = xf if cfg.moe_latent is None else self._lin(xf, m + "routed_expert_down_proj.weight")
        w1, w3, w2 = (self._experts(m, n) for n in ("w1", "w3", "w2"))   # [E, I, W] gate, up; [E, W, I]
        h = self.act(torch.einsum("mw,eiw->emi", lat, w1), torch.einsum("mw,eiw->emi", lat, w3))
        y = torch.einsum("me,emw->mw", dense, torch.einsum("emi,ewi->emw", h, w2))
        if cfg.latent_norm:
            y = rms_norm_fp32(y, self.w(m + "routed_expert_norm.weight"), cfg.eps)
        if cfg.moe_latent is not None:
            y = self._lin(y, m + "routed_expert_up_proj.weight")
        if cfg.shared_experts:
            y = y + self._mlp(xf, m + "shared_experts.")
        return y.reshape(shape)

    @torch.no_grad()
    def balance(self, rate: float) -> None:
        """The aux-loss-free balancing of noaux_tc routers (DeepSeek-V3): each MoE layer's correction
        bias moves by `rate` toward its under-loaded experts, from the loads of the last forward."""
        moe = [i for i in range(self.cfg.layers) if not self.cfg.is_dense(i)]
        for i, load in zip(moe, self.loads):
            b = self.p[_key(f"model.layers.{i}.block_sparse_moe.gate.e_score_correction_bias")]
            load = load.float()
            b += rate * torch.sign(load.mean() - load).to(b.device)


__all__ = ["K3Train", "stored_dtypes", "init_tensor", "mxfp4_round_trip"]
