"""model/params.py: parameter counts and per-rank weight bytes from a ModelConfig.

The K3 figures are checked against published ones; the exact arithmetic against hand counts of
the `tiny` preset (hidden 256, vocab 512, 2 heads, 4 layers: KDA 0, 2, MLA 1, 3; layer 0 dense
512, layers 1-3 MoE with 8 experts of 128 on a 128 latent, top-2, one shared expert of 128)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from k3gen.errors import SpecError
from model.config import get_config
from model.params import count_params, weight_bytes_by_group, weight_bytes_per_rank

K3, TINY = get_config("k3"), get_config("tiny")
ROOT = Path(__file__).resolve().parents[3]


# -- K3 against the published figures ---------------------------------------------------------------
def test_k3_reproduces_the_published_parameter_counts():
    # "about 2.8 T parameters (104 B active)": SPEC.md section 1, the model card and arXiv 2607.24653.
    n = count_params(K3)
    assert abs(n.total / 2.8e12 - 1) < 0.01, n.total
    assert abs(n.active / 104e9 - 1) < 0.01, n.active
    # The routed experts are nearly all of it: 92 MoE layers x 896 x 3 x 3072 x 3584.
    assert n.by_group["routed_experts"] == 92 * 896 * 3 * 3072 * 3584
    assert n.active_by_group["routed_experts"] == 92 * 16 * 3 * 3072 * 3584


def test_k3_checkpoint_bytes_match_the_published_files():
    # moonshotai/Kimi-K3 "is 1.561 TB" (a third-party loader test quoting the HF file list; it
    # includes the ~1 GB vision tower this text-only count leaves out); nvidia/Kimi-K3-NVFP4
    # "about 1,609.9 GB" (tools_tmp/k3_facts.md section 4).
    assert abs(weight_bytes_per_rank(K3, 1, 1, "mxfp4", "checkpoint") / 1.561e12 - 1) < 0.005
    assert abs(weight_bytes_per_rank(K3, 1, 1, "nvfp4", "checkpoint") / 1609.9e9 - 1) < 0.005


# -- tiny, by hand ----------------------------------------------------------------------------------
def test_tiny_counts_by_hand():
    n = count_params(TINY)
    kda = 4 * 256 * 256 + 256 * 256 + 128 * 256 + 256 * 128 + 2 * 256 + 3 * 256 * 4 + 2 + 256 + 128   # 397,186
    mla = 1536 * 256 + 1536 + 2 * 192 * 1536 + 576 * 256 + 512 + 2 * 256 * 512 + 2 * 128 * 256 + 256 * 256
    assert (kda, mla) == (397_186, 1_525_760)
    expected = {"embed": 512 * 256, "lm_head": 512 * 256, "kda_attn": 2 * kda, "mla_attn": 2 * mla,
                "dense_mlp": 3 * 512 * 256, "router": 3 * (8 * 256 + 8), "shared_experts": 3 * 3 * 128 * 256,
                "latent": 3 * (2 * 128 * 256 + 128), "routed_experts": 3 * 8 * 3 * 128 * 128,
                "attn_res": 4 * 4 * 256 + 2 * 256, "norms": 4 * 2 * 256 + 256}
    assert n.by_group == expected
    assert n.total == 6_185_884
    # Active: the routed experts at 2 of 8, the embedding as the one row a token reads.
    assert n.active == 6_185_884 - 3 * 8 * 49_152 + 3 * 2 * 49_152 - 512 * 256 + 256 == 5_170_332


def test_tiny_bytes_by_hand_tp1_and_tp2():
    # bf16 checkpoint: BF16 except the FP32 conv1d, A_log, dt_bias, o_norm and correction bias.
    # TP2: split = heads (q,k,v,g,o,f_b,b,q_b,kv_b, MLA g, o), dense/shared intermediate, experts'
    # intermediate, vocab; replicated = f_a, q_a, kv_a, their norms, router, latent, all norms.
    split_bf16 = 2 * 360_960 + 2 * 983_040 + 393_216 + 3 * (98_304 + 393_216) + 2 * 131_072
    repl_bf16 = 2 * 32_768 + 2 * 542_720 + 3 * 67_712 + 4 * 1536 + 256 + 512
    split_f32, repl_f32 = 2 * (3072 + 2 + 256), 2 * 128 + 3 * 8
    assert split_bf16 + repl_bf16 + split_f32 + repl_f32 == 6_185_884
    assert weight_bytes_per_rank(TINY, 1, 1, "bf16", "checkpoint") == 2 * (split_bf16 + repl_bf16) + \
        4 * (split_f32 + repl_f32) == 12_385_648
    assert weight_bytes_per_rank(TINY, 2, 1, "bf16", "checkpoint") == split_bf16 + 2 * repl_bf16 + \
        2 * split_f32 + 4 * repl_f32 == 7_554_408


def test_tiny_formats_by_hand():
    g = lambda layout, form, tp=1, ep=1: weight_bytes_by_group(TINY, tp, ep, layout, form)
    # KDA as stored in the official layout: projections BF16, conv/A_log/dt_bias/o_norm FP32.
    assert g("mxfp4", "checkpoint")["kda_attn"] == 2 * (393_728 * 2 + (3072 + 2 + 256 + 128) * 4)
    # Served: q,k,v,g,o FP8 [256,256] + 2x2 FP32 tiles; f_a [128,256] and b [2,256] one tile row;
    # f_b and conv BF16; A_log, dt_bias, o_norm FP32. The same from either checkpoint.
    per_layer = 5 * (65_536 + 16) + (32_768 + 8) + (512 + 8) + 2 * 32_768 + 2 * 3072 + 4 * (2 + 256 + 128)
    assert per_layer == 434_280
    assert g("mxfp4", "serving")["kda_attn"] == g("nvfp4", "serving")["kda_attn"] == 2 * per_layer
    # Experts [128,128]: MXFP4 codes + a byte per 32; NVFP4 codes + a byte per 16 + two FP32 scalars.
    assert g("mxfp4", "checkpoint")["routed_experts"] == 72 * (8192 + 512)
    assert g("nvfp4", "checkpoint")["routed_experts"] == 72 * (8192 + 1024 + 8)
    # TP2 halves every expert ([64,128] / [128,64]) but each rank keeps all 72 slices' scalars;
    # EP2 keeps 36 whole experts.
    assert g("nvfp4", "serving", tp=2)["routed_experts"] == 72 * (4096 + 512 + 8)
    assert g("nvfp4", "serving", tp=2, ep=2)["routed_experts"] == 36 * (8192 + 1024 + 8)


# -- K3 split arithmetic ----------------------------------------------------------------------------
def test_k3_tp8_is_an_eighth_of_the_split_tensors_plus_the_replicated_ones():
    h = 7168
    repl = (69 * (128 * h * 2 + 128 * 4)                                  # f_a, o_norm (FP32)
            + 24 * (1536 * h + 1536 + 576 * h + 512) * 2                  # q_a, kv_a and their norms
            + 92 * ((896 * h + 2 * 3584 * h + 3584) * 2 + 896 * 4)        # router, latent, bias (FP32)
            + 93 * 6 * h * 2 + 3 * h * 2)                                  # layer/AttnRes norms, final
    full = weight_bytes_per_rank(K3, 1, 1, "bf16", "checkpoint")
    assert (full - repl) % 8 == 0
    assert weight_bytes_per_rank(K3, 8, 1, "bf16", "checkpoint") == (full - repl) // 8 + repl
    # Replicated embeddings instead: both vocab tables join the replicated bytes.
    emb = 2 * 163840 * h * 2
    assert weight_bytes_per_rank(K3, 8, 1, "bf16", "checkpoint", vocab_parallel=False) == \
        (full - repl - emb) // 8 + repl + emb


def test_k3_expert_parallel_splits_experts_by_id():
    tp1 = weight_bytes_by_group(K3, 1, 1, "nvfp4")
    tp8 = weight_bytes_by_group(K3, 8, 1, "nvfp4")
    ep8 = weight_bytes_by_group(K3, 8, 8, "nvfp4")
    assert ep8["routed_experts"] * 8 == tp1["routed_experts"]            # 112 whole experts a rank
    scalars = 92 * 896 * 3 * 8                                             # FP32 pairs on every TP rank
    assert tp8["routed_experts"] == (tp1["routed_experts"] - scalars) // 8 + scalars
    assert {k: v for k, v in tp8.items() if k != "routed_experts"} == \
        {k: v for k, v in ep8.items() if k != "routed_experts"}           # attention stays TP8
    # ep=2 inside tp=8: 448 experts a rank, each split 4 ways by intermediate; MXFP4 has no scalars.
    assert weight_bytes_by_group(K3, 8, 2, "mxfp4")["routed_experts"] * 8 == \
        weight_bytes_by_group(K3, 1, 1, "mxfp4")["routed_experts"]


# -- bad input ------------------------------------------------------------------------------------
@pytest.mark.parametrize("tp,ep,layout,form,field", [
    (5, 1, "nvfp4", "serving", "tp"),             # 96 heads
    (8, 3, "nvfp4", "serving", "ep"),             # ep must divide tp
    (96, 3, "nvfp4", "serving", "ep"),            # 896 experts
    (0, 1, "nvfp4", "serving", "tp"),
    (8, 1, "fp8", "serving", "layout"),
    (8, 1, "nvfp4", "disk", "form"),
])
def test_bad_input_is_a_spec_error(tp, ep, layout, form, field):
    with pytest.raises(SpecError) as e:
        weight_bytes_per_rank(K3, tp, ep, layout, form)
    assert e.value.field == field


# -- the CLI ----------------------------------------------------------------------------------------
def _plan(*args):
    return subprocess.run([sys.executable, "-m", "model", "plan-memory", *args], cwd=ROOT,
                          capture_output=True, text=True)


def test_plan_memory_shows_parameters_and_weights_per_rank():
    p = _plan("--config", "k3", "--tp", "8")
    gib = weight_bytes_per_rank(K3, 8, 1, "nvfp4") / 2**30
    assert 190 < gib < 200
    assert "2.78 T params" in p.stdout and "104.2 B active" in p.stdout, p.stdout
    assert f"nvfp4 TP8 EP1: weights {gib:.1f} GiB/rank" in p.stdout, p.stdout
    assert p.returncode == 1 and "the weights alone exceed the budget" in p.stderr
    p = _plan("--config", "k3", "--tp", "8", "--ep", "8", "--layout", "mxfp4")
    gib = weight_bytes_per_rank(K3, 8, 8, "mxfp4") / 2**30
    assert f"mxfp4 TP8 EP8: weights {gib:.1f} GiB/rank" in p.stdout, p.stdout
    p = _plan("--config", "k3", "--tp", "8", "--ep", "3")
    assert p.returncode == 2 and "ep=3" in p.stderr and not p.stdout, (p.stdout, p.stderr)
