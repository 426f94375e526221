"""Model configs and the serving target (`TargetConfig`, validated by k3gen's `check_serving`).

A `ModelConfig` is what a HF `config.json` says (model/hf_config.py reads one; the presets of
model/presets.py are config dicts in that same format). Architecture variants are fields, never
family-name checks in the layers: Attention Residuals (`attn_res_block`), the latent MoE
(`moe_latent`, `latent_norm`), the activation (`act`: SiTU or SiLU), the KDA gate kind and output
gate (`kda_gate`, `kda_out_gate`), the MLA output gate (`mla_out_gate`), the router (`n_group`,
`topk_group`, `renormalize`, `routed_scale`).
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields

from k3gen.errors import SpecError
from k3gen.ir.dtypes import GateKind, KvDtype, ScaleRecipe, SsmDtype
from k3gen.ir.layouts import KDA_DK, MLA_LATENT, MLA_ROPE, KvLayout, StatePoolLayout
from k3gen.ir.target import Target
from k3gen.targets import ModelShape, ServingOptions, check_serving, ffn_shape, get_target, serving_kv_layout


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    name: str
    family: str                          # "kimi_k3" or "kimi_linear" (reported, never branched on)
    layers: int
    layer_kinds: tuple[str, ...]         # per 0-based layer: "kda" or "mla"
    mlp_kinds: tuple[str, ...]           # per 0-based layer: "dense" or "moe"
    hidden: int
    vocab: int
    eps: float = 1e-5
    tie_embeddings: bool = False
    # KDA
    kda_heads: int                       # full model (TP1)
    kda_head_dim: int = KDA_DK
    conv_size: int = 4
    kda_gate: GateKind = GateKind.BOUNDED
    gate_lower_bound: float | None = -5.0
    kda_out_gate: str = "full"           # "full": g_proj D x hidden; "low_rank": g_b(g_a(x)) through head_dim
    a_log_pad: int | None = None         # A_log stored padded to this many entries (None: [1, 1, H, 1])
    # MLA
    mla_heads: int
    q_lora: int | None = 1536         # None: a plain q_proj (Kimi-Linear-48B)
    kv_lora: int = MLA_LATENT
    qk_nope: int = 128
    qk_rope: int = MLA_ROPE
    v_head: int = 128
    mla_out_gate: bool = True            # sigmoid output gate g (H*128 x hidden) before o_proj
    # FFN
    experts: int
    top_k: int
    shared_experts: int
    moe_inter: int                       # one routed expert's intermediate size
    dense_inter: int                     # the dense MLP's intermediate size
    n_group: int = 1
    topk_group: int = 1
    renormalize: bool = True
    routed_scale: float = 1.0
    moe_latent: int | None = None        # routed experts' width (None: they run on the hidden width)
    latent_norm: bool = False            # routed_expert_norm RMSNorm(moe_latent) after the experts
    act: str = "situ"
    situ_beta: float = 4.0
    situ_linear_beta: float = 25.0
    # residual stream
    attn_res_block: int | None = None    # Attention Residuals block size (None: the plain residual sum)

    def __post_init__(self):
        L = self.layers
        for f, ok in (("layer_kinds", ("kda", "mla")), ("mlp_kinds", ("dense", "moe"))):
            v = tuple(getattr(self, f))
            object.__setattr__(self, f, v)
            if len(v) != L or any(x not in ok for x in v):
                raise SpecError(f, v, f"{L} entries of {ok}")
        object.__setattr__(self, "kda_gate", GateKind(self.kda_gate))
        if self.kv_lora != MLA_LATENT or self.qk_rope != MLA_ROPE:
            raise SpecError("kv_lora/qk_rope", (self.kv_lora, self.qk_rope), [(MLA_LATENT, MLA_ROPE)],
                            "the KV cache formats are written for 512 + 64")
        if self.qk_nope != 128 or self.v_head != 128 or self.kda_head_dim != KDA_DK or self.conv_size != 4:
            raise SpecError("qk_nope/v_head/kda head_dim/conv", (self.qk_nope, self.v_head, self.kda_head_dim,
                                                                  self.conv_size), [(128, 128, KDA_DK, 4)])
        if not 1 <= self.top_k <= self.experts:
            raise SpecError("top_k", self.top_k, f"1..{self.experts}")
        if self.experts % self.n_group or not 1 <= self.topk_group <= self.n_group:
            raise SpecError("n_group/topk_group", (self.n_group, self.topk_group),
                            f"n_group divides experts={self.experts}, 1 <= topk_group <= n_group")
        if self.top_k > self.topk_group * (self.experts // self.n_group):
            raise SpecError("top_k", self.top_k, f"<= topk_group * experts/n_group")
        if self.a_log_pad is not None and self.kda_heads > self.a_log_pad:
            raise SpecError("kda_heads", self.kda_heads, f"<= a_log_pad ({self.a_log_pad})")
        if self.act not in ("situ", "silu"):
            raise SpecError("act", self.act, ["situ", "silu"])
        if self.kda_out_gate not in ("full", "low_rank"):
            raise SpecError("kda_out_gate", self.kda_out_gate, ["full", "low_rank"])
        if (self.kda_gate is GateKind.BOUNDED) != (self.gate_lower_bound is not None):
            raise SpecError("gate_lower_bound", self.gate_lower_bound, "a bound with the bounded gate, None with softplus")
        if self.gate_lower_bound not in (None, -5.0):
            raise SpecError("gate_lower_bound", self.gate_lower_bound, [-5.0], "the KDA kernels' bounded gate")
        if self.attn_res_block is not None and self.attn_res_block < 1:
            raise SpecError("attn_res_block", self.attn_res_block, ">= 1")
        if self.latent_norm and self.moe_latent is None:
            raise SpecError("latent_norm", True, [False], "no latent to normalize")
        for f in ("hidden", "moe_latent", "moe_inter", "dense_inter"):
            v = getattr(self, f)
            if v is not None and v % 128:
                raise SpecError(f, v, "multiples of 128", "FP8/NVFP4 block scales")

    def kind(self, layer: int) -> str:
        """"mla" or "kda" for a 0-based layer index."""
        return self.layer_kinds[layer]

    def is_dense(self, layer: int) -> bool:
        return self.mlp_kinds[layer] == "dense"

    @property
    def mla_layers(self) -> tuple[int, ...]:
        """1-based MLA layer numbers (as `linear_attn_config.full_attn_layers` lists them)."""
        return tuple(i + 1 for i, k in enumerate(self.layer_kinds) if k == "mla")

    @property
    def shared_inter(self) -> int:
        """The shared experts run as one MLP of this width (transformers' KimiLinearMoE:
        moe_intermediate_size x n_shared_experts)."""
        return self.moe_inter * self.shared_experts

    @property
    def expert_width(self) -> int:
        """What a routed expert reads and writes: the latent, or the hidden width."""
        return self.moe_latent or self.hidden

    @property
    def kda_layer_ids(self) -> list[int]:
        return [i for i in range(self.layers) if self.kind(i) == "kda"]

    @property
    def mla_layer_ids(self) -> list[int]:
        return [i for i in range(self.layers) if self.kind(i) == "mla"]

    def for_tp(self, tp: int) -> "RankShape":
        hk, hm = self.kernel_shape().heads_at(tp)
        return RankShape(kda_heads=hk, mla_heads=hm)

    def kernel_shape(self) -> ModelShape:
        """What k3gen's enumerator (targets.model_specs) reads of this model."""
        return ModelShape(name=self.name, hidden=self.hidden, kda_heads=self.kda_heads, mla_heads=self.mla_heads,
                          q_lora=self.q_lora, kda=bool(self.kda_layer_ids), mla=bool(self.mla_layer_ids),
                          gate=self.kda_gate, ffn=ffn_shape({f.name: getattr(self, f.name) for f in fields(self)}))


@dataclass(frozen=True)
class RankShape:
    kda_heads: int
    mla_heads: int


def get_config(name: str) -> ModelConfig:
    """A preset by name (k3gen/presets.py), or a config.json path / checkpoint folder."""
    from k3gen.presets import PRESETS, preset_fields
    if name in PRESETS:
        return ModelConfig(**preset_fields(name))
    import os
    if os.sep in name or name.endswith(".json") or os.path.isdir(name):
        return config_from_json(name)
    raise SpecError("config", name, sorted(PRESETS) + ["a config.json path or checkpoint folder"])


def config_from_json(path) -> ModelConfig:
    """The `ModelConfig` of a config.json file or a checkpoint folder holding one."""
    from k3gen.hf_config import config_fields, read_config
    return ModelConfig(**config_fields(*read_config(path)))


def config_from_dict(d: dict, name: str | None = None) -> ModelConfig:
    from k3gen.hf_config import config_fields
    return ModelConfig(**config_fields(d, name))


def k3_config() -> ModelConfig:
    return get_config("k3")


def small_config() -> ModelConfig:
    return get_config("small")


def tiny_config() -> ModelConfig:
    return get_config("tiny")


PATHS = ("reference", "kernel")


@dataclass(frozen=True, kw_only=True)
class TargetConfig:
    """What one deployment runs: target arch, cache dtypes, scale recipe, drafts, graph sizes.

    Invalid combinations raise k3gen's typed errors (TargetError/SpecError) here, at construction.
    """
    arch: str = "sm90"
    kv: KvDtype = KvDtype.BF16
    ssm: SsmDtype = SsmDtype.FP32
    recipe: ScaleRecipe | None = None         # FP8 projection scales; None: the target's recipe
    max_drafts: int = 0
    graph_batch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    path: str = "reference"
    tp: int = 1
    ep: int = 1                               # expert-parallel ranks among the tp (model/dist.py Layout.ep)
    # Batch-invariant, lossless serving (issue 27): mla_decode's split count fixed per step length
    # (planned at the largest graph batch size, so a sequence's partials and their combine are the
    # same whatever batch it shares) and verify attention through the T = 1 kernel, each query
    # token a virtual sequence (what T = 1 decoding reads; NVFP4 KV always does so) for every KV
    # dtype. Off by default: it costs small batches their extra KV splits and BF16/FP8 verify the
    # multi-token kernel: 2-5% of a small-preset step (tools/invariant_price.py), but 1.7-3.2x the
    # attention of one long request (the batch-8 split count at batch 1; H100 figures in the README).
    invariant: bool = False
    target: Target = field(init=False)

    def __post_init__(self):
        object.__setattr__(self, "target", get_target(self.arch))
        kv, ssm = KvDtype(self.kv), SsmDtype(self.ssm)
        object.__setattr__(self, "kv", kv)
        object.__setattr__(self, "ssm", ssm)
        # The target's recipes decide which FP8 projection scales are allowed (check_serving).
        served = check_serving(self.target, ServingOptions(kv=kv, ssm=ssm, max_drafts=self.max_drafts,
                                                           recipe=self.recipe))
        recipe = served.recipe
        object.__setattr__(self, "recipe", recipe)
        if self.path not in PATHS:
            raise SpecError("path", self.path, PATHS)
        sizes = tuple(self.graph_batch_sizes)
        if not sizes or any(not isinstance(b, int) or b < 1 for b in sizes) or list(sizes) != sorted(set(sizes)):
            raise SpecError("graph_batch_sizes", sizes, "strictly increasing positive ints")
        object.__setattr__(self, "graph_batch_sizes", sizes)
        if self.tp < 1:
            raise SpecError("tp", self.tp, ">= 1")
        if isinstance(self.ep, bool) or not isinstance(self.ep, int) or self.ep < 1 or self.tp % self.ep:
            raise SpecError("ep", self.ep, f"a divisor of tp {self.tp}")

    def serving(self) -> ServingOptions:
        return ServingOptions(kv=self.kv, ssm=self.ssm, max_drafts=self.max_drafts, recipe=self.recipe)

    def kv_layout(self) -> KvLayout:
        return serving_kv_layout(self.target, self.serving())

    def state_layout(self, heads: int) -> StatePoolLayout:
        return StatePoolLayout(heads=heads, ssm=self.ssm, max_drafts=self.max_drafts)

    def graph_size_for(self, batch: int) -> int:
        """The smallest captured batch size >= batch (rows beyond `batch` are padding)."""
        for b in self.graph_batch_sizes:
            if b >= batch:
                return b
        raise SpecError("batch", batch, f"<= {self.graph_batch_sizes[-1]}", "largest captured decode graph")


__all__ = ["ModelConfig", "TargetConfig", "k3_config", "small_config", "tiny_config", "get_config", "KDA_DK"]
