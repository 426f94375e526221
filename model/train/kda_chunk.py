"""KDA's recurrence (SPEC.md section 2 step 4) in a differentiable chunked (WY) form for training,
and the token loop it must equal.

Per head, state S [K, V] from zero: S' = diag(exp(g_t)) S; u_t = beta_t (v_t - S'^T k_t);
S = S' + k_t u_t^T; o_t = S^T q_t. Inputs are already conv'd, SiLU'd and normalized (q carries its
K^-0.5) exactly as model/reference.py computes them; g is the log decay per key channel (K3's bounded
gate keeps it in [-5, 0]).

Chunked form, chunk C, with G_r = sum_{i<=r} g_i inside the chunk (SPEC.md section 2 "Prefill"):
A[r, s] = beta_r sum_i k_r[i] k_s[i] e^(G_r[i] - G_s[i]) (s < r), (I + A) X = diag(beta) [V | e^G * K]
gives U = X_V and W = X_K; per chunk, from the state S entering it: V_new = U - W S,
O = (e^G * Q) S + mask_{s<=r}(Q K^T weighted by e^(G_r - G_s)) V_new, and
S <- diag(e^(G_C)) S + (K * e^(G_C - G))^T V_new. Only this state pass is sequential; everything else
is batched over the chunks.

e^(G_r - G_s) over a whole chunk is not representable as e^(G_r) e^(-G_s) (G reaches -5 C), so the
pair products are formed per column sub-block of `sub` tokens with the block's first position as
reference: e^(G_r - G_ref) <= 1 for every row at or after the block (rows before it are masked; their
exponent is clamped to 0 so nothing overflows) and e^(G_ref - G_s) <= e^(5 (sub - 1)) inside FP32's
range for sub <= 16. Every factor is a rounded FP32 number, so the chunked form equals the token loop
within FP32 noise (tests/nogpu/modeling/test_train_forward.py).
"""
from __future__ import annotations

import torch

from k3gen.errors import SpecError


def kda_loop(q, k, v, g, beta):
    """The token loop (model/reference.py's order of operations). q, k, v, g [B, T, H, K]; beta
    [B, T, H]. Returns o [B, T, H, V] (the state starts at zero)."""
    B, T, H, K = q.shape
    S = q.new_zeros(B, H, K, v.shape[-1])
    out = []
    for t in range(T):
        S = S * torch.exp(g[:, t])[..., None]
        u = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhkv,bhk->bhv", S, k[:, t]))
        S = S + k[:, t, :, :, None] * u[:, :, None, :]
        out.append(torch.einsum("bhkv,bhk->bhv", S, q[:, t]))
    return torch.stack(out, dim=1)


def _pairs(rows: torch.Tensor, k: torch.Tensor, G: torch.Tensor, sub: int) -> torch.Tensor:
    """[.., C, C] with [r, s] = sum_i rows_r[i] k_s[i] e^(G_r[i] - G_s[i]) wherever s lies at or
    before r's sub-block end (the caller masks the pairs it needs), per column sub-block of `sub`."""
    C = G.shape[-2]
    cols = []
    for b0 in range(0, C, sub):
        ref = G[..., b0:b0 + 1, :]                                            # [.., 1, K]
        r = rows * torch.exp(torch.clamp(G - ref, max=0.0))                   # rows before b0: masked later
        c = k[..., b0:b0 + sub, :] * torch.exp(ref - G[..., b0:b0 + sub, :])
        cols.append(r @ c.transpose(-1, -2))
    return torch.cat(cols, dim=-1)


def kda_chunked(q, k, v, g, beta, chunk: int = 64, sub: int = 16):
    """The chunked form (module docstring). Same arguments and result as `kda_loop`."""
    if chunk < 1 or sub < 1 or chunk % sub or sub > 16:
        raise SpecError("chunk/sub", (chunk, sub), "sub divides chunk, sub <= 16 (e^(5 (sub-1)) in FP32)")
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = chunk
    pad = (-T) % C
    if pad:   # zero tokens after the end: k = q = beta = 0 and g = 0 change nothing before them
        q, k, v, g = (torch.nn.functional.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v, g))
        beta = torch.nn.functional.pad(beta, (0, 0, 0, pad))
    N = (T + pad) // C

    def chunks(x):   # [B, T, H, D] -> [B, H, N, C, D]
        return x.reshape(B, N, C, H, -1).permute(0, 3, 1, 2, 4)

    q, k, v, g = chunks(q), chunks(k), chunks(v), chunks(g)
    beta = beta.reshape(B, N, C, H).permute(0, 3, 1, 2)                       # [B, H, N, C]
    G = torch.cumsum(g, dim=-2)
    idx = torch.arange(C, device=q.device)
    strict = (idx[:, None] > idx[None, :]).to(q.dtype)
    causal = (idx[:, None] >= idx[None, :]).to(q.dtype)
    A = _pairs(k, k, G, sub) * strict * beta[..., None]
    eye = torch.eye(C, device=q.device, dtype=q.dtype)
    rhs = beta[..., None] * torch.cat([v, torch.exp(G) * k], dim=-1)
    X = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)
    U, W = X[..., :V], X[..., V:]
    P = _pairs(q, k, G, sub) * causal
    last = G[..., -1:, :]                                                     # [B, H, N, 1, K]
    decay = torch.exp(last).transpose(-1, -2)                                 # [B, H, N, K, 1]
    kd = (k * torch.exp(last - G)).transpose(-1, -2)                          # [B, H, N, K, C]
    S = q.new_zeros(B, H, K, V)
    states, vnew = [], []
    # unbind once: indexing chunk n inside the loop would make autograd write a whole zero tensor
    # per chunk (select_backward), O(N^2) traffic; unbind's backward is one stack
    for u, w, d, kn in zip(U.unbind(2), W.unbind(2), decay.unbind(2), kd.unbind(2)):
        vn = u - w @ S
        states.append(S)
        vnew.append(vn)
        S = d * S + kn @ vn
    S_in = torch.stack(states, dim=2)                                         # [B, H, N, K, V]
    Vn = torch.stack(vnew, dim=2)                                             # [B, H, N, C, V]
    o = (q * torch.exp(G)) @ S_in + P @ Vn
    return o.permute(0, 2, 3, 1, 4).reshape(B, N * C, H, V)[:, :T]


__all__ = ["kda_loop", "kda_chunked"]
