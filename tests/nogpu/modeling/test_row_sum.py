"""k3gen.numerics.row_sum and the RMSNorm built on it (mla_q_absorb's reference rms_norm_bf16, which
model/layers.py rms_norm is): the torch-side norms of the kernel path sum each row in one
fixed order (a halving tree), so a row's bits do not depend on its batch (issue 27: torch's CUDA
reductions choose their lanes per row from the row count). On the CPU the order itself is checked
against the tree computed independently in NumPy FP32; a reduction in torch's order (the mutation
`x.square().mean(-1)`) fails it."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from k3gen.numerics import row_sum
from model.layers import rms_norm


def tree_sum_np(row: np.ndarray) -> np.float32:
    v = list(row.astype(np.float32))
    while len(v) & (len(v) - 1):
        v.append(np.float32(0))
    while len(v) > 1:
        h = len(v) // 2
        v = [np.float32(a + b) for a, b in zip(v[:h], v[h:])]
    return v[0]


@pytest.mark.parametrize("n", [1, 5, 512, 1000])
def test_row_sum_is_the_halving_tree(n):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(4, n, generator=g) * torch.logspace(-3, 3, n)
    got = row_sum(x)
    assert got.shape == (4, 1) and got.dtype == torch.float32
    for r in range(4):
        assert got[r, 0].item() == float(tree_sum_np(x[r].numpy())), r


def test_row_sum_of_squares_is_the_tree_order():
    # FP32 sums in torch's own order differ from the tree in about a third of such rows.
    g = torch.Generator().manual_seed(5)
    x = torch.randn(64, 7168, generator=g) * torch.logspace(-3, 3, 7168)
    ss = row_sum(x * x)[:, 0]
    assert torch.equal(ss, torch.tensor([tree_sum_np((x[r] * x[r]).numpy()) for r in range(64)]))


def test_rms_norm_rows_do_not_depend_on_the_batch_and_use_the_tree():
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(64, 7168, generator=g) * torch.logspace(-2, 2, 7168)).to(torch.bfloat16)
    w = torch.rand(7168, generator=g) + 0.5
    full = rms_norm(x, w, 1e-6)
    for b in (1, 3, 5, 12):
        assert torch.equal(rms_norm(x[:b], w, 1e-6), full[:b])
    xf = x.float()
    ss = torch.tensor([tree_sum_np((xf[r] * xf[r]).numpy()) for r in range(64)])[:, None]
    want = ((xf * torch.rsqrt(ss / 7168 + 1e-6)) * w).to(torch.bfloat16)
    assert torch.equal(full, want)
