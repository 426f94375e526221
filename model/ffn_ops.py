"""The FFN and residual-stream half of `Ops` (model/ops.py mixes these into RefOps and KernelOps):
the router and its permutation, the routed experts' seam, routed_expert_norm, the GLU of the shared
experts and the dense MLP, and the Attention Residuals stream with the RMSNorm and FP8 quantization
of the next GEMM's input fused into its mix.

Kernel path: moe_route, attn_res (the mix fused with the next RMSNorm and act_quant_fp8; the
partial-sum update fused as its delta), glu_act, fp8_block_gemm, and moe_experts (the grouped FP4
expert GEMMs with SiTU and the ordered combine, on the experts packed as loaded). Reference path:
the same math in FP32/FP64 on the same weights (the ops' references; the routed experts by the
FP64 stand-in of model/moe_torch.py, which BF16 experts, having no FP4 kernel, also take on the
kernel path).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from k3gen.ops.act_quant_fp8.reference import act_quant_fp8 as ref_act_quant
from k3gen.ops.attn_res import reference as res_ref
from k3gen.ops.attn_res.spec import ResDelta
from k3gen.ops.glu_act.reference import glu_act as ref_glu_act

import k3gen.api as api
from k3gen.ops.glu_act.spec import GluKind
from k3gen.ops.moe_experts.spec import GluAct, WeightFormat
from k3gen.ops.router_logits.spec import RouterWeight, has_kernel as has_router_kernel
from k3gen.targets import has_expert_kernel

from model import arch, moe_torch

BF16 = torch.bfloat16


class QAct(NamedTuple):
    """A GEMM input already quantized: BF16 rows `x` (None where no op reads them) and their
    act_quant_fp8 codes [M, K] and scales [M, K/128]. `Ops.linear` takes it in place of x."""
    x: Optional[torch.Tensor]
    codes: torch.Tensor
    scales: torch.Tensor


def rows(x) -> int:
    return (x.codes if isinstance(x, QAct) else x).shape[0]


def bf16(x) -> torch.Tensor:
    return x.x if isinstance(x, QAct) else x


def _delta_kind(delta) -> ResDelta:
    if delta is None:
        return ResDelta.NONE
    return ResDelta.BF16 if delta.dtype == BF16 else ResDelta.FP32


class ResStream:
    """The residual stream of one forward over M rows in a source buffer [max_sources, M, hidden]
    FP32 allocated once per forward (a fresh tensor: graph-safe under capture and torch.compile):
    source 0 the embedding, then one per completed block, the last the running partial sum
    (arch.AttnResStream's protocol, which model/reference.py keeps; n_max = FfnShape.max_sources). A layer output is not added
    at once: it becomes the delta of the next mix, which updates the partial sum in place (or
    starts a new source: `seal`) before mixing. A plain residual (block None) is one source."""

    def __init__(self, ops, embed: torch.Tensor, cfg, n_max: int):
        self.ops, self.cfg, self.block = ops, cfg, cfg.attn_res_block
        self.src = torch.empty(n_max, embed.shape[0], embed.shape[1], dtype=torch.float32, device=embed.device)
        self.src[0].copy_(embed)
        self.n = 1
        self.delta, self.seal = None, False

    def _mix(self, w, norm_w, mixed: bool = False):
        out = self.ops.attn_res_mix(self.src, self.n, w, norm_w, self.cfg.eps, self.delta, self.seal, mixed)
        self.delta, self.seal = None, False
        return out

    def attn_input(self, w, norm_w) -> QAct:
        return self._mix(w, norm_w)

    def add_attn(self, layer: int, out: torch.Tensor) -> None:
        self.delta = out
        if self.block is not None and layer % self.block == 0:
            self.n, self.seal = self.n + 1, True

    def ffn_input(self, w, norm_w) -> QAct:
        return self._mix(w, norm_w)

    def add_ffn(self, out: torch.Tensor) -> None:
        self.delta = out.float()

    def output(self, w, norm_w) -> torch.Tensor:
        """The output query's mix, FP32 [M, hidden] (K3Model._logits norms it with the final norm)."""
        return self._mix(w, norm_w, mixed=True)


class FfnOps:
    """What both paths share: the stand-ins (router logits, the routed experts) and the composition."""

    def _query(self, w, hidden: int, device) -> torch.Tensor:
        """The pseudo-query (norm * proj, made at load: AttnResWeights.q), or zeros where only one
        source is mixed (a plain residual, routed_expert_norm: its weight is 1 whatever the score)."""
        return torch.zeros(hidden, dtype=torch.float32, device=device) if w is None else w.query()

    def router_logits(self, x, router: torch.Tensor) -> torch.Tensor:
        """FP32 router logits: FP64 products rounded once, row-invariant (the reference path's; the
        kernel path runs the generated router_logits where its target's menu has it)."""
        self._mark("router_logits", "torch" if self.kind == "kernel" else "ref")
        return moe_torch.router_logits(bf16(x), router)

    def moe_experts(self, xl: torch.Tensor, routing: dict, experts, cfg, mine: slice | None = None) -> torch.Tensor:
        """The routed experts' weighted sum over this rank's experts (`mine`: their global numbers),
        FP32 [M, W] (what the EP / TP reduction and routed_expert_norm take), from the latent rows
        xl [M, W] BF16 and moe_route's outputs (`routing`: ids, weights, counts, offsets, perm, inv).
        Here the FP64 stand-in (model/moe_torch.py), which reads ids and weights only."""
        self._mark("moe_experts", "torch" if self.kind == "kernel" else "ref")
        return moe_torch.experts(xl, routing["ids"], routing["weights"], experts, arch.act_fn(cfg), cfg.experts, mine)

    def glu(self, x, w, cfg) -> torch.Tensor:
        """down(act(gate(x), up(x))) BF16 [M, N]: the fused [gate | up] GEMM, glu_act (the
        activation fused with the FP8 quantization of down's input), the down GEMM."""
        return self.linear(QAct(None, *self.glu_hidden(x, w, cfg)), w.down)


class RefFfnOps(FfnOps):
    def route(self, logits: torch.Tensor, bias: torch.Tensor, cfg) -> dict:
        """moe_route's outputs by its contract (arch.route is its arithmetic; the grouped order by
        device-side sorts, no host sync)."""
        self._mark("moe_route")
        ids, w = arch.route(logits, bias, cfg)
        flat = ids.reshape(-1)
        n = flat.numel()
        counts = torch.zeros(cfg.experts, dtype=torch.long, device=ids.device).scatter_add_(0, flat,
                                                                                          torch.ones_like(flat))
        offsets = torch.cat([counts.new_zeros(1), torch.cumsum(counts, 0)])
        perm = torch.argsort(flat * max(n, 1) + torch.arange(n, device=ids.device))
        inv = torch.empty_like(perm).scatter_(0, perm, torch.arange(n, device=ids.device))
        return {"ids": ids.int(), "weights": w, "counts": counts.int(), "offsets": offsets.int(), "perm": perm.int(),
                "inv": inv.int()}

    def attn_res_mix(self, src, n: int, w, norm_w, eps: float, delta=None, seal: bool = False, mixed: bool = False):
        """attn_res's reference (its kernel's sum order) on the buffer, in place for the delta; the
        normed, quantized rows (QAct), or with `mixed` the mixed FP32 rows before the norm."""
        self._mark("attn_res")
        dev = src.device
        if delta is not None:
            src[n - 1].copy_(res_ref.partial_update(None if seal else src[n - 1], delta, seal).to(dev))
        x = res_ref.mix(src[:n], self._query(w, src.shape[2], dev), eps)
        if mixed:
            return x.to(dev)
        out = res_ref.norm(x, norm_w, eps)
        codes, scales = ref_act_quant(out, self.recipe)
        return QAct(out.to(dev), codes.to(dev), scales.to(dev))

    def latent_norm(self, y: torch.Tensor, norm_w: torch.Tensor, eps: float) -> QAct:
        """routed_expert_norm: BF16(RMSNorm(y) * w) and its FP8 quantization (attn_res's one-source norm)."""
        self._mark("routed_expert_norm")
        out = res_ref.norm(y.float().cpu(), norm_w, eps)      # the op's reference computes on the CPU
        codes, scales = ref_act_quant(out, self.recipe)
        return QAct(out.to(y.device), codes.to(y.device), scales.to(y.device))

    def glu_hidden(self, x, w, cfg):
        gu = self.linear(x, w.gate_up)
        self._mark("glu_act")
        return ref_glu_act(gu, w.width, cfg.act, cfg.situ_beta, cfg.situ_linear_beta, self.recipe)


class KernelFfnOps(FfnOps):
    def _kernel(self, key: tuple, fields):
        """The handle at `key`; only on a miss are the spec's fields built (`fields()`), so a traced
        step (torch.compile) sees a dict lookup."""
        h = self._handles.get(key)
        return h if h is not None else self._handle(key, **fields())

    def router_logits(self, x, router: torch.Tensor) -> torch.Tensor:
        """FP32 router logits by the generated router_logits (its fixed FP32 summation order,
        row-invariant) on the router weight as stored (FP32 holding BF16 values); targets whose
        menu lacks the op, and routers of a width the kernel does not take, keep the PyTorch stand-in."""
        if not has_router_kernel(self.target, router.shape[1], router.shape[0]):
            return super().router_logits(x, router)
        self._mark("router_logits")
        wt = RouterWeight.BF16 if router.dtype == torch.bfloat16 else RouterWeight.FP32
        h = self._kernel(("router_logits",), lambda: dict(hidden=router.shape[1], experts=router.shape[0],
                                                           weight=wt))
        return api.router_logits(h, bf16(x).contiguous(), router)

    def route(self, logits: torch.Tensor, bias: torch.Tensor, cfg) -> dict:
        self._mark("moe_route")
        h = self._kernel(("moe_route",), lambda: dict(experts=cfg.experts, top_k=cfg.top_k, n_group=cfg.n_group,
                                                       topk_group=cfg.topk_group, renormalize=cfg.renormalize,
                                                       routed_scale=float(cfg.routed_scale)))
        return api.moe_route(h, logits.contiguous(), bias)

    def _res_handle(self, hidden: int, n_max: int, eps: float, delta: ResDelta) -> str:
        return self._kernel(("attn_res", hidden, n_max, delta.value),
                            lambda: dict(hidden=hidden, max_sources=n_max, eps=float(eps), recipe=self.recipe,
                                         delta=delta))

    def attn_res_mix(self, src, n: int, w, norm_w, eps: float, delta=None, seal: bool = False, mixed: bool = False):
        self._mark("attn_res")
        kind = _delta_kind(delta)
        h = self._res_handle(src.shape[2], src.shape[0], eps, kind)
        d = None if delta is None else delta.contiguous()
        r = api.attn_res(h, src, n, self._query(w, src.shape[2], src.device), norm_w, delta=d, seal=seal, mixed=mixed)
        return r.mixed if mixed else QAct(r.out, r.codes, r.scales)

    def latent_norm(self, y: torch.Tensor, norm_w: torch.Tensor, eps: float) -> QAct:
        """routed_expert_norm as a one-source attn_res over the latent: the mix of one source is the
        source itself exactly (softmax weight p / p = 1), then the RMSNorm and the FP8 quantization."""
        self._mark("routed_expert_norm")
        W = y.shape[1]
        h = self._res_handle(W, 1, eps, ResDelta.NONE)
        r = api.attn_res(h, y.contiguous().view(1, -1, W), 1, self._query(None, W, y.device), norm_w)
        return QAct(r.out, r.codes, r.scales)

    def moe_experts(self, xl: torch.Tensor, routing: dict, experts, cfg, mine: slice | None = None) -> torch.Tensor:
        """moe_experts on the FP4 experts as loaded (MXFP4 / NVFP4, W4A16 on the BF16 latent rows):
        gate_up with the activation fused, down, and the combine in slot order; FP32 sum. The
        router's ids are global: this rank's experts start at mine.start (EP)."""
        if experts.fmt not in ("mxfp4", "nvfp4") or not has_expert_kernel(self.target):
            return super().moe_experts(xl, routing, experts, cfg, mine)
        self._mark("moe_experts")
        E, I, W = experts.experts, experts.inter, experts.width

        def fields():
            betas = dict(situ_beta=float(cfg.situ_beta), situ_linear_beta=float(cfg.situ_linear_beta)) \
                if cfg.act == "situ" else {}
            return dict(weights=WeightFormat(experts.fmt), hidden=W, inter=I, experts=E, top_k=cfg.top_k,
                        route_experts=cfg.experts, glu=GluAct(cfg.act), **betas)
        h = self._kernel(("moe_experts", experts.fmt, E, I), fields)
        return api.moe_experts(h, xl.contiguous(), experts.w13, experts.w13_scale, experts.w2, experts.w2_scale,
                               routing, gs13=experts.w13_global, gs2=experts.w2_global,
                               expert_base=0 if mine is None else mine.start, f32=True)[1]

    def glu_hidden(self, x, w, cfg):
        gu = self.linear(x, w.gate_up)
        self._mark("glu_act")

        def fields():
            kw = dict(beta=float(cfg.situ_beta), linear_beta=float(cfg.situ_linear_beta)) if cfg.act == "situ" else {}
            return dict(inter=w.width, act=GluKind(cfg.act), recipe=self.recipe, **kw)
        return api.glu_act(self._kernel(("glu_act", w.width), fields), gu)
