"""What is trained and how: the model config (a kimi_k3 config.json dict), the tasks and the
optimization settings, as named presets.

`acc` is the model the accuracy table is measured on: the `tiny` preset's K3 structure and shapes
(k3gen/presets.py: 4 layers, KDA at 1 and 3 and MLA at 2 and 4 (1-based) as the config lists them,
AttnRes blocks of 2 layers, a dense first layer, then the latent MoE with 8 routed experts top-2 by the
noaux_tc sigmoid router, one shared expert, SiTU, gated MLA without RoPE, 2 KDA and 2 MLA heads,
hidden 256) with a vocabulary of 128 (two-symbol keys from 64 symbols, 32 one-symbol values; `acc-k1`: 2912, one-symbol keys); the vocabulary is no kernel's shape (the
embedding and LM head run in PyTorch), so the kernels it needs are tiny's (`k3gen build --model tiny`).
`toy` is the CPU demonstration: two layers (KDA then MLA), hidden 128, one head each, 2-digit sums and
retrieval over 32-192 tokens.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from k3gen.errors import SpecError
from k3gen.presets import preset_dict

from model.train.tasks import TaskSpec

ACC_VOCAB = 128       # 64 key symbols (4096 two-symbol keys: an 8K-token context holds 2047 pairs) + 32 values
ACC_K1_VOCAB = 2912   # 2848 one-symbol keys (an 8K-token context holds 2729 pairs) + 32 values


def acc_config(vocab: int = ACC_VOCAB) -> dict:
    d = preset_dict("tiny")
    d["text_config"].update(_name_or_path="k3-acc", vocab_size=vocab)
    return d


def toy_config() -> dict:
    d = preset_dict("tiny")
    t = d["text_config"]
    t.update(num_hidden_layers=2, hidden_size=128, vocab_size=128, num_attention_heads=1, num_experts=4,
             intermediate_size=256, attn_res_block_size=1, _name_or_path="k3-toy")
    t["linear_attn_config"].update(num_heads=1, kda_layers=[1], full_attn_layers=[2])
    return d


@dataclass(frozen=True)
class TrainConfig:
    name: str
    model: dict = field(repr=False)
    task: TaskSpec = TaskSpec()
    seed: int = 0
    # optimizer: AdamW, linear warm-up then cosine to min_lr_frac * lr
    lr: float = 2e-3
    min_lr_frac: float = 0.05
    warmup: int = 200
    weight_decay: float = 0.01
    clip: float = 1.0
    betas: tuple[float, float] = (0.9, 0.95)
    # arithmetic: sequences of BOS + `arith_per_seq` packed problems
    arith_seqs: int = 128
    arith_per_seq: int = 16
    # retrieval: `ret_tokens` per step in sequences of one length, `ret_queries` questions each; the
    # length is drawn log-uniformly in [len_min, cap], cap growing from len_start to len_max over the
    # first `len_ramp` of training
    ret_tokens: int = 65536
    ret_queries: int = 32
    # > 0: a sequence of L tokens asks min(ret_queries, L // ret_query_every) keys (at least one), so
    # short sequences hold only a few pairs: the first lookups are among few candidates
    ret_query_every: int = 0
    len_min: int = 64
    len_start: int = 256
    len_max: int = 8448        # the 8K-token eval contexts (plus their query) inside the trained range
    len_ramp: float = 0.4
    # the last `qat_frac` of training reads the weights as the checkpoint stores them (net.py)
    qat_frac: float = 0.15
    # the LM head starts as the embedding / sqrt(hidden) (K3 does not tie them; only their start is shared)
    tied_init: bool = False
    balance_rate: float = 1e-3
    chunk: int = 64
    sub: int = 16
    # logging / held-out probes / state saves (seconds of training)
    log_every: int = 20
    probe_every_s: float = 120.0
    probe_questions: int = 64
    save_every_s: float = 180.0

    def __post_init__(self):
        if self.len_min > self.len_start or self.len_start > self.len_max:
            raise SpecError("len_min/len_start/len_max", (self.len_min, self.len_start, self.len_max), "increasing")
        if not 0.0 <= self.qat_frac < 1.0:
            raise SpecError("qat_frac", self.qat_frac, "[0, 1)")
        if self.ret_tokens and self.ret_tokens < self.len_max:
            raise SpecError("ret_tokens", self.ret_tokens, f">= len_max ({self.len_max})", "one sequence per step")


ACC_TASK = TaskSpec(vocab=ACC_VOCAB, digits=4, key_len=2, val_len=1, val_symbols=32)
ACC_K1_TASK = TaskSpec(vocab=ACC_K1_VOCAB, digits=4, key_len=1, val_len=1, val_symbols=32)
# What makes retrieval learnable in minutes (docs/ACCURACY.md): values from 32 symbols (well under the
# hidden size, so one map copies them all), the LM head starting as the embedding, and short sequences
# asking few keys among few pairs
_ACC = dict(tied_init=True, ret_query_every=32, len_min=16, len_start=128, len_ramp=0.5)
TOY_TASK = TaskSpec(vocab=128, digits=2, ops=("+",), key_len=1, val_len=1, val_symbols=32)
PRESETS: dict[str, TrainConfig] = {
    "acc": TrainConfig(name="acc", model=acc_config(), task=ACC_TASK, **_ACC),
    "acc-k1": TrainConfig(name="acc-k1", model=acc_config(ACC_K1_VOCAB), task=ACC_K1_TASK, **_ACC),
    "toy": TrainConfig(name="toy", model=toy_config(), task=TOY_TASK, lr=3e-3, warmup=30, arith_seqs=16,
                       arith_per_seq=8, ret_tokens=1024, ret_queries=8, len_min=32, len_start=48, len_max=192,
                       len_ramp=0.5, qat_frac=0.1, chunk=16, sub=16, log_every=25, probe_every_s=1e9,
                       probe_questions=0, save_every_s=1e9),
}


def get_train_config(name: str, **overrides) -> TrainConfig:
    if name not in PRESETS:
        raise SpecError("train config", name, sorted(PRESETS))
    return dataclasses.replace(PRESETS[name], **overrides) if overrides else PRESETS[name]


__all__ = ["TrainConfig", "PRESETS", "get_train_config", "acc_config", "toy_config"]
