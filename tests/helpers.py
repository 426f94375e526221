"""Test helpers that several test files share (`from helpers import ...`; tests/ is on sys.path, see
conftest.py). Tolerances live in numerics.py."""
from __future__ import annotations

import contextlib

import torch

from numerics import rel_rms


def random_checkpoint_dir(cfg, seed: int):
    """The random checkpoint of `cfg` and `seed` (model/checkpoint.py's writer), written once per k3gen
    cache under its file lock (model.generate.random_checkpoint): test workers that share the cache
    (K3GEN_CACHE_DIR, as the GPU scripts set it) share one writer instead of each quantizing its own copy."""
    from pathlib import Path

    from model.generate import random_checkpoint
    return Path(random_checkpoint(cfg, seed)[0])


def fp8_gemm_inputs(m, n, k, recipe, seed):
    """Quantized FP8 GEMM operands on the GPU (x codes, x scales, w codes, w scales): rows spread
    over four decades of magnitude so that every tile scale differs."""
    from k3gen.ops.fp8_block_gemm.reference import quantize_activations, quantize_weights
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * torch.logspace(-2, 2, m).unsqueeze(1)).to(torch.bfloat16)
    w = torch.randn(n, k, generator=g) * torch.logspace(-3, 0, n).unsqueeze(1)
    xc, xs = quantize_activations(x, recipe)
    wc, ws = quantize_weights(w, recipe)
    return [t.cuda() for t in (xc, xs, wc, ws)]


def poisoned_bf16(m, n):
    return torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")


def fp8_gemm_close(out, xc, xs, wc, ws, recipe, bound: float):
    """No NaN, and rel RMS <= bound against both the FP64 and the FP32 reference; returns
    (got, ref64) in float64 on the CPU for the caller's per-element bound."""
    from k3gen.ops.fp8_block_gemm.reference import fp8_block_gemm
    assert not torch.isnan(out).any()
    ref64 = fp8_block_gemm(xc.cpu(), xs.cpu(), wc.cpu(), ws.cpu(), recipe, dtype=torch.float64)
    ref32 = fp8_block_gemm(xc.cpu(), xs.cpu(), wc.cpu(), ws.cpu(), recipe)
    got = out.cpu().double()
    assert rel_rms(got, ref64) <= bound
    assert rel_rms(got, ref32) <= bound
    return got, ref64


def assert_each_rejected(call, args: dict, cases) -> None:
    """For each (name, bad, needle) of `cases`, `call(**args)` with args[name] = bad (bad None:
    args unchanged; CPU tensors then fail the device check) raises a SpecError whose text holds
    `needle`."""
    import pytest

    from k3gen.errors import SpecError
    for name, bad, needle in cases:
        a = dict(args)
        if bad is not None:
            a[name] = bad
        with pytest.raises(SpecError) as e:
            call(**a)
        assert needle in str(e.value)


def random_block_tables(rng, num_seqs: int, per_seq: int, spare_pages: int, num_slots: int):
    """(num_pages, block table [num_seqs, per_seq] int32, ring slot [num_seqs] int32): shuffled, so
    no sequence's pages or ring slot are contiguous, with `spare_pages` pages no sequence owns."""
    num_pages = num_seqs * per_seq + spare_pages
    ids = list(range(num_pages))
    rng.shuffle(ids)
    bt = torch.tensor(ids[:num_seqs * per_seq], dtype=torch.int32).view(num_seqs, per_seq)
    slots = list(range(num_slots))
    rng.shuffle(slots)
    return num_pages, bt, torch.tensor(slots[:num_seqs], dtype=torch.int32)


def fp8_gemm_graph_replay(run, out, xc, xs, fresh, check) -> None:
    """Graph replay of an FP8 GEMM launch: the replay equals the eager run bit for bit, and a replay
    after new activations are copied in (`fresh()` -> (xc, xs)) passes `check(out)`. The eager run comes
    first because a launcher may allocate its workspace there, outside capture."""
    from k3gen.runtime.graphs import capture
    run()
    torch.cuda.synchronize()
    eager = out.clone()
    graph = capture(run)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    nxc, nxs = fresh()
    xc.copy_(nxc)
    xs.copy_(nxs)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    check(out)


def check_spec_equals_greedy(greedy, spec, rows_of, step_error, spike_cap: float, max_spikes: int):
    """Speculative vs greedy requests, per request and step while the tokens so far agree: the
    step's logits agree (`step_error(got, want, what)` -> message or None), but for at most
    `max_spikes` isolated steps within `spike_cap` rel RMS (a router top-k flip; a wrong committed
    state is off at every later step instead); then the token, which may differ only where the
    top-2 gap is within what the two runs' logits moved at that step, ending that request's
    comparison. `rows_of(req)` gives a request's logits rows. Returns (steps compared,
    divergences [(request, step, margin)])."""
    steps, diverged = 0, []
    for i, (a, b) in enumerate(zip(greedy, spec)):
        la, lb = rows_of(a), rows_of(b)
        bad, n = {}, 0
        for t, (x, y) in enumerate(zip(a.out, b.out)):
            msg = step_error(lb[t], la[t], f"request {i} step {t}")
            if msg:
                bad[t] = msg
            n += 1
            if x != y:
                break
        steps += n
        spikes = [t for t in bad if t - 1 not in bad and t + 1 not in bad and 0 < t < n - 1
                  and rel_rms(lb[t], la[t]) <= spike_cap]
        rest = [bad[t] for t in bad if t not in spikes]
        if rest or len(spikes) > max_spikes:
            raise AssertionError(f"{len(bad)} of {n} steps off ({len(spikes)} isolated): "
                                 + "; ".join(rest or [bad[t] for t in spikes]))
        t = n - 1
        if a.out[t] != b.out[t]:
            moved = 2 * float((lb[t] - la[t]).abs().max())
            assert min(a.margins[t], b.margins[t]) <= moved, \
                f"request {i} token {t}: {b.out[t]} != {a.out[t]}, margin {a.margins[t]:.3g} > {moved:.3g}"
            diverged.append((i, t, a.margins[t]))
    return steps, diverged


def drop_kda_state(monkeypatch, ops_cls, pools: tuple[str, ...]) -> None:
    """The mutation issue 20 names: `ops_cls.kda_decode` zeroes the named state pools ("ssm",
    "conv") of its slots before every step, so a test must fail when the KDA state is lost."""
    real = ops_cls.kda_decode

    def stateless(self, qkvg, fa, beta, pool, slots, w):
        for name in pools:
            pool[name][slots.long()] = 0
        return real(self, qkvg, fa, beta, pool, slots, w)
    monkeypatch.setattr(ops_cls, "kda_decode", stateless)


class LogitSpy:
    """The logits row of every emitted token, per request (model.generate.sample sees each one:
    a speculative request's accepted positions and bonus token included)."""

    def __init__(self, monkeypatch):
        import model.generate as G
        self.rows: dict[int, list[torch.Tensor]] = {}
        self.seen: list = []            # keeps every request alive, so no id() is reused
        real = G.sample

        def spy(logits, req, gen):
            if id(req) not in self.rows:
                self.seen.append(req)
            self.rows.setdefault(id(req), []).append(logits.detach().float().cpu().clone())
            return real(logits, req, gen)
        monkeypatch.setattr(G, "sample", spy)

    def of(self, req) -> list[torch.Tensor]:
        return self.rows[id(req)]


def logits_step_error(kv: str, got: torch.Tensor, want: torch.Tensor, what: str, nvfp4_rel_rms: float) -> str | None:
    """None when one step's logits agree (numerics' BF16 bound for BF16 KV, `nvfp4_rel_rms` for
    NVFP4 KV), else the failure message."""
    if kv == "bf16":
        from numerics import assert_close
        try:
            assert_close(got, want, torch.bfloat16, what=f"{what} logits")
        except AssertionError as e:
            return str(e)
        return None
    err = rel_rms(got, want)
    return None if err <= nvfp4_rel_rms else f"{what} logits: relative RMS {err:.3g} > {nvfp4_rel_rms:g}"


def ngram_hits(seed: list[int], out: list[int], drafts: int, start: int = 24) -> int:
    """How many tokens of a greedy continuation `out` (from position `start`) the n-gram drafter
    would have proposed right: how prompts on which speculative decoding accepts drafts are chosen."""
    from model.generate import ngram_drafts
    n = 0
    for k in range(start, len(out) - drafts):
        d = ngram_drafts(seed + out[:k], drafts)
        while d and d[0] == out[k]:
            n, d, k = n + 1, d[1:], k + 1
    return n


class CountingShard:
    """A safetensors handle (safe_open's subset the readers use: keys, get_slice(name)[idx],
    get_tensor, the context manager) whose every tensor read passes through `on_tensor` (which
    returns it), and `on_close()` when it closes: how the streaming tests count host bytes."""

    def __init__(self, path, framework, on_tensor, on_close=lambda: None):
        from safetensors import safe_open
        self._f, self._on_tensor, self._on_close = safe_open(path, framework=framework), on_tensor, on_close

    def keys(self):
        return self._f.keys()

    def get_tensor(self, name):
        return self._on_tensor(self._f.get_tensor(name))

    def get_slice(self, name):
        s, on_tensor = self._f.get_slice(name), self._on_tensor

        class _Slice:
            get_shape, get_dtype = s.get_shape, s.get_dtype

            def __getitem__(self, idx):
                return on_tensor(s[idx])
        return _Slice()

    def __enter__(self):
        return self

    def __exit__(self, *a):
        self._on_close()


@contextlib.contextmanager
def reference_projections_in_fp32():
    """The reference path (model/ops.py RefOps) with every FP8 projection's products summed in FP32
    instead of FP64: the same math in another rounding, the size of the difference a kernel's own
    accumulation order makes. What that moves a model's logits by is the model's sensitivity to
    rounding (router top-k near-ties, FP8/FP4 code flips, BF16 roundings downstream): the noise floor
    a kernel path is judged against, measured in the same run (`floor_error`)."""
    import pytest

    from model.ops import RefOps
    mp = pytest.MonkeyPatch()
    mp.setattr(RefOps, "linear_acc", torch.float32)
    try:
        yield
    finally:
        mp.undo()


def logits_errors(got: torch.Tensor, want: torch.Tensor) -> dict:
    """Relative RMS over all rows, the median row's relative RMS, mean KL(want || got) and top-1
    agreement of logits [N, vocab] against the reference's."""
    g, w = got.float(), want.float()
    row = (g - w).pow(2).mean(-1).sqrt() / w.pow(2).mean(-1).sqrt().clamp_min(1e-30)
    kl = torch.nn.functional.kl_div(torch.log_softmax(g, -1), torch.log_softmax(w, -1), log_target=True,
                                    reduction="batchmean").item()
    return {"rel": rel_rms(g, w), "median": row.median().item(), "kl": kl,
            "top1": (g.argmax(-1) == w.argmax(-1)).float().mean().item()}


# A kernel path's logits may be this many times as far from the reference as the reference's own
# FP32-projection variant (reference_projections_in_fp32) is, as tests/nogpu/dist/dist_cases.py
# order_bound allows twice the order variants' movement.
FLOOR_FACTOR = 2.0


def floor_error(got, want, alt, what: str) -> str | None:
    """None when `got` is within FLOOR_FACTOR x the floor `alt` on the all-row and the median-row
    relative RMS, else the failure message (it says "relative RMS"). The median row matters: the
    rounding floor is a few large rows (a router flip), a lost state moves every row (on the CPU
    small model: median 0.053 floor vs 0.31 with the KDA state dropped, all-row 0.137 vs 0.326)."""
    e, f = logits_errors(got, want), logits_errors(alt, want)
    for k in ("rel", "median"):
        if not e[k] <= FLOOR_FACTOR * f[k]:
            return (f"{what}: {'all-row' if k == 'rel' else 'median-row'} relative RMS {e[k]:.3g} > "
                    f"{FLOOR_FACTOR:g} x the reference's rounding floor {f[k]:.3g}")
    return None
