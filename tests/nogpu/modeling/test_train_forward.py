"""The training forward (model/train/net.py) computes what is served: its logits equal
model/reference.py's `Fp32Reference.prefill` on the same canonical tensors (the guarantee that the
trained function is the checkpoint's), the chunked KDA (model/train/kda_chunk.py) equals the token
recurrence in values and gradients, and gradients reach every trained tensor.

Bounds: the two forwards differ only in the order of FP32 operations (chunked vs token-sequential
KDA, one attention vs per-token rows, dense vs gathered experts); through 4 layers the logits agree to
a few 1e-6 relative (measured 2.6e-6). A real difference (a dropped AttnRes, a wrong gate, a wrong
head split) moves them by O(1): the negative controls below show the bound catches those."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from numerics import rel_rms

from k3gen.errors import SpecError
from model.config import tiny_config
from model.reference import Fp32Reference
from model.train.kda_chunk import kda_chunked, kda_loop
from model.train.net import K3Train, _key

CFG = tiny_config()
FWD_TOL = 2e-5


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _kda_inputs(B=2, T=45, H=2, K=128, dtype=torch.float64, gate="random", seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=g, dtype=dtype)
    k = torch.randn(B, T, H, K, generator=g, dtype=dtype)
    q = q / q.norm(dim=-1, keepdim=True) * K ** -0.5
    k = k / k.norm(dim=-1, keepdim=True)
    v = torch.randn(B, T, H, K, generator=g, dtype=dtype)
    if gate == "random":
        gg = -5 * torch.rand(B, T, H, K, generator=g, dtype=dtype) ** 3
    else:
        gg = torch.full((B, T, H, K), float(gate), dtype=dtype)
    beta = torch.rand(B, T, H, generator=g, dtype=dtype)
    return q, k, v, gg, beta


@pytest.mark.parametrize("chunk,sub", [(64, 16), (16, 4), (32, 16), (8, 8)])
@pytest.mark.parametrize("gate", ["random", -5.0, 0.0])
def test_chunked_kda_equals_the_token_loop(chunk, sub, gate):
    x = _kda_inputs(gate=gate)
    want = kda_loop(*x)
    assert rel_rms(kda_chunked(*x, chunk=chunk, sub=sub), want) < 1e-12            # FP64: the same math
    got = kda_chunked(*(t.float() for t in x), chunk=chunk, sub=sub)                 # FP32: finite, FP32 noise
    assert torch.isfinite(got).all() and rel_rms(got, want) < 5e-6


def test_chunked_kda_gradients_equal_the_loops():
    x = _kda_inputs(T=37)
    a = [t.clone().requires_grad_() for t in x]
    b = [t.clone().requires_grad_() for t in x]
    w = torch.randn(x[2].shape, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    (kda_loop(*a) * w).sum().backward()
    (kda_chunked(*b, chunk=16, sub=8) * w).sum().backward()
    for ta, tb in zip(a, b):
        assert rel_rms(tb.grad, ta.grad) < 1e-10
    c = [t.float().requires_grad_() for t in _kda_inputs(gate=-5.0)]
    kda_chunked(*c).square().sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in c)                             # the steepest gate


def test_chunked_kda_rejects_unrepresentable_blocks():
    x = _kda_inputs(T=8, dtype=torch.float32)
    for chunk, sub in ((64, 32), (48, 32), (30, 16), (0, 1)):
        with pytest.raises(SpecError, match="sub"):
            kda_chunked(*x, chunk=chunk, sub=sub)


def _net(seed=1, chunk=16, sub=4, cfg=CFG) -> K3Train:
    """A random K3Train with every tensor off its neutral initial value (AttnRes queries, correction
    biases), so that each piece of the forward shows in the logits."""
    net = K3Train(cfg, seed=seed, chunk=chunk, sub=sub)
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for n, p in net.p.items():
            if n.endswith("res_proj/weight"):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            elif n.endswith("e_score_correction_bias"):
                p.copy_(0.05 * torch.randn(p.shape, generator=g))
            elif n.endswith("A_log"):
                p.copy_(torch.rand(p.shape, generator=g))
    return net


@pytest.fixture(scope="module")
def case():
    net = _net()
    toks = torch.randint(0, CFG.vocab, (2, 37), generator=torch.Generator().manual_seed(3))
    ref = Fp32Reference(CFG, net.tensors())
    want = torch.stack([ref.prefill(t) for t in toks])
    return net, toks, want


def test_training_forward_equals_the_reference_prefill(case):
    net, toks, want = case
    with torch.no_grad():
        got = net(toks)
    assert got.shape == want.shape == (2, 37, CFG.vocab)
    for b in range(2):
        assert rel_rms(got[b], want[b]) < FWD_TOL, b
    # chunk and sub-block sizes change only the FP32 order
    with torch.no_grad():
        other = K3Train(CFG, tensors=net.tensors(), chunk=64, sub=16)(toks)
    assert rel_rms(other, want) < FWD_TOL


@pytest.mark.parametrize("mutation", ["no_attn_res", "attn_res_block", "softplus_gate", "tied_head"])
def test_a_changed_forward_fails_the_bound(case, mutation):
    """Negative controls: each of these real changes of the function is far outside FWD_TOL."""
    net, toks, want = case
    t = net.tensors()
    if mutation == "no_attn_res":
        m = K3Train(CFG, tensors=t, chunk=16, sub=4)
        m.use_attn_res = False
    elif mutation == "attn_res_block":
        m = K3Train(dataclasses.replace(CFG, attn_res_block=1), tensors=t, chunk=16, sub=4)
    elif mutation == "softplus_gate":
        m = K3Train(dataclasses.replace(CFG, kda_gate="softplus", gate_lower_bound=None), tensors=t, chunk=16, sub=4)
    else:
        m = K3Train(dataclasses.replace(CFG, tie_embeddings=True), tensors={**t}, chunk=16, sub=4)
    with torch.no_grad():
        got = m(toks)
    assert rel_rms(got, want) > 100 * FWD_TOL


def test_gradients_reach_every_trained_tensor():
    cfg = CFG
    net = _net(seed=4)
    toks = torch.randint(0, cfg.vocab, (2, 20), generator=torch.Generator().manual_seed(9))
    net(toks).logsumexp(-1).mean().backward()
    single = ("model/layers/0/self_attention_res_proj/weight", "model/layers/0/self_attention_res_norm/weight")
    for n, p in net.p.items():
        if n.endswith("e_score_correction_bias"):
            assert not p.requires_grad and p.grad is None, n      # moved by balance(), not by gradients
            continue
        if n in single:   # layer 0's attention mixes the embedding alone: softmax over one source is 1
            assert p.grad is not None and (p.grad == 0).all(), n
            continue
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, n
    A = net.p[_key("model.layers.0.self_attn.A_log")].grad
    assert (A[cfg.kda_heads:] == 0).all()                         # the padding past the real heads is never read


def test_balance_moves_biases_toward_idle_experts():
    net = _net(seed=2)
    toks = torch.randint(0, CFG.vocab, (2, 30), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        net(toks)
    loads = [l.clone() for l in net.loads]
    assert len(loads) == sum(not CFG.is_dense(i) for i in range(CFG.layers))
    assert all(int(l.sum()) == 2 * 30 * CFG.top_k for l in loads)
    before = {i: net.p[_key(f"model.layers.{i}.block_sparse_moe.gate.e_score_correction_bias")].clone()
              for i in range(1, CFG.layers)}
    net.balance(0.01)
    for (i, b0), load in zip(before.items(), loads):
        moved = net.p[_key(f"model.layers.{i}.block_sparse_moe.gate.e_score_correction_bias")] - b0
        over = load.float() > load.float().mean()
        assert (moved[over] < 0).all() and (moved[load.float() < load.float().mean()] > 0).all()
