"""PyTorch reference of kda_decode (contract: the docstring of k3gen/ops/kda_decode/spec.py).

Two entry points share one step function:

- `kda_decode`: the kernel's twin. One token per sequence, FP32 math, the state pool and conv
  window updated in place at `slots` (negative slot: output zeros, nothing touched), the state
  stored back in its storage dtype (BF16: round to nearest even), BF16 output.
- `kda_token_loop`: T tokens of N sequences from an initial state, in any float dtype (float64
  for drift checks), optionally rounding the state to a storage dtype after every token and
  returning every intermediate state (what the prefill and verify kernels are checked against).

The state is V-first, `S_t[h, v, k]` (K contiguous), i.e. the transpose of SPEC.md's K x V S.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from k3gen.ir.dtypes import GateKind
from k3gen.ir.layouts import KDA_DK

BOUNDED_LOWER = -5.0
L2_EPS = 1e-6
NORM_EPS = 1e-5


@dataclass
class KdaWeights:
    """Per-layer KDA weights in the kernel's formats (D = H * 128)."""
    conv_w: torch.Tensor   # [3D, 4] BF16, q|k|v channels, tap 0 oldest
    fb_w: torch.Tensor     # [D, 128] BF16 (out x in)
    dt_bias: torch.Tensor  # [D] FP32
    a_log: torch.Tensor    # [H] FP32
    norm_w: torch.Tensor   # [128] FP32, shared by all heads

    @property
    def heads(self) -> int:
        return self.a_log.shape[0]

    def to(self, device) -> "KdaWeights":
        return KdaWeights(*(t.to(device) for t in (self.conv_w, self.fb_w, self.dt_bias, self.a_log, self.norm_w)))


def random_weights(heads: int, *, generator: torch.Generator | None = None, device="cpu") -> KdaWeights:
    """Weights with Kimi-like magnitudes: A_log so that exp(A_log) spans 1..16 (FLA's test range)."""
    D = heads * KDA_DK
    g = generator

    def rn(*shape, scale=1.0):
        return torch.randn(*shape, generator=g) * scale

    return KdaWeights(
        conv_w=rn(3 * D, 4, scale=0.5).to(torch.bfloat16),
        fb_w=rn(D, KDA_DK, scale=KDA_DK ** -0.5).to(torch.bfloat16),
        dt_bias=rn(D, scale=0.5),
        a_log=torch.log(torch.rand(heads, generator=g) * 15 + 1),
        norm_w=1.0 + rn(KDA_DK, scale=0.1),
    ).to(device)


def gate_decay(z: torch.Tensor, a_log: torch.Tensor, gate: GateKind) -> torch.Tensor:
    """exp(g) from z = f_b(f_a) + dt_bias, shaped [..., H, 128]; a_log [H]."""
    a = torch.exp(a_log.to(z.dtype))[:, None]
    if gate is GateKind.BOUNDED:
        g = BOUNDED_LOWER * torch.sigmoid(a * z)
    elif gate is GateKind.SOFTPLUS:
        g = -a * F.softplus(z)   # identity above 20, as the kernel
    else:
        raise ValueError(f"unknown gate {gate!r}")
    return torch.exp(g)


def kda_step(x_qkv: torch.Tensor, g_out: torch.Tensor, fa: torch.Tensor, beta_logit: torch.Tensor,
             state: torch.Tensor, window: torch.Tensor, w: KdaWeights, gate: GateKind):
    """One token of N sequences, all math in `state.dtype`.

    x_qkv [N, 3D] raw q|k|v; g_out [N, D]; fa [N, 128]; beta_logit [N, H]; state [N, H, V, K];
    window [N, 3D, 3] (oldest first). Returns (y [N, H, 128] gated-normed output, new state,
    new window), all in the compute dtype.
    """
    dt = state.dtype
    N, H = state.shape[0], state.shape[1]
    D = H * KDA_DK
    x = x_qkv.to(dt)
    taps = torch.cat([window.to(dt), x[..., None]], dim=-1)            # [N, 3D, 4]
    y = F.silu((taps * w.conv_w.to(dt)).sum(-1))
    q, k, v = (t.reshape(N, H, KDA_DK) for t in y.split(D, dim=-1))
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + L2_EPS) * KDA_DK ** -0.5
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + L2_EPS)
    beta = torch.sigmoid(beta_logit.to(dt))                               # [N, H]
    z = (fa.to(dt) @ w.fb_w.to(dt).t() + w.dt_bias.to(dt)).reshape(N, H, KDA_DK)
    eg = gate_decay(z, w.a_log, gate)                                     # [N, H, K]
    s = state * eg[:, :, None, :]                                         # S^T[v, k] * exp(g_k)
    u = beta[..., None] * (v - (s * k[:, :, None, :]).sum(-1))            # [N, H, V]
    s = s + u[..., None] * k[:, :, None, :]
    o = (s * q[:, :, None, :]).sum(-1)                                    # [N, H, V]
    rstd = torch.rsqrt((o * o).mean(-1, keepdim=True) + NORM_EPS)
    gate_out = torch.sigmoid(g_out.to(dt).reshape(N, H, KDA_DK))
    out = o * rstd * w.norm_w.to(dt) * gate_out
    return out, s, taps[..., 1:]


def zeroed_out(out, shape, device) -> torch.Tensor:
    """`out` (a new BF16 tensor when None) cleared: padded rows stay zeros, as the kernels write them."""
    if out is None:
        out = torch.empty(*shape, dtype=torch.bfloat16, device=device)
    return out.zero_()


def live_rows(slots, num_slots: int):
    """(rows, their slots) of the rows whose slot is in [0, num_slots): the kernels skip the others."""
    sl = slots.long()
    live = ((sl >= 0) & (sl < num_slots)).nonzero().flatten()
    return live, sl[live]


def split_qkvg(qkvg: torch.Tensor, heads: int):
    D = heads * KDA_DK
    return qkvg[..., :3 * D], qkvg[..., 3 * D:4 * D]


@torch.no_grad()
def kda_decode(qkvg, fa, beta_logit, ssm, conv, slots, w: KdaWeights, out=None, *,
               gate: GateKind = GateKind.BOUNDED) -> torch.Tensor:
    """The kernel's twin: returns `out` [B, H, 128] BF16; updates `ssm`/`conv` in place."""
    B, H = slots.shape[0], w.heads
    out = zeroed_out(out, (B, H, KDA_DK), qkvg.device)
    live, idx = live_rows(slots, ssm.shape[0])
    if live.numel() == 0:
        return out
    x_qkv, g_out = split_qkvg(qkvg[live], H)
    y, s_new, win_new = kda_step(x_qkv, g_out, fa[live], beta_logit[live], ssm[idx].float(),
                                 conv[idx].float(), w, gate)
    ssm[idx] = s_new.to(ssm.dtype)
    conv[idx] = win_new.to(conv.dtype)
    out[live] = y.to(torch.bfloat16)
    return out


@torch.no_grad()
def kda_token_loop(qkvg, fa, beta_logit, state, window, w: KdaWeights, *, gate: GateKind = GateKind.BOUNDED,
                   dtype: torch.dtype = torch.float32, state_round: torch.dtype | None = None,
                   return_states: bool = False):
    """T tokens of N sequences: qkvg [N, T, >= 4D], fa [N, T, 128], beta_logit [N, T, H],
    state [N, H, V, K] (V-first), window [N, 3D, 3] raw inputs.

    Returns (out [N, T, H, 128], final state, final window, states [N, T, H, V, K] or None), all
    in `dtype` (out is not rounded to BF16). `state_round` rounds the state after each token, as
    a kernel with that storage dtype does.
    """
    N, T = qkvg.shape[0], qkvg.shape[1]
    H = w.heads
    s = state.to(dtype)
    win = window.to(dtype)
    outs, states = [], []
    for t in range(T):
        x_qkv, g_out = split_qkvg(qkvg[:, t], H)
        y, s, win = kda_step(x_qkv, g_out, fa[:, t], beta_logit[:, t], s, win, w, gate)
        if state_round is not None:
            s = s.to(state_round).to(dtype)
        outs.append(y)
        if return_states:
            states.append(s)
    out = torch.stack(outs, 1) if outs else torch.empty(N, 0, H, KDA_DK, dtype=dtype, device=qkvg.device)
    return out, s, win, (torch.stack(states, 1) if return_states else None)
