"""Synthetic tasks with exact answers, in tokens: multi-digit arithmetic and key-value retrieval over
long contexts. One vocabulary, a training stream and a fixed held-out question set.

Vocabulary (ids below `SYM` are special or digits; `SYM..vocab-1` are symbols for keys and values):
PAD 0, BOS 1, EOS 2, SEP 3, PLUS 4, MINUS 5, EQ 6, (7 unused), QUERY 8, digits 0-9 at 16-25.

Arithmetic: `BOS a op b EQ` -> `c EOS`, op + or - (a >= b for -). Every number is written least
significant digit first, zero-padded to a fixed width (`digits` for a and b, digits + 1 for c): the
answer's i-th digit depends on the operands' i-th digits and the carry, in the order it is emitted.
Operands draw a digit count uniformly in 1..digits, then a value with that many digits. A problem is
held out (never trained on) iff `held_out(a, op, b)`: a fixed hash picks 1 in 32.

Retrieval: `BOS (key value SEP)^n QUERY key` -> `value EOS`: n pairs of distinct keys of `key_len`
symbols and values of `val_len` symbols (drawn from their own symbols with `val_symbols`, so a value
never reads as a key), then one key asked for. The value follows its key directly in the
context and the answer follows the asked key: the lookup an induction head makes (attend from the
current token to the position whose previous token it is, copy that position's token). A prompt of context length L holds
as many pairs as fit (`pairs_for`). Training sequences ask `queries` keys in a row (each answered and closed by
EOS); held-out contexts come from a random stream disjoint from the training one (different seeds).

The held-out set: question i comes from its own generator (seed, i), so the first N questions are the
same whatever N. Even i: arithmetic; odd i: retrieval, context lengths cycling through `lengths`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from k3gen.errors import SpecError

PAD, BOS, EOS, SEP, PLUS, MINUS, EQ, COLON, QUERY = range(9)
DIGIT = 16
SYM = 32
LENGTHS = (1024, 2048, 4096, 8192)
HELD_OUT_MOD = 32
EVAL_SEED = 0x5EED_E7A1        # the held-out stream; training streams use (train seed, step)


@dataclass(frozen=True)
class TaskSpec:
    vocab: int = 512
    digits: int = 4               # operand width (the answer has digits + 1)
    ops: tuple[str, ...] = ("+", "-")
    key_len: int = 2              # symbols per retrieval key
    val_len: int = 2              # symbols per retrieval value
    val_symbols: int = 0          # values from the last val_symbols symbols, keys from the others; 0: shared
    order: str = "kv"             # a context pair: key value SEP ("kv") or value key SEP ("vk")

    def __post_init__(self):
        if self.vocab < SYM + 16:
            raise SpecError("vocab", self.vocab, f">= {SYM + 16}", "symbols for keys and values")
        if not 1 <= self.digits <= 9:
            raise SpecError("digits", self.digits, "1..9")
        if not self.ops or any(o not in "+-" for o in self.ops):
            raise SpecError("ops", self.ops, "a non-empty subset of ('+', '-')")
        if self.key_len not in (1, 2) or self.val_len not in (1, 2):
            raise SpecError("key_len/val_len", (self.key_len, self.val_len), "1 or 2 each")
        if not 0 <= self.val_symbols < self.symbols:
            raise SpecError("val_symbols", self.val_symbols, f"0..{self.symbols - 1}")
        if self.order not in ("kv", "vk"):
            raise SpecError("order", self.order, ["kv", "vk"])

    @property
    def pair_len(self) -> int:
        """Tokens of one context pair: key value SEP."""
        return self.key_len + self.val_len + 1

    @property
    def query_len(self) -> int:
        """Tokens of one asked and answered key: QUERY key value EOS."""
        return self.key_len + self.val_len + 2

    @property
    def key_symbols(self) -> int:
        return self.symbols - self.val_symbols

    @property
    def keys(self) -> int:
        return self.key_symbols ** self.key_len

    @property
    def retrieval_answer_len(self) -> int:
        return self.val_len + 1

    @property
    def symbols(self) -> int:
        return self.vocab - SYM

    @property
    def arith_len(self) -> int:
        """Tokens of one problem with its answer: a op b EQ c EOS."""
        return 3 * self.digits + 4

    @property
    def answer_len(self) -> int:
        return self.digits + 2


@dataclass
class Question:
    qid: int
    task: str                     # "arith" or "retrieval"
    length: int                   # retrieval: the context length bucket; arith: 0
    prompt: list[int] = field(repr=False)
    answer: list[int]             # ends with EOS

    def text(self) -> str:
        return f"{self.task}{'' if not self.length else f'@{self.length}'}#{self.qid}"


# -- arithmetic ------------------------------------------------------------------------------------
def held_out(a: np.ndarray, op: np.ndarray, b: np.ndarray) -> np.ndarray:
    """True for the problems kept out of training (op: 0 for +, 1 for -): a splitmix64-style hash."""
    h = (np.asarray(a, np.uint64) * np.uint64(0x9E3779B97F4A7C15)
         ^ (np.asarray(b, np.uint64) + np.uint64(0x632BE59BD9B4E019)) * np.uint64(0xBF58476D1CE4E5B9)
         ^ np.asarray(op, np.uint64) * np.uint64(0x94D049BB133111EB))
    h ^= h >> np.uint64(31)
    h *= np.uint64(0xD6E8FEB86659FD93)
    h ^= h >> np.uint64(29)
    return (h % np.uint64(HELD_OUT_MOD)) == 0


def _operands(rng: np.random.Generator, n: int, digits: int) -> np.ndarray:
    d = rng.integers(1, digits + 1, size=n)
    lo = np.where(d == 1, 0, 10 ** (d - 1))
    return rng.integers(lo, 10 ** d)


def _digits(x: np.ndarray, width: int) -> np.ndarray:
    """[n, width] digit tokens, least significant first."""
    p = 10 ** np.arange(width, dtype=np.int64)
    return DIGIT + (x[:, None] // p) % 10


def arith_problems(rng: np.random.Generator, n: int, spec: TaskSpec, want_held_out: bool = False) -> np.ndarray:
    """[n, arith_len] problems with answers (a op b EQ c EOS), none held out (or only held-out ones)."""
    out = np.empty((0, spec.arith_len), np.int64)
    while len(out) < n:
        m = 2 * (n - len(out)) * (HELD_OUT_MOD if want_held_out else 1)
        a, b = _operands(rng, m, spec.digits), _operands(rng, m, spec.digits)
        op = rng.integers(0, len(spec.ops), size=m)
        minus = np.array([o == "-" for o in spec.ops])[op]
        a, b = np.where(minus & (b > a), b, a), np.where(minus & (b > a), a, b)
        keep = held_out(a, minus.astype(np.int64), b) == want_held_out
        a, b, minus = a[keep], b[keep], minus[keep]
        c = np.where(minus, a - b, a + b)
        W = spec.digits
        rows = np.concatenate([_digits(a, W), np.where(minus, MINUS, PLUS)[:, None], _digits(b, W),
                               np.full((len(a), 1), EQ), _digits(c, W + 1), np.full((len(a), 1), EOS)], axis=1)
        out = np.concatenate([out, rows])
    return out[:n]


def arith_batch(rng: np.random.Generator, batch: int, per_seq: int, spec: TaskSpec):
    """(tokens [batch, 1 + per_seq * arith_len], targets, mask): BOS and `per_seq` packed problems;
    the loss is on the answer digits and their EOS (targets[t] = tokens[t + 1])."""
    p = arith_problems(rng, batch * per_seq, spec).reshape(batch, per_seq * spec.arith_len)
    toks = np.concatenate([np.full((batch, 1), BOS), p], axis=1)
    start = 2 * spec.digits + 2                       # the answer's first digit inside a problem
    m = np.zeros(spec.arith_len, bool)
    m[start:] = True
    mask = np.concatenate([np.zeros((batch, 1), bool), np.tile(m, (batch, per_seq))], axis=1)
    return _shift(toks, mask)


def _shift(toks: np.ndarray, mask: np.ndarray):
    """Inputs tokens[:, :-1], targets tokens[:, 1:], the mask of the targets."""
    return toks[:, :-1], toks[:, 1:], mask[:, 1:]


# -- retrieval -------------------------------------------------------------------------------------
def pairs_for(length: int, spec: TaskSpec) -> int:
    """Pairs in a prompt of at most `length` tokens (BOS, the pairs, QUERY key)."""
    n = (length - 2 - spec.key_len) // spec.pair_len
    if not 1 <= n <= spec.keys:
        raise SpecError("retrieval length", length, f"{spec.pair_len + 2 + spec.key_len}.."
                        f"{spec.keys * spec.pair_len + 2 + spec.key_len} tokens", f"{spec.keys} distinct keys")
    return n


def _digits_of(x: np.ndarray, base: int, n: int) -> np.ndarray:
    return np.stack([(x // base ** (n - 1 - j)) % base for j in range(n)], 1)


def _keys_values(rng: np.random.Generator, n: int, spec: TaskSpec):
    """Distinct keys [n, key_len] and values [n, val_len], as tokens."""
    Sk = spec.key_symbols
    if n > spec.keys:
        raise SpecError("pairs", n, f"<= {spec.keys}", f"distinct keys of {spec.key_len} of {Sk} symbols")
    keys = rng.choice(spec.keys, size=n, replace=False)
    Sv = spec.val_symbols or spec.symbols
    v0 = SYM + (Sk if spec.val_symbols else 0)
    vals = rng.integers(0, Sv ** spec.val_len, size=n)
    return SYM + _digits_of(keys, Sk, spec.key_len), v0 + _digits_of(vals, Sv, spec.val_len)


def retrieval_sequence(rng: np.random.Generator, n_pairs: int, queries: int, spec: TaskSpec):
    """(tokens, mask) of BOS, n_pairs pairs and `queries` distinct keys asked and answered."""
    k, v = _keys_values(rng, n_pairs, spec)
    kv = (k, v) if spec.order == "kv" else (v, k)
    ctx = np.concatenate([*kv, np.full((n_pairs, 1), SEP)], axis=1).reshape(-1)
    ask = rng.choice(n_pairs, size=min(queries, n_pairs), replace=False)
    qs = np.concatenate([np.full((len(ask), 1), QUERY), k[ask], v[ask],
                         np.full((len(ask), 1), EOS)], axis=1)
    toks = np.concatenate([[BOS], ctx, qs.reshape(-1)])
    qm = np.zeros(spec.query_len, bool)
    qm[-spec.retrieval_answer_len:] = True
    mask = np.concatenate([np.zeros(1 + ctx.size, bool), np.tile(qm, len(ask))])
    return toks, mask


def retrieval_batch(rng: np.random.Generator, batch: int, length: int, queries: int, spec: TaskSpec):
    """Sequences of `length` tokens: as many pairs as fit before `queries` questions."""
    n = min(spec.keys, max(queries, (length - 1 - queries * spec.query_len) // spec.pair_len))
    rows = [retrieval_sequence(rng, n, queries, spec) for _ in range(batch)]
    return _shift(np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows]))


# -- the held-out question set ---------------------------------------------------------------------
def question(i: int, spec: TaskSpec, lengths=LENGTHS, seed: int = EVAL_SEED) -> Question:
    rng = np.random.default_rng([seed, i])
    if i % 2 == 0:
        p = arith_problems(rng, 1, spec, want_held_out=True)[0].tolist()
        cut = 2 * spec.digits + 2
        return Question(i, "arith", 0, [BOS] + p[:cut], p[cut:])
    L = lengths[(i // 2) % len(lengths)]
    toks, _ = retrieval_sequence(rng, pairs_for(L, spec), 1, spec)
    toks = toks.tolist()
    a = spec.retrieval_answer_len
    return Question(i, "retrieval", L, toks[:-a], toks[-a:])


def question_set(n: int, spec: TaskSpec, lengths=LENGTHS, seed: int = EVAL_SEED) -> list[Question]:
    return [question(i, spec, tuple(lengths), seed) for i in range(n)]


def decode_answer(tokens: list[int]) -> str:
    """A readable form of answer tokens (digits, symbols as s<N>), for reports."""
    out = []
    for t in tokens:
        if DIGIT <= t < DIGIT + 10:
            out.append(str(t - DIGIT))
        elif t >= SYM:
            out.append(f"s{t - SYM}")
        else:
            out.append({EOS: "<eos>", PLUS: "+", MINUS: "-", EQ: "=", COLON: ":", QUERY: "?", SEP: ";",
                        BOS: "<bos>", PAD: "<pad>"}.get(t, f"<{t}>"))
    return " ".join(out)


__all__ = ["TaskSpec", "Question", "question", "question_set", "arith_batch", "retrieval_batch", "arith_problems",
           "retrieval_sequence", "held_out", "pairs_for", "decode_answer", "LENGTHS", "BOS", "EOS", "PAD", "SYM",
           "DIGIT"]
