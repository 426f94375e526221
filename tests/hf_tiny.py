"""The tiny Kimi-Linear model the oracle tests build with transformers (KimiLinearForCausalLM, 5.23
here): its KimiLinearConfig arguments, with head dims the kernels take (KDA head_dim 128, MLA
kv_lora 512, rope 64, nope 128, v 128, 2 heads of each), the config.json dict k3gen/hf_config.py
reads (no transformers needed: tests/gpu/specs.py enumerates the kernels from it), the builder with
non-trivial random weights, and transformers' own prefill + cached decode logits.

Its variants are Kimi-Linear-48B's: softplus KDA gate, the low-rank KDA output gate (g_a/g_b), no
MLA output gate, SiLU, grouped noaux_tc routing; q_lora_rank 1536 or None (a plain q_proj).
"""
from __future__ import annotations

CASES = {"q_lora": 1536, "q_proj": None}
SEEDS = {"q_lora": 0, "q_proj": 10}
PROMPT, DECODE = 12, 4


def kwargs(q_lora, kda_heads: int = 2, mla_heads: int = 2, moe_inter: int = 128) -> dict:
    return dict(
        vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=moe_inter, num_hidden_layers=5,
        num_attention_heads=mla_heads, num_key_value_heads=mla_heads, q_lora_rank=q_lora, kv_lora_rank=512,
        num_experts=8, num_experts_per_token=2, num_shared_experts=1, num_expert_group=2, topk_group=1,
        routed_scaling_factor=1.5, first_k_dense_replace=1, pad_token_id=None, bos_token_id=None, eos_token_id=None,
        linear_attn_config={"kda_layers": [1, 2, 4, 5], "full_attn_layers": [3], "head_dim": 128,
                            "num_heads": kda_heads, "short_conv_kernel_size": 4})


def config_dict(q_lora) -> dict:
    """What save_pretrained writes into config.json, as far as k3gen/hf_config.py reads it
    (test_hf_oracle checks the two agree)."""
    d = {k: v for k, v in kwargs(q_lora).items() if not k.endswith("token_id")}
    return {"model_type": "kimi_linear", "hidden_act": "silu", "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
            "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "moe_renormalize": True,
            "_name_or_path": f"hf_tiny_{'q_lora' if q_lora else 'q_proj'}", **d}


def random_like(name: str, shape, g):
    """Non-trivial values of a trained model's kind for every tensor (norms not ones, gate
    parameters in their trained ranges, biases non-zero)."""
    import torch
    if name.endswith("A_log"):
        return torch.log(torch.rand(shape, generator=g) * 15 + 1)
    if name.endswith("dt_bias"):
        return torch.randn(shape, generator=g) * 0.5
    if name.endswith("e_score_correction_bias"):
        return torch.randn(shape, generator=g) * 0.1
    if name.endswith("_res_proj.weight"):
        return torch.randn(shape, generator=g) * 2 * shape[-1] ** -0.5   # scores of RMS ~2
    if "norm" in name:
        return 1 + 0.2 * torch.randn(shape, generator=g)
    if "conv1d" in name:
        return 0.5 * torch.randn(shape, generator=g)
    if "embed" in name:
        return torch.randn(shape, generator=g)
    return torch.randn(shape, generator=g) * shape[-1] ** -0.5


def torch_path_transformers():
    """transformers with Kimi-Linear's modeling bound to its own torch KDA path. The modeling module
    binds FLA's chunk_kda / fused_recurrent_kda when `fla` imports when it is first imported
    (hub_kernels.use_kernel_func_from_hub_with_fallback); FLA's Triton kernels reject the CPU
    tensors the oracle runs on, and the oracle is transformers' own formulas, not another kernel.
    So `fla` is hidden while that module is imported and restored afterwards."""
    import importlib
    import sys
    import transformers
    name = "transformers.models.kimi_linear.modeling_kimi_linear"
    if name not in sys.modules:
        saved = {k: v for k, v in sys.modules.items() if k == "fla" or k.startswith("fla.")}
        for k in saved:
            del sys.modules[k]
        sys.modules["fla"] = None          # import fla raises ImportError: the torch fallback is bound
        try:
            importlib.import_module(name)
        finally:
            del sys.modules["fla"]
            sys.modules.update(saved)
    mod = sys.modules[name]
    for fn in ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention"):
        cells = getattr(getattr(mod, fn, None), "__closure__", None) or ()
        bound = [c.cell_contents for c in cells if callable(c.cell_contents)]
        if any((getattr(f, "__module__", "") or "").split(".")[0] == "fla" for f in bound):
            raise RuntimeError(f"{name}.{fn} is bound to FLA (the module was imported before hf_tiny hid it)")
    return transformers


def build(q_lora, seed: int, stable_routing: bool = False, **heads):
    """The FP32 transformers model with random weights. stable_routing: correction biases spaced
    by 2 (> the sigmoid scores' whole range), so every token picks the same experts by bias and
    only their weights vary: a model whose logits move continuously with its weights, for tests of
    quantized paths (a near-tie in the top-k would otherwise flip on any rounding and move the
    logits by O(1)); the exact FP32 oracle keeps the data-dependent routing. heads: kda_heads /
    mla_heads (2 each by default), moe_inter (128)."""
    import torch
    transformers = torch_path_transformers()
    torch.manual_seed(seed)
    m = transformers.KimiLinearForCausalLM(transformers.KimiLinearConfig(**kwargs(q_lora, **heads))).float().eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for n, p in list(m.named_parameters()) + list(m.named_buffers()):
            if stable_routing and n.endswith("e_score_correction_bias"):
                p.copy_(torch.arange(p.numel(), 0, -1, dtype=p.dtype) * 2.0)
            else:
                p.copy_(random_like(n, tuple(p.shape), g))
    return m


def tokens(seed: int, vocab: int = 512):
    import torch
    return torch.randint(0, vocab, (PROMPT + DECODE,), generator=torch.Generator().manual_seed(seed + 2))


def hf_logits(m, toks) -> list:
    """[prefill logits [PROMPT, vocab]] + DECODE single-token logits, transformers' cached path."""
    import torch
    with torch.no_grad():
        out = m(input_ids=toks[None, :PROMPT], use_cache=True)
        res, pkv = [out.logits[0].clone()], out.past_key_values
        for j in range(PROMPT, PROMPT + DECODE):
            out = m(input_ids=toks[None, j:j + 1], past_key_values=pkv, use_cache=True)
            res.append(out.logits[0, -1].clone())
            pkv = out.past_key_values
    return res


# -- the FP8 bound's calibration (tests/nogpu/modeling/test_load_model_weights.py derives it) ---------
# The projections the loader quantizes to FP8 (leaf names; kv_b and f_b stay BF16).
FP8_LEAVES = ("q_proj", "k_proj", "v_proj", "g_proj", "g_a_proj", "g_b_proj", "f_a_proj", "b_proj", "o_proj",
              "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa")


# The FFN's FP8 projections (issue 21): the dense MLP, the shared experts, the latent projections; the
# routed experts (".experts.") and the router ("gate") stay as stored.
FFN_FP8_LEAVES = ("gate_proj", "up_proj", "down_proj", "routed_expert_down_proj", "routed_expert_up_proj")


def fp8_weight(name: str) -> bool:
    if not name.endswith(".weight"):
        return False
    leaf = name.split(".")[-2]
    if ".self_attn." in name:
        return leaf in FP8_LEAVES
    return ".experts." not in name and leaf in FFN_FP8_LEAVES


def eps_e4m3(recipe) -> float:
    """Relative RMS error of one E4M3 rounding with 128x128 tile scales, on Gaussian weights."""
    import torch
    from k3gen.ops.fp8_block_gemm.reference import dequantize_weights, quantize_weights
    g = torch.randn(1024, 1024, generator=torch.Generator().manual_seed(0))
    c, s = quantize_weights(g, recipe)
    d = dequantize_weights(c, s, recipe)
    return float((d - g).norm() / g.norm())


def noise_logits(m, toks, eps: float, seed: int = 1) -> list:
    """transformers' logits with every weight the kernel path quantizes multiplied once by
    (1 + eps N(0, 1)); of the low-rank gate only g_b (the fold rounds the product once)."""
    import copy
    import torch
    m2 = copy.deepcopy(m)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in m2.named_parameters():
            if fp8_weight(n) and not n.endswith("g_a_proj.weight"):
                p.mul_(1 + eps * torch.randn(p.shape, generator=g))
    return hf_logits(m2, toks)


def flat(xs):
    import torch
    return torch.cat([x.reshape(-1).float().cpu() for x in xs])
