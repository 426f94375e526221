"""The published checkpoint layouts through the kernel path on the H200 (issue 20).

- The tiny transformers Kimi-Linear (tests/hf_tiny.py: softplus KDA gate, the low-rank KDA gate folded
  into qkvg, MLA without the output gate, q_lora 1536 and a plain q_proj) from its save_pretrained
  folder through load_model_weights, at KV BF16 / FP8 / NVFP4 x SSM FP32 / BF16: prefill + decode
  logits against the reference path on the same weights and KV format, and against transformers' own
  forward; greedy tokens equal to the reference path's but at ties; only kernels ran (besides the
  named PyTorch stand-ins).
- The K3 small preset from a checkpoint in the official compressed-tensors MXFP4 layout (routed
  experts kept packed as MXFP4), CUDA graphs for batch 1/2/4/8: deterministic, graph == eager.

Bounds (tests/nogpu/modeling/test_load_model_weights.py derives the FP8 part; e_noise is
transformers' logit response to one E4M3 rounding of every weight the kernel path quantizes, measured
here on the CPU). Kernel vs reference path: the weights and their FP8 codes are the same, so the paths
differ by FP32 accumulation order and the BF16 roundings it flips (2^-9 relative); an FP8 activation
re-quantized from a BF16 input that moved by 2^-9 changes by about sqrt(2^-9 * 2^-3) ~ 0.016 relative,
0.6 of one weight rounding (eps ~0.026): bound e_noise. Kernel path vs transformers: the reference
path's FP8 error (CPU bound 2 sqrt(2) e_noise), the KV format's own rounding (measured as the reference
path with that KV against the reference path with BF16 KV, e_kv) and the kernel-vs-reference slack:
(2 sqrt(2) + 1) e_noise + e_kv.

Needs: transformers with KimiLinearForCausalLM (5.23 here; carry a wheel if the device's lacks it),
and the bundle's model_hf_tiny and model_small lists (tests/gpu/specs.py).
"""
from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import pytest
import torch

import hf_tiny
from numerics import rel_rms

from k3gen.ir.dtypes import KvDtype, SsmDtype
from model.cache import HybridCache
from model.config import TargetConfig, config_from_json, small_config
from model.formats.detect import load_model_weights
from model.generate import Generator, Request
from model.model import K3Model
from model.ops import RefOps
from tests.gpu.specs import model_hf_tiny_ffn

pytestmark = pytest.mark.gpu
# Named here so that the bundle check (tests/nogpu/pipeline/test_prebuild.py) sees them.
HF_SPECS = model_hf_tiny_ffn()
KVS = [k.value for k in KvDtype]
SSMS = [s.value for s in SsmDtype]
NEW = 8
KERNELS = {"kernel:fp8_linear", "kernel:kda_decode", "kernel:kda_prefill", "kernel:kv_cache_write",
           "kernel:mla_vb_gate", "kernel:mla_decode", "kernel:moe_route", "kernel:attn_res", "kernel:glu_act"}
# The routed BF16 experts (ops.moe_experts takes the FP4 formats only) and Kimi-Linear's plain q_proj
# absorption stay PyTorch stand-ins; the router logits are the router_logits kernel.
TORCH_OK = {"torch:moe_experts", "torch:mla_q_proj_absorb"}


# -- the tiny transformers Kimi-Linear --------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _hf(case: str):
    """(folder, tokens, transformers' logits, e_noise) of the stable-routing tiny model."""
    pytest.importorskip("transformers")
    try:
        # Before any attribute lookup of the model class: that lazily imports the modeling module,
        # which would bind FLA where it is importable (hf_tiny.torch_path_transformers).
        transformers = hf_tiny.torch_path_transformers()
    except ModuleNotFoundError:
        transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "KimiLinearForCausalLM"):
        pytest.skip(f"transformers {transformers.__version__} has no KimiLinearForCausalLM (5.23 has)")
    from k3gen.ir.dtypes import ScaleRecipe
    m = hf_tiny.build(hf_tiny.CASES[case], hf_tiny.SEEDS[case], stable_routing=True)
    toks = hf_tiny.tokens(hf_tiny.SEEDS[case])
    d = Path(tempfile.mkdtemp(prefix=f"k3gen-hf-{case}-"))
    m.save_pretrained(d)
    want = hf_tiny.hf_logits(m, toks)
    e_noise = rel_rms(hf_tiny.flat(hf_tiny.noise_logits(m, toks, hf_tiny.eps_e4m3(ScaleRecipe.FP32))),
                      hf_tiny.flat(want))
    return d, toks, want, e_noise


@functools.lru_cache(maxsize=None)
def _weights(case: str):
    folder = _hf(case)[0]
    cfg = config_from_json(folder)
    return cfg, load_model_weights(folder, cfg, TargetConfig().recipe, device="cuda")


def _run(case: str, kv: str, ssm: str, path: str):
    """(prefill + decode logits [CPU FP32], greedy tokens, their margins, what ran)."""
    cfg, w = _weights(case)
    toks = _hf(case)[1]
    P = hf_tiny.PROMPT
    t = TargetConfig(kv=kv, ssm=ssm, path=path)
    cache = HybridCache(cfg, t, num_slots=2, num_pages=8, max_seq_len=64, device="cuda")
    # The reference path with the config's softplus gate (make_ops' RefOps is built bounded).
    m = K3Model(w, t, cache, ops=RefOps(t.recipe, gate=cfg.kda_gate) if path == "reference" else None)
    out = [m.prefill([0], [toks[:P].tolist()], all_logits=True)]
    out += [m.decode([0], [int(x)])[0] for x in toks[P:]]
    m.release([0])
    r = Generator(m).generate([Request(toks[:P].tolist(), NEW)])[0]
    torch.cuda.synchronize()
    return [x.float().cpu() for x in out], r.out, r.margins, dict(m.ops.ran)


@pytest.mark.parametrize("ssm", SSMS)
@pytest.mark.parametrize("kv", KVS)
@pytest.mark.parametrize("case", list(hf_tiny.CASES))
def test_hf_kimi_linear_kernel_path(case, kv, ssm):
    _, _, want, e_noise = _hf(case)
    got, toks_k, _, ran = _run(case, kv, ssm, "kernel")
    ref, toks_r, margins_r, _ = _run(case, kv, ssm, "reference")
    ref_bf16 = ref if kv == "bf16" else _run(case, "bf16", ssm, "reference")[0]
    names = {k for k, v in ran.items() if v > 0}
    need = KERNELS | ({"kernel:mla_q_absorb"} if hf_tiny.CASES[case] else {"torch:mla_q_proj_absorb"})
    assert need <= names, need - names
    assert not {n for n in names if n.startswith("ref:")} and {n for n in names if n.startswith("torch:")} <= TORCH_OK
    e_kr = rel_rms(hf_tiny.flat(got), hf_tiny.flat(ref))
    e_kv = rel_rms(hf_tiny.flat(ref), hf_tiny.flat(ref_bf16))
    e_kh = rel_rms(hf_tiny.flat(got), hf_tiny.flat(want))
    bound = (2 * 2 ** 0.5 + 1) * e_noise + e_kv
    print(f"{case} kv={kv} ssm={ssm}: kernel vs reference {e_kr:.4f} (bound e_noise {e_noise:.4f}); "
          f"vs transformers {e_kh:.4f} (bound {bound:.4f}, KV format {e_kv:.4f}); tokens {toks_k} / {toks_r}")
    assert all(torch.isfinite(x).all() for x in got)
    assert e_kr <= e_noise
    assert e_kh <= bound
    # Greedy tokens: equal up to the first step where the reference's top-2 gap lies within the
    # paths' logit noise (both saw the same history up to there).
    j = next((i for i, (a, b) in enumerate(zip(toks_k, toks_r)) if a != b), None)
    if j is not None:
        tie = 4 * e_noise * float(ref[0].pow(2).mean().sqrt())
        assert margins_r[j] <= tie, (j, toks_k, toks_r, margins_r[j], tie)


# -- the small K3 preset from the official MXFP4 layout ----------------------------------------------
CFG = small_config()
COMBOS = [("nvfp4", "bf16"), ("bf16", "fp32")]
SMALL_KERNELS = KERNELS | {"kernel:mla_q_absorb"}


@functools.lru_cache(maxsize=1)
def _mxfp4_dir() -> Path:
    from model.formats.ct_mxfp4 import write_official_checkpoint
    d = Path(tempfile.mkdtemp(prefix="k3gen-small-mxfp4-"))
    return write_official_checkpoint(CFG, d, seed=11, shards=4)


@functools.lru_cache(maxsize=1)
def _small_weights():
    return load_model_weights(_mxfp4_dir(), CFG, TargetConfig().recipe, device="cuda")


def _small(kv, ssm, graphs):
    t = TargetConfig(kv=kv, ssm=ssm, max_drafts=3, path="kernel")
    cache = HybridCache(CFG, t, num_slots=8, num_pages=32, max_seq_len=256, device="cuda")
    m = K3Model(_small_weights(), t, cache)
    return m, Generator(m, graphs=graphs)


@pytest.mark.parametrize("kv,ssm", COMBOS, ids=lambda x: x)
def test_small_from_official_mxfp4_with_graphs(kv, ssm):
    w = _small_weights()
    fmts = {lw.ffn.experts.fmt for lw in w.layers if hasattr(lw.ffn, "experts")}
    assert fmts == {"mxfp4"} and all(lw.ffn.experts.w13.dtype == torch.uint8 for lw in w.layers
                                     if hasattr(lw.ffn, "experts"))
    m, g = _small(kv, ssm, graphs=True)
    _, eager = _small(kv, ssm, graphs=False)
    gen = torch.Generator().manual_seed(3)
    for n in (1, 2, 4, 8):
        ps = [torch.randint(0, CFG.vocab, (20 - i,), generator=gen).tolist() for i in range(n)]
        a = [r.out for r in g.generate([Request(p, 12) for p in ps])]
        b = [r.out for r in g.generate([Request(p, 12) for p in ps])]
        c = [r.out for r in eager.generate([Request(p, 12) for p in ps])]
        assert a == b, f"group {n}: two graph runs differ"
        assert a == c, f"group {n}: graph replay differs from eager"
        assert all(len(x) == 12 for x in a)
    names = {k for k, v in eager.m.ops.ran.items() if v > 0}
    assert SMALL_KERNELS <= names, SMALL_KERNELS - names
    assert not {n for n in names if n.startswith("ref:")} and {n for n in names if n.startswith("torch:")} <= TORCH_OK
    assert m.cache.mgr.free_slots == 8
