"""k3gen's kernels inside transformers' Kimi-Linear (`KimiLinearForCausalLM`, transformers 5.23).

    import k3gen.api.hf as k3hf
    with k3hf.install(model):          # or a = k3hf.install(model) ... a.remove()
        out = model.generate(ids, max_new_tokens=16, do_sample=False)

What runs where once installed (the module's own code is untouched; everything is undone by
`remove()`):
- **KDA**: the modeling module's two KDA functions (`chunk_kimi_delta_attention` for prefill,
  `recurrent_kimi_delta_attention` for a cached one-token step: the names transformers itself
  rebinds to FLA's kernels) call `k3gen.api.fla.chunk_kda` / `fused_recurrent_kda`, i.e. k3gen's
  kda_prefill kernel with its fused stages made identities (that module's docstring: what maps,
  and the extra BF16 roundings of q, k, v and the precomputed decay). This rebinding is
  process-wide while installed: one adapted model at a time.
- **MLA decode**: each `KimiLinearAttention` keeps its own paged BF16 latent cache (the
  kv_cache_write layout) beside transformers' cache, written by `kv_cache_write` at prefill and at
  every step. A one-token step runs absorbed: q_nope @ W_UK per head, `mla_decode` over the
  latent rows, then @ W_UV^T; prefill keeps transformers' own attention. Transformers' cache is
  still updated (its lengths drive the masks), so its memory is spent twice: an engine keeps only
  k3gen's cache.
- **MoE routing**: `KimiLinearMoE` routes with `moe_route` (sigmoid + correction bias, grouped
  top-k with ties to the lower expert index, renormalize, routed scaling) on the FP32 router
  logits; the experts themselves stay transformers' BF16/FP32 modules, because k3gen's expert
  kernel (`moe_experts`) takes the FP4 checkpoint formats only (MXFP4, NVFP4), not BF16 weights.

Limits (typed `SpecError`s): batches without padding (an attention mask with zeros is refused),
prompts plus generated tokens up to `max_len` (default 4096) per sequence, a cache that only grows
(beam search's reordering, cropping or reuse across calls from a non-zero length are refused),
head dims as K3's (KDA 128; MLA nope 128, rope 64, v 128, kv_lora 512).
On CPU tensors every op runs its FP32 reference; on CUDA the kernels must be prepared (a prebuilt
bundle or the JIT), `specs(config)` lists them.
"""
from __future__ import annotations

import collections
import sys
from dataclasses import dataclass, field

import torch

from k3gen.errors import SpecError

MODELING = "transformers.models.kimi_linear.modeling_kimi_linear"
KDA_FUNCS = ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention")
PARTS = ("kda", "mla", "moe")
LATENT, ROPE, NOPE, VDIM = 512, 64, 128, 128


def _cfg(config):
    return getattr(config, "text_config", None) or config


def _check_config(cfg) -> None:
    want = {"kv_lora_rank": LATENT, "qk_rope_head_dim": ROPE, "qk_nope_head_dim": NOPE, "v_head_dim": VDIM}
    for name, v in want.items():
        if getattr(cfg, name, v) != v:
            raise SpecError(f"config.{name}", getattr(cfg, name), [v], "k3gen's MLA kernels take K3's head dims")
    lin = getattr(cfg, "linear_attn_config", None) or {}
    if lin.get("head_dim", 128) != 128:
        raise SpecError("config.linear_attn_config.head_dim", lin.get("head_dim"), [128], "k3gen's KDA head dim")


def specs(config, target: str = "sm90") -> dict:
    """The kernels the adapter launches for this config, by part (what a prebuilt bundle needs)."""
    from k3gen.api.fla import fla_specs
    from k3gen.ir.dtypes import KvDtype
    from k3gen.ops.kv_cache_write.spec import KvCacheWriteSpec
    from k3gen.ops.mla_decode.spec import MlaDecodeSpec
    from k3gen.ops.moe_route.spec import MoeRouteSpec
    from k3gen.targets import get_target
    cfg = _cfg(config)
    _check_config(cfg)
    t = get_target(target)
    return {"kda": fla_specs(t),
            "mla": [KvCacheWriteSpec(target=t, kv=KvDtype.BF16),
                    MlaDecodeSpec(target=t, heads=cfg.num_attention_heads, kv=KvDtype.BF16)],
            "moe": [MoeRouteSpec(target=t, experts=cfg.num_local_experts, top_k=cfg.num_experts_per_tok,
                                 n_group=cfg.n_group, topk_group=cfg.topk_group,
                                 renormalize=bool(cfg.norm_topk_prob),
                                 routed_scale=float(cfg.routed_scaling_factor))]}


@dataclass
class _MlaCache:
    """One layer's paged BF16 latent cache: sequence b owns pages b*P .. b*P+P-1."""
    batch: int
    kv: torch.Tensor                     # [batch * P, page, 576] BF16
    block_table: torch.Tensor            # [batch, P] int32
    plan: object
    length: int = 0


@dataclass
class Adapter:
    """What `install` changed; `remove()` (or leaving the `with` block) restores it. `ran` counts the
    k3gen calls by part (tests assert the kernels actually ran)."""
    model: object
    target: str
    max_len: int
    parts: tuple
    ran: collections.Counter = field(default_factory=collections.Counter)
    _saved_funcs: dict = field(default_factory=dict)
    _patched: list = field(default_factory=list)
    _caches: dict = field(default_factory=dict)
    _handles: dict = field(default_factory=dict)

    def remove(self) -> None:
        mod = sys.modules.get(MODELING)
        for name, fn in self._saved_funcs.items():
            setattr(mod, name, fn)
        self._saved_funcs.clear()
        for m in self._patched:
            m.__dict__.pop("forward", None)
        self._patched.clear()
        self._caches.clear()
        global _ACTIVE
        if _ACTIVE is self:
            _ACTIVE = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.remove()
        return False

    def handle(self, part: str, i: int):
        from k3gen import api
        key = (part, i)
        if key not in self._handles:
            self._handles[key] = api.prepare(specs(self.model.config, self.target)[part][i])
        return self._handles[key]


_ACTIVE: Adapter | None = None


def install(model, *, target: str = "sm90", max_len: int = 4096, parts=PARTS) -> Adapter:
    """Route `model` (a KimiLinearForCausalLM or its inner model) through k3gen's kernels; returns
    the Adapter (a context manager). `parts`: any of "kda", "mla", "moe"."""
    global _ACTIVE
    mod = sys.modules.get(MODELING)
    if mod is None or not any(type(m).__module__ == MODELING for m in model.modules()):
        raise SpecError("model", type(model).__name__, "a transformers Kimi-Linear model", "nothing to adapt")
    bad = [p for p in parts if p not in PARTS]
    if bad or not parts:
        raise SpecError("parts", tuple(parts), list(PARTS))
    if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1:
        raise SpecError("max_len", max_len, ">= 1")
    if _ACTIVE is not None:
        raise SpecError("install", "twice", "remove() the active adapter first",
                        "the KDA functions are rebound module-wide")
    _check_config(_cfg(model.config))
    a = Adapter(model, target, max_len, tuple(parts))
    if "kda" in parts:
        for name in KDA_FUNCS:
            a._saved_funcs[name] = getattr(mod, name)
        mod.chunk_kimi_delta_attention = _kda_call(a, recurrent=False)
        mod.recurrent_kimi_delta_attention = _kda_call(a, recurrent=True)
    for m in model.modules():
        kind = type(m).__name__
        if "mla" in parts and kind == "KimiLinearAttention":
            m.forward = _mla_forward(a, m)
            a._patched.append(m)
        elif "moe" in parts and kind == "KimiLinearMoE":
            m.forward = _moe_forward(a, m)
            a._patched.append(m)
    _ACTIVE = a
    return a


# -- KDA --------------------------------------------------------------------------------------------
def _kda_call(a: Adapter, recurrent: bool):
    from k3gen.api import fla

    def call(query, key, value, g, beta, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False,
             **kwargs):
        a.ran["kda_recurrent" if recurrent else "kda_chunk"] += 1
        fn = fla.fused_recurrent_kda if recurrent else fla.chunk_kda
        cu = kwargs.get("cu_seqlens")
        o, s = fn(query.contiguous(), key.contiguous(), value.contiguous(), g.float().contiguous(),
                  beta.contiguous(), initial_state=initial_state, output_final_state=output_final_state,
                  use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu, target=a.target)
        return o, s
    return call


# -- MLA --------------------------------------------------------------------------------------------
def _no_padding(attention_mask) -> None:
    """A one-token step's mask ([B, 1, 1, L] bool or additive, or [B, L]) may hide no cached row:
    a hidden one is padding, which the adapter's cache holds as a real row."""
    if attention_mask is None:
        return
    hidden = ~attention_mask.bool() if attention_mask.dtype in (torch.bool, torch.long, torch.int32) \
        else attention_mask < 0
    if bool(hidden.any()):
        raise SpecError("attention_mask", "with padding", "no padded rows", "the adapter's caches hold unpadded rows")


def _mla_forward(a: Adapter, attn):
    orig = type(attn).forward

    def forward(hidden_states, attention_mask=None, past_key_values=None, **kwargs):
        B, T = hidden_states.shape[:2]
        if past_key_values is None:
            return orig(attn, hidden_states, attention_mask, past_key_values, **kwargs)
        past = past_key_values.get_seq_length(attn.layer_idx)
        c = _mla_cache(a, attn, B, hidden_states.device)
        if past != c.length or B != c.batch:
            if past != 0:
                raise SpecError("past_key_values", f"{past} cached tokens", f"{c.length} (the adapter's cache)",
                                "the adapter's caches only grow: no reordering, cropping or reuse")
            c = _mla_cache(a, attn, B, hidden_states.device, fresh=True)
        if past + T > a.max_len:
            raise SpecError("tokens", past + T, f"<= max_len = {a.max_len}", "install(model, max_len=...)")
        ckv = attn.kv_a_proj_with_mqa(hidden_states)
        lat, k_rot = torch.split(ckv, [LATENT, ROPE], dim=-1)
        rows = torch.cat([attn.kv_a_layernorm(lat), k_rot], dim=-1).reshape(B * T, LATENT + ROPE)
        _write_rows(a, c, rows.to(torch.bfloat16).contiguous(), B, T, past)
        if T > 1 or past == 0:
            return orig(attn, hidden_states, attention_mask, past_key_values, **kwargs)
        # Keep transformers' cache in step (its length drives positions and masks).
        past_key_values.update(rows[:, :LATENT].view(B, 1, 1, LATENT).to(lat.dtype),
                               rows[:, LATENT:].view(B, 1, 1, ROPE).to(lat.dtype), attn.layer_idx)
        return _absorbed_step(a, attn, c, hidden_states, attention_mask), None
    return forward


def _mla_cache(a: Adapter, attn, B: int, device, fresh: bool = False) -> _MlaCache:
    from k3gen import api
    c = a._caches.get(attn.layer_idx)
    if c is not None and not fresh:
        return c
    page = specs(a.model.config, a.target)["mla"][0].page
    P = -(-a.max_len // page)
    kv = torch.zeros(B * P, page, LATENT + ROPE, dtype=torch.bfloat16, device=device)
    bt = torch.arange(B * P, dtype=torch.int32, device=device).view(B, P)
    plan = api.mla_decode_plan(a.handle("mla", 1), B, a.max_len, device=device)
    c = a._caches[attn.layer_idx] = _MlaCache(B, kv, bt, plan)
    return c


def _write_rows(a: Adapter, c: _MlaCache, rows, B: int, T: int, past: int) -> None:
    from k3gen import api
    dev = rows.device
    cu = torch.arange(0, B * T + 1, T, dtype=torch.int32, device=dev)
    start = torch.full((B,), past, dtype=torch.int32, device=dev)
    api.kv_cache_write(a.handle("mla", 0), rows, cu, start, c.block_table, {"kv": c.kv}, max_rows_per_seq=T)
    a.ran["kv_cache_write"] += 1
    c.length = past + T


def _absorbed_step(a: Adapter, attn, c: _MlaCache, x, attention_mask):
    from k3gen import api
    _no_padding(attention_mask)
    B = x.shape[0]
    H = attn.num_heads
    if attn.q_lora_rank is None:
        q = attn.q_proj(x)
    else:
        q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x)))
    q = q.view(B, H, NOPE + ROPE)
    w = attn.kv_b_proj.weight.view(H, NOPE + VDIM, LATENT)
    w_uk, w_uv = w[:, :NOPE].float(), w[:, NOPE:].float()
    q_lat = torch.einsum("bhd,hdc->bhc", q[..., :NOPE].float(), w_uk)
    q576 = torch.cat([q_lat, q[..., NOPE:].float()], dim=-1).to(torch.bfloat16).view(B, 1, H, LATENT + ROPE)
    lengths = torch.full((B,), c.length, dtype=torch.int32, device=x.device)
    o_lat = api.mla_decode(a.handle("mla", 1), q576.contiguous(), {"kv": c.kv}, c.block_table, lengths, plan=c.plan)
    a.ran["mla_decode"] += 1
    o = torch.einsum("bhc,hdc->bhd", o_lat.view(B, H, LATENT).float(), w_uv).to(x.dtype)
    return attn.o_proj(o.reshape(B, 1, H * VDIM))


# -- MoE --------------------------------------------------------------------------------------------
def _moe_forward(a: Adapter, moe):
    import torch.nn.functional as F

    def forward(hidden_states):
        from k3gen import api
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        logits = F.linear(x.float(), moe.gate.weight.float()).contiguous()
        r = api.moe_route(a.handle("moe", 0), logits, moe.gate.e_score_correction_bias.float().contiguous())
        a.ran["moe_route"] += 1
        y = moe.experts(x, r["ids"].long(), r["weights"]).view(shape)
        return y + moe.shared_experts(hidden_states)
    return forward
