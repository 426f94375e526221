"""decode_tm.cuh's mbarrier protocol on the CPU under random interleavings (nothing runs on a GPU).

Actors, as the kernel orders them: the producer (lane 0 of warp 4: TMA / bulk copies into the ring),
the decoders (warps 6-9, FP8 / NVFP4: raw stage -> operand tile), the MMA issuer (lane 0 of warp 5:
QK ahead by one tile when there are two operand tiles, PV, tcgen05.commit), the softmax warps (one
actor: their named barriers are internal). Asynchronous work (TMA / bulk copies, MMAs and their
commits, which arrive in issue order once everything before them completed) finishes at random
later steps. mbarrier waits use the hardware's parity rule; every successful wait must find the
phase it was meant for (not one further), every buffer access must see the tile it expects with no
conflicting access in flight, and every run must finish (no deadlock). Three protocol mutations are
caught."""
from __future__ import annotations

import random

import pytest


class Bar:
    def __init__(self, count: int):
        self.count, self.pending, self.phases = count, 0, 0

    def arrive(self, k: int = 1):
        self.pending += k
        assert self.pending <= self.count, "more arrivals than the phase expects"
        if self.pending == self.count:
            self.phases, self.pending = self.phases + 1, 0


class Sim:
    def __init__(self, n: int, os_: int, rs: int, bf16: bool, seed: int, mutation: str = ""):
        self.n, self.os, self.rs, self.bf16, self.mut = n, os_, rs, bf16, mutation
        self.rng = random.Random(seed)
        ring = os_ if bf16 else rs
        self.full = [Bar(1) for _ in range(ring)]
        self.empty = [Bar(1 if bf16 else 128) for _ in range(ring)]
        self.op_full = [Bar(128) for _ in range(os_)]
        self.op_empty = [Bar(1) for _ in range(os_)]
        self.s_full, self.p_full, self.o_done = [Bar(1), Bar(1)], Bar(128), Bar(1)
        self.op = [None] * os_          # tile held by each operand tile
        self.raw = [None] * rs
        self.s = [None, None]           # tile whose scores each S^T buffer holds
        self.p = None                   # tile whose P^T the P buffer holds
        self.o = -1                     # last tile accumulated into O^T
        self.s_reading = [None, None]   # tile the softmax is reading from each S^T buffer
        self.writing = set()            # ("op" | "raw", index) with a copy in flight
        self.fifo = []                  # issued tcgen05 MMAs / commits, completing in order
        self.copies = []                # in-flight copies: (kind, index, tile, full barrier)

    # -- checks ---------------------------------------------------------------------------------------
    def mma_reads(self, kind, idx):
        return any(m[0] in ("qk", "pv") and (kind, idx) in m[2] for m in self.fifo)

    def wait(self, bar: Bar, k: int) -> bool:
        if (bar.phases & 1) == (k & 1):
            return False
        assert bar.phases == k + 1, f"wait for phase {k} passed at phase {bar.phases}"
        return True

    # -- actors (generators yielding a wait predicate) -------------------------------------------------
    def producer(self):
        ring = self.os if self.bf16 else self.rs
        for it in range(self.n):
            s = it % ring
            if it >= ring:
                yield lambda: self.wait(self.empty[s], it // ring - 1 + (self.mut == "producer_parity"))
            kind = "op" if self.bf16 else "raw"
            assert (kind, s) not in self.writing and not self.mma_reads(kind, s), f"{kind}[{s}] still in use"
            self.writing.add((kind, s))
            self.copies.append((kind, s, it, self.full[s]))

    def decoders(self):
        for it in range(self.n):
            s, os_ = it % self.rs, it % self.os
            yield lambda: self.wait(self.full[s], it // self.rs)
            if it >= self.os and self.mut != "decoder_no_op_empty":
                yield lambda: self.wait(self.op_empty[os_], it // self.os - 1)
            assert self.raw[s] == it and ("raw", s) not in self.writing
            assert not self.mma_reads("op", os_), f"decoders overwrite op[{os_}] under an MMA"
            self.op[os_] = it
            self.empty[s].arrive(128)
            self.op_full[os_].arrive(128)

    def mma(self):
        def issue_qk(it):
            s = it % self.os
            yield lambda: self.wait((self.full if self.bf16 else self.op_full)[s], it // self.os)
            assert self.op[s] == it and ("op", s) not in self.writing
            b = it & 1
            assert self.s_reading[b] is None, f"QK({it}) overwrites S^T[{b}] under the softmax"
            self.fifo.append(("qk", it, {("op", s)}))
            self.fifo.append(("commit", self.s_full[b]))
        ahead = self.os >= 2
        if ahead and self.n:
            yield from issue_qk(0)
        for it in range(self.n):
            if not ahead:
                yield from issue_qk(it)
            elif it + 1 < self.n:
                yield from issue_qk(it + 1)
            yield lambda: self.wait(self.p_full, it)
            s = it % self.os
            assert self.op[s] == it and self.p == it
            self.fifo.append(("pv", it, {("op", s), ("p", 0), ("o", 0)}))
            self.fifo.append(("commit", self.o_done))
            release = (self.empty if self.bf16 else self.op_empty)[s]
            if self.mut == "release_before_pv":   # the operand tile released with QK's commit instead
                self.fifo.insert(len(self.fifo) - 2, ("commit", release))
            else:
                self.fifo.append(("commit", release))

    def softmax(self):
        for it in range(self.n):
            b = it & 1
            yield lambda: self.wait(self.s_full[b], it >> 1)
            assert self.s[b] == it
            self.s_reading[b] = it
            if it > 0:
                yield lambda: self.wait(self.o_done, it - 1)
            assert not self.mma_reads("o", 0) and not self.mma_reads("p", 0), "O / P touched under PV"
            assert self.o == it - 1
            if self.bf16:   # the owners zero the V rows past the end: no copy or MMA on that tile
                s = it % self.os
                assert self.op[s] == it and ("op", s) not in self.writing and not self.mma_reads("op", s)
            self.p = it
            self.s_reading[b] = None
            self.p_full.arrive(128)
        if self.n:
            yield lambda: self.wait(self.o_done, self.n - 1)
        assert self.o == self.n - 1 and not self.mma_reads("o", 0)

    # -- the scheduler ------------------------------------------------------------------------------
    def run(self):
        actors = [self.producer(), self.mma(), self.softmax()] + ([] if self.bf16 else [self.decoders()])
        waits = {}
        for a in actors:
            waits[a] = next(a, None)
        live = {a for a, w in waits.items() if w is not None}
        for _ in range(100000):
            choices = [("actor", a) for a in live if waits[a]()]
            if self.copies:
                choices.append(("copy", None))
            if self.fifo:
                choices.append(("mma", None))
            if not choices:
                assert not live, "deadlock"
                return
            kind, a = self.rng.choice(choices)
            if kind == "actor":
                waits[a] = next(a, None)
                if waits[a] is None:
                    live.discard(a)
            elif kind == "copy":
                what, idx, tile, bar = self.copies.pop(self.rng.randrange(len(self.copies)))
                (self.op if what == "op" else self.raw)[idx] = tile
                self.writing.discard((what, idx))
                bar.arrive()
            else:
                head = self.fifo.pop(0)
                if head[0] == "commit":
                    head[1].arrive()
                elif head[0] == "qk":
                    self.s[head[1] & 1] = head[1]
                else:
                    self.o = head[1]
        raise AssertionError("did not finish")


CASES = [(True, 2, 0), (True, 3, 0), (False, 1, 3), (False, 2, 2), (False, 1, 4), (False, 1, 1)]


@pytest.mark.parametrize("bf16,os_,rs", CASES)
def test_protocol_holds_under_random_interleavings(bf16, os_, rs):
    for seed in range(60):
        for n in (0, 1, 2, 5, 9):
            Sim(n, os_, rs, bf16, seed).run()


@pytest.mark.parametrize("mutation,bf16,os_,rs", [("producer_parity", True, 2, 0),
                                                  ("decoder_no_op_empty", False, 2, 2),
                                                  ("release_before_pv", False, 1, 3)])
def test_protocol_mutations_are_caught(mutation, bf16, os_, rs):
    caught = 0
    for seed in range(60):
        try:
            Sim(7, os_, rs, bf16, seed, mutation).run()
        except AssertionError:
            caught += 1
    assert caught > 0, mutation
