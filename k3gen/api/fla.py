"""FLA-compatible KDA entry points: `fused_recurrent_kda` and `chunk_kda` with the argument names,
order, defaults and layouts of `fla.ops.kda` (fla-core 0.6.0), running k3gen's KDA kernels.

q, k [B, T, H, K], v [B, T, HV, V] (HV a multiple of H: GVA), g [B, T, HV, K] (log decay, or the
raw gate with use_gate_in_kernel), beta [B, T, HV], initial_state [N, HV, K, V] ([N, HV, V, K] with
state_v_first), cu_seqlens [N + 1] with B = 1; returns (o [B, T, HV, V] in v's dtype, the final
state FP32 in the initial state's layout, or None). K = V = 128.

What k3gen's kernels compute is more than FLA's bare recurrence: they fuse the short conv + SiLU
before it and the gated RMSNorm after it, take the decay through f_b(f_a) + dt_bias and a fixed
gate formula, and hold the state V-first. Here each (sequence, value head) is one sequence of a
one-head kernel (`fla_specs`: kda_prefill, and kda_decode on request, FP32 state) whose fused
stages are made identities or inverted exactly around the call:
- conv taps (0, 0, 0, 1) over a zero window, so the kernel applies SiLU to its input: the input is
  SiLU^-1(c x) (principal branch) for q, k, v scaled by powers of two c (per token for q and k,
  which the L2 norm makes scale-free; one c for v and the initial state, which the recurrence is
  linear in, undone on o and the final state). This rounds q, k, v once more to BF16 (2^-9);
- the decay: f_b = identity, f_a = the raw gate (exact for a BF16 gate), dt_bias and A_log as
  given: with use_gate_in_kernel FLA's `-exp(A_log) softplus(g + dt_bias)` is the softplus gate and
  `lower_bound * sigmoid(exp(A_log) (g + dt_bias))` with lower_bound -5 the bounded gate, exactly;
  a precomputed log decay g goes in as z = log(expm1(-g)) through the softplus gate with A_log = 0
  (one more BF16 rounding; g >= 0 acts as 0);
- beta: the logits as given (use_beta_sigmoid_in_kernel), else logit(beta) (one BF16 rounding);
- the output: norm weight 1 and output gate sigmoid(88) = 1; c keeps mean(o^2) far below the
  norm's eps, and the RMSNorm is inverted: o = out sqrt(eps / (1 - mean(out^2))), then scaled by
  scale * sqrt(K) (the kernels' q scale is 1/sqrt(K); o is linear in q).
Not supported (SpecError naming the argument): use_qk_l2norm_in_kernel=False (the kernels always
normalize q and k), allow_neg_eigval (beta in [0, 2)), lower_bound other than -5, head-wise beta
[B, T, HV, V], K or V other than 128, return_intermediate_states, cp_context. Accepted and without
effect: safe_gate, disable_recompute, chunk_size, cu_seqlens_cpu, use_graph, max_num_seqs (FLA's own
kernel choices). `target=` (a k3gen target name, default "sm90") picks the kernels. Differences left: the BF16 roundings above, and an L2 norm of q or k whose
squared length is near 1e-6 (the prescale moves FLA's eps). The kernels' own ordering
(chunk64 prefill: BF16 tensor-core operands, FP32 sums and state) follows their specs. No host sync; not CUDA-graph safe
(it allocates the one-head pools per call).
"""
from __future__ import annotations

import math
import warnings

import torch

from k3gen.errors import SpecError
from k3gen.ir.dtypes import GateKind, SsmDtype

EPS_NORM = 1e-5          # the kernels' gated RMSNorm eps (kda_decode spec)
GATE_ONE = 88.0          # sigmoid(88) == 1 in FP32
BOUNDED_LOWER = -5.0
K_DIM = 128


def fla_specs(target) -> list:
    """The one-head KDA specs these entry points launch (FP32 state, both gate kinds)."""
    from k3gen.ops.kda_decode.spec import KdaDecodeSpec
    from k3gen.ops.kda_prefill.spec import KdaPrefillSpec
    return [cls(target=target, heads=1, gate=g, ssm=SsmDtype.FP32) for cls in (KdaPrefillSpec, KdaDecodeSpec)
            for g in (GateKind.BOUNDED, GateKind.SOFTPLUS)]


_HANDLES: dict = {}


def _spec(kind: str, gate: GateKind, target: str, device) -> str:
    key = (kind, gate, target, device.type)
    h = _HANDLES.get(key)
    if h is None:
        from k3gen.api import prepare
        from k3gen.ops.kda_decode.spec import KdaDecodeSpec
        from k3gen.ops.kda_prefill.spec import KdaPrefillSpec
        from k3gen.targets import get_target
        cls = KdaPrefillSpec if kind == "prefill" else KdaDecodeSpec
        spec = cls(target=get_target(target), heads=1, gate=gate, ssm=SsmDtype.FP32)
        h = _HANDLES[key] = prepare(spec, load=device.type == "cuda")
    return h


def _pow2_scale(x: torch.Tensor, top: float) -> torch.Tensor:
    """The power of two c with max|c x| in (top / 2, top] (1 where x is all zero), FP32."""
    m = x.float().abs().amax(-1, keepdim=True)
    e = torch.floor(torch.log2(top / m.clamp_min(1e-30)))
    return torch.where(m > 0, torch.exp2(e), torch.ones_like(m))


def silu_inverse(y: torch.Tensor) -> torch.Tensor:
    """p >= -1.2785 with SiLU(p) = y, for y in [-0.25, 0.25] (Newton in FP64)."""
    y = y.double()
    p = 2.0 * y
    for _ in range(8):
        s = torch.sigmoid(p)
        p = p - (p * s - y) / (s * (1.0 + p * (1.0 - s)))
    return p


def _check(q, k, v, g, beta, use_qk_l2norm_in_kernel, allow_neg_eigval, lower_bound, cu_seqlens, initial_state,
           state_v_first):
    if not use_qk_l2norm_in_kernel:
        raise SpecError("use_qk_l2norm_in_kernel", False, [True], "k3gen's KDA kernels always L2-normalize q and k")
    if allow_neg_eigval:
        raise SpecError("allow_neg_eigval", True, [False], "the kernels' beta is sigmoid(logit), in (0, 1)")
    if lower_bound is not None and float(lower_bound) != BOUNDED_LOWER:
        raise SpecError("lower_bound", lower_bound, [None, BOUNDED_LOWER], "the kernels' bounded gate is -5 sigmoid")
    if q.dim() != 4 or k.shape != q.shape or v.dim() != 4 or v.shape[:2] != q.shape[:2]:
        raise SpecError("q/k/v", (tuple(q.shape), tuple(k.shape), tuple(v.shape)), "[B, T, H, K], [B, T, HV, V]")
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if K != K_DIM or V != K_DIM:
        raise SpecError("K/V", (K, V), [(K_DIM, K_DIM)], "the kernels' head dims")
    if HV % H:
        raise SpecError("HV", HV, f"a multiple of H = {H}", "GVA")
    if tuple(g.shape) != (B, T, HV, K):
        raise SpecError("g", tuple(g.shape), [(B, T, HV, K)])
    if beta.dim() == 4:
        raise SpecError("beta", tuple(beta.shape), [(B, T, HV)], "head-wise beta is not a k3gen kernel input")
    if tuple(beta.shape) != (B, T, HV):
        raise SpecError("beta", tuple(beta.shape), [(B, T, HV)])
    if cu_seqlens is not None and B != 1:
        raise SpecError("q.shape[0]", B, [1], "flatten variable-length inputs with cu_seqlens (as FLA)")
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    if initial_state is not None:
        want = (N, HV, V, K) if state_v_first else (N, HV, K, V)
        if tuple(initial_state.shape) != want:
            raise SpecError("initial_state", tuple(initial_state.shape), [want])
    return B, T, H, HV, N


def _run(q, k, v, g, beta, A_log, dt_bias, scale, initial_state, output_final_state, use_gate_in_kernel,
         use_beta_sigmoid_in_kernel, lower_bound, state_v_first, cu_seqlens, dims, prefer_decode: bool,
         target: str):
    from k3gen import api
    B, T, H, HV, N = dims
    dev = q.device
    L = B * T                                        # tokens, flattened
    q = q.reshape(L, H, K_DIM).repeat_interleave(HV // H, dim=1)      # [L, HV, K]
    k = k.reshape(L, H, K_DIM).repeat_interleave(HV // H, dim=1)
    v, g, beta = v.reshape(L, HV, K_DIM), g.reshape(L, HV, K_DIM), beta.reshape(L, HV)
    cu = (torch.arange(0, L + 1, T, device=dev) if cu_seqlens is None else cu_seqlens.to(dev)).long()
    s0 = None
    if initial_state is not None:
        s0 = initial_state.float() if state_v_first else initial_state.float().transpose(-1, -2)   # [N, HV, V, K]
    # One c for v and the state: the output stays far below the norm's eps (|o| <= |S| |q| / sqrt(K)
    # and |S| grows by at most |v| per token).
    bound = v.float().norm(dim=-1).amax() * L
    if s0 is not None:
        bound = bound + s0.flatten(2).norm(dim=-1).amax()
    cv = torch.exp2(torch.floor(torch.log2(1e-3 / bound.clamp_min(1e-30))))
    x_q = silu_inverse(_pow2_scale(q, 0.25) * q.float())
    x_k = silu_inverse(_pow2_scale(k, 0.25) * k.float())
    x_v = silu_inverse((cv * v.float()).clamp(-0.25, 0.25))
    if use_gate_in_kernel:
        gate = GateKind.BOUNDED if lower_bound is not None else GateKind.SOFTPLUS
        a_log = (torch.zeros(HV) if gate is GateKind.BOUNDED else torch.ones(HV)) if A_log is None else A_log
        z = g.float()
        bias = torch.zeros(HV * K_DIM) if dt_bias is None else dt_bias.float().reshape(HV * K_DIM)
    else:
        gate, a_log = GateKind.SOFTPLUS, torch.zeros(HV)
        z = torch.log(torch.expm1((-g.float()).clamp_min(1e-30)))
        bias = torch.zeros(HV * K_DIM)
    blog = beta.float() if use_beta_sigmoid_in_kernel else torch.logit(beta.float())
    # Rows of sequence (hv, n), hv-major: row hv * L + t; slot hv * N + n.
    one = torch.full((L, HV, K_DIM), GATE_ONE, dtype=x_q.dtype, device=x_q.device)
    qkvg = torch.stack([x_q, x_k, x_v, one], dim=2)                            # [L, HV, 4, K]
    qkvg = qkvg.permute(1, 0, 2, 3).reshape(HV * L, 4 * K_DIM).to(dev, torch.bfloat16)
    fa = z.permute(1, 0, 2).reshape(HV * L, K_DIM).to(dev, torch.bfloat16)
    bl = blog.t().reshape(HV * L, 1).to(dev, torch.bfloat16)
    S = HV * N
    ssm = torch.zeros(S, 1, K_DIM, K_DIM, dtype=torch.float32, device=dev)
    if s0 is not None:
        ssm.copy_((s0.to(dev) * cv).permute(1, 0, 2, 3).reshape(S, 1, K_DIM, K_DIM))
    conv = torch.zeros(S, 3 * K_DIM, 3, dtype=torch.bfloat16, device=dev)
    conv_w = torch.zeros(3 * K_DIM, 4, dtype=torch.bfloat16, device=dev)
    conv_w[:, 3] = 1
    fb_w = torch.eye(K_DIM, dtype=torch.bfloat16, device=dev)
    norm_w = torch.ones(K_DIM, dtype=torch.float32, device=dev)
    outs = []
    for hv in range(HV):   # one head-1 launch per value head: its own A_log and dt_bias
        w = (conv_w, fb_w, bias[hv * K_DIM:(hv + 1) * K_DIM].to(dev).contiguous(),
             a_log.reshape(HV)[hv:hv + 1].float().to(dev), norm_w)
        rows = slice(hv * L, (hv + 1) * L)
        pool = slice(hv * N, (hv + 1) * N)
        slots = torch.arange(N, dtype=torch.int32, device=dev)
        if prefer_decode and cu_seqlens is None and T == 1:
            h = _spec("decode", gate, target, dev)
            o = api.kda_decode(h, qkvg[rows], fa[rows], bl[rows], ssm[pool], conv[pool], slots, *w)
        else:
            h = _spec("prefill", gate, target, dev)
            resume = torch.full((N,), 1 if s0 is not None else 0, dtype=torch.int32, device=dev)
            o = api.kda_prefill(h, qkvg[rows], fa[rows], bl[rows], cu.to(torch.int32), slots, resume, ssm[pool],
                                conv[pool], *w)
        outs.append(o.reshape(L, K_DIM))
    out = torch.stack(outs, dim=1).float()                                            # [L, HV, V]
    r = out.square().mean(-1, keepdim=True)
    o = out * torch.sqrt(EPS_NORM / (1.0 - r)) / cv * (scale * math.sqrt(K_DIM))
    o = o.reshape(B, T, HV, K_DIM).to(v.dtype)
    final = None
    if output_final_state:
        fs = (ssm / cv).reshape(HV, N, K_DIM, K_DIM).permute(1, 0, 2, 3)                   # [N, HV, V, K]
        final = fs.contiguous() if state_v_first else fs.transpose(-1, -2).contiguous()
    return o, final


def _common(q, k, v, g, beta, A_log, dt_bias, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
            use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound, state_v_first,
            cu_seqlens, kwargs, prefer_decode, recurrent):
    if "transpose_state_layout" in kwargs:   # FLA's deprecated name
        if state_v_first:
            raise SpecError("transpose_state_layout", True, "state_v_first alone", "both given")
        warnings.warn("`transpose_state_layout` is deprecated and renamed to `state_v_first`.", DeprecationWarning,
                      stacklevel=3)
        state_v_first = kwargs.pop("transpose_state_layout")
    dims = _check(q, k, v, g, beta, use_qk_l2norm_in_kernel, allow_neg_eigval, lower_bound, cu_seqlens,
                  initial_state, state_v_first)
    if use_gate_in_kernel and A_log is None and lower_bound is None and not recurrent:
        raise SpecError("A_log", None, "a [HV] tensor", "use_gate_in_kernel without lower_bound (as FLA's chunk_kda)")
    if scale is None:
        scale = q.shape[-1] ** -0.5
    return _run(q, k, v, g, beta, A_log, dt_bias, scale, initial_state, output_final_state, use_gate_in_kernel,
                use_beta_sigmoid_in_kernel, lower_bound, state_v_first, cu_seqlens, dims, prefer_decode,
                kwargs.pop("target", "sm90"))


def fused_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    lower_bound: float | None = None,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fla.ops.kda.fused_recurrent_kda on k3gen's kda_prefill kernel (module docstring: what maps and
    what does not). `k3gen_decode=True` runs a decode step (T = 1, no cu_seqlens) on kda_decode
    instead: that route is not yet matched against FLA on the H200 (tests/gpu/test_library.py)."""
    decode = bool(kwargs.pop("k3gen_decode", False))
    return _common(q, k, v, g, beta, A_log, dt_bias, scale, initial_state, output_final_state,
                   use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval,
                   lower_bound, state_v_first, cu_seqlens, kwargs, prefer_decode=decode, recurrent=True)


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    safe_gate: bool = False,
    lower_bound: float | None = None,
    disable_recompute: bool = False,
    return_intermediate_states: bool = False,
    state_v_first: bool = False,
    cu_seqlens: torch.LongTensor | None = None,
    cu_seqlens_cpu: torch.LongTensor | None = None,
    cp_context=None,
    use_graph: bool = False,
    max_num_seqs: int | None = None,
    **kwargs,
):
    """fla.ops.kda.chunk_kda on k3gen's kda_prefill kernel (module docstring: what maps and what
    does not). A_log and dt_bias come as keyword arguments, as FLA's."""
    if return_intermediate_states:
        raise SpecError("return_intermediate_states", True, [False], "k3gen's prefill keeps chunk states on chip")
    if cp_context is not None:
        raise SpecError("cp_context", type(cp_context).__name__, [None], "no context parallelism")
    A_log, dt_bias = kwargs.pop("A_log", None), kwargs.pop("dt_bias", None)
    return _common(q, k, v, g, beta, A_log, dt_bias, scale, initial_state, output_final_state,
                   use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval,
                   lower_bound, state_v_first, cu_seqlens, kwargs, prefer_decode=False, recurrent=False)
