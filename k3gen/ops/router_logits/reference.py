"""CPU reference of router_logits (the contract is the docstring of k3gen.ops.router_logits.spec): the
kernel's summation order replayed in FP32 with torch, so a GPU result is checked bit for bit. A BF16
x BF16 product is exact in FP32, so torch's multiply-then-add rounds once per step, as the kernel's FMA.
`fp64` gives the same logits from FP64 products rounded once (the model's reference path): the two
differ by FP32 rounding only."""
from __future__ import annotations

import torch

from k3gen.ops.router_logits.spec import CHUNK, LANES


def router_logits(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """FP32 [M, E] of x [M, H] BF16 and w [E, H] (BF16, or FP32 rounded to BF16 first as the kernel does)."""
    M, H = x.shape
    E = w.shape[0]
    P = H // (CHUNK * LANES)
    X = x.float().reshape(M, P, LANES, CHUNK)
    W = w.to(torch.bfloat16).float().reshape(E, P, LANES, CHUNK)
    acc = torch.zeros(M, E, LANES, dtype=torch.float32)
    for i in range(P):
        for j in range(CHUNK):
            acc = acc + X[:, None, i, :, j] * W[None, :, i, :, j]
    lanes = torch.arange(LANES)
    for d in (16, 8, 4, 2, 1):
        acc = acc + acc[..., lanes ^ d]
    return acc[..., 0].contiguous()


def fp64(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return (x.double() @ w.double().T).float()
