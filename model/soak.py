"""A serving soak of K3Model (issue 27): requests admitted while others run, decoded, verified with
drafts, rewound by commit and freed, with the cache's accounting checked after every step.

Every scheduling choice (arrivals, prompt tokens and lengths, output lengths, decode or verify,
drafts, accepted counts) comes from one seeded generator and never from the model's outputs, so a
rerun schedules identically: the tokens must then be identical (reproducible), and a request whose
own state is poisoned with NaN must leave every other request's tokens as they were (isolation).
Only the golden tokens (argmax of the logits) come from the model. The accepted counts are drawn,
not matched against the logits: the soak exercises the cache (rewinds of every length, pages freed
at boundaries, `pending` commits), not speculative losslessness (tests/gpu/test_spec_lossless.py).

    python tools/soak.py --steps 2500 --path kernel      # on a GPU: the kernel path
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from model.cache import CacheStateError


@dataclass
class SoakReport:
    steps: int = 0                # model steps (decode or verify batches)
    row_steps: int = 0            # sequences advanced, summed over the steps
    verify_steps: int = 0
    admitted: int = 0
    finished: int = 0
    accepted_drafts: int = 0
    max_live: int = 0
    victim: int | None = None
    victim_nonfinite: bool = False
    tokens: dict[int, list[int]] = field(default_factory=dict)


@dataclass
class _Req:
    rid: int
    prompt: list[int]
    max_new: int
    out: list[int] = field(default_factory=list)


def check_accounting(m, live: dict[int, _Req]) -> None:
    """The manager's invariants, the exact counts, and the device block table the kernels read."""
    mgr = m.cache.mgr
    mgr.check_invariants()
    if set(mgr.seqs) != set(live):
        raise CacheStateError(f"the cache holds sequences {sorted(mgr.seqs)}, the soak {sorted(live)}")
    if mgr.free_slots != mgr.num_slots - len(live):
        raise CacheStateError(f"{mgr.free_slots} free slots with {len(live)} of {mgr.num_slots} live")
    owned = sum(len(e.pages) for e in mgr.seqs.values())
    if mgr.free_pages != mgr.num_pages - owned:
        raise CacheStateError(f"{mgr.free_pages} free pages, {owned} owned of {mgr.num_pages}")
    bt = m.cache.block_table.cpu()
    for e in mgr.seqs.values():
        if e.length != len(live[e.seq_id].prompt) + len(live[e.seq_id].out) - 1:
            raise CacheStateError(f"sequence {e.seq_id}: cache length {e.length} is not its history - 1")
        if bt[e.slot, :len(e.pages)].tolist() != e.pages:
            raise CacheStateError(f"sequence {e.seq_id}: the block table row is not its pages")


def _poison(m, slot: int) -> None:
    """NaN into one slot's KDA state (recurrent state and conv window) in every KDA layer."""
    for pools in m.cache.state.values():
        for name in ("ssm", "conv"):
            if pools[name].is_floating_point():
                pools[name][slot] = float("nan")


def soak(m, steps: int, seed: int, *, max_prompt: int = 48, max_new: int = 96, p_arrive: float = 0.3,
         p_verify: float = 0.5, poison_first: bool = False, vocab: int | None = None,
         on_step=None, core=None) -> SoakReport:
    """Run `steps` model steps on K3Model `m` (its cache empty); returns the report with every
    request's tokens. `poison_first`: the first request's KDA state is set to NaN after its
    prefill. `on_step(report)` after every step (progress). `core(ids, tokens, T)`: the decode /
    verify step's logits [B T, vocab] for the flat tokens (default: model.generate.Generator(m).step,
    eager; a Generator with graphs=True replays the CUDA graphs a serving engine runs)."""
    rng = random.Random(seed)
    vocab = vocab or m.cfg.vocab
    M = m.tcfg.max_drafts
    mgr = m.cache.mgr
    if mgr.seqs:
        raise CacheStateError(f"soak needs an empty cache; it holds {sorted(mgr.seqs)}")
    cap = m.cache.max_pages_per_seq * mgr.page - M - 1
    rep, live, next_id = SoakReport(), {}, 0
    reserved = lambda r: mgr.pages_for(len(r.prompt) + r.max_new + M + 1)   # noqa: E731  (worst case)
    if core is None:
        from model.generate import Generator
        core = Generator(m).step
    while rep.steps < steps:
        # Arrivals: admitted only when their worst case fits beside the live requests' worst cases,
        # so no extend can fail (a serving engine would preempt instead).
        while rng.random() < p_arrive or not live:
            n_prompt = rng.randint(1, max_prompt)
            r = _Req(next_id, [rng.randrange(vocab) for _ in range(n_prompt)], rng.randint(1, max_new))
            r.max_new = min(r.max_new, cap - n_prompt)
            next_id += 1
            need = sum(reserved(x) for x in live.values()) + reserved(r)
            if r.max_new < 1 or reserved(r) > mgr.num_pages:
                raise CacheStateError(f"a request of {n_prompt} + {r.max_new} tokens cannot fit this cache "
                                      f"({mgr.num_pages} pages): lower max_prompt / max_new")
            if len(live) >= mgr.num_slots or need > mgr.num_pages:
                break
            logits = m.prefill([r.rid], [r.prompt])
            r.out.append(int(logits[0].argmax()))
            rep.admitted += 1
            if len(r.out) >= r.max_new:      # the prefill's token was all it asked for: never live
                m.release([r.rid])
                rep.tokens[r.rid] = r.out
                rep.finished += 1
                continue
            live[r.rid] = r
            if poison_first and rep.victim is None:
                rep.victim = r.rid
                _poison(m, mgr.entry(r.rid).slot)
        ids = sorted(live)
        if M and rng.random() < p_verify:
            drafts = [[rng.randrange(vocab) for _ in range(M)] for _ in ids]
            flat = [x for i, d in zip(ids, drafts) for x in [live[i].out[-1]] + d]
            lg = core(ids, flat, 1 + M).view(len(ids), 1 + M, -1)
            top = lg.argmax(-1).tolist()     # one host sync for the step's tokens
            acc = []
            for i, d, rows, am in zip(ids, drafts, lg, top):
                r = live[i]
                a = rng.randint(1, min(M + 1, r.max_new - len(r.out)))
                r.out += d[:a - 1] + [am[a - 1]]
                acc.append(a)
                rep.accepted_drafts += a - 1
                if i == rep.victim:
                    rep.victim_nonfinite |= not bool(torch.isfinite(rows).all())
            m.commit(ids, acc)
            rep.verify_steps += 1
        else:
            lg = core(ids, [live[i].out[-1] for i in ids], 1)
            for i, row, am in zip(ids, lg, lg.argmax(-1).tolist()):
                live[i].out.append(am)
                if i == rep.victim:
                    rep.victim_nonfinite |= not bool(torch.isfinite(row).all())
        rep.steps += 1
        rep.row_steps += len(ids)
        rep.max_live = max(rep.max_live, len(ids))
        check_accounting(m, live)
        done = [i for i in ids if len(live[i].out) >= live[i].max_new]
        m.release(done)
        for i in done:
            rep.tokens[i] = live.pop(i).out
            rep.finished += 1
        check_accounting(m, live)
        if on_step:
            on_step(rep)
    m.release(sorted(live))
    for i, r in live.items():
        rep.tokens[i] = r.out
    live.clear()
    check_accounting(m, live)
    if mgr.free_slots != mgr.num_slots or mgr.free_pages != mgr.num_pages:
        raise CacheStateError("pages or slots leaked after every request was freed")
    return rep
