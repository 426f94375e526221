"""Per-layer decode time of one K3 TP8 layer of each kind (KDA + MoE, MLA + MoE) through the
kernel path, on the H200 (issue 21): CUDA-graph replay medians of

- `attn`: the attention half (the AttnRes mix into the layer's input, fused with input_layernorm and
  the FP8 quantization; the KDA or MLA step at a 4K context);
- `ffn`: the FFN half (the FFN-input mix, the router logits, moe_route, routed_expert_down_proj,
  the routed experts, routed_expert_norm, routed_expert_up_proj, the shared experts' [gate | up]
  GEMM, glu_act and down GEMM);
- `layer`: both, one graph.

The routed experts (`ops.moe_experts`): by default (`--experts ops`) the generated moe_experts on
random MXFP4 experts of the rank's shapes; `--experts stub` a zero stub (the layer without its
routed-expert GEMMs); `--experts torch` the PyTorch stand-in at B = 1 (it dequantizes all 896
experts every step: the "before" of issue 21). Weights are random
(FP8 block weights, K3 TP8 shapes: hidden 7168, 12 heads, latent 3584, shared 768 per rank, 896
experts top-16, 9 AttnRes sources with 5 valid). Run:

    .venv/bin/python tools/bench_k3_layers.py [--kv nvfp4|bf16|fp8] [--batch 1 8 32] [--experts stub|torch|ops]
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from k3gen.ir.dtypes import ScaleRecipe  # noqa: E402
from k3gen.ops.fp8_block_gemm.reference import quantize_weights  # noqa: E402
from k3gen.ops.kda_decode.reference import random_weights  # noqa: E402
from model import layers as L  # noqa: E402
from model.arch import AttnResWeights  # noqa: E402
from model.cache import HybridCache  # noqa: E402
from model.config import TargetConfig, k3_config  # noqa: E402
from model.ffn_ops import FfnOps  # noqa: E402
from model.ops import KernelOps  # noqa: E402
from model.weights import (KV_A_PAD, ExpertWeights, Fp8Linear, GluWeights, KdaLayerWeights,  # noqa: E402
                           MlaLayerWeights, MoeWeights)

TP, CONTEXT, N_VALID = 8, 4096, 5
CFG = dataclasses.replace(k3_config(), layers=2, layer_kinds=("kda", "mla"), mlp_kinds=("moe", "moe"))


def lin(n, k, g, recipe):
    c, s = quantize_weights((torch.randn(n, k, generator=g) * k ** -0.5).cuda(), recipe)
    return Fp8Linear(c, s, recipe)


def graph_time(fn, reps: int = 50) -> float:
    """Median microseconds of a CUDA-graph replay of fn (bench.harness.time_graph: warmed up
    eagerly, captured through k3gen.runtime.graphs)."""
    from bench.harness import time_graph
    return time_graph([fn], reps=reps)


def moe_weights(g, recipe, real_experts: bool = False) -> MoeWeights:
    cfg, W, hid = CFG, CFG.moe_latent, CFG.hidden
    sh = cfg.shared_inter // TP
    I, W, E = cfg.moe_inter // TP, cfg.moe_latent, cfg.experts
    if real_experts:
        # Random MXFP4 experts at the rank's shapes (1.8 GB): E2M1 bytes, UE8M0 scales 2^-7..2^-4.
        experts = ExpertWeights(
            "mxfp4", torch.randint(0, 256, (E, 2 * I, W // 2), dtype=torch.uint8, device="cuda"),
            torch.randint(120, 124, (E, 2 * I, W // 32), dtype=torch.uint8, device="cuda"), None,
            torch.randint(0, 256, (E, W, I // 2), dtype=torch.uint8, device="cuda"),
            torch.randint(120, 124, (E, W, I // 32), dtype=torch.uint8, device="cuda"), None)
    else:
        dummy = torch.zeros(1, 2 * I, 1, dtype=torch.uint8, device="cuda")     # the stub reads no expert weight
        experts = ExpertWeights("mxfp4", dummy, dummy, None, dummy[:, :1], dummy[:, :1], None)
    gu = lin(2 * sh, hid, g, recipe)
    return MoeWeights(router=(torch.randn(cfg.experts, hid, generator=g) * hid ** -0.5).cuda(),
                      bias=torch.zeros(cfg.experts, device="cuda"), experts=experts,
                      latent_down=lin(W, hid, g, recipe), latent_up=lin(hid, W, g, recipe),
                      latent_norm=torch.ones(W, dtype=torch.bfloat16, device="cuda"),
                      shared=GluWeights(gate_up=gu, down=lin(hid, sh, g, recipe), inter=sh))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kv", default="nvfp4")
    ap.add_argument("--ssm", default="bf16")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--experts", choices=("stub", "torch", "ops"), default="ops")
    a = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    t = TargetConfig(kv=a.kv, ssm=a.ssm, tp=TP, path="kernel")
    recipe = t.recipe
    H, hid = CFG.kda_heads // TP, CFG.hidden
    # The kernels of the whole K3 rank (93 layers: 9 AttnRes sources); the cache holds the two layers timed.
    ops = KernelOps(t.target, recipe, t.ssm, t.kv_layout(), H, H, 0, gate=CFG.kda_gate, model=k3_config(), tp=TP)
    ops.load_all()
    if a.experts == "stub":
        ops.moe_experts = lambda xl, routing, experts, cfg, mine=None: torch.zeros(
            xl.shape[0], cfg.expert_width, dtype=torch.float32, device=xl.device)
    elif a.experts == "torch":
        ops.moe_experts = functools.partial(FfnOps.moe_experts, ops)
    kda = KdaLayerWeights(qkvg=lin(4 * H * 128, hid, g, recipe), fab=lin(144, hid, g, recipe),
                          o_proj=lin(hid, H * 128, g, recipe), kda=random_weights(H, generator=g, device="cuda"))
    kvb = (torch.randn(H, 256, 512, generator=g) * 0.05).to(torch.bfloat16).cuda()
    mla = MlaLayerWeights(a_proj=lin(1536 + KV_A_PAD + H * 128, hid, g, recipe),
                          q_a_norm=torch.ones(1536, dtype=torch.bfloat16, device="cuda"),
                          q_b=lin(H * 192, 1536, g, recipe), kv_a_norm=torch.ones(512, dtype=torch.bfloat16,
                                                                                  device="cuda"),
                          w_uk=kvb[:, :128].contiguous(), w_uv=kvb[:, 128:].contiguous(),
                          o_proj=lin(hid, H * 128, g, recipe))
    moe = moe_weights(g, recipe, real_experts=a.experts != "stub")
    res = AttnResWeights(proj=(torch.randn(hid, generator=g) * 0.01).cuda(), norm=torch.ones(hid, device="cuda"))
    norm = torch.ones(hid, dtype=torch.bfloat16, device="cuda")
    n_max = k3_config().kernel_shape().ffn.max_sources
    print(f"K3 TP{TP} layer decode, kv={a.kv} ssm={a.ssm}, context {CONTEXT}, experts: {a.experts} "
          f"(AttnRes {N_VALID} of {n_max} sources)")
    for B in a.batch:
        if a.experts == "torch" and B > 1:
            continue
        cache = HybridCache(CFG, t, num_slots=B, num_pages=B * (CONTEXT // t.kv_layout().page + 2),
                            max_seq_len=CONTEXT + 64, device="cuda")
        for s in range(B):
            cache.admit(s, CONTEXT)
            cache.extend(s, CONTEXT - 1)
        slots = torch.arange(B, dtype=torch.int32, device="cuda")
        st = L.Step(slots=slots, start=torch.full((B,), CONTEXT - 1, dtype=torch.int32, device="cuda"),
                    block_table=cache.block_table[slots.long()], T=1,
                    cu_rows=torch.arange(B + 1, dtype=torch.int32, device="cuda"))
        src = torch.randn(n_max, B, hid, generator=g).cuda()
        prev = torch.randn(B, hid, generator=g).cuda()          # the previous layer's FFN output (FP32)

        def attn(kind):
            xn = ops.attn_res_mix(src, N_VALID, res, norm, CFG.eps, prev)
            if kind == "kda":
                return L.kda_step(ops, kda, xn, cache.state[0], st)
            return L.mla_step(ops, mla, xn, cache.kv[1], cache.layout, cache.kv_scale[1], st, CFG.eps)

        def ffn(out):
            xf = ops.attn_res_mix(src, N_VALID, res, norm, CFG.eps, out)
            return L.moe(ops, moe, xf, CFG)

        line = [f"B={B}:"]
        for kind in ("kda", "mla"):
            out = attn(kind)
            ta = graph_time(lambda: attn(kind))
            tf = graph_time(lambda: ffn(out))
            tl = graph_time(lambda: ffn(attn(kind)))
            line.append(f"{kind.upper()}+MoE layer {tl:.1f} us (attn {ta:.1f}, ffn {tf:.1f})")
        print("  " + "; ".join(line))
    print("ran: " + ", ".join(f"{k} {v}" for k, v in sorted(ops.ran.items())))


if __name__ == "__main__":
    main()
