"""PyTorch reference of kda_prefill (contract: the docstring of k3gen/ops/kda_prefill/spec.py): the
decode token loop over each sequence of a varlen batch, FP32, the state rounded to its storage
dtype once at the end (as the kernel, which keeps it in registers)."""
from __future__ import annotations

import torch

from k3gen.ir.dtypes import GateKind
from k3gen.ir.layouts import KDA_DK
from k3gen.ops.kda_decode.reference import KdaWeights, kda_token_loop, zeroed_out


@torch.no_grad()
def kda_prefill(qkvg, fa, beta_logit, cu_seqlens, slots, resume, ssm, conv, w: KdaWeights, out=None, *,
                gate: GateKind = GateKind.BOUNDED, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Returns out [N, H, 128] BF16 (N = cu_seqlens[-1]); updates ssm/conv in place at `slots`.
    `dtype` float64 gives a drift reference (the pools still get their storage dtypes)."""
    N, H = qkvg.shape[0], w.heads
    D = H * KDA_DK
    out = zeroed_out(out, (N, H, KDA_DK), qkvg.device)
    cu = [int(x) for x in cu_seqlens.tolist()]
    for b, slot in enumerate(int(x) for x in slots.tolist()):
        lo, hi = cu[b], cu[b + 1]
        if slot < 0 or slot >= ssm.shape[0] or hi <= lo:
            continue
        if int(resume[b]):
            s0, w0 = ssm[slot].to(dtype), conv[slot].to(dtype)
        else:
            s0 = torch.zeros(H, KDA_DK, KDA_DK, dtype=dtype, device=qkvg.device)
            w0 = torch.zeros(3 * D, 3, dtype=dtype, device=qkvg.device)
        o, s, win, _ = kda_token_loop(qkvg[None, lo:hi], fa[None, lo:hi], beta_logit[None, lo:hi], s0[None],
                                      w0[None], w, gate=gate, dtype=dtype)
        ssm[slot] = s[0].to(ssm.dtype)
        conv[slot] = win[0].to(conv.dtype)
        out[lo:hi] = o[0].to(torch.bfloat16)
    return out


@torch.no_grad()
def chunk_emulation(q, k, v, g, beta, state, chunk: int = 16):
    """The chunked WY algebra (SPEC.md section 2) at any chunk size, exact in the input dtype,
    written plainly so the CPU tests can hold it against the token recurrence and chunk64's
    emulation against it. Per head: q, k normalized
    [T, K], v [T, V], g log decays [T, K] (<= 0), beta [T], state S^T [V, K] (V-first). Returns
    (o [T, V] before the gated RMSNorm, final S^T). Every decay factor is exp of a difference <= 0."""
    T = q.shape[0]
    s = state.clone()
    outs = []
    for t0 in range(0, T, chunk):
        qc, kc, vc, gc, bc = (x[t0:t0 + chunk] for x in (q, k, v, g, beta))
        n = qc.shape[0]
        G = gc.cumsum(0)                                                   # [n, K]
        dec = torch.exp((G[:, None, :] - G[None, :, :]).clamp(max=0))      # [r, s, K]
        kk = (kc[:, None, :] * kc[None, :, :] * dec).sum(-1)
        qk = (qc[:, None, :] * kc[None, :, :] * dec).sum(-1)
        low = torch.tril(torch.ones(n, n, dtype=torch.bool), -1)
        A = torch.where(low, bc[:, None] * kk, torch.zeros_like(kk))
        P = torch.where(torch.tril(torch.ones(n, n, dtype=torch.bool)), qk, torch.zeros_like(qk))
        rhs = bc[:, None] * torch.cat([kc * torch.exp(G), vc], dim=1)
        x = torch.linalg.solve_triangular(torch.eye(n, dtype=q.dtype) + A, rhs, upper=False, unitriangular=True)
        W, U = x[:, :kc.shape[1]], x[:, kc.shape[1]:]
        vnew = U - W @ s.t()                                               # [n, V]
        outs.append((qc * torch.exp(G)) @ s.t() + P @ vnew)
        kd = kc * torch.exp(G[-1] - G)
        s = s * torch.exp(G[-1])[None, :] + vnew.t() @ kd
    o = torch.cat(outs) if outs else torch.empty(0, v.shape[1], dtype=q.dtype)
    return o, s


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).to(x.dtype)


@torch.no_grad()
def chunk64_records(q, k, v, g, beta, *, bf16: bool = True, bounded: bool = False) -> list[dict]:
    """chunk64's prep (include/k3gen/kda/prefill_chunk64.cuh) per 64-token chunk, with its rounding
    points: A and Aqk on the 16 x 16 diagonal blocks per element in FP32 (the softplus gate's form;
    see `bounded`); off the diagonal from BF16 factor tiles referred to G at the end of the previous
    16-token block (every exp of a difference <= 0); T = (I + A)^-1 applied in FP32. Returns what
    each chunk's record holds, logically ([n] rows, n the chunk's tokens): w = W and qg = e^G Q
    ([n, K], BF16 values; the record stores -W), kg = K e^(G_C - G) ([n, K], BF16), aqk = Aqk ([n, n],
    BF16), u = U ([n, V], FP32), egl = e^(G_C) ([K], FP32). bf16=False keeps every operand in the
    input dtype (the algebra alone, for the FP64 check). bounded=True: the kernel's bounded-gate form
    (g >= -5, so G falls by at most 80 over a block and e^(ref_i - G_s) stays finite), where the
    diagonal blocks also come from BF16 factors referred to ref_i (0 for the first block), masked to
    s <= r."""
    rnd = _bf16 if bf16 else (lambda x: x)
    T, C, B = q.shape[0], 64, 16
    recs = []
    for t0 in range(0, T, C):
        qc, kc, vc, gc, bc = (x[t0:t0 + C] for x in (q, k, v, g, beta))
        n = qc.shape[0]
        G = gc.cumsum(0)
        A = torch.zeros(n, n, dtype=q.dtype)
        P = torch.zeros(n, n, dtype=q.dtype)
        for i in range(0, n, B):
            r = slice(i, min(i + B, n))
            if bounded:
                ref = G[i - 1] if i else torch.zeros_like(G[0])
                left, right = torch.exp(G[r] - ref), rnd(kc[r] * torch.exp(ref - G[r]))
                P[r, r] = torch.tril(rnd(qc[r] * left) @ right.t())
                A[r, r] = torch.tril(rnd(kc[r] * left) @ right.t(), -1)
            else:
                dec = torch.exp((G[r, None, :] - G[None, r, :]).clamp(max=0))
                P[r, r] = torch.tril((qc[r, None, :] * kc[None, r, :] * dec).sum(-1))
                A[r, r] = torch.tril((kc[r, None, :] * kc[None, r, :] * dec).sum(-1), -1)
            if i:
                ref = G[i - 1]
                right = rnd(kc[:i] * torch.exp(ref - G[:i]))
                left = torch.exp(G[r] - ref)
                P[r, :i] = rnd(qc[r] * left) @ right.t()
                A[r, :i] = rnd(kc[r] * left) @ right.t()
        A = bc[:, None] * A
        rhs = bc[:, None] * torch.cat([kc * torch.exp(G), vc], dim=1)
        # Row-major like every other record: solve_triangular returns x column-major, and a CPU
        # GEMM may round differently (another kernel) with a transposed operand than with a
        # row-major one of the same values, so the state pass's products would depend on layout.
        x = torch.linalg.solve_triangular(torch.eye(n, dtype=q.dtype) + A, rhs, upper=False,
                                          unitriangular=True).contiguous()
        recs.append({"w": rnd(x[:, :kc.shape[1]]), "u": x[:, kc.shape[1]:].contiguous(),
                     "qg": rnd(qc * torch.exp(G)), "aqk": rnd(P), "kg": rnd(kc * torch.exp(G[-1] - G)),
                     "egl": torch.exp(G[-1])})
    return recs


@torch.no_grad()
def chunk64_state_pass(recs, state, *, bf16: bool = True):
    """chunk64's state pass over `chunk64_records` from S^T = `state` [V, K]: per chunk, S enters the
    MMAs as bf16(S) (FP32 kept), V_new = U - W bf16(S)^T in FP32 and enters as bf16 once,
    O = e^G Q bf16(S)^T + Aqk bf16(V_new), S <- S e^(G_C) + bf16(V_new)^T K e^(G_C - G). The rounding
    contract chunk64 and chunk64_tc share (spec.py). Returns (o [T, V], final S^T)."""
    rnd = _bf16 if bf16 else (lambda x: x)
    s = state.clone()
    outs = []
    for r in recs:
        sb = rnd(s)
        vnew = r["u"] - r["w"] @ sb.t()                                    # [n, V]
        outs.append(r["qg"] @ sb.t() + r["aqk"] @ rnd(vnew))
        s = s * r["egl"][None, :] + rnd(vnew).t() @ r["kg"]
    o = torch.cat(outs) if outs else torch.empty(0, state.shape[0], dtype=state.dtype)
    return o, s


@torch.no_grad()
def chunk64_emulation(q, k, v, g, beta, state, *, bf16: bool = True, bounded: bool = False):
    """The chunk64 kernels' algebra with their rounding points: `chunk64_records` (prep) then
    `chunk64_state_pass`. Arguments and returns as chunk_emulation; bf16 and bounded as
    chunk64_records."""
    return chunk64_state_pass(chunk64_records(q, k, v, g, beta, bf16=bf16, bounded=bounded), state, bf16=bf16)
