"""Model configs (the real Kimi K3 text backbone and small same-shaped ones) and the serving
target (`TargetConfig`), validated by k3gen's `check_serving` at construction.

Choices k3gen makes where SPEC.md leaves a detail open (each one is a field, so a real
checkpoint's facts replace them without code changes):
- MoE: latent experts. The router reads the hidden state; routed experts run in a `moe_latent`
  space entered through `latent_down` (hidden -> latent) and left through `latent_up`; shared
  experts run in the hidden space. The expert activation is the gated SiLU (`act = "swiglu"`):
  SPEC.md's "SiTU" is not confirmed publicly, so the activation is a named field.
- K3's routed-expert and shared-expert intermediate sizes are not in SPEC.md: 1024 (latent) and
  2048 are placeholders that put the NVFP4 checkpoint near 0.6 TB; plan-memory's weight estimate
  follows them.
- `routed_scale` multiplies the renormalized top-k weights (1.0 until the K3 value is known).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from k3gen.errors import SpecError
from k3gen.ir.dtypes import KvDtype, ScaleRecipe, SsmDtype
from k3gen.ir.layouts import KDA_DK, MLA_LATENT, MLA_ROPE, KvLayout, StatePoolLayout
from k3gen.ir.target import Target
from k3gen.targets import ModelShape, ServingOptions, check_serving, get_target, serving_kv_layout


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    name: str
    layers: int
    mla_layers: tuple[int, ...]          # 1-based layer numbers that are MLA; the others are KDA
    hidden: int
    vocab: int
    kda_heads: int                       # full model (TP1)
    mla_heads: int
    q_lora: int = 1536
    kv_lora: int = MLA_LATENT
    qk_nope: int = 128
    qk_rope: int = MLA_ROPE
    v_head: int = 128
    experts: int
    top_k: int
    shared_experts: int
    moe_latent: int
    expert_inter: int                    # intermediate size of one routed expert (in the latent)
    shared_inter: int                    # intermediate size of one shared expert (in the hidden space)
    dense_layers: tuple[int, ...] = (1,)  # 1-based layers with a dense MLP instead of the MoE
    dense_inter: int
    routed_scale: float = 1.0
    act: str = "swiglu"
    eps: float = 1e-5
    a_log_pad: int = 128                 # A_log is stored padded to this many entries
    tie_embeddings: bool = False

    def __post_init__(self):
        if self.kv_lora != MLA_LATENT or self.qk_rope != MLA_ROPE:
            raise SpecError("kv_lora/qk_rope", (self.kv_lora, self.qk_rope), [(MLA_LATENT, MLA_ROPE)],
                            "the KV cache formats are written for 512 + 64")
        if self.qk_nope != 128 or self.v_head != 128:
            raise SpecError("qk_nope/v_head", (self.qk_nope, self.v_head), [(128, 128)])
        bad = [n for n in self.mla_layers if not 1 <= n <= self.layers]
        if bad:
            raise SpecError("mla_layers", bad, f"1..{self.layers}")
        if not 1 <= self.top_k <= self.experts:
            raise SpecError("top_k", self.top_k, f"1..{self.experts}")
        if self.kda_heads > self.a_log_pad:
            raise SpecError("kda_heads", self.kda_heads, f"<= a_log_pad ({self.a_log_pad})")
        if self.act != "swiglu":
            raise SpecError("act", self.act, ["swiglu"])
        for f in ("hidden", "moe_latent", "expert_inter", "shared_inter", "dense_inter"):
            if getattr(self, f) % 128:
                raise SpecError(f, getattr(self, f), "multiples of 128", "FP8/NVFP4 block scales")

    def kind(self, layer: int) -> str:
        """"mla" or "kda" for a 0-based layer index."""
        return "mla" if layer + 1 in self.mla_layers else "kda"

    def is_dense(self, layer: int) -> bool:
        return layer + 1 in self.dense_layers

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
                          q_lora=self.q_lora, kda=bool(self.kda_layer_ids), mla=bool(self.mla_layer_ids))


@dataclass(frozen=True)
class RankShape:
    kda_heads: int
    mla_heads: int


def k3_config() -> ModelConfig:
    """Kimi K3 text backbone (SPEC.md section 1): 93 layers, MLA at 4, 8, ..., 92 and 93."""
    return ModelConfig(name="k3", layers=93, mla_layers=tuple(range(4, 93, 4)) + (93,), hidden=7168,
                       vocab=163840, kda_heads=96, mla_heads=96, experts=896, top_k=16, shared_experts=2,
                       moe_latent=3584, expert_inter=1024, shared_inter=2048, dense_inter=18432)


def small_config() -> ModelConfig:
    """Same structure at test size: 8 layers, KDA at 1-3 and 5-7, MLA at 4 and 8, H = 12."""
    return ModelConfig(name="small", layers=8, mla_layers=(4, 8), hidden=1024, vocab=2048, kda_heads=12,
                       mla_heads=12, experts=32, top_k=4, shared_experts=1, moe_latent=512,
                       expert_inter=256, shared_inter=512, dense_inter=2048)


def tiny_config() -> ModelConfig:
    """The small structure shrunk (4 layers, H = 2, hidden 256): what the CPU tests generate with."""
    return replace(small_config(), name="tiny", layers=4, mla_layers=(2, 4), hidden=256, vocab=512, kda_heads=2,
                   mla_heads=2, experts=8, top_k=2, moe_latent=128, expert_inter=128, shared_inter=128,
                   dense_inter=512)


CONFIGS = {"k3": k3_config, "small": small_config, "tiny": tiny_config}


def get_config(name: str) -> ModelConfig:
    if name not in CONFIGS:
        raise SpecError("config", name, sorted(CONFIGS))
    return CONFIGS[name]()


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
