"""The FP32 whole-model reference of Kimi K3 / Kimi-Linear, written from the formulas (SPEC.md
sections 1, 2 and 4), CPU-runnable: the oracle the serving model and the kernels are compared with.

Everything is FP32: weights are upcast once, no BF16 rounding anywhere. One sequence at a time:
`prefill(tokens [T]) -> logits [T, vocab]` starts a fresh sequence, `decode(token) -> [vocab]`
continues it from the kept state (per KDA layer: the FP32 state S [H, K, V] and the last 3 raw
conv inputs; per MLA layer: the cache rows [RMSNorm(c_kv) 512 | k_pe 64] of every past token).
Both run the same per-layer code over the new tokens: KDA is the token-sequential recurrence, MLA
the unabsorbed form with a bottom-right causal mask.

Tensor names are the canonical ones (`canonical_shapes`): the published checkpoints' names without
kimi_k3's `language_model.` wrapper; model/formats/ readers produce such dicts.

Sources for the facts (read, never copied): transformers 5.23 `models/kimi_linear/
modeling_kimi_linear.py` (the Kimi-Linear forward: conv, l2norm, gate, recurrence, gated norm,
MLA without RoPE); SGLang `models/kimi_k3.py` and vLLM `models/kimi_k3/nvidia/{kda,mla,model}.py`
via /work/tools_tmp/k3_facts.md (K3's bounded gate, full-rank output gate, MLA output gate,
latent MoE, A_log padding, kv_b row order per head [k_nope | v]).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from k3gen.ir.dtypes import GateKind

from model.arch import AttnResStream, AttnResWeights, act_fn, rms_norm_fp32, route
from model.checkpoint import BadValueError, MissingTensorError, TensorShapeError
from model.config import ModelConfig

KDA_QK_EPS = 1e-6   # inside the sqrt of q/k's L2 norm (SPEC.md section 2 step 2; fla's l2norm)


# -- canonical names and shapes --------------------------------------------------------------------
def a_log_shapes(cfg: ModelConfig) -> tuple[tuple[int, ...], ...]:
    """The storage shapes A_log may have: K3's padded [a_log_pad] (the first H real) and
    Kimi-Linear's [1, 1, H, 1] (transformers 5.23 KimiLinearForgetGate)."""
    H = cfg.kda_heads
    shapes = [(1, 1, H, 1)]
    if cfg.a_log_pad:
        shapes.insert(0, (cfg.a_log_pad,))
    return tuple(shapes)


def canonical_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the model of `cfg` reads, by canonical name, with its shape (A_log: the
    first of `a_log_shapes`; the checks accept any of them)."""
    hid, t = cfg.hidden, {}
    t["model.embed_tokens.weight"] = (cfg.vocab, hid)
    t["model.norm.weight"] = (hid,)
    if not cfg.tie_embeddings:
        t["lm_head.weight"] = (cfg.vocab, hid)
    if cfg.attn_res_block is not None:
        t["model.output_attn_res_norm.weight"] = (hid,)
        t["model.output_attn_res_proj.weight"] = (1, hid)
    for i in range(cfg.layers):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = (hid,)
        t[p + "post_attention_layernorm.weight"] = (hid,)
        if cfg.attn_res_block is not None:
            for side in ("self_attention", "mlp"):
                t[f"{p}{side}_res_norm.weight"] = (hid,)
                t[f"{p}{side}_res_proj.weight"] = (1, hid)
        a = p + "self_attn."
        if cfg.kind(i) == "kda":
            H, Kd = cfg.kda_heads, cfg.kda_head_dim
            D = H * Kd
            for n in ("q", "k", "v"):
                t[f"{a}{n}_proj.weight"] = (D, hid)
                t[f"{a}{n}_conv1d.weight"] = (D, 1, cfg.conv_size)
            t[a + "f_a_proj.weight"] = (Kd, hid)
            t[a + "f_b_proj.weight"] = (D, Kd)
            t[a + "b_proj.weight"] = (H, hid)
            if cfg.kda_out_gate == "full":
                t[a + "g_proj.weight"] = (D, hid)
            else:
                t[a + "g_a_proj.weight"] = (Kd, hid)
                t[a + "g_b_proj.weight"] = (D, Kd)
            t[a + "A_log"] = a_log_shapes(cfg)[0]
            t[a + "dt_bias"] = (D,)
            t[a + "o_norm.weight"] = (Kd,)
            t[a + "o_proj.weight"] = (hid, D)
        else:
            H, qk = cfg.mla_heads, cfg.qk_nope + cfg.qk_rope
            if cfg.q_lora is None:
                t[a + "q_proj.weight"] = (H * qk, hid)
            else:
                t[a + "q_a_proj.weight"] = (cfg.q_lora, hid)
                t[a + "q_a_layernorm.weight"] = (cfg.q_lora,)
                t[a + "q_b_proj.weight"] = (H * qk, cfg.q_lora)
            t[a + "kv_a_proj_with_mqa.weight"] = (cfg.kv_lora + cfg.qk_rope, hid)
            t[a + "kv_a_layernorm.weight"] = (cfg.kv_lora,)
            t[a + "kv_b_proj.weight"] = (H * (cfg.qk_nope + cfg.v_head), cfg.kv_lora)
            if cfg.mla_out_gate:
                t[a + "g_proj.weight"] = (H * cfg.v_head, hid)
            t[a + "o_proj.weight"] = (hid, H * cfg.v_head)
        if cfg.is_dense(i):
            m = p + "mlp."
            t[m + "gate_proj.weight"] = (cfg.dense_inter, hid)
            t[m + "up_proj.weight"] = (cfg.dense_inter, hid)
            t[m + "down_proj.weight"] = (hid, cfg.dense_inter)
            continue
        m, W = p + "block_sparse_moe.", cfg.expert_width
        t[m + "gate.weight"] = (cfg.experts, hid)
        t[m + "gate.e_score_correction_bias"] = (cfg.experts,)
        for e in range(cfg.experts):
            t[f"{m}experts.{e}.w1.weight"] = (cfg.moe_inter, W)
            t[f"{m}experts.{e}.w3.weight"] = (cfg.moe_inter, W)
            t[f"{m}experts.{e}.w2.weight"] = (W, cfg.moe_inter)
        if cfg.moe_latent is not None:
            t[m + "routed_expert_down_proj.weight"] = (cfg.moe_latent, hid)
            t[m + "routed_expert_up_proj.weight"] = (hid, cfg.moe_latent)
            if cfg.latent_norm:
                t[m + "routed_expert_norm.weight"] = (cfg.moe_latent,)
        if cfg.shared_experts:
            # One MLP of moe_inter * shared_experts (transformers' KimiLinearMoE; K3: 2 x 3072 = 6144).
            t[m + "shared_experts.gate_proj.weight"] = (cfg.shared_inter, hid)
            t[m + "shared_experts.up_proj.weight"] = (cfg.shared_inter, hid)
            t[m + "shared_experts.down_proj.weight"] = (hid, cfg.shared_inter)
    return t


def check_shape(cfg: ModelConfig, name: str, shape: tuple[int, ...], want: tuple[int, ...]) -> None:
    ok = a_log_shapes(cfg) if name.endswith(".A_log") else (want,)
    if tuple(shape) not in ok:
        raise TensorShapeError(f"{name}: shape {list(shape)}, expected " + " or ".join(str(list(s)) for s in ok))


def check_tensors(cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> None:
    """Every canonical tensor present, of its shape and finite (typed errors naming the tensor)."""
    for name, want in canonical_shapes(cfg).items():
        if name not in tensors:
            raise MissingTensorError(f"{name}: missing")
        t = tensors[name]
        check_shape(cfg, name, tuple(t.shape), want)
        if not bool(torch.isfinite(t).all()):
            raise BadValueError(f"{name}: {int((~torch.isfinite(t)).sum())} non-finite values")


# -- the model -------------------------------------------------------------------------------------
def _lin(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x @ w.t()


class Fp32Reference:
    """FP32 reference of `cfg` over canonical tensors (see the module docstring).

    `mla_norm_eps`: the eps of q_a_layernorm and kv_a_layernorm (default cfg.eps, what SGLang and
    vLLM use: RMSNorm(kv_lora, eps=config.rms_norm_eps)). transformers 5.23 builds those two norms
    with KimiLinearRMSNorm's default 1e-6 instead; the HF oracle test passes that.
    """

    def __init__(self, cfg: ModelConfig, tensors: dict[str, torch.Tensor], *, mla_norm_eps: float | None = None):
        check_tensors(cfg, tensors)
        self.cfg = cfg
        self.mla_eps = cfg.eps if mla_norm_eps is None else float(mla_norm_eps)
        self.w = {n: tensors[n].detach().to(torch.float32) for n in canonical_shapes(cfg)}
        self.act = act_fn(cfg)
        self.state: list[dict] = []
        self.reset()

    # -- sequence state ------------------------------------------------------------------------------
    def reset(self) -> None:
        cfg = self.cfg
        self.state = []
        for i in range(cfg.layers):
            if cfg.kind(i) == "kda":
                H, K = cfg.kda_heads, cfg.kda_head_dim
                self.state.append({"S": torch.zeros(H, K, K),
                                   "conv": torch.zeros(3, cfg.conv_size - 1, H * K)})
            else:
                self.state.append({"ckv": torch.zeros(0, cfg.kv_lora), "kpe": torch.zeros(0, cfg.qk_rope)})
        self.pos = 0

    @torch.no_grad()
    def prefill(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits [T, vocab] of a new sequence `tokens` [T]."""
        self.reset()
        return self._forward(torch.as_tensor(tokens).reshape(-1))

    @torch.no_grad()
    def decode(self, token) -> torch.Tensor:
        """Logits [vocab] of one more token of the current sequence."""
        return self._forward(torch.as_tensor(token).reshape(1))[0]

    # -- forward -------------------------------------------------------------------------------------
    def _res(self, prefix: str) -> AttnResWeights | None:
        if self.cfg.attn_res_block is None:
            return None
        return AttnResWeights(proj=self.w[prefix + "_res_proj.weight"], norm=self.w[prefix + "_res_norm.weight"])

    def _forward(self, tokens: torch.Tensor) -> torch.Tensor:
        cfg, w = self.cfg, self.w
        x = w["model.embed_tokens.weight"][tokens.long()]
        stream = AttnResStream(x, cfg.attn_res_block, cfg.eps)
        for i in range(cfg.layers):
            p = f"model.layers.{i}."
            h = rms_norm_fp32(stream.inputs(self._res(p + "self_attention")), w[p + "input_layernorm.weight"], cfg.eps)
            a = self._kda(i, h) if cfg.kind(i) == "kda" else self._mla(i, h)
            stream.add_attn(i, a)
            h = rms_norm_fp32(stream.inputs(self._res(p + "mlp")), w[p + "post_attention_layernorm.weight"], cfg.eps)
            stream.add_ffn(self._dense(i, h) if cfg.is_dense(i) else self._moe(i, h))
        self.pos += len(tokens)
        out = rms_norm_fp32(stream.output(self._res("model.output_attn")), w["model.norm.weight"], cfg.eps)
        head = w["model.embed_tokens.weight"] if cfg.tie_embeddings else w["lm_head.weight"]
        return _lin(out, head)

    # -- KDA (SPEC.md section 2) ---------------------------------------------------------------------
    def _kda(self, i: int, x: torch.Tensor) -> torch.Tensor:
        cfg, w, st = self.cfg, self.w, self.state[i]
        a = f"model.layers.{i}.self_attn."
        T, H, K = x.shape[0], cfg.kda_heads, cfg.kda_head_dim
        D, W = H * K, cfg.conv_size
        qkv = []
        for j, n in enumerate("qkv"):
            raw = _lin(x, w[f"{a}{n}_proj.weight"])                      # [T, D]
            seq = torch.cat([st["conv"][j], raw])                       # [W-1+T, D], oldest first
            taps = w[f"{a}{n}_conv1d.weight"].reshape(D, W)
            # y_t[c] = SiLU(sum_j taps[c, j] * x_{t-(W-1)+j}[c]): tap 0 reads the oldest input.
            y = sum(taps[:, j] * seq[j:j + T] for j in range(W))
            qkv.append(F.silu(y).reshape(T, H, K))
            st["conv"][j] = seq[T:].clone()                             # the last W-1 raw inputs
        q, k, v = qkv
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + KDA_QK_EPS) * K ** -0.5
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + KDA_QK_EPS)
        beta = torch.sigmoid(_lin(x, w[a + "b_proj.weight"]))           # [T, H]
        z = _lin(_lin(x, w[a + "f_a_proj.weight"]), w[a + "f_b_proj.weight"]) + w[a + "dt_bias"]
        z = z.reshape(T, H, K)
        A = w[a + "A_log"].reshape(-1)[:H].reshape(1, H, 1)              # padded storage: the first H real
        if cfg.kda_gate is GateKind.BOUNDED:
            g = cfg.gate_lower_bound * torch.sigmoid(torch.exp(A) * z)
        else:
            g = -torch.exp(A) * F.softplus(z)
        S = st["S"]                                                     # [H, K, V]
        o = torch.empty(T, H, K)
        for t in range(T):
            S = S * torch.exp(g[t])[:, :, None]                         # decay along the key channel
            u = beta[t][:, None] * (v[t] - torch.einsum("hkv,hk->hv", S, k[t]))
            S = S + k[t][:, :, None] * u[:, None, :]
            o[t] = torch.einsum("hkv,hk->hv", S, q[t])                   # reads the updated state
        st["S"] = S
        if cfg.kda_out_gate == "full":
            gate = _lin(x, w[a + "g_proj.weight"])
        else:
            gate = _lin(_lin(x, w[a + "g_a_proj.weight"]), w[a + "g_b_proj.weight"])
        y = rms_norm_fp32(o, w[a + "o_norm.weight"], cfg.eps) * torch.sigmoid(gate.reshape(T, H, K))
        return _lin(y.reshape(T, D), w[a + "o_proj.weight"])

    # -- MLA, unabsorbed (SPEC.md section 4) ---------------------------------------------------------
    def _mla(self, i: int, x: torch.Tensor) -> torch.Tensor:
        cfg, w, st = self.cfg, self.w, self.state[i]
        a = f"model.layers.{i}.self_attn."
        T, H, nope, rope, vd = x.shape[0], cfg.mla_heads, cfg.qk_nope, cfg.qk_rope, cfg.v_head
        if cfg.q_lora is None:
            q = _lin(x, w[a + "q_proj.weight"])
        else:
            qa = rms_norm_fp32(_lin(x, w[a + "q_a_proj.weight"]), w[a + "q_a_layernorm.weight"], self.mla_eps)
            q = _lin(qa, w[a + "q_b_proj.weight"])
        q = q.reshape(T, H, nope + rope)                                # per head [nope | pe]
        kva = _lin(x, w[a + "kv_a_proj_with_mqa.weight"])
        ckv = rms_norm_fp32(kva[:, :cfg.kv_lora], w[a + "kv_a_layernorm.weight"], self.mla_eps)
        st["ckv"] = torch.cat([st["ckv"], ckv])
        st["kpe"] = torch.cat([st["kpe"], kva[:, cfg.kv_lora:]])        # NoPE: never rotated
        N = st["ckv"].shape[0]
        kvb = w[a + "kv_b_proj.weight"].reshape(H, nope + vd, cfg.kv_lora)   # per head [k_nope | v] rows
        k_nope = torch.einsum("nc,hdc->hnd", st["ckv"], kvb[:, :nope])
        val = torch.einsum("nc,hdc->hnd", st["ckv"], kvb[:, nope:])
        s = (torch.einsum("thd,hnd->htn", q[..., :nope], k_nope)
             + torch.einsum("thd,nd->htn", q[..., nope:], st["kpe"])) / math.sqrt(nope + rope)
        # Bottom-right causal: new token t sits at position N - T + t and sees rows 0..N-T+t.
        allowed = torch.arange(N)[None, :] <= (N - T + torch.arange(T))[:, None]
        p = torch.softmax(s.masked_fill(~allowed, float("-inf")), dim=-1)
        o = torch.einsum("htn,hnd->thd", p, val)
        if cfg.mla_out_gate:
            o = o * torch.sigmoid(_lin(x, w[a + "g_proj.weight"]).reshape(T, H, vd))
        return _lin(o.reshape(T, H * vd), w[a + "o_proj.weight"])

    # -- FFN -----------------------------------------------------------------------------------------
    def _mlp(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        w = self.w
        return _lin(self.act(_lin(x, w[prefix + "gate_proj.weight"]), _lin(x, w[prefix + "up_proj.weight"])),
                    w[prefix + "down_proj.weight"])

    def _dense(self, i: int, x: torch.Tensor) -> torch.Tensor:
        return self._mlp(x, f"model.layers.{i}.mlp.")

    def _moe(self, i: int, x: torch.Tensor) -> torch.Tensor:
        cfg, w = self.cfg, self.w
        m = f"model.layers.{i}.block_sparse_moe."
        ids, wts = route(_lin(x, w[m + "gate.weight"]), w[m + "gate.e_score_correction_bias"], cfg)
        lat = x if cfg.moe_latent is None else _lin(x, w[m + "routed_expert_down_proj.weight"])
        y = torch.zeros_like(lat)
        for e in ids.unique().tolist():
            rows, slot = (ids == e).nonzero(as_tuple=True)
            xe = lat[rows]
            pre = f"{m}experts.{e}."
            he = self.act(_lin(xe, w[pre + "w1.weight"]), _lin(xe, w[pre + "w3.weight"]))  # w1 gate, w3 up
            y.index_add_(0, rows, _lin(he, w[pre + "w2.weight"]) * wts[rows, slot][:, None])
        if cfg.latent_norm:
            y = rms_norm_fp32(y, w[m + "routed_expert_norm.weight"], cfg.eps)
        if cfg.moe_latent is not None:
            y = _lin(y, w[m + "routed_expert_up_proj.weight"])
        if cfg.shared_experts:
            y = y + self._mlp(x, m + "shared_experts.")               # shared experts see the hidden width
        return y


# -- the reference of loaded weights --------------------------------------------------------------
def canonical_from_weights(w) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(config, canonical FP32 tensors) computing exactly what a TP1 `ModelWeights` (model/weights.py,
    as model/formats/assemble.py builds it) holds: the FP8 and packed weights dequantized, the fused
    projections split back, W_UK / W_UV as kv_b. Kimi-Linear's low-rank KDA gate comes back as the
    full-rank g_proj it was folded into (the config says so), and an MLA layer without the output
    gate loses its zero gate rows and the doubling of o_proj (exact). Fp32Reference over them is the
    loaded model in FP32 math, without the activation roundings of K3Model's paths."""
    import dataclasses
    cfg = dataclasses.replace(w.cfg, kda_out_gate="full")
    t: dict[str, torch.Tensor] = {}
    f = torch.float32
    t["model.embed_tokens.weight"] = w.embed.to(f)
    t["model.norm.weight"] = w.final_norm.to(f)
    if not cfg.tie_embeddings:
        t["lm_head.weight"] = w.lm_head.to(f)
    if w.output_res is not None:
        t["model.output_attn_res_proj.weight"] = w.output_res.proj.to(f).reshape(1, -1)
        t["model.output_attn_res_norm.weight"] = w.output_res.norm.to(f)
    for i, lw in enumerate(w.layers):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"], t[p + "post_attention_layernorm.weight"] = lw.input_norm.to(f), lw.post_norm.to(f)
        for side, r in (("self_attention", lw.attn_res), ("mlp", lw.mlp_res)):
            if r is not None:
                t[f"{p}{side}_res_proj.weight"], t[f"{p}{side}_res_norm.weight"] = r.proj.to(f).reshape(1, -1), r.norm.to(f)
        a, x = p + "self_attn.", lw.attn
        if cfg.kind(i) == "kda":
            H = x.kda.heads
            D = H * cfg.kda_head_dim
            qkvg, fab = x.qkvg.dequant(), x.fab.dequant()
            for j, n in enumerate(("q_proj", "k_proj", "v_proj", "g_proj")):
                t[a + n + ".weight"] = qkvg[j * D:(j + 1) * D]
            for j, n in enumerate("qkv"):
                t[f"{a}{n}_conv1d.weight"] = x.kda.conv_w[j * D:(j + 1) * D].to(f).reshape(D, 1, -1)
            t[a + "f_a_proj.weight"], t[a + "b_proj.weight"] = fab[:cfg.kda_head_dim], fab[cfg.kda_head_dim:][:H]
            t[a + "f_b_proj.weight"], t[a + "dt_bias"] = x.kda.fb_w.to(f), x.kda.dt_bias.to(f)
            t[a + "A_log"], t[a + "o_norm.weight"] = x.kda.a_log.to(f).reshape(1, 1, H, 1), x.kda.norm_w.to(f)
            t[a + "o_proj.weight"] = x.o_proj.dequant()
        else:
            H = x.w_uk.shape[0]
            ap = x.a_proj.dequant()
            kv = 0 if x.q_proj is not None else cfg.q_lora
            if x.q_proj is None:
                t[a + "q_a_proj.weight"], t[a + "q_a_layernorm.weight"] = ap[:kv], x.q_a_norm.to(f)
                t[a + "q_b_proj.weight"] = x.q_b.dequant()
            else:
                t[a + "q_proj.weight"] = x.q_proj.dequant()
            t[a + "kv_a_proj_with_mqa.weight"] = ap[kv:kv + cfg.kv_lora + cfg.qk_rope]
            t[a + "kv_a_layernorm.weight"] = x.kv_a_norm.to(f)
            t[a + "kv_b_proj.weight"] = torch.cat([x.w_uk, x.w_uv], dim=1).to(f).reshape(-1, cfg.kv_lora)
            o = x.o_proj.dequant()
            if cfg.mla_out_gate:
                t[a + "g_proj.weight"] = ap[kv + 640:kv + 640 + H * cfg.v_head]
            else:
                o = o / 2          # the ungated layer's o_proj (assemble._ungated_o_proj doubled it)
            t[a + "o_proj.weight"] = o
        m = p + ("mlp." if cfg.is_dense(i) else "block_sparse_moe.")
        ffn = lw.ffn
        if cfg.is_dense(i):
            t.update(_glu_tensors(m, ffn))
            continue
        t[m + "gate.weight"], t[m + "gate.e_score_correction_bias"] = ffn.router.to(f), ffn.bias.to(f)
        w13, w2 = ffn.experts.dequant()
        I = ffn.experts.inter
        for e in range(ffn.experts.experts):
            t[f"{m}experts.{e}.w1.weight"], t[f"{m}experts.{e}.w3.weight"] = w13[e, :I].to(f), w13[e, I:].to(f)
            t[f"{m}experts.{e}.w2.weight"] = w2[e].to(f)
        for n, v in (("routed_expert_down_proj", ffn.latent_down), ("routed_expert_up_proj", ffn.latent_up)):
            if v is not None:
                t[m + n + ".weight"] = v.dequant()
        if ffn.latent_norm is not None:
            t[m + "routed_expert_norm.weight"] = ffn.latent_norm.to(f)
        if ffn.shared is not None:
            t.update(_glu_tensors(m + "shared_experts.", ffn.shared))
    return cfg, t


def _glu_tensors(m: str, w) -> dict[str, torch.Tensor]:
    """gate/up/down of a weight_types.GluWeights without its tile padding (FP32 values)."""
    gu, I, W = w.gate_up.dequant(), w.inter, w.width
    return {m + "gate_proj.weight": gu[:I], m + "up_proj.weight": gu[W:W + I],
            m + "down_proj.weight": w.down.dequant()[:, :I]}


__all__ = ["Fp32Reference", "canonical_shapes", "check_tensors", "check_shape", "a_log_shapes",
           "canonical_from_weights"]
