"""K3's model-level math in FP32, written from the formulas (SPEC.md section 1), shared by the
serving model (model/layers.py, model/model.py) and the FP32 reference (model/reference.py):
the activations (SiTU, SiLU), the router, and Attention Residuals.

Sources for the facts (read, never copied): SGLang `models/kimi_k3.py` (`KimiK3DecoderLayer`,
`_forward_unfused`), vLLM `models/kimi_k3/nvidia/model.py`; /work notes in SPEC.md section 1.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


def rms_norm_fp32(x: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) (* w), all FP32."""
    x = x.float()
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if w is None else y * w.float()


def situ(gate: torch.Tensor, up: torch.Tensor, beta: float = 4.0, linear_beta: float = 25.0) -> torch.Tensor:
    """SiTU: beta tanh(gate / beta) sigmoid(gate) * linear_beta tanh(up / linear_beta), FP32
    (the published `hidden_act: situ`, beta 4, linear_beta 25)."""
    g, u = gate.float(), up.float()
    return beta * torch.tanh(g / beta) * torch.sigmoid(g) * (linear_beta * torch.tanh(u / linear_beta))


def silu_glu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    g = gate.float()
    return g * torch.sigmoid(g) * up.float()


def act_fn(cfg):
    """The gated activation of `cfg` as f(gate, up)."""
    if cfg.act == "situ":
        return lambda g, u: situ(g, u, cfg.situ_beta, cfg.situ_linear_beta)
    return silu_glu


def route(logits: torch.Tensor, bias: torch.Tensor, cfg) -> tuple[torch.Tensor, torch.Tensor]:
    """The noaux_tc sigmoid router: scores = sigmoid(logits); experts ranked by scores + bias
    within the best `topk_group` of `n_group` groups (a group's rank: the sum of its two best
    biased scores); weights = the chosen experts' unbiased scores, renormalized if configured,
    times routed_scale. Returns (ids [M, k] int64 in pick order, weights [M, k] FP32).

    The arithmetic is the moe_route op's contract (k3gen/ops/moe_route/reference.py), on any
    device and without a host sync: the sigmoid as 1 / (1 + FP32(exp(-x))) with the exp in FP64
    (two FP32 exp libraries differ in the last bit), ties to the lower expert (and group) index by
    a stable sort (torch.topk leaves them unspecified), the renormalizing sum in slot order."""
    scores = sigmoid_scores(logits)
    choice = scores + bias.float()
    M, E = choice.shape
    if cfg.n_group > 1:
        G = E // cfg.n_group
        top = torch.sort(choice.view(M, cfg.n_group, G), dim=-1, descending=True, stable=True).values
        gscore = top[..., 0] + top[..., 1] if G >= 2 else top[..., 0]
        kept = _ranked(gscore)[:, :cfg.topk_group]
        keep = torch.zeros_like(gscore, dtype=torch.bool).scatter(1, kept, True)
        choice = choice.masked_fill(~keep.repeat_interleave(G, dim=1), float("-inf"))
    ids = _ranked(choice)[:, :cfg.top_k]
    return ids, route_weights(scores, ids, cfg)


def route_weights(scores: torch.Tensor, ids: torch.Tensor, cfg) -> torch.Tensor:
    """The routing weights of experts `ids` [M, k] (pick order): their unbiased scores,
    renormalized by the slot-order sum if configured, times routed_scale."""
    w = scores.gather(1, ids)
    if cfg.renormalize:
        total = w[:, 0]
        for j in range(1, w.shape[1]):
            total = total + w[:, j]
        w = w / (total + 1e-20)[:, None]
    # A Python scalar, not a new tensor: building one copies host to device, which CUDA graph
    # capture forbids. The scalar is rounded to FP32 as the op's math type, so the product is the same.
    return w * float(cfg.routed_scale)


def sigmoid_scores(logits: torch.Tensor) -> torch.Tensor:
    e = torch.exp(-logits.double()).float()
    d = 1 + e
    return torch.div(torch.ones_like(d), d)     # tensor / tensor: IEEE division, no reciprocal


def _ranked(values: torch.Tensor) -> torch.Tensor:
    """Indices of `values` (last dim) from the largest down, equal values in index order."""
    return torch.sort(-values, dim=-1, stable=True).indices


@dataclass
class AttnResWeights:
    """One pseudo-query: `proj` [hidden] (the checkpoint's `*_res_proj.weight` [1, hidden]) and
    its RMSNorm weight `norm` [hidden] (`*_res_norm.weight`), both FP32."""
    proj: torch.Tensor
    norm: torch.Tensor
    q: torch.Tensor = field(init=False, repr=False)    # query(), made once (rebuilt with the tensors)

    def __post_init__(self):
        # score_i = proj . (norm * RMSNorm(V_i)) = (norm * proj) . RMSNorm(V_i)
        self.q = (self.norm.float() * self.proj.float().reshape(-1)).contiguous()

    def query(self) -> torch.Tensor:
        return self.q


def attn_res_mix(sources: list[torch.Tensor], w: AttnResWeights, eps: float) -> torch.Tensor:
    """sum_i softmax_i(q . RMSNorm(V_i)) V_i over the sources (each [M, hidden] FP32)."""
    V = torch.stack([s.float() for s in sources])                       # [N, M, hidden]
    score = (rms_norm_fp32(V, None, eps) * w.query()).sum(-1)
    return (torch.softmax(score, dim=0)[..., None] * V).sum(0)


class AttnResStream:
    """The Attention Residuals stream of one forward over rows [M, hidden] (FP32): the completed
    block sums and the running partial sum of the current block.

    Blocks of `block` layers; source 0 is the embedding. For 0-based layer l: the attention input
    mixes the completed blocks and the partial; if l starts a block (l % block == 0), the partial
    is sealed as a completed block right after that mix and a new partial starts with the
    attention output; the FFN input mixes the completed blocks and the (new) partial. The final
    output query mixes everything once more. So at layer 0 the attention reads the embedding
    alone, and at a block-start layer l > 0 it reads ceil(l / block) completed blocks + the
    block just finished (SGLang kimi_k3: prev_valid_blocks = ceil(l / 12), the FFN side one more
    when l is a block-write layer).

    A plain residual stream (block None) is the same object with `mix` returning the sum.
    """

    def __init__(self, embed: torch.Tensor, block: int | None, eps: float):
        self.block, self.eps = block, eps
        self.blocks: list[torch.Tensor] = []
        self.partial = embed.float()

    def inputs(self, w: AttnResWeights | None) -> torch.Tensor:
        if self.block is None:
            return self.partial
        return attn_res_mix(self.blocks + [self.partial], w, self.eps)

    def add_attn(self, layer: int, out: torch.Tensor) -> None:
        if self.block is not None and layer % self.block == 0:
            self.blocks.append(self.partial)
            self.partial = out.float()
        else:
            self.partial = self.partial + out.float()

    def add_ffn(self, out: torch.Tensor) -> None:
        self.partial = self.partial + out.float()

    def output(self, w: AttnResWeights | None) -> torch.Tensor:
        return self.inputs(w)
