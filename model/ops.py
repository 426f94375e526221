"""The two implementations of every fused op a layer calls: `RefOps` (k3gen's FP32 PyTorch
references, CPU or GPU) and `KernelOps` (the generated kernels, through the `k3gen::` torch.library
ops: traceable by torch.compile; on CPU tensors those ops run the references). A layer never knows
which one it has; `TargetConfig.path` picks. Both count what ran in `ran` ("ref:<op>",
"kernel:<op>", "torch:<op>" for the PyTorch stand-ins; eager calls only), so a test can prove which
path executed.

Rounding points are the same on both paths: BF16 activations between ops, FP8 activations
quantized per token per 128 columns with the target's recipe, FP32 accumulation.

The FFN and residual-stream ops (route, attn_res_mix, latent_norm, glu, moe_experts, router_logits)
come from model/ffn_ops.py's mixins (RefFfnOps, KernelFfnOps). A GEMM input may arrive already
quantized (`QAct`: the AttnRes mix, glu_act and routed_expert_norm write the FP8 codes the next GEMM
reads); `linear` takes it in place of a BF16 tensor.
"""
from __future__ import annotations

import collections

import torch

from k3gen.errors import SpecError
from k3gen.ir.dtypes import GateKind, KvDtype, ScaleRecipe, SsmDtype
from k3gen.ir.layouts import KvLayout
from k3gen.ops.act_quant_fp8.reference import act_quant_fp8 as ref_act_quant
from k3gen.ops.act_quant_fp8.reference import dequantize as ref_act_dequant
from k3gen.ops.kda_decode.reference import KdaWeights
from k3gen.ops.kda_decode.reference import kda_decode as ref_kda_decode
from k3gen.ops.kda_prefill.reference import kda_prefill as ref_kda_prefill
from k3gen.ops.kda_verify.reference import kda_verify as ref_kda_verify
from k3gen.ops.kv_cache_write.reference import kv_cache_write as ref_kv_write
from k3gen.ops.mla_prefill.reference import mla_prefill as ref_mla_prefill
from k3gen.ops.mla_q_absorb.reference import NOPE, Q_LORA, rms_norm_bf16
from k3gen.ops.mla_vb_gate.reference import mla_vb_gate as ref_vb_gate
from k3gen.targets import (ServingOptions, SpecMenu, attention_tokens, has_prefill_kernel, mla_decode_spec, model_specs,
                           rank_specs)

import k3gen.api as api
import k3gen.library as library
from model import mla_attention as attn
from model.ffn_ops import KernelFfnOps, QAct, RefFfnOps
from model.weights import Fp8Linear

BF16 = torch.bfloat16
QK_HEAD = 192


class Ops:
    kind = "base"

    def __init__(self, recipe: ScaleRecipe, gate: GateKind = GateKind.BOUNDED):
        self.recipe, self.gate = recipe, gate
        self.ran: collections.Counter = collections.Counter()

    def _mark(self, op: str, kind: str | None = None) -> None:
        # Not inside torch.compile: dynamo would guard on the count and recompile every step. What
        # a compiled step runs is its graph (the k3gen:: ops in it), not this record.
        if torch.compiler.is_compiling():
            return
        self.ran[f"{kind or self.kind}:{op}"] += 1

    def mla_attention(self, layout: KvLayout, q, cache, block_table, start, ring_slot, scale):
        """q [B, T, H, 576] BF16 -> o_lat [B, T, H, 512] BF16 (the FP32 PyTorch attention;
        KernelOps runs the generated mla_decode instead)."""
        self._mark("mla_attention", "torch" if self.kind == "kernel" else "ref")
        return attn.paged_mla_attention(layout, q, cache, block_table, start, ring_slot, scale).to(BF16)


    def prefill_attention(self, q, k_nope, k_pe, v, pf):
        """Bottom-right causal attention of a prefill's new rows over their keys (a continued
        sequence's cached prefix, then the new rows: pf.cu_k): q [Nq, H, 192] BF16, k_nope / v
        [Nk, H, 128], k_pe [Nk, 64] -> o [Nq, H, 128] FP32. k3gen's mla_prefill reference (FP64,
        rounded once to FP32: where a prompt was split or which rows share the batch moves a row only
        by FP64 reassociation, below FP32's rounding); KernelOps runs the generated mla_prefill where
        its target has one."""
        self._mark("mla_prefill_attention", "torch" if self.kind == "kernel" else "ref")
        return ref_mla_prefill(q, k_nope, k_pe, v, pf.cu_host, pf.cu_k_host)


class RefOps(RefFfnOps, Ops):
    kind = "ref"
    # The projections' products and sums: FP64 rounded to FP32 (below). Tests set FP32 to measure
    # the model's sensitivity to another rounding (tests/helpers.reference_projections_in_fp32).
    linear_acc = torch.float64

    def linear(self, x, w: Fp8Linear) -> torch.Tensor:
        """x BF16 [M, K] (quantized here) or a QAct (quantized by the op before) times w."""
        self._mark("fp8_linear")
        codes, scales = (x.codes, x.scales) if isinstance(x, QAct) else ref_act_quant(x, self.recipe)
        xd = ref_act_dequant(codes, scales, self.recipe)
        # FP64 products rounded to FP32: row-invariant (an FP32 GEMM's reduction order depends on
        # the row count), so a verify row equals the decode row and speculative == greedy holds
        # on this path to the last bit but for the FP32 LM head.
        acc = self.linear_acc
        return (xd.to(acc) @ w.dequant().to(xd.device).to(acc).T).float().to(BF16)

    def kda_decode(self, qkvg, fa, beta, pools, slots, w: KdaWeights):
        self._mark("kda_decode")
        return ref_kda_decode(qkvg, fa, beta, pools["ssm"], pools["conv"], slots, w, gate=self.gate)

    def kda_verify(self, qkvg, fa, beta, pools, slots, w: KdaWeights):
        self._mark("kda_verify")
        return ref_kda_verify(qkvg, fa, beta, pools["ssm"], pools["draft_rec"], pools["conv_ext"], pools["pending"],
                              slots, w, gate=self.gate)

    def kda_prefill(self, qkvg, fa, beta, cu_seqlens, slots, resume, pools, w: KdaWeights):
        self._mark("kda_prefill")
        return ref_kda_prefill(qkvg, fa, beta, cu_seqlens, slots, resume, pools["ssm"], pools["conv"], w,
                               gate=self.gate)

    def kv_write(self, layout, cache, rows, cu_rows, start_pos, block_table, ring_slot, scale, max_rows):
        self._mark("kv_cache_write")
        ref_kv_write(layout, cache, rows, cu_rows, start_pos, block_table,
                     ring_slot if layout.kv is KvDtype.NVFP4 else None, scale)

    def q_absorb(self, q_a, norm_w, q_b: Fp8Linear, w_uk):
        """reference.mla_q_absorb's rounding points, with Q-B's dequantized weight computed once
        (the reference function dequantizes it on every call)."""
        self._mark("mla_q_absorb")
        H = w_uk.shape[0]
        q = RefOps.linear(self, rms_norm_bf16(q_a[:, :Q_LORA], norm_w), q_b).float().view(-1, H, QK_HEAD)
        self.ran["ref:fp8_linear"] -= 1
        lat = torch.einsum("bhd,hdc->bhc", q[..., :NOPE].double(), w_uk.double()).float().to(BF16)
        return torch.cat([lat, q[..., NOPE:].to(BF16)], dim=-1)

    def vb_gate(self, o_lat, w_uv, gate):
        self._mark("mla_vb_gate")
        return ref_vb_gate(o_lat, w_uv, gate).to(BF16)


class KernelOps(KernelFfnOps, Ops):
    """The generated kernels of `target`, called through the `k3gen::` torch.library ops
    (k3gen.api), so a step traces under torch.compile(fullgraph=True) with no graph break: each
    call looks its kernel handle (the spec's canonical JSON, a str) up in a dict filled when the
    kernel is first used or by `load_all`; what the handle names is chosen here, at plan time.
    `load_all` must run before CUDA-graph capture and before a compiled step's first run (capture
    never compiles or loads). On CPU tensors the ops run k3gen's FP32 references.

    With `model` (a ModelConfig, as `make_ops` passes) every kernel is found by (op, fields) in
    k3gen's `targets.model_specs` for this rank and serving setting, the list `k3gen build --model`
    builds: a launch the enumerator does not list raises instead of compiling something unbuilt.
    Built from head counts alone (tests), the specs come from the same enumerator's core
    (`targets.rank_specs`) for the FP8 shapes given."""
    kind = "kernel"

    def __init__(self, target, recipe: ScaleRecipe, ssm: SsmDtype, kv: KvLayout, heads_kda: int, heads_mla: int,
                 max_drafts: int, gate: GateKind = GateKind.BOUNDED, model=None, tp: int = 1, ep: int = 1,
                 experts: str | None = None, invariant: bool = False, plan_batch: int = 1):
        super().__init__(recipe, gate)
        # TargetConfig.invariant: splits planned for `plan_batch` sequences at every batch size.
        self.invariant, self.plan_batch = invariant, plan_batch
        self.target, self.ssm, self.kv_layout = target, ssm, kv
        self.heads_kda, self.heads_mla, self.max_drafts = heads_kda, heads_mla, max_drafts
        self.serving = ServingOptions(kv=kv.kv, ssm=ssm, max_drafts=max_drafts, recipe=recipe)
        self.menu = None
        if model is not None:
            self.menu = SpecMenu(model_specs(target, model, tp, ep, serving=self.serving, experts=experts))
        self._launchers: dict[str, object] = {}
        # Kernel handles by (op, the fields a call site varies): plain dict lookups on str/int keys,
        # which torch.compile traces (a spec's JSON would not be).
        self._handles: dict[tuple, str] = {}
        self._kv_names = tuple(kv.tensors())
        # mla_decode split plans (split count + FP32 workspace) by (T, batch), per-token verify's by
        # ("verify", T, batch) (verify_plan): made outside capture, sized for the longest sequence
        # a block-table row can hold; a graph keeps the workspace pointers of the plan it was
        # captured with.
        self._plans: dict[tuple, object] = {}

    # -- specs ------------------------------------------------------------------------------------
    def specs(self, gemm_shapes=None) -> list:
        """Every spec this rank runs: the enumerated list, or (no model) the enumerator's core over
        `gemm_shapes`, the (N, K) of its FP8 linears."""
        if gemm_shapes is None:
            if self.menu is None:
                raise SpecError("gemm_shapes", None, "the (N, K) list", "KernelOps built without a model")
            return list(self.menu.specs)
        return rank_specs(self.target, kda_heads=self.heads_kda, mla_heads=self.heads_mla, gemm_shapes=gemm_shapes,
                          serving=self.serving, gate=self.gate)

    def step_tokens(self) -> list[int]:
        """Query tokens per sequence of the decode (1) and verify (1 + drafts) steps."""
        return [1] + ([1 + self.max_drafts] if self.max_drafts else [])

    def mla_decode_spec(self, T: int):
        """The attention spec whose KvLayout is exactly the cache's (targets.mla_decode_spec)."""
        if self.menu is not None:
            spec = self.menu.find("mla_decode", tokens=T)
            if spec.layout.tensors() != self.kv_layout.tensors() or spec.page != self.kv_layout.page:
                raise SpecError("kv_layout", str(self.kv_layout), [str(spec.layout)],
                                "mla_decode reads the cache's own layout")
            return spec
        return mla_decode_spec(self.target, self.heads_mla, self.kv_layout, T)

    def launcher(self, spec):
        """The launcher of `spec`, loaded where CUDA is (the one the k3gen:: ops launch: loaded
        once per process). Loading compiles or reads a cubin: never inside capture. Without CUDA
        it comes back unloaded (the ops run the references on CPU tensors)."""
        key = spec.digest()
        op = self._launchers.get(key)
        if op is None:
            if not torch.cuda.is_available():
                from k3gen.runtime.launcher import launcher_class
                return launcher_class(spec.op)(spec)
            if torch.cuda.is_current_stream_capturing() and not library.loaded(library.handle_of(spec)):
                raise SpecError("kernel", spec.file_stem, "loaded before CUDA-graph capture (load_all)")
            op = self._launchers[key] = library.launcher(library.handle_of(spec))
            return op
        if op._kernel is None:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise SpecError("kernel", spec.file_stem, "loaded before CUDA-graph capture (load_all)")
            op.load()
        return op

    def load_all(self, gemm_shapes=None, batch_sizes=(), max_len: int | None = None) -> None:
        """Load every kernel and fill the handle table; with `max_len`, plan mla_decode for each
        batch size and step length."""
        for s in self.specs(gemm_shapes):
            self.launcher(s)
            self._handles.setdefault(self._key(s), library.handle_of(s))
        if max_len is not None:
            for T in self.attention_tokens():
                for B in batch_sizes:
                    self.attention_plan(T, B, max_len)
            if self.verify_per_token():
                for B in batch_sizes:
                    self.verify_plan(B, 1 + self.max_drafts, max_len)

    def attention_plan(self, T: int, B: int, max_len: int):
        """The plan of a T-token launch over B sequences (cached by (T, B))."""
        def splits(lau):
            return lau.splits_for(max(B, self.plan_batch), max_len) if self.invariant else None
        return self._plan((T, B), T, B, max_len, splits)

    def verify_per_token(self) -> bool:
        """Whether verify attention gives each query token the T = 1 decode's view (mla_attention)."""
        return bool(self.max_drafts) and (self.kv_layout.kv is KvDtype.NVFP4 or self.invariant)

    def verify_plan(self, B: int, T: int, max_len: int):
        """The plan of a per-token verify step: the T = 1 kernel over B * T virtual sequences, with
        the split count of the batch-B decode plan (each query token split as its own T = 1 decode
        is) and a workspace for B * T rows."""
        base = self.attention_plan(1, B, max_len)
        return self._plan(("verify", T, B), 1, B * T, max_len, lambda lau: base.splits)

    def _plan(self, key, T: int, rows: int, max_len: int, splits):
        """A cached mla_decode plan for `rows` sequences of the T-token kernel, made outside capture;
        splits(launcher) gives the split count (None: the launcher's choice)."""
        plan = self._plans.get(key)
        if plan is None or plan.max_len < max_len:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise SpecError("mla_decode plan", key, "made before CUDA-graph capture (load_all)")
            lau = self.launcher(self.mla_decode_spec(T))
            if lau._kernel is None:     # no CUDA here: the CPU reference does not split
                from k3gen.ops.mla_decode.launcher import SplitPlan
                plan = SplitPlan(rows, max_len, 1)
            else:
                plan = lau.plan(rows, max_len, splits=splits(lau))
                # The workspace is written in place by every step: a compiled step replayed as a
                # CUDA graph (mode="reduce-overhead") may mutate it only at a fixed address.
                for t in (plan.part_o, plan.part_lse):
                    if isinstance(t, torch.Tensor) and t.is_cuda:
                        torch._dynamo.mark_static_address(t)
            self._plans[key] = plan
        return plan

    def _key(self, spec) -> tuple:
        """The handle-table key of a spec: the fields a call site varies (the rest is fixed per rank)."""
        op = spec.op
        if op == "act_quant_fp8":
            return (op, spec.k)
        if op == "fp8_block_gemm":
            return (op, spec.n, spec.k)
        if op == "mla_decode":
            return (op, spec.tokens)
        if op in ("kv_cache_write", "moe_route", "router_logits"):
            return (op,)
        if op == "attn_res":
            return (op, spec.hidden, spec.max_sources, spec.delta.value)
        if op == "glu_act":
            return (op, spec.inter)
        if op == "moe_experts":
            return (op, spec.weights.value, spec.experts, spec.inter)
        return (op, spec.heads)

    def _get(self, op: str, **kw):
        if self.menu is not None:
            return self.launcher(self.menu.find(op, **kw))
        from k3gen.ops import registry
        return self.launcher(registry()[op](target=self.target, **kw))

    def _handle(self, key: tuple, **kw) -> str:
        """The handle of the kernel at `key`; a miss (a call before load_all, eagerly) finds the spec
        through the enumerator (`_get`) and remembers it."""
        h = self._handles.get(key)
        if h is None:
            h = self._handles[key] = library.handle_of(self._get(key[0], **kw).spec)
        return h

    # -- ops --------------------------------------------------------------------------------------
    def linear(self, x, w: Fp8Linear):
        """x BF16 [M, K] through act_quant_fp8, or a QAct (quantized by the op before), then the GEMM."""
        self._mark("fp8_linear")
        gemm = self._handle(("fp8_block_gemm", w.n, w.k), n=w.n, k=w.k, recipe=self.recipe)
        if isinstance(x, QAct):
            return api.fp8_block_gemm(gemm, x.codes, x.scales, w.codes, w.scales)
        x = x.contiguous()
        k = x.shape[1]
        quant = self._handle(("act_quant_fp8", k), k=k, recipe=self.recipe)
        return api.fp8_linear(quant, gemm, x, w.codes, w.scales)

    def _kda_args(self, w: KdaWeights):
        return (w.conv_w, w.fb_w, w.dt_bias, w.a_log, w.norm_w)

    def _kda_handle(self, op: str, heads: int, **kw) -> str:
        return self._handle((op, heads), heads=heads, ssm=self.ssm, gate=self.gate, **kw)

    def kda_decode(self, qkvg, fa, beta, pools, slots, w):
        self._mark("kda_decode")
        h = self._kda_handle("kda_decode", w.heads)
        return api.kda_decode(h, qkvg, fa, beta, pools["ssm"], pools["conv"], slots, *self._kda_args(w))

    def kda_verify(self, qkvg, fa, beta, pools, slots, w):
        self._mark("kda_verify")
        h = self._kda_handle("kda_verify", w.heads, drafts=self.max_drafts)
        return api.kda_verify(h, qkvg, fa, beta, pools["ssm"], pools["draft_rec"], pools["conv_ext"],
                              pools["pending"], slots, *self._kda_args(w))

    def kda_prefill(self, qkvg, fa, beta, cu_seqlens, slots, resume, pools, w):
        self._mark("kda_prefill")
        h = self._kda_handle("kda_prefill", w.heads)
        return api.kda_prefill(h, qkvg, fa, beta, cu_seqlens, slots, resume, pools["ssm"], pools["conv"],
                               *self._kda_args(w))

    def _cache(self, cache: dict) -> list:
        return [cache[n] for n in self._kv_names]

    def mla_attention(self, layout: KvLayout, q, cache, block_table, start, ring_slot, scale):
        """The generated mla_decode over the paged cache (the step's rows are written first).

        Decode (T = 1) and BF16/FP8 verify run one launch with lengths = start + T. NVFP4 verify
        gives each query token t what a T = 1 decode would read: one launch of the T = 1 kernel
        over B * T virtual sequences (b, t), each with sequence b's block-table row and ring slot,
        query row t and length start + t + 1. The multi-token kernel instead reads every tile
        completed by the step's rows as FP4 for all T queries, while decoding token by token reads
        a query's own live tile exact from the HP ring (speculative == greedy needs the latter);
        the ring (16 + drafts rows) still holds every such tile. With `invariant` BF16/FP8 verify
        runs so too: the T = 1 + M kernel splits each query's tiles at other boundaries than the
        T = 1 decode of that query (tests/gpu/test_spec_lossless.py's xfail says where). The
        virtual batch takes the split count of the batch-B decode plan (verify_plan), and the
        kernel's work per (sequence, split) does not depend on the rows beside it."""
        self._mark("mla_decode")
        B, T, H = q.shape[0], q.shape[1], q.shape[2]
        max_len = block_table.shape[1] * layout.page   # a block-table row's capacity: plans hold for any length
        ring = ring_slot if layout.kv is KvDtype.NVFP4 else None
        per_token = T > 1 and self.verify_per_token()
        Tk = 1 if per_token else T
        h = self._handles.get(("mla_decode", Tk))
        if h is None:
            spec = self.mla_decode_spec(Tk)
            self.launcher(spec)
            h = self._handles[("mla_decode", Tk)] = library.handle_of(spec)
        if H != self.heads_mla:
            raise SpecError("q heads", H, [self.heads_mla])
        kv = self._cache(cache)
        if not per_token:
            p = self.attention_plan(T, B, max_len)
            return api.mla_decode(h, q.contiguous(), kv, block_table, (start + T).to(torch.int32),
                                  plan=api.MlaDecodePlan(p.splits, p.part_o, p.part_lse), ring_slot=ring,
                                  scale=float(scale))
        p = self.verify_plan(B, T, max_len)
        lengths = (start.to(torch.int32).view(B, 1)
                   + torch.arange(1, T + 1, dtype=torch.int32, device=start.device)).reshape(B * T)
        out = api.mla_decode(h, q.reshape(B * T, 1, H, q.shape[3]).contiguous(), kv,
                             block_table[:B].repeat_interleave(T, dim=0), lengths,
                             plan=api.MlaDecodePlan(p.splits, p.part_o, p.part_lse),
                             ring_slot=None if ring is None else ring[:B].repeat_interleave(T),
                             scale=float(scale))
        return out.view(B, T, H, out.shape[3])

    def attention_tokens(self) -> list[int]:
        """Query tokens per launch of the mla_decode kernels this target runs."""
        return attention_tokens(self.kv_layout.kv, self.max_drafts)

    def prefill_attention(self, q, k_nope, k_pe, v, pf):
        """The generated mla_prefill (FP32 out) over the prompt rows and each continued sequence's
        cached prefix (cu_seqlens_k = pf.cu_k), one launch for the varlen batch; targets without
        the kernel (targets.has_prefill_kernel) keep the PyTorch attention."""
        if not has_prefill_kernel(self.target):
            return super().prefill_attention(q, k_nope, k_pe, v, pf)
        self._mark("mla_prefill")
        H = q.shape[1]
        h = self._handle(("mla_prefill", H), heads=H)
        return api.mla_prefill(h, q, k_nope, k_pe, v, pf.cu_seqlens, pf.cu_k, pf.max_len)

    def kv_write(self, layout, cache, rows, cu_rows, start_pos, block_table, ring_slot, scale, max_rows):
        self._mark("kv_cache_write")
        h = self._handle(("kv_cache_write",), kv=layout.kv, fp8_scales=layout.fp8_scales, max_drafts=layout.max_drafts)
        api.kv_cache_write(h, rows.contiguous(), cu_rows, start_pos, block_table, self._cache(cache),
                           ring_slot=ring_slot if layout.kv is KvDtype.NVFP4 else None, scale=scale,
                           max_rows_per_seq=max_rows)

    def q_absorb(self, q_a, norm_w, q_b: Fp8Linear, w_uk):
        self._mark("mla_q_absorb")
        h = self._handle(("mla_q_absorb", w_uk.shape[0]), heads=w_uk.shape[0], recipe=self.recipe)
        return api.mla_q_absorb(h, q_a, norm_w, q_b.codes, q_b.scales, w_uk)

    def vb_gate(self, o_lat, w_uv, gate):
        self._mark("mla_vb_gate")
        h = self._handle(("mla_vb_gate", w_uv.shape[0]), heads=w_uv.shape[0])
        return api.mla_vb_gate(h, o_lat.contiguous(), w_uv, gate)


def static_tensors(model) -> list:
    """Every tensor a compiled step reads or writes at a fixed address: the weights, the KV cache
    and state pools, the block table (each once)."""
    import dataclasses
    seen: dict[int, torch.Tensor] = {}

    def walk(obj):
        if isinstance(obj, torch.Tensor):
            seen.setdefault(id(obj), obj)
        elif isinstance(obj, dict):
            for v in obj.values():
                walk(v)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                walk(v)
        elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            for f in dataclasses.fields(obj):
                walk(getattr(obj, f.name))
    walk(model.w)
    walk([model.cache.kv, model.cache.state, model.cache.block_table])
    return list(seen.values())


def prepare_compile(model) -> None:
    """What torch.compile(mode="reduce-overhead") of `model.step_core` needs first: every kernel
    loaded and every mla_decode plan made (`load_kernels`), and every weight, pool and cache tensor
    marked as a static address, so the CUDA graphs it records mutate the pools in place and never
    copy the weights in."""
    model.load_kernels()
    for t in static_tensors(model):
        if t.is_cuda:
            torch._dynamo.mark_static_address(t)


def make_ops(tcfg, cfg, experts: str | None = None) -> Ops:
    """The ops of `tcfg.path`; `experts`: the routed experts' stored format (ExpertWeights.fmt;
    None: both FP4 formats' kernels are listed)."""
    if tcfg.path == "reference":
        return RefOps(tcfg.recipe, gate=cfg.kda_gate)
    shape = cfg.for_tp(tcfg.tp)
    return KernelOps(tcfg.target, tcfg.recipe, tcfg.ssm, tcfg.kv_layout(), shape.kda_heads, shape.mla_heads,
                     tcfg.max_drafts, gate=cfg.kernel_shape().gate, model=cfg, tp=tcfg.tp, ep=tcfg.ep,
                     experts=experts, invariant=tcfg.invariant, plan_batch=max(tcfg.graph_batch_sizes))
