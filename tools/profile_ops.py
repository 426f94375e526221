"""Launch one op on a bench shape a few times for `ncu` (ncu measures; nothing is timed here).

Usage: python tools/profile_ops.py moe-t1|moe-t8|moe-t64|attn-b16|attn-b64|mla-bf16|mla-fp8|mla-fp8-wg|mla-nvfp4|mla-nvfp4-wg|mla-fp8-wg-b32|mla-bf16-b32|mla-fp8-wg-b1|mla-nvfp4-wg-b1|mla-h128|prefill-h96|prefill-h96-ov|prefill-h12|prefill-h12-b8|gemm-m1|gemm-m1-stream|gemm-m128|gemm-qkvg-m8
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: bench/ and k3gen/

import torch

from bench.cases.mla_decode import _random_cache
from k3gen.ir.dtypes import KvDtype, ScaleRecipe
from k3gen.targets import get_target


def mla(kv: KvDtype, H=12, B=128, L=8192, T=1, schedule="auto"):
    from k3gen.ops.mla_decode.spec import MlaDecodeSpec
    from k3gen.ops.mla_decode.launcher import MlaDecode
    kw = {"max_drafts": 3} if kv is KvDtype.NVFP4 else {}
    spec = MlaDecodeSpec(target=get_target("sm90"), heads=H, tokens=T, kv=kv, schedule=schedule, **kw)
    op = MlaDecode(spec).load()
    gen = torch.Generator(device="cuda").manual_seed(0)
    pages = -(-L // spec.page)
    cache = _random_cache(spec, B * pages, B, gen)
    bt = torch.randperm(B * pages, device="cuda", generator=gen).to(torch.int32).view(B, pages)
    lengths = torch.full((B,), L, dtype=torch.int32, device="cuda")
    ring = torch.arange(B, dtype=torch.int32, device="cuda")
    q = (torch.randn(B, T, H, 576, device="cuda", generator=gen) * 0.5).to(torch.bfloat16)
    out = torch.empty(B, T, H, 512, dtype=torch.bfloat16, device="cuda")
    plan = op.plan(B, L)
    print(f"mla {kv.value} H{H} B{B} L{L}: splits {plan.splits}", flush=True)
    for _ in range(3):
        op(q, cache, bt, lengths, out, ring_slot=ring, scale=1.0, plan=plan)


def prefill(H=96, B=1, T=4096, kernel="wgmma"):
    from k3gen.ops.mla_prefill.launcher import MlaPrefill
    from k3gen.ops.mla_prefill.spec import MlaPrefillSpec, OutDtype, PrefillKernel
    spec = MlaPrefillSpec(target=get_target("sm90"), heads=H, out_dtype=OutDtype.BF16, kernel=PrefillKernel(kernel))
    op = MlaPrefill(spec).load()
    from bench.cases.mla_prefill import prefill_inputs
    s = prefill_inputs(H, B, T, torch.Generator(device="cuda").manual_seed(0), n_sets=1)[0]
    N = B * T
    cu = torch.arange(0, N + 1, T, device="cuda", dtype=torch.int32)
    out = torch.empty(N, H, 128, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        op(s["q"], s["kn"], s["kp"], s["v"], cu, cu, out, T, heads_fast=spec.heads_fast(N))


def gemm(n, k, m, **kw):
    from k3gen.ops.fp8_block_gemm.spec import Fp8BlockGemmSpec
    from k3gen.ops.fp8_block_gemm.launcher import Fp8BlockGemm
    op = Fp8BlockGemm(Fp8BlockGemmSpec(target=get_target("sm90"), n=n, k=k, recipe=ScaleRecipe.FP32)).load()
    s = op.spec
    wc = torch.randint(0, 0x7E, (n, k), device="cuda", dtype=torch.uint8)
    ws = torch.rand(s.n_blocks, s.k_blocks, device="cuda") * 1e-2
    xc = torch.randint(0, 0x7E, (m, k), device="cuda", dtype=torch.uint8)
    xs = torch.rand(m, s.k_blocks, device="cuda") * 1e-2
    y = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    print(f"gemm N{n} K{k} M{m}: plan {op.plan_for(m, **kw)}", flush=True)
    for _ in range(3):
        op(xc, xs, wc, ws, y, **kw)


def verify(H=12, B=128, M=3, schedule=None):
    from k3gen.ir.dtypes import SsmDtype
    from k3gen.ops.kda_verify.spec import KdaVerifySpec
    from k3gen.ops.kda_decode.reference import random_weights
    from k3gen.ops.kda_verify.launcher import KdaVerify
    K, T, D = 128, 1 + M, H * 128
    op = KdaVerify(KdaVerifySpec(target=get_target("sm90"), heads=H, drafts=M, ssm=SsmDtype.FP32)).load()
    w = random_weights(H, generator=torch.Generator().manual_seed(H)).to("cuda")
    fab = torch.randn(B * T, K + H, device="cuda").to(torch.bfloat16)
    args = (torch.randn(B * T, 4 * D, device="cuda").to(torch.bfloat16), fab[:, :K], fab[:, K:],
            torch.randn(B, H, K, K, device="cuda") * 0.05, torch.randn(B, M, H, K, K, device="cuda") * 0.05,
            torch.randn(B, 3 * D, 3 + M, device="cuda"),
            torch.randint(0, M + 1, (B,), device="cuda", dtype=torch.int32),
            torch.randperm(B, device="cuda").to(torch.int32), w.conv_w, w.fb_w, w.dt_bias, w.a_log, w.norm_w,
            torch.empty(B, T, H, K, device="cuda", dtype=torch.bfloat16))
    print(f"verify H{H} B{B}: schedule {schedule or op.schedule_for(B)}", flush=True)
    for _ in range(3):
        op(*args, schedule=schedule)


def moe(T: int, shape: str = "tp8"):
    """moe_experts MXFP4 / BF16 at the bench's K3 shapes, random routing (bench.cases.moe_experts)."""
    from bench.cases.moe_experts import EP_BASE, SHAPES, _route, _weights
    from k3gen.ops.moe_experts.launcher import MoeExperts
    from k3gen.ops.moe_experts.spec import MoeExpertsSpec, WeightFormat
    spec = MoeExpertsSpec(target=get_target("sm90"), weights=WeightFormat.MXFP4, **SHAPES[shape])
    op = MoeExperts(spec).load()
    base = EP_BASE if shape == "ep8" else 0
    w = _weights(spec, torch.Generator(device="cuda").manual_seed(0))
    r = _route(spec, T, torch.Generator().manual_seed(T), base)
    x = torch.randn(T, spec.hidden, device="cuda").to(torch.bfloat16)
    out = torch.empty(T, spec.hidden, dtype=torch.bfloat16, device="cuda")
    ws = op.workspace(T)
    print(f"moe {shape} T{T}: {r['touched']} experts, grids {spec.gate_up_grid(T, op.sm_count)} "
          f"{spec.down_grid(T, op.sm_count)}", flush=True)
    for _ in range(3):
        op(x, w["w13"], w["s13"], w["w2"], w["s2"], r["dev"], out, ws=ws, expert_base=base)


def attn_res(B: int, fp8: bool = True):
    from k3gen.ops.attn_res.launcher import AttnRes
    from k3gen.ops.attn_res.spec import AttnResSpec
    spec = AttnResSpec(target=get_target("sm90"), hidden=7168, fp8=fp8)
    op = AttnRes(spec).load()
    src = torch.randn(9, B, 7168, device="cuda")
    q = torch.randn(7168, device="cuda") * 0.02
    nw = torch.ones(7168, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(B, 7168, dtype=torch.bfloat16, device="cuda")
    kw = {"codes": torch.empty(B, 7168, dtype=torch.uint8, device="cuda"),
          "scales": torch.empty(B, spec.groups, device="cuda")} if fp8 else {}
    for _ in range(3):
        op(src, 9, q, nw, out, **kw)


CASES = {
    "moe-t1": lambda: moe(1), "moe-t8": lambda: moe(8), "moe-t64": lambda: moe(64),
    "attn-b16": lambda: attn_res(16), "attn-b64": lambda: attn_res(64),
    "verify-b128": lambda: verify(), "verify-b32": lambda: verify(B=32),
    "verify-b512": lambda: verify(B=512), "verify-b512-split": lambda: verify(B=512, schedule="split"),
    "verify-b1-split": lambda: verify(B=1, schedule="split"),
    "mla-bf16": lambda: mla(KvDtype.BF16), "mla-fp8": lambda: mla(KvDtype.FP8),
    "mla-fp8-wg": lambda: mla(KvDtype.FP8, schedule="wgmma"),
    "mla-nvfp4": lambda: mla(KvDtype.NVFP4, schedule="mma"),
    "mla-nvfp4-wg": lambda: mla(KvDtype.NVFP4, schedule="wgmma"),
    "mla-fp8-wg-b32": lambda: mla(KvDtype.FP8, B=32, schedule="wgmma"),
    "mla-bf16-b32": lambda: mla(KvDtype.BF16, B=32),
    "mla-fp8-wg-b1": lambda: mla(KvDtype.FP8, B=1, schedule="wgmma"),
    "mla-nvfp4-wg-b1": lambda: mla(KvDtype.NVFP4, B=1, schedule="wgmma"), "mla-h128": lambda: mla(KvDtype.BF16, H=128, B=32, L=8192),
    "prefill-h96": lambda: prefill(), "prefill-h96-ov": lambda: prefill(kernel="wgmma_ov"),
    "prefill-h12": lambda: prefill(H=12), "prefill-h12-b8": lambda: prefill(H=12, B=8, T=1024),
    "gemm-m1": lambda: gemm(7168, 12288, 1), "gemm-m128": lambda: gemm(7168, 12288, 128),
    "gemm-qkvg-m8": lambda: gemm(6144, 7168, 8),
    "gemm-m1-stream": lambda: gemm(7168, 12288, 1, ctas=132),   # the persistent mode on every SM
}
for name in sys.argv[1:]:
    CASES[name]()
torch.cuda.synchronize()
