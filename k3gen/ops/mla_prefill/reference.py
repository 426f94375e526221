"""FP64 reference of mla_prefill (contract: ops/mla_prefill/spec.py), rounded to FP32 once.

Per sequence and head: scores in FP64, bottom-right causal over the sequence's keys (query row i of
a sequence with prefix p = len_k - len_q sees keys 0 .. p + i), softmax and P V in FP64. A row that
sees no key (len_k < len_q, which the launcher rejects when validating) is zero, as the kernel
writes it. Runs on the CPU or the GPU (the tensors' device); scores are made for a chunk of heads
at a time (HEAD_CHUNK_ELEMS)."""
from __future__ import annotations

import torch

from k3gen.ops.mla_prefill.spec import NOPE, SOFTMAX_SCALE, V_HEAD

HEAD_CHUNK_ELEMS = 1 << 27   # FP64 score elements per chunk of heads (1 GiB)


def mla_prefill(q: torch.Tensor, k_nope: torch.Tensor, k_pe: torch.Tensor, v: torch.Tensor,
                cu_seqlens_q, cu_seqlens_k) -> torch.Tensor:
    """q [Nq, H, 192], k_nope / v [Nk, H, 128], k_pe [Nk, 64]; cu_seqlens [B + 1] (tensors or lists).
    Returns o [Nq, H, 128] FP32."""
    cq = [int(x) for x in (cu_seqlens_q.tolist() if hasattr(cu_seqlens_q, "tolist") else cu_seqlens_q)]
    ck = [int(x) for x in (cu_seqlens_k.tolist() if hasattr(cu_seqlens_k, "tolist") else cu_seqlens_k)]
    N, H = q.shape[0], q.shape[1]
    out = torch.zeros(N, H, V_HEAD, dtype=torch.float64, device=q.device)
    for b in range(len(cq) - 1):
        q0, q1, k0, k1 = cq[b], cq[b + 1], ck[b], ck[b + 1]
        lq, lk = q1 - q0, k1 - k0
        if lq <= 0 or lk <= 0:
            continue
        i = torch.arange(lq, device=q.device)[:, None]
        j = torch.arange(lk, device=q.device)[None, :]
        live = j <= (lk - lq) + i                                   # [lq, lk]
        seen = live.any(dim=1)                                      # rows with at least one key
        kpe = k_pe[k0:k1].double()
        step = max(1, HEAD_CHUNK_ELEMS // (lq * lk))               # heads per chunk: bounded FP64 scores
        for h0 in range(0, H, step):
            hs = slice(h0, min(H, h0 + step))
            qq = q[q0:q1, hs].double()
            s = (torch.einsum("ihd,jhd->hij", qq[..., :NOPE], k_nope[k0:k1, hs].double())
                 + torch.einsum("ihd,jd->hij", qq[..., NOPE:], kpe)) * SOFTMAX_SCALE
            s = s.masked_fill(~live, float("-inf"))
            p = torch.softmax(s, dim=-1).nan_to_num(0.0) * seen[None, :, None]
            out[q0:q1, hs] = torch.einsum("hij,jhd->ihd", p, v[k0:k1, hs].double())
    return out.float()


def naive(q, k_nope, k_pe, v, cu_seqlens_q, cu_seqlens_k) -> torch.Tensor:
    """The same by explicit loops over rows (tests: the vectorized reference against the formula)."""
    import math
    cq, ck = list(cu_seqlens_q), list(cu_seqlens_k)
    N, H = q.shape[0], q.shape[1]
    out = torch.zeros(N, H, V_HEAD, dtype=torch.float64)
    for b in range(len(cq) - 1):
        lq, lk = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
        for i in range(lq):
            for h in range(H):
                qi = q[cq[b] + i, h].double()
                keys = range(0, min(lk, lk - lq + i + 1))
                sc = [float((qi[:NOPE] @ k_nope[ck[b] + j, h].double() + qi[NOPE:] @ k_pe[ck[b] + j].double())
                            * SOFTMAX_SCALE) for j in keys]
                if not sc:
                    continue
                mx = max(sc)
                e = [math.exp(x - mx) for x in sc]
                tot = sum(e)
                for w, j in zip(e, keys):
                    out[cq[b] + i, h] += (w / tot) * v[ck[b] + j, h].double()
    return out.float()
