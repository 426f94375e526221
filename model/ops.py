"""The two implementations of every fused op a layer calls: `RefOps` (k3gen's FP32 PyTorch
references, CPU or GPU) and `KernelOps` (the generated launchers, GPU only). A layer never knows
which one it has; `TargetConfig.path` picks. Both count what ran in `ran` ("ref:<op>",
"kernel:<op>", "torch:<op>" for the PyTorch stand-ins), so a test can prove which path executed.

Rounding points are the same on both paths: BF16 activations between ops, FP8 activations
quantized per token per 128 columns with the target's recipe, FP32 accumulation.
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
from k3gen.ops.mla_q_absorb.reference import NOPE, Q_LORA, rms_norm_bf16
from k3gen.ops.mla_vb_gate.reference import mla_vb_gate as ref_vb_gate
from k3gen.targets import ServingOptions, SpecMenu, attention_tokens, mla_decode_spec, model_specs, rank_specs

from model import mla_attention as attn
from model.weights import Fp8Linear

BF16 = torch.bfloat16
QK_HEAD = 192


class Ops:
    kind = "base"

    def __init__(self, recipe: ScaleRecipe, gate: GateKind = GateKind.BOUNDED):
        self.recipe, self.gate = recipe, gate
        self.ran: collections.Counter = collections.Counter()

    def _mark(self, op: str, kind: str | None = None) -> None:
        self.ran[f"{kind or self.kind}:{op}"] += 1

    def mla_attention(self, layout: KvLayout, q, cache, block_table, start, ring_slot, scale):
        """q [B, T, H, 576] BF16 -> o_lat [B, T, H, 512] BF16 (the FP32 PyTorch attention;
        KernelOps runs the generated mla_decode instead)."""
        self._mark("mla_attention", "torch" if self.kind == "kernel" else "ref")
        return attn.paged_mla_attention(layout, q, cache, block_table, start, ring_slot, scale).to(BF16)


class RefOps(Ops):
    kind = "ref"

    def linear(self, x: torch.Tensor, w: Fp8Linear) -> torch.Tensor:
        self._mark("fp8_linear")
        codes, scales = ref_act_quant(x, self.recipe)
        xd = ref_act_dequant(codes, scales, self.recipe)
        # FP64 products rounded to FP32: row-invariant (an FP32 GEMM's reduction order depends on
        # the row count), so a verify row equals the decode row and speculative == greedy holds
        # on this path to the last bit but for the FP32 LM head.
        return (xd.double() @ w.dequant().to(xd.device).double().T).float().to(BF16)

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


class KernelOps(Ops):
    """The generated kernels of `target` (launchers of specs, cubins JIT-compiled or prebuilt).
    `load_all` must run before CUDA-graph capture (capture never compiles).

    With `model` (a ModelConfig, as `make_ops` passes) every kernel is found by (op, fields) in
    k3gen's `targets.model_specs` for this rank and serving setting, the list `k3gen build --model`
    builds: a launch the enumerator does not list raises instead of compiling something unbuilt.
    Built from head counts alone (tests), the specs come from the same enumerator's core
    (`targets.rank_specs`) for the FP8 shapes given."""
    kind = "kernel"

    def __init__(self, target, recipe: ScaleRecipe, ssm: SsmDtype, kv: KvLayout, heads_kda: int, heads_mla: int,
                 max_drafts: int, gate: GateKind = GateKind.BOUNDED, model=None, tp: int = 1):
        super().__init__(recipe, gate)
        self.target, self.ssm, self.kv_layout = target, ssm, kv
        self.heads_kda, self.heads_mla, self.max_drafts = heads_kda, heads_mla, max_drafts
        self.serving = ServingOptions(kv=kv.kv, ssm=ssm, max_drafts=max_drafts, recipe=recipe)
        self.menu = None
        if model is not None:
            self.menu = SpecMenu(model_specs(target, model, tp, serving=self.serving))
        self._launchers: dict[str, object] = {}
        # mla_decode split plans (split count + FP32 workspace) by (T, batch): made outside
        # capture, sized for the longest sequence a block-table row can hold; a graph keeps the
        # workspace pointers of the plan it was captured with.
        self._plans: dict[tuple[int, int], object] = {}

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
        """The loaded launcher of `spec`. Loading compiles or reads a cubin: never inside capture."""
        key = spec.digest()
        if key not in self._launchers:
            from k3gen.runtime.launcher import launcher_class
            self._launchers[key] = launcher_class(spec.op)(spec)
        op = self._launchers[key]
        if op._kernel is None:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise SpecError("kernel", spec.file_stem, "loaded before CUDA-graph capture (load_all)")
            op.load()
        return op

    def load_all(self, gemm_shapes=None, batch_sizes=(), max_len: int | None = None) -> None:
        """Load every kernel; with `max_len`, plan mla_decode for each batch size and step length."""
        for s in self.specs(gemm_shapes):
            self.launcher(s)
        if max_len is not None:
            for T in self.attention_tokens():
                for B in batch_sizes:
                    self.attention_plan(T, B, max_len)

    def attention_plan(self, T: int, B: int, max_len: int):
        key = (T, B)
        plan = self._plans.get(key)
        if plan is None or plan.max_len < max_len:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise SpecError("mla_decode plan", key, "made before CUDA-graph capture (load_all)")
            plan = self.launcher(self.mla_decode_spec(T)).plan(B, max_len)
            self._plans[key] = plan
        return plan

    def _get(self, op: str, **kw):
        if self.menu is not None:
            return self.launcher(self.menu.find(op, **kw))
        from k3gen.ops import registry
        return self.launcher(registry()[op](target=self.target, **kw))

    # -- ops --------------------------------------------------------------------------------------
    def linear(self, x, w: Fp8Linear):
        self._mark("fp8_linear")
        x = x.contiguous()
        m, k = x.shape
        aq = self._get("act_quant_fp8", k=k, recipe=self.recipe)
        codes = torch.empty(m, k, dtype=torch.uint8, device=x.device)
        sdt = torch.float32 if self.recipe is ScaleRecipe.FP32 else torch.uint8
        scales = torch.empty(m, k // 128, dtype=sdt, device=x.device)
        aq(x, codes, scales)
        out = torch.empty(m, w.n, dtype=BF16, device=x.device)
        self._get("fp8_block_gemm", n=w.n, k=w.k, recipe=self.recipe)(codes, scales, w.codes, w.scales, out)
        return out

    def _kda_args(self, w: KdaWeights):
        return (w.conv_w, w.fb_w, w.dt_bias, w.a_log, w.norm_w)

    def kda_decode(self, qkvg, fa, beta, pools, slots, w):
        self._mark("kda_decode")
        out = torch.empty(slots.shape[0], w.heads, 128, dtype=BF16, device=qkvg.device)
        op = self._get("kda_decode", heads=w.heads, ssm=self.ssm, gate=self.gate)
        return op(qkvg, fa, beta, pools["ssm"], pools["conv"], slots, *self._kda_args(w), out)

    def kda_verify(self, qkvg, fa, beta, pools, slots, w):
        self._mark("kda_verify")
        T = 1 + self.max_drafts
        out = torch.empty(slots.shape[0], T, w.heads, 128, dtype=BF16, device=qkvg.device)
        op = self._get("kda_verify", heads=w.heads, drafts=self.max_drafts, ssm=self.ssm, gate=self.gate)
        return op(qkvg, fa, beta, pools["ssm"], pools["draft_rec"], pools["conv_ext"], pools["pending"], slots,
                  *self._kda_args(w), out)

    def kda_prefill(self, qkvg, fa, beta, cu_seqlens, slots, resume, pools, w):
        self._mark("kda_prefill")
        out = torch.empty(qkvg.shape[0], w.heads, 128, dtype=BF16, device=qkvg.device)
        op = self._get("kda_prefill", heads=w.heads, ssm=self.ssm, gate=self.gate)
        return op(qkvg, fa, beta, cu_seqlens, slots, resume, pools["ssm"], pools["conv"], *self._kda_args(w), out)

    def mla_attention(self, layout: KvLayout, q, cache, block_table, start, ring_slot, scale):
        """The generated mla_decode over the paged cache (the step's rows are written first).

        Decode (T = 1) and BF16/FP8 verify run one launch with lengths = start + T. NVFP4 verify
        runs one T = 1 launch per query token with lengths = start + t + 1: the multi-token kernel
        reads every tile completed by the step's rows as FP4 for all T queries, while decoding
        token by token reads a query's own live tile exact from the HP ring; per-token launches
        keep verify's attention identical to greedy decode's (speculative == greedy), and the
        ring (16 + drafts rows) still holds every such tile."""
        self._mark("mla_decode")
        B, T, H = q.shape[0], q.shape[1], q.shape[2]
        max_len = block_table.shape[1] * layout.page   # a block-table row's capacity: plans hold for any length
        ring = ring_slot if layout.kv is KvDtype.NVFP4 else None
        per_token = layout.kv is KvDtype.NVFP4 and T > 1
        Tk = 1 if per_token else T
        op = self.launcher(self.mla_decode_spec(Tk))
        if H != op.spec.heads:
            raise SpecError("q heads", H, [op.spec.heads])
        plan = self.attention_plan(Tk, B, max_len)
        out = torch.empty(B, T, H, 512, dtype=BF16, device=q.device)
        if not per_token:
            return op(q.contiguous(), cache, block_table, (start + T).to(torch.int32), out, ring_slot=ring,
                      scale=float(scale), plan=plan)
        for t in range(T):
            o = torch.empty(B, 1, H, 512, dtype=BF16, device=q.device)
            op(q[:, t:t + 1].contiguous(), cache, block_table, (start + (t + 1)).to(torch.int32), o, ring_slot=ring,
               scale=float(scale), plan=plan)
            out[:, t:t + 1].copy_(o)
        return out

    def attention_tokens(self) -> list[int]:
        """Query tokens per launch of the mla_decode kernels this target runs."""
        return attention_tokens(self.kv_layout.kv, self.max_drafts)

    def kv_write(self, layout, cache, rows, cu_rows, start_pos, block_table, ring_slot, scale, max_rows):
        self._mark("kv_cache_write")
        op = self._get("kv_cache_write", kv=layout.kv, fp8_scales=layout.fp8_scales, max_drafts=layout.max_drafts)
        op(rows.contiguous(), cu_rows, start_pos, block_table, cache,
           ring_slot=ring_slot if layout.kv is KvDtype.NVFP4 else None, scale=scale, max_rows_per_seq=max_rows)

    def q_absorb(self, q_a, norm_w, q_b: Fp8Linear, w_uk):
        self._mark("mla_q_absorb")
        op = self._get("mla_q_absorb", heads=w_uk.shape[0], recipe=self.recipe)
        out = torch.empty(q_a.shape[0], w_uk.shape[0], 576, dtype=BF16, device=q_a.device)
        return op(q_a, norm_w, q_b.codes, q_b.scales, w_uk, out, workspace=op.workspace(q_a.shape[0], q_a.device))

    def vb_gate(self, o_lat, w_uv, gate):
        self._mark("mla_vb_gate")
        op = self._get("mla_vb_gate", heads=w_uv.shape[0])
        out = torch.empty(o_lat.shape[0], w_uv.shape[0], 128, dtype=BF16, device=o_lat.device)
        return op(o_lat.contiguous(), w_uv, gate, out)


def make_ops(tcfg, cfg) -> Ops:
    if tcfg.path == "reference":
        return RefOps(tcfg.recipe)
    shape = cfg.for_tp(tcfg.tp)
    return KernelOps(tcfg.target, tcfg.recipe, tcfg.ssm, tcfg.kv_layout(), shape.kda_heads, shape.mla_heads,
                     tcfg.max_drafts, gate=cfg.kernel_shape().gate, model=cfg, tp=tcfg.tp)
