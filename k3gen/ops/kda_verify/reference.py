"""PyTorch reference of kda_verify (contract: the docstring of k3gen/ops/kda_verify/spec.py), built
on the decode token loop, plus the host-side `commit` that is the only thing sampling changes.

Token t runs kda_decode's step (kda_step) on the state token t - 1 left, rounded to the SSM
storage dtype as kda_decode stores and reloads it: verify + commit == serial decode, bit for bit."""
from __future__ import annotations

import torch

from k3gen.ir.dtypes import GateKind
from k3gen.ir.layouts import KDA_DK
from k3gen.ops.kda_decode.reference import KdaWeights, kda_token_loop, live_rows, zeroed_out


def storage_round(ssm_dtype: torch.dtype) -> torch.dtype | None:
    """The dtype the per-token state is rounded to (None: FP32 storage, no rounding)."""
    return None if ssm_dtype == torch.float32 else ssm_dtype


def start_of(ssm, draft_rec, conv_ext, pending, idx):
    """FP32 start state [n, H, V, K] and window [n, 3D, 3] of the live slots `idx` (long)."""
    M = draft_rec.shape[1]
    P = pending[idx].long().clamp(0, M)
    rec = draft_rec[idx, (P - 1).clamp(min=0)].float()
    state = torch.where((P == 0)[:, None, None, None], ssm[idx].float(), rec)
    cols = P[:, None, None] + torch.arange(3, device=P.device)[None, None, :]
    window = torch.gather(conv_ext[idx].float(), 2, cols.expand(-1, conv_ext.shape[1], 3))
    return state, window


@torch.no_grad()
def kda_verify(qkvg, fa, beta_logit, ssm, draft_rec, conv_ext, pending, slots, w: KdaWeights, out=None, *,
               gate: GateKind = GateKind.BOUNDED) -> torch.Tensor:
    """The kernel's twin: qkvg [B*T, >= 4D], fa [B*T, 128], beta_logit [B*T, H] (row b*T + t);
    returns out [B, T, H, 128] BF16 and updates ssm, draft_rec, conv_ext in place at `slots`."""
    B, H, M = slots.shape[0], w.heads, draft_rec.shape[1]
    T, D = 1 + M, w.heads * KDA_DK
    out = zeroed_out(out, (B, T, H, KDA_DK), qkvg.device)
    live, idx = live_rows(slots, ssm.shape[0])
    if live.numel() == 0:
        return out
    q3 = qkvg.reshape(B, T, -1)[live]
    state, window = start_of(ssm, draft_rec, conv_ext, pending, idx)
    # Plain decoding stores the state in the SSM dtype after every token and the next token reloads
    # it: verify rounds the same way after every token (a no-op for FP32), so the records hold the
    # BF16-rounded states exactly and an accepted path is bit for bit the serial one (SPEC.md s. 3).
    o, _, _, states = kda_token_loop(q3, fa.reshape(B, T, -1)[live], beta_logit.reshape(B, T, -1)[live], state,
                                     window, w, gate=gate, return_states=True, state_round=storage_round(ssm.dtype))
    ssm[idx] = states[:, 0].to(ssm.dtype)
    draft_rec[idx] = states[:, 1:].to(draft_rec.dtype)
    raw = q3[..., :3 * D].float().transpose(1, 2)                        # [n, 3D, T]
    conv_ext[idx] = torch.cat([window[..., 1:], raw], dim=-1).to(conv_ext.dtype)
    out[live] = o.to(torch.bfloat16)
    return out


def commit(pending, slots, accepted) -> None:
    """After sampling: pending[slot] = accepted - 1, clamped at 0, for every live row.

    `accepted[b]` counts the accepted tokens of row b among its 1 + M (the golden token
    included, so 1..M+1; the bonus token the sampler adds is not counted). Nothing else changes:
    the next verify starts from draft_rec[slot, accepted - 2] (or ssm[slot] when no draft was
    accepted) and from the conv columns accepted - 1 .. accepted + 1.
    """
    sl = slots.long()
    live = (sl >= 0) & (sl < pending.shape[0])
    pending[sl[live]] = (accepted.to(pending.device).long()[live] - 1).clamp(min=0).to(pending.dtype)
