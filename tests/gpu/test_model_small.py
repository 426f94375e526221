"""The small K3 config through the generated kernels on the H200 (kernel path), against the FP32
reference path: NVFP4 KV (128-token pages) + BF16 SSM, and BF16 KV + FP32 SSM.

- groups of 1, 2, 4, 8 requests with CUDA graphs: the same requests twice give identical tokens,
  graph replay gives the eager tokens, the pools have the target's dtypes, and the record of what
  ran holds kernels only (mla_decode for decode and verify attention; moe_route, attn_res for the
  residual stream, moe_experts, glu_act and routed_expert_norm for the FFN; besides the named
  PyTorch stand-ins: the router logits and the prefill attention), eager and captured;
- teacher-forced logits vs the reference path: top-1 agreement, mean KL and relative RMS per KV
  dtype printed and floored at this random model's measured values; a relative-RMS bound that a decoder dropping the KDA state
  every step fails (run as a test that asserts the failure);
- speculative decoding == greedy decoding on tokens and on the logits of every emitted position,
  over prompts on which the n-gram drafter is right (acceptance asserted), a divergence allowed only
  where the step's own logit difference can swap the top two; a commit that never records accepted
  drafts fails it (run as a test that asserts the failure);
- typed errors on bad input;
- layerwise diagnosis (one prefill + one decode step, identical inputs): per-layer residual and
  per-op relative RMS between the paths, and each kernel op's own error against RefOps on the
  kernel's inputs (test_layerwise_agreement, run with -s to see the table).
"""
from __future__ import annotations

import functools

import pytest
import torch

import model.model as MM
from k3gen.errors import SpecError
from model.cache import CacheCapacityError, HybridCache, check_dtypes
from model.checkpoint import write_random_checkpoint
from model.config import TargetConfig, small_config
from model.generate import Generator, Request
from model.model import K3Model
from model.ops import KernelOps
from model.weights import load_weights
from numerics import rel_rms
from helpers import (FLOOR_FACTOR, LogitSpy, check_spec_equals_greedy, drop_kda_state, floor_error, logits_errors,
                     logits_step_error, ngram_hits, random_checkpoint_dir, reference_projections_in_fp32)

pytestmark = pytest.mark.gpu
CFG = small_config()
COMBOS = [("nvfp4", "bf16"), ("bf16", "fp32")]
DRAFTS = 3
# No PyTorch stand-in is left on the kernel path: the router logits are router_logits (FP32 in a fixed
# order: row-invariant), the routed experts moe_experts (the checkpoint's NVFP4 experts as loaded). The
# embedding gather, the final norm and the FP32 LM head are outside the ops and unrecorded.
ALLOWED_TORCH: set = set()
KERNEL_OPS = {"kernel:fp8_linear", "kernel:kda_decode", "kernel:kv_cache_write", "kernel:mla_q_absorb",
              "kernel:mla_vb_gate", "kernel:mla_decode", "kernel:moe_route", "kernel:attn_res", "kernel:glu_act",
              "kernel:routed_expert_norm", "kernel:moe_experts"}


@functools.lru_cache(maxsize=1)
def checkpoint_dir():
    return random_checkpoint_dir(CFG, 11)


@functools.lru_cache(maxsize=None)
def weights(device: str):
    return load_weights(checkpoint_dir(), CFG).to(device)


def make(kv, ssm, path="kernel", drafts=DRAFTS, device="cuda", graphs=False, slots=8):
    t = TargetConfig(kv=kv, ssm=ssm, max_drafts=drafts, path=path)
    cache = HybridCache(CFG, t, num_slots=slots, num_pages=slots * 4, max_seq_len=256, device=device)
    m = K3Model(weights(device), t, cache)
    return m, Generator(m, graphs=graphs)


def prompts(n, seed, length=24):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, CFG.vocab, (length - i,), generator=g).tolist() for i in range(n)]


def check_ran(ran):
    names = {k for k, v in ran.items() if v > 0}
    assert KERNEL_OPS <= names, f"kernels missing from the record: {KERNEL_OPS - names}"
    assert not {n for n in names if n.startswith("ref:")}, names
    assert {n for n in names if n.startswith("torch:")} <= ALLOWED_TORCH, names


@pytest.mark.parametrize("kv,ssm", COMBOS, ids=lambda x: x)
def test_groups_with_graphs_deterministic_and_equal_to_eager(kv, ssm):
    m, g = make(kv, ssm, graphs=True)
    check_dtypes(m.cache)
    captured = dict(m.ops.ran)                       # capture ran step_core once per graph
    check_ran(captured)
    assert captured["kernel:kda_decode"] > 0 and captured.get("kernel:kda_verify", 0) > 0
    _, eager = make(kv, ssm, graphs=False)
    for n in (1, 2, 4, 8):
        ps = prompts(n, seed=n)
        a = [r.out for r in g.generate([Request(p, 12) for p in ps])]
        b = [r.out for r in g.generate([Request(p, 12) for p in ps])]
        c = [r.out for r in eager.generate([Request(p, 12) for p in ps])]
        assert a == b, f"group {n}: two runs differ"
        assert a == c, f"group {n}: graph replay differs from eager"
        s = [r.out for r in g.generate([Request(p, 12, temperature=0.9, seed=5 + i) for i, p in enumerate(ps)])]
        assert s == [r.out for r in g.generate([Request(p, 12, temperature=0.9, seed=5 + i)
                                               for i, p in enumerate(ps)])]
    check_ran(eager.m.ops.ran)
    check_dtypes(m.cache)
    assert m.cache.mgr.free_slots == 8 and m.cache.mgr.free_pages == 32


# Teacher-forced logits of the kernel path against the reference path's (same KV format on both,
# so KV quantization is common and the difference is accumulation order plus the BF16 / FP8 / FP4
# rounding flips it causes), judged against the reference path's own rounding floor measured in the
# same run: the reference with its projections summed in FP32 instead of FP64
# (helpers.reference_projections_in_fp32), no kernel involved. The random small model amplifies
# rounding (router top-k near-ties, code flips) so much that an absolute bound says little: on the
# CPU (2026-12-03) that FP32 variant alone moved the reference's logits by rel RMS 0.137 / 0.133,
# top-1 0.910 / 0.949, mean KL 0.060 / 0.045 (NVFP4 / BF16 KV), while the kernel path measured on
# the H200 (2026-12-02) rel RMS 0.150 / 0.142, top-1 0.898 / 0.887, KL 0.080 / 0.077, every flip at
# a near-tie (margin / row error <= 1.55): the old absolute bounds (0.15, 0.90, 0.06 / 0.05) had
# been set before the FFN ran on kernels and the floor was never measured. What separates a bug
# from that noise is the median row (the floor is a few large rows, a lost KDA state moves every
# row: CPU, NVFP4 KV, median-row rel RMS 0.053 floor vs 0.31 with the SSM state dropped; all-row
# 0.137 vs 0.326; KL 0.060 vs 0.44) and test_teacher_forced_bound_fails_without_kda_state checks
# that the mutations fail here. Bounds: helpers.FLOOR_FACTOR x the floor on the all-row and
# median-row relative RMS and on the mean KL, and on the top-1 disagreement; every top-1 flip at a
# near-tie: a row whose reference top-2 margin exceeds FLIP_SIGMAS x its own RMS logit error
# cannot flip but through an error concentrated on its two top logits.
FLIP_SIGMAS = 6.0


def _teacher_forced(kv, ssm, monkeypatch=None, drop=()):
    """(kernel model, kernel logits, reference logits, the reference's FP32-projection logits)."""
    ps = prompts(8, seed=100, length=20)
    g = torch.Generator().manual_seed(101)
    targets = [torch.randint(0, CFG.vocab, (32,), generator=g).tolist() for _ in ps]
    _, gr = make(kv, ssm, path="reference", device="cuda")
    want = torch.cat(gr.teacher_forced(ps, targets))
    with reference_projections_in_fp32():
        _, ga = make(kv, ssm, path="reference", device="cuda")
        alt = torch.cat(ga.teacher_forced(ps, targets))
    if drop:
        drop_kda_state(monkeypatch, KernelOps, drop)
    mk, gk = make(kv, ssm, graphs=not drop)    # the mutation runs eager: a graph would bake it in anyway
    got = torch.cat(gk.teacher_forced(ps, targets))
    return mk, got, want, alt


def _check_teacher_forced(kv, got, want, alt) -> None:
    msg = floor_error(got, want, alt, f"teacher-forced logits ({kv} KV)")
    if msg:
        raise AssertionError(msg)


@pytest.mark.parametrize("kv,ssm", COMBOS, ids=lambda x: x)
def test_teacher_forced_logits_vs_reference(kv, ssm):
    mk, got, want, alt = _teacher_forced(kv, ssm)
    assert torch.isfinite(got).all()
    e, f = logits_errors(got, want), logits_errors(alt, want)
    fmt = lambda d: ", ".join(f"{k} {v:.4f}" for k, v in d.items())   # noqa: E731
    print(f"\n[{kv} KV, {ssm} SSM] teacher-forced over {len(got)} tokens: kernel {fmt(e)}; "
          f"reference floor (FP32 projections) {fmt(f)}")
    top2 = want.topk(2, dim=-1).values
    margin = top2[:, 0] - top2[:, 1]
    row_err = (got - want).pow(2).mean(-1).sqrt()
    flips = got.argmax(-1) != want.argmax(-1)
    ratio = margin[flips] / row_err[flips]
    print(f"[{kv} KV, {ssm} SSM] {int(flips.sum())} flips at margin / row RMS error "
          f"{[round(x, 2) for x in ratio.tolist()]}; median row margin / error "
          f"{(margin / row_err).median().item():.1f}")
    assert (ratio <= FLIP_SIGMAS).all(), "a top-1 flip where the reference margin is no near-tie"
    _check_teacher_forced(kv, got, want, alt)
    assert e["kl"] <= FLOOR_FACTOR * f["kl"], (e["kl"], f["kl"])
    assert 1 - e["top1"] <= FLOOR_FACTOR * (1 - f["top1"]) + 1 / len(got), (e["top1"], f["top1"])
    check_ran(mk.ops.ran)


@pytest.mark.parametrize("drop", [("ssm",), ("ssm", "conv")], ids=["ssm", "ssm+conv"])
@pytest.mark.parametrize("kv,ssm", COMBOS, ids=lambda x: x)
def test_teacher_forced_bound_fails_without_kda_state(kv, ssm, drop, monkeypatch):
    _, got, want, alt = _teacher_forced(kv, ssm, monkeypatch, drop)
    e, f = logits_errors(got, want), logits_errors(alt, want)
    print(f"\n[{kv} KV, KDA {'+'.join(drop)} dropped] teacher-forced rel RMS {e['rel']:.4f} (floor "
          f"{f['rel']:.4f}), median row {e['median']:.4f} (floor {f['median']:.4f}), top-1 {e['top1']:.4f}")
    with pytest.raises(AssertionError, match="relative RMS"):
        _check_teacher_forced(kv, got, want, alt)


# Per-step logits bound of speculative vs greedy: numerics' BF16 bound for BF16 KV; NVFP4 KV 3e-2 rel
# RMS (verify's T = 1 + M launches and decode's T = 1 launches reduce in other orders and an FP4 code
# may flip: on the CPU model NVFP4 measured <= 1.3e-2 where BF16 KV measured <= 6e-3). An isolated
# step up to SPIKE_CAP is allowed (a router top-k flip), at most MAX_SPIKES per request; a wrong
# committed state persists into every later step instead.
# H200 2026-12-02: 3 isolated steps of 24 (0.036-0.094) on NVFP4 KV; a wrong commit is off at every
# later step (not isolated), so it fails whatever MAX_SPIKES is.
NVFP4_LOGITS_REL_RMS, SPIKE_CAP, MAX_SPIKES = 3e-2, 0.15, 4


def check_spec_logits(kv, greedy, spec, spy) -> tuple[int, list]:
    """tests/helpers.py check_spec_equals_greedy with this test's per-step bounds."""
    return check_spec_equals_greedy(greedy, spec, spy.of,
                                    lambda got, want, what: logits_step_error(kv, got, want, what, NVFP4_LOGITS_REL_RMS),
                                    SPIKE_CAP, MAX_SPIKES)


def cycling_prompts(g, n=4) -> list[list[int]]:
    """Prompts on which the n-gram drafter is right: of 32 seeds, the n whose greedy continuation
    (tokens 24..56) ngram_drafts would predict best (simulated, no model call), as seed + its first
    24 tokens. A random model's greedy walk tends to settle into short cycles, but not every walk
    within 56 tokens: on the H200 (2026-12-02) none of 8 seeds gave the BF16-KV model a hit."""
    seeds = [p[:8] * 2 for p in prompts(32, seed=7, length=40)]
    outs = [r.out for i in range(0, len(seeds), 8) for r in g.generate([Request(p, 56) for p in seeds[i:i + 8]])]

    best = sorted(range(len(seeds)), key=lambda i: -ngram_hits(seeds[i], outs[i], DRAFTS))[:n]
    return [seeds[i] + outs[i][:24] for i in best]


@pytest.mark.parametrize("mutate", [False, True], ids=["honest", "commit-drops-drafts"])
@pytest.mark.parametrize("kv,ssm", COMBOS, ids=lambda x: x)
def test_speculative_equals_greedy(kv, ssm, mutate, monkeypatch):
    """The n-gram drafter over prompts it predicts (acceptance asserted), then an oracle drafter
    that proposes greedy's own continuation with its first wrong draft at a rotating position, so
    every accepted count 0..M occurs and accepted drafts' states are committed; tokens and logits
    judged. With `mutate`, commit never records the accepted drafts and the logits check must fail."""
    spy = LogitSpy(monkeypatch)
    _, g = make(kv, ssm, graphs=True)
    ps = cycling_prompts(g)
    greedy = g.generate([Request(p, 24) for p in ps])
    if mutate:
        monkeypatch.setattr(MM, "kda_commit", lambda pending, slots, accepted: None)
    g.accepted.clear()
    spec = g.generate([Request(p, 24) for p in ps], speculative=True)
    acc_ngram = list(g.accepted)
    # The n-gram drafter must have been right at least once (measured 3 on this random model, which
    # rarely cycles); the oracle drafter below covers every accepted count 0..M.
    assert sum(acc_ngram) >= 1, \
        f"n-gram drafter accepted {acc_ngram}"

    def oracle(i, history, m):
        n = len(history) - len(ps[i])                       # tokens generated so far
        d = (greedy[i].out[n:n + m] + [0] * m)[:m]
        k = (n + i) % (m + 1)                               # first wrong draft; k == m: all right
        if k < m:
            d[k] = (d[k] + 1) % CFG.vocab
        return d

    g.accepted.clear()
    spec_o = g.generate([Request(p, 24) for p in ps], speculative=True, drafter=oracle)
    acc = list(g.accepted)
    assert set(range(DRAFTS + 1)) <= set(acc), acc
    if mutate:
        for s in (spec, spec_o):
            with pytest.raises(AssertionError, match="logits"):
                check_spec_logits(kv, greedy, s, spy)
        return
    steps, diverged = check_spec_logits(kv, greedy, spec, spy)
    steps_o, diverged_o = check_spec_logits(kv, greedy, spec_o, spy)
    print(f"\n[{kv}] n-gram drafter: {sum(acc_ngram)} drafts accepted, {steps} steps compared, divergences at "
          f"ties {diverged}; oracle drafter: accepted counts {sorted(set(acc))}, {steps_o} steps, divergences "
          f"{diverged_o}")
    assert steps >= 24 and steps_o >= 24


def test_bad_input_is_typed():
    m, g = make("bf16", "fp32", graphs=True)
    with pytest.raises(CacheCapacityError, match="no free state slot"):
        g.generate([Request([1, 2, 3], 2) for _ in range(9)])
    assert m.cache.mgr.free_slots == 8
    _, g16 = make("bf16", "fp32", graphs=True, slots=16)
    with pytest.raises(SpecError, match="batch"):     # no captured graph holds 9 rows
        g16.generate([Request([1, 2, 3], 2) for _ in range(9)])
    assert g16.m.cache.mgr.free_slots == 16
    with pytest.raises(SpecError, match="verify tokens"):
        m.verify([0], [[1, 2]])
    with pytest.raises(SpecError):
        TargetConfig(arch="sm90", kv="nvfp4", max_drafts=3, graph_batch_sizes=(8, 4))
    assert m.cache.mgr.free_slots == 8


@pytest.mark.parametrize("kv,ssm", COMBOS, ids=lambda x: x)
def test_mla_decode_on_model_cache_vs_reference(kv, ssm):
    """The generated mla_decode over the cache the model allocates and writes (kv_cache_write
    kernel, padding slot and page included) against the reference path's FP32 attention, for
    decode and verify steps (lengths around the 16-token tile and the page edge), eager and
    replayed from a graph captured with other lengths."""
    from model.ops import RefOps
    t = TargetConfig(kv=kv, ssm=ssm, max_drafts=DRAFTS, path="kernel")
    sh = CFG.for_tp(1)
    H = sh.mla_heads
    c = HybridCache(CFG, t, num_slots=8, num_pages=32, max_seq_len=256, device="cuda")
    ops = KernelOps(t.target, t.recipe, t.ssm, t.kv_layout(), sh.kda_heads, H, DRAFTS)
    import dataclasses
    from k3gen.targets import model_gemm_shapes
    shapes = model_gemm_shapes(dataclasses.replace(CFG.kernel_shape(), ffn=None))   # the attention's GEMMs
    ops.load_all(shapes, t.graph_batch_sizes, c.max_pages_per_seq * c.layout.page)
    layer = CFG.mla_layer_ids[0]
    kvd, scale = c.kv[layer], c.kv_scale[layer]
    lengths = [18, 129, 16, 64, 200]
    g = torch.Generator(device="cuda").manual_seed(9)
    for s, n in enumerate(lengths):
        c.admit(s, n)
        c.extend(s, n)
    slots = torch.tensor([c.mgr.entry(s).slot for s in range(len(lengths))], dtype=torch.int32, device="cuda")
    bt = c.block_table[slots.long()]
    rows = [torch.randn(n, 576, device="cuda", generator=g).bfloat16() for n in lengths]
    T = 1 + DRAFTS
    for part in (0, 1):                  # the context, then the last step's T rows
        cnt = [n - T if part == 0 else T for n in lengths]
        st = [0 if part == 0 else n - T for n in lengths]
        new = torch.cat([r[:k] if part == 0 else r[s0:] for r, k, s0 in zip(rows, cnt, st)])
        cu = torch.tensor([0] + torch.tensor(cnt).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
        ops.kv_write(c.layout, kvd, new.contiguous(), cu, torch.tensor(st, dtype=torch.int32, device="cuda"), bt,
                     slots, scale, max(cnt))
    ref = RefOps(t.recipe)
    for steps in (1, T):
        start = torch.tensor([n - steps for n in lengths], dtype=torch.int32, device="cuda")
        q = (torch.randn(len(lengths), steps, H, 576, device="cuda", generator=g) * (1 / 3) ** 0.5).bfloat16()
        want = ref.mla_attention(c.layout, q, kvd, bt, start, slots, scale).float()
        got = ops.mla_attention(c.layout, q, kvd, bt, start, slots, scale)
        assert got.dtype == torch.bfloat16 and not torch.isnan(got).any()
        err = float((got.float() - want).norm() / want.norm())
        assert err <= 1e-2, f"T={steps}: rel RMS {err:.3g}"
        # A graph captured with shorter lengths replays the current ones (plans hold any length).
        start_buf = torch.zeros_like(start)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = ops.mla_attention(c.layout, q, kvd, bt, start_buf, slots, scale)
        start_buf.copy_(start)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, got), f"T={steps}: graph replay differs from eager"
    assert ops.ran["kernel:mla_decode"] == 4 and not [k for k in ops.ran if k.startswith(("torch:", "ref:"))]


# -- layerwise diagnosis: where do the two paths part? ----------------------------------------------
class Trace:
    """Records, per layer, what a model's ops produced: every op output (propagated: its inputs
    are this path's own), the residual stream after each layer and the MoE expert choices. With
    `isolate` (the kernel path), each op is also re-run through RefOps on the kernel's own inputs
    (stateful ops on clones of the pools/cache taken just before the kernel ran), so the op's own
    error is measured apart from what earlier layers passed to it."""

    OPS = ("linear", "kda_decode", "kda_prefill", "kv_write", "q_absorb", "mla_attention", "vb_gate")

    def __init__(self, model, monkeypatch, isolate: bool):
        from model.ops import RefOps
        self.layer, self.ops, self.h, self.sel, self.iso, self.ids = 0, [], [], [], [], []
        self.force = None
        ref = RefOps(model.tcfg.recipe)
        for name in self.OPS:
            monkeypatch.setattr(model.ops, name, self._wrap(name, getattr(model.ops, name),
                                                            getattr(ref, name) if isolate else None))
        ffn = model._ffn

        def traced_ffn(i, h):
            out = ffn(i, h)
            self.layer = i + 1
            return out
        monkeypatch.setattr(model, "_ffn", traced_ffn)
        # The stream after each layer as the next layer reads it: layer i + 1's normed attention
        # input (model/ffn_ops.py ResStream.attn_input: the AttnRes mix through its query, normed
        # and quantized in the same op), and after the last layer the output query's FP32 mix.
        import model.model as MM
        trace, base = self, MM.ResStream

        class TracedStream(base):
            def attn_input(s, w, norm_w):
                out = super().attn_input(w, norm_w)
                if Trace.active is trace:     # the other Trace's subclass runs in super() too
                    s.calls = getattr(s, "calls", 0) + 1
                    if s.calls > 1:
                        trace.h.append(out.x.float().clone())
                return out

            def output(s, w, norm_w):
                out = super().output(w, norm_w)
                if Trace.active is trace:
                    trace.h.append(out.clone())
                return out
        monkeypatch.setattr(MM, "ResStream", TracedStream)
        route = model.ops.route

        def traced_route(logits, bias, cfg):
            r = route(logits, bias, cfg)
            if Trace.active is self:
                sel = r["ids"].long()
                self.sel.append(torch.sort(sel, dim=1).values.clone())
                self.ids.append(sel.clone())
                if self.force is not None:      # the other path's choice, this path's weights
                    sel = self.force.ids[len(self.ids) - 1].to(sel.device)
                    r = {**r, "ids": sel.int(), "weights": forced_weights(logits, sel, cfg)}
            return r
        monkeypatch.setattr(model.ops, "route", traced_route)

    active = None

    @staticmethod
    def _clone(d: dict) -> dict:
        return {k: v.clone() for k, v in d.items()}

    def _wrap(self, name, fn, ref_fn):
        state_arg = {"kda_decode": 3, "kda_prefill": 6, "kv_write": 1}.get(name)

        def traced(*args):
            stateful = ref_fn is not None and state_arg is not None
            pre = self._clone(args[state_arg]) if stateful else None
            before = self._clone(args[state_arg]) if stateful else None
            out = fn(*args)
            if name == "kv_write":
                out = None
            self.ops.append((self.layer, name, None if out is None else out.float().clone()))
            if ref_fn is not None:
                rargs = list(args)
                if before is not None:
                    rargs[state_arg] = before
                rout = ref_fn(*rargs)
                errs = {}
                if out is not None:
                    errs["out"] = rel_rms(out, rout)
                if before is not None:   # the state/cache each wrote
                    for k, v in args[state_arg].items():
                        if v.is_floating_point():
                            r = before[k].float()
                            errs[k] = rel_rms(v, r) if r.norm() > 0 else float(v.float().norm())
                        else:   # of the bytes either path wrote
                            wrote = (v != pre[k]) | (before[k] != pre[k])
                            errs[k + " bytes differing"] = float(((v != before[k]) & wrote).sum()
                                                                 / wrote.sum().clamp_min(1))
                self.iso.append((self.layer, name, errs))
            return out
        return traced


def forced_weights(logits, ids, cfg):
    """arch.route's weights for the experts `ids` (pick order) from this path's own logits."""
    from model.arch import route_weights, sigmoid_scores
    return route_weights(sigmoid_scores(logits), ids, cfg)


def _pair(tr_k: Trace, tr_r: Trace, cfg, what: str, logits_k, logits_r) -> dict:
    """Prints the per-layer and per-op table of one step; returns the numbers asserted on."""
    first = {cfg.kda_layer_ids[0], cfg.mla_layer_ids[0]}
    print(f"\n== {what}: kernel path vs reference path (relative RMS) ==")
    for i, (hk, hr) in enumerate(zip(tr_k.h, tr_r.h)):
        iso = max((e for l, _, d in tr_k.iso if l == i for e in d.values()), default=0.0)
        print(f"layer {i + 1} ({cfg.kind(i)}): residual {rel_rms(hk, hr):.2e}  worst isolated op {iso:.2e}")
        if i in first:
            for (l, name, ok), (_, _, orr) in zip(tr_k.ops, tr_r.ops):
                if l == i and ok is not None:
                    print(f"    {name:14s} propagated {rel_rms(ok, orr):.2e}")
            for l, name, d in tr_k.iso:
                if l == i:
                    print(f"    {name:14s} isolated   " + ", ".join(f"{k} {v:.2e}" for k, v in d.items()))
    print(f"logits: {rel_rms(logits_k, logits_r):.2e}; top-1 agreement "
          f"{float((logits_k.argmax(-1) == logits_r.argmax(-1)).float().mean()):.3f}")
    print(("MoE rows whose own choice differs (the reference ran the kernel path's), per MoE layer: "
           if tr_r.force is not None else "MoE rows routed to a different expert set, per MoE layer: ")
          + " ".join(f"{float((a != b).any(1).float().mean()):.3f}" for a, b in zip(tr_k.sel, tr_r.sel)))
    return {"residual": [rel_rms(a, b) for a, b in zip(tr_k.h, tr_r.h)],
            "iso": [(l, n, k, v) for l, n, d in tr_k.iso for k, v in d.items()],
            "logits": rel_rms(logits_k, logits_r)}


@pytest.mark.parametrize("kv,ssm", COMBOS, ids=lambda x: x)
def test_layerwise_agreement(kv, ssm, monkeypatch):
    """One prefill and one decode step from identical inputs on both paths: each op's own error
    (re-run through the reference on the kernel's inputs) within BF16 output rounding plus the
    FP8 GEMM's accumulation error, and the residual stream / logits of the whole model within a few
    percent (the model is conditioned: model/checkpoint.py RESIDUAL_GAIN)."""
    mk, _ = make(kv, ssm)
    mr, _ = make(kv, ssm, path="reference")
    tk, tr = Trace(mk, monkeypatch, isolate=True), Trace(mr, monkeypatch, isolate=False)
    # The router's top-k is a discontinuous function of its input: a 1e-3 difference at a near-tie
    # picks another expert and the random model carries that into a different stream (the H200,
    # 2026-12-02: every op within 2e-3 of its reference, 25-75% of the 4 decode rows routed
    # differently by layer 6, residual 0.19). The reference path therefore runs the kernel path's
    # expert choice with its own routing weights; how many rows chose otherwise is printed.
    tr.force = tk
    ps = prompts(4, seed=300, length=20)
    ids = [0, 1, 2, 3]
    Trace.active = tk
    lk = mk.prefill(ids, ps)
    Trace.active = tr
    lr = mr.prefill(ids, ps)
    pre = _pair(tk, tr, CFG, "prefill", lk, lr)
    for t in (tk, tr):
        t.layer, t.ops, t.h, t.sel, t.iso, t.ids = 0, [], [], [], [], []
    tok = lr.argmax(-1).tolist()                # the same next tokens into both paths
    Trace.active = tk
    dk = mk.decode(ids, tok)
    Trace.active = tr
    dr = mr.decode(ids, tok)
    Trace.active = None
    dec = _pair(tk, tr, CFG, "decode", dk, dr)
    for step in (pre, dec):
        bad = [(l + 1, n, k, v) for l, n, k, v in step["iso"]
               if (v > (1e-3 if "bytes" in k else (3e-2 if n.startswith("kda") else 1e-2)))]
        assert not bad, f"ops whose own error exceeds its bound (layer, op, tensor, rel RMS): {bad}"
        assert max(step["residual"]) <= 0.1, step["residual"]
        assert step["logits"] <= 0.1, step["logits"]
    assert "kernel:mla_decode" in mk.ops.ran and "kernel:kda_decode" in mk.ops.ran


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_moe_experts_kernel_vs_stand_in_on_model_weights(fmt):
    """The kernel path's routed experts (moe_experts on the experts as the loader packed them) against
    the PyTorch stand-in (model/moe_torch.py, FP64 products) on the same latent rows and routing, per
    MoE layer of the small model: the layout contract between the loaders and the kernel, which the
    model-level tests only see through the random model's amplified noise. Rows 1..40 so several
    tokens share an expert tile; the routing is the model's own router on random rows."""
    from model.ffn_ops import FfnOps
    from model.weights import MoeWeights
    w = weights_fmt(fmt)
    m = K3Model(w, TargetConfig(kv="bf16", ssm="fp32", path="kernel"),
                HybridCache(CFG, TargetConfig(kv="bf16", ssm="fp32", path="kernel"), num_slots=2, num_pages=2,
                            max_seq_len=64, device="cuda"))
    g = torch.Generator(device="cuda").manual_seed(7)
    layers = [lw.ffn for lw in w.layers if isinstance(lw.ffn, MoeWeights)]
    assert layers and all(f.experts.fmt == fmt for f in layers)
    for T in (1, 40):
        for i, f in enumerate(layers):
            x = torch.randn(T, CFG.hidden, device="cuda", generator=g).to(torch.bfloat16)
            routing = m.ops.route(m.ops.router_logits(x, f.router), f.bias, CFG)
            xl = torch.randn(T, f.experts.width, device="cuda", generator=g).to(torch.bfloat16)
            got = m.ops.moe_experts(xl, routing, f.experts, CFG)
            want = FfnOps.moe_experts(m.ops, xl, routing, f.experts, CFG)
            assert got.dtype == torch.float32 and got.shape == want.shape
            err = rel_rms(got, want)
            # BF16 intermediate rounded on both sides from FP32 vs FP64 sums: a few 1e-3
            assert err <= 1e-2, f"{fmt} layer {i} T={T}: rel RMS {err:.3g}"
    assert m.ops.ran.get("kernel:moe_experts", 0) == 2 * len(layers)


@functools.lru_cache(maxsize=2)
def weights_fmt(fmt: str):
    """The small model's random checkpoint in the published layout whose routed experts are `fmt`:
    ModelOpt NVFP4 (nvidia/Kimi-K3-NVFP4) or the official compressed-tensors MXFP4 (moonshotai/Kimi-K3)."""
    import tempfile
    from pathlib import Path

    from model.formats.ct_mxfp4 import write_official_checkpoint
    from model.formats.detect import load_model_weights
    d = Path(tempfile.mkdtemp(prefix=f"k3gen-small-{fmt}-"))
    if fmt == "nvfp4":
        write_random_checkpoint(CFG, d, seed=11)
    else:
        write_official_checkpoint(CFG, d, seed=11, shards=2)
    return load_model_weights(d, CFG).to("cuda")
