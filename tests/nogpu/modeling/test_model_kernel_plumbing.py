"""The kernel path's MLA attention plumbing on the CPU: KernelOps.mla_attention drives the real
MlaDecode launcher's checks (cache tensors by the spec's layout, q/out/lengths/block table/ring
shapes and dtypes) with its launch replaced by k3gen's FP32 mla_decode reference, over a
HybridCache the model allocates, and must equal the reference path's attention (RefOps) for
decode and verify steps, including NVFP4 verify steps whose rows complete a 16-token tile.
Also: the specs the model loads (mla_decode per step length, Q-B's GEMM), plans made once per
(T, batch) outside capture and sized for a block-table row."""
from __future__ import annotations

import pytest
import torch

from k3gen.errors import SpecError
from k3gen.ir.dtypes import KvDtype
from k3gen.ir.layouts import MLA_LATENT
from k3gen.ops.mla_decode.reference import mla_decode as mla_ref
from k3gen.ops.mla_decode import launcher as launcher_mod
from k3gen.ops.mla_decode.launcher import MlaDecode, SplitPlan
from model.cache import HybridCache
from model.config import TargetConfig, small_config, tiny_config
from model.model import gemm_shapes_for
from model.ops import KernelOps, RefOps

H, M = 2, 3


class CpuMlaDecode(MlaDecode):
    """The launcher with its checks and plan bookkeeping, the launch replaced by the reference."""
    plans: list = []
    splits: list = []      # the `splits` each plan was asked for (None: the launcher's own choice)
    launch_tokens: list = []

    def load(self):
        self._kernel = object()
        return self

    def plan(self, batch, max_len, *, splits=None, device=None):
        CpuMlaDecode.plans.append((self.spec.tokens, batch, max_len))
        CpuMlaDecode.splits.append(splits)
        return SplitPlan(batch, max_len, self.splits_for(batch, max_len) if splits is None else splits)

    def splits_for(self, batch, max_len):
        return max(1, 16 // batch)      # any rule that follows the batch

    def __call__(self, q, cache, block_table, lengths, out, *, ring_slot=None, scale=1.0, plan=None):
        B, _, _ = self.check(q, cache, block_table, lengths, out, ring_slot)
        assert plan is not None and plan.batch >= B
        assert int(lengths.max()) <= plan.max_len
        self.validate_inputs(block_table, lengths, cache[next(iter(cache))].shape[0], ring_slot,
                             cache["hp_tail"].shape[0] if "hp_tail" in cache else 1)
        out.copy_(mla_ref(self.spec.layout, cache, q, block_table, lengths, ring_slot=ring_slot, scale=scale))
        return out


@pytest.fixture
def cpu_kernels(monkeypatch):
    monkeypatch.setattr(launcher_mod, "check_one_device", lambda *a: None)
    CpuMlaDecode.plans, CpuMlaDecode.splits, CpuMlaDecode.launch_tokens = [], [], []

    def make(t: TargetConfig) -> KernelOps:
        ops = KernelOps(t.target, t.recipe, t.ssm, t.kv_layout(), H, H, t.max_drafts, invariant=t.invariant,
                        plan_batch=max(t.graph_batch_sizes))
        for T in ops.attention_tokens():
            spec = ops.mla_decode_spec(T)
            ops._launchers[spec.digest()] = CpuMlaDecode(spec)
        return ops
    return make


def _cache(t: TargetConfig, lengths: list[int], seed: int):
    """A tiny-config HybridCache whose first MLA layer holds `lengths` rows per sequence, written
    by the reference KV write in two parts: the context, then a step's last rows."""
    cfg = tiny_config()
    c = HybridCache(cfg, t, num_slots=len(lengths) + 1, num_pages=12, max_seq_len=300)
    g = torch.Generator().manual_seed(seed)
    layer = cfg.mla_layer_ids[0]
    ref = RefOps(t.recipe)
    for s, n in enumerate(lengths):
        c.admit(s + 10, n)
        c.extend(s + 10, n)
    slots = torch.tensor([c.mgr.entry(s + 10).slot for s in range(len(lengths))], dtype=torch.int32)
    bt = c.block_table[slots.long()]
    rows = [(torch.randn(n, 576, generator=g) * 2).to(torch.bfloat16) for n in lengths]
    for part in (0, 1):
        cnt = [n - 4 if part == 0 else 4 for n in lengths]
        st = [0 if part == 0 else n - 4 for n in lengths]
        new = torch.cat([r[:k] if part == 0 else r[s:] for r, k, s in zip(rows, cnt, st)])
        cu = torch.tensor([0] + torch.tensor(cnt).cumsum(0).tolist(), dtype=torch.int32)
        ref.kv_write(c.layout, c.kv[layer], new, cu, torch.tensor(st, dtype=torch.int32), bt, slots,
                     c.kv_scale[layer], max(cnt))
    return c, c.kv[layer], bt, slots, c.kv_scale[layer]


COMBOS = [dict(kv="bf16", ssm="fp32"), dict(kv="fp8", ssm="fp32"), dict(kv="nvfp4", ssm="bf16")]


@pytest.mark.parametrize("tk", COMBOS, ids=lambda d: d["kv"])
def test_kernel_attention_equals_reference_path(cpu_kernels, tk):
    t = TargetConfig(max_drafts=M, path="kernel", **tk)
    lengths = [18, 132, 37]            # 18 = 14 + 4: the verify rows complete the first 16-token tile
    c, kv, bt, slots, scale = _cache(t, lengths, seed=5)
    ops = cpu_kernels(t)
    g = torch.Generator().manual_seed(6)
    for T in (1, 1 + M):
        start = torch.tensor([n - T for n in lengths], dtype=torch.int32)
        q = (torch.randn(len(lengths), T, H, 576, generator=g) * 0.6).to(torch.bfloat16)
        got = ops.mla_attention(c.layout, q, kv, bt, start, slots, scale)
        want = RefOps(t.recipe).mla_attention(c.layout, q, kv, bt, start, slots, scale)
        assert got.dtype == torch.bfloat16 and got.shape == (len(lengths), T, H, MLA_LATENT)
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    assert ops.ran["kernel:mla_decode"] == 2 and not [k for k in ops.ran if k.startswith("torch:")]
    # One plan per (launch tokens, batch), sized for a block-table row, reused by later calls; NVFP4
    # verify's T = 1 launch over 3 * (1 + M) virtual sequences has its own, split as the batch-3 decode.
    row_cap = bt.shape[1] * c.layout.page
    want = {(T, 3, row_cap) for T in ops.attention_tokens()}
    if t.kv is KvDtype.NVFP4:
        want.add((1, 3 * (1 + M), row_cap))
        assert CpuMlaDecode.splits == [None, CpuMlaDecode(ops.mla_decode_spec(1)).splits_for(3, row_cap)]
    assert sorted(set(CpuMlaDecode.plans)) == sorted(want)
    assert len(CpuMlaDecode.plans) == len(set(CpuMlaDecode.plans))


@pytest.mark.parametrize("kv", ["bf16", "fp8"])
@pytest.mark.parametrize("invariant", [False, True])
def test_invariant_mode_fixes_the_splits_and_verifies_per_token(cpu_kernels, kv, invariant, monkeypatch):
    """TargetConfig.invariant: every plan's split count is the one for the largest graph batch (8),
    whatever the batch, and BF16/FP8 verify attention runs as one T = 1 launch over B * (1 + M)
    virtual sequences (what decode reads) split as the T = 1 decode, with the reference path's
    result; the default mode lets the launcher choose and runs verify as one T = 1 + M launch."""
    t = TargetConfig(kv=kv, ssm="fp32", max_drafts=M, path="kernel", invariant=invariant)
    lengths = [18, 132, 37]
    c, kvc, bt, slots, scale = _cache(t, lengths, seed=9)
    ops = cpu_kernels(t)
    import model.ops as O
    real = O.api.mla_decode

    def counted(h, q, *a, **k):
        CpuMlaDecode.launch_tokens.append(tuple(q.shape[:2]))
        return real(h, q, *a, **k)
    monkeypatch.setattr(O.api, "mla_decode", counted)
    q = (torch.randn(3, 1 + M, H, 576, generator=torch.Generator().manual_seed(10)) * 0.6).to(torch.bfloat16)
    start = torch.tensor([n - 1 - M for n in lengths], dtype=torch.int32)
    got = ops.mla_attention(c.layout, q, kvc, bt, start, slots, scale)
    want = RefOps(t.recipe).mla_attention(c.layout, q, kvc, bt, start, slots, scale)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    for B in (1, 5):
        ops.attention_plan(1, B, 256)
    assert CpuMlaDecode.launch_tokens == ([(3 * (1 + M), 1)] if invariant else [(3, 1 + M)])
    assert CpuMlaDecode.splits == ([16 // 8] * 4 if invariant else [None] * 3)


def test_nvfp4_verify_sees_each_query_own_tail():
    """Why NVFP4 verify launches per token: one multi-token launch reads a tile completed by the
    step's later rows as FP4 for the earlier queries, unlike the token-by-token decode."""
    t = TargetConfig(kv="nvfp4", ssm="bf16", max_drafts=M)
    c, kv, bt, slots, scale = _cache(t, [18], seed=7)
    q = (torch.randn(1, 1 + M, H, 576, generator=torch.Generator().manual_seed(8)) * 0.6).to(torch.bfloat16)
    start = torch.tensor([14], dtype=torch.int32)
    per_query = RefOps(t.recipe).mla_attention(c.layout, q, kv, bt, start, slots, scale).float()
    whole = mla_ref(c.layout, kv, q, bt, [18], ring_slot=slots, scale=scale)
    assert (per_query[0, 0] - whole[0, 0]).abs().max() > 1e-2      # query 0 (length 15) differs
    torch.testing.assert_close(per_query[0, 3], whole[0, 3], rtol=2e-2, atol=2e-2)   # the last one agrees


@pytest.mark.parametrize("tk", COMBOS, ids=lambda d: d["kv"])
def test_kernel_specs_cover_every_launch(tk):
    """The kernels the model launches are the ones load_all loads (and prebuild builds): the
    mla_decode of each launch length with the cache's exact layout, and Q-B's prefill GEMM."""
    t = TargetConfig(max_drafts=M, path="kernel", **tk)
    cfg = small_config()
    sh = cfg.for_tp(1)
    ops = KernelOps(t.target, t.recipe, t.ssm, t.kv_layout(), sh.kda_heads, sh.mla_heads, M)
    specs = ops.specs(gemm_shapes_for(cfg))
    attn = [s for s in specs if s.op == "mla_decode"]
    want_tokens = [1] if t.kv is KvDtype.NVFP4 else [1, 1 + M]
    assert sorted(s.tokens for s in attn) == want_tokens
    for s in attn:
        assert s.layout.tensors() == t.kv_layout().tensors() and s.page == t.kv_layout().page
        assert s.heads == sh.mla_heads
    gemms = {(s.n, s.k) for s in specs if s.op == "fp8_block_gemm"}
    assert (sh.mla_heads * 192, cfg.q_lora) in gemms
    assert {s.k for s in specs if s.op == "act_quant_fp8"} == {k for _, k in gemms}


@pytest.mark.parametrize("heads", [2, 12, 24, 96])
def test_verify_attention_uses_the_decode_schedule(heads):
    # "auto" would give verify (T = 1 + M) wgmma above 16 query rows while decode keeps mma.sync;
    # the model pins every T to the decode step's schedule so spec decoding reproduces greedy.
    from k3gen.ops.mla_decode.spec import MlaDecodeSpec
    t = TargetConfig(kv="bf16", ssm="fp32", max_drafts=3, path="kernel")
    ops = KernelOps(t.target, t.recipe, t.ssm, t.kv_layout(), heads, heads, 3)
    want = MlaDecodeSpec(target=t.target, heads=heads, tokens=1).schedule
    assert [ops.mla_decode_spec(T).schedule for T in ops.attention_tokens()] == [want, want]


# -- the model launches exactly what the enumerator lists ------------------------------------------
class _Stub:
    """A launcher that records nothing but its spec: zero outputs keep every shape flowing."""

    def __init__(self, spec):
        self.spec, self._kernel = spec, object()

    def load(self):
        return self

    def plan(self, batch, max_len, **kw):
        return SplitPlan(batch, max_len, 1)

    def workspace(self, *a, **kw):
        return None

    def __call__(self, *args, **kw):
        out = args[-1]
        if isinstance(out, torch.Tensor):
            out.zero_()
        return out


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    from model.checkpoint import write_random_checkpoint
    d = tmp_path_factory.mktemp("tiny-ckpt")
    write_random_checkpoint(tiny_config(), d, seed=3)
    return str(d)


RUNS = [("sm90", kv, ssm, m, None) for kv in ("bf16", "fp8", "nvfp4") for ssm in ("fp32", "bf16") for m in (0, 3)]
RUNS += [("sm90", "fp8", "fp32", 3, "ue8m0"), ("sm103", "nvfp4", "bf16", 3, None), ("sm107", "bf16", "fp32", 7, None)]


@pytest.mark.parametrize("arch,kv,ssm,drafts,recipe", RUNS, ids=lambda v: str(v))
def test_generate_launches_exactly_model_specs(monkeypatch, tiny_checkpoint, arch, kv, ssm, drafts, recipe):
    """Greedy and speculative generation on the kernel path (launches stubbed on the CPU): every
    spec the model creates is in targets.model_specs for its config and serving setting, and every
    listed spec is launched."""
    from k3gen.targets import model_specs
    from model.generate import Generator, Request, build_model
    seen: dict[str, object] = {}

    def launcher(self, spec):
        seen.setdefault(spec.digest(), spec)
        return _Stub(spec)
    monkeypatch.setattr(KernelOps, "launcher", launcher)
    m = build_model("tiny", arch, kv, ssm, drafts, "kernel", tiny_checkpoint, 0, "cpu", 64, 2)
    if recipe:   # the weights in that recipe's scale format too: the ops check the pairing
        from model.weights import load_weights
        t = TargetConfig(arch=arch, kv=kv, ssm=ssm, max_drafts=drafts, path="kernel", recipe=recipe)
        m = type(m)(load_weights(tiny_checkpoint, tiny_config(), t.recipe), t, m.cache)
    assert m.ops.menu is not None
    g = Generator(m)
    g.generate([Request([1, 2, 3, 1, 2], 4), Request([4, 5], 3)])
    if drafts:
        g.generate([Request([1, 2, 3, 1, 2], 6)], speculative=True)
    from model.model import expert_format
    want = {s.digest(): s for s in model_specs(m.tcfg.target, tiny_config(), 1, serving=m.tcfg.serving(),
                                               experts=expert_format(m.w))}
    assert sorted(s.file_stem for s in seen.values()) == sorted(s.file_stem for s in want.values())
    assert {s.digest() for s in m.kernel_specs()} == set(want)


def test_unlisted_launch_raises():
    t = TargetConfig(kv="bf16", path="kernel")
    ops = KernelOps(t.target, t.recipe, t.ssm, t.kv_layout(), H, H, 0, model=tiny_config())
    with pytest.raises(SpecError, match="fp8_block_gemm"):
        ops._get("fp8_block_gemm", n=384, k=256, recipe=t.recipe)


def test_model_presets_match_k3gen_presets():
    """k3gen builds a preset by name without importing model/: its kernel view must be the model's."""
    from k3gen.presets import PRESETS
    from k3gen.targets import get_model
    from model.config import get_config
    for name in PRESETS:
        assert get_config(name).kernel_shape() == get_model(name), name


@pytest.mark.parametrize("flag,want", [([], TargetConfig().invariant), (["--invariant"], True),
                                       (["--no-invariant"], False)])
def test_generate_invariant_flag_reaches_the_kernel_ops(monkeypatch, tiny_checkpoint, flag, want):
    """`generate --invariant / --no-invariant` (absent: TargetConfig's default) is the served model's
    TargetConfig.invariant and its KernelOps'."""
    import argparse

    import model.generate as gen_mod
    from model.cli import add_generate_arguments
    a = argparse.ArgumentParser()
    add_generate_arguments(a)
    args = a.parse_args(["--config", "tiny", *flag])
    assert args.invariant == (want if flag else None)
    monkeypatch.setattr(KernelOps, "launcher", lambda self, spec: _Stub(spec))
    m = gen_mod.build_model("tiny", "sm90", "bf16", "fp32", 3, "kernel", tiny_checkpoint, 0, "cpu", 64, 2,
                            invariant=args.invariant)
    assert m.tcfg.invariant is want and m.ops.invariant is want
