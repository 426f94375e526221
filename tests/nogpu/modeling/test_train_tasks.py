"""The synthetic tasks (model/train/tasks.py): every answer is right, the held-out arithmetic problems
never reach training, retrieval asks for a key of its own context, the held-out set is fixed, and the
loss masks select exactly the answers."""
from __future__ import annotations

import numpy as np
import pytest

from k3gen.errors import SpecError
from model.train import tasks as T

SPEC = T.TaskSpec()


def _number(digit_tokens) -> int:
    return sum((int(t) - T.DIGIT) * 10 ** i for i, t in enumerate(digit_tokens))


def _check_problem(p, spec=SPEC) -> tuple[int, int, int]:
    W = spec.digits
    a, op, b, eq = _number(p[:W]), p[W], _number(p[W + 1:2 * W + 1]), p[2 * W + 1]
    c = _number(p[2 * W + 2:3 * W + 3])
    assert eq == T.EQ and p[-1] == T.EOS and op in (T.PLUS, T.MINUS)
    assert c == (a + b if op == T.PLUS else a - b) and c >= 0
    return a, (0 if op == T.PLUS else 1), b


def test_arithmetic_answers_and_the_held_out_split():
    rng = np.random.default_rng(1)
    train = T.arith_problems(rng, 4000, SPEC)
    held = T.arith_problems(rng, 300, SPEC, want_held_out=True)
    for rows, want in ((train, False), (held, True)):
        abo = np.array([_check_problem(r) for r in rows])
        assert (T.held_out(abo[:, 0], abo[:, 1], abo[:, 2]) == want).all()
    frac = T.held_out(np.arange(20000), np.zeros(20000, np.int64), np.arange(20000) * 7).mean()
    assert abs(frac - 1 / T.HELD_OUT_MOD) < 0.01
    # every digit count occurs, for both operands, and both operations
    a = np.array([_number(r[:4]) for r in train])
    assert {len(str(x)) for x in a} == {1, 2, 3, 4}
    assert set(train[:, SPEC.digits].tolist()) == {T.PLUS, T.MINUS}


def test_arith_batch_packs_problems_and_masks_answers():
    x, y, m = T.arith_batch(np.random.default_rng(2), 3, 5, SPEC)
    L = SPEC.arith_len
    assert x.shape == y.shape == m.shape == (3, 5 * L)
    assert (x[:, 0] == T.BOS).all() and (y[:, :-1] == x[:, 1:]).all()
    for row, tgt, mask in zip(x, y, m):
        probs = np.concatenate([row[1:], tgt[-1:]]).reshape(5, L)
        for p in probs:
            _check_problem(p)
        assert mask.sum() == 5 * SPEC.answer_len
        assert (tgt[mask].reshape(5, -1) == probs[:, -SPEC.answer_len:]).all()


RETRIEVAL_SPECS = [T.TaskSpec(key_len=1), T.TaskSpec(key_len=2), T.TaskSpec(vocab=3136, key_len=1, val_len=1,
                                                                                val_symbols=256),
                   T.TaskSpec(vocab=128, key_len=2, val_len=1, val_symbols=32),                  # acc
                   T.TaskSpec(vocab=2912, key_len=1, val_len=1, val_symbols=32),                 # acc-k1
                   T.TaskSpec(vocab=128, key_len=2, val_len=1, val_symbols=32, order="vk")]


def _split(pairs: np.ndarray, spec: T.TaskSpec):
    """(keys, values) of context pairs [n, pair_len] in the spec's order."""
    k, nv = spec.key_len, spec.val_len
    if spec.order == "kv":
        return pairs[:, :k], pairs[:, k:k + nv]
    return pairs[:, nv:nv + k], pairs[:, :nv]


@pytest.mark.parametrize("spec", RETRIEVAL_SPECS)
def test_retrieval_sequences_answer_from_their_context(spec):
    P, Q, k, nv = spec.pair_len, spec.query_len, spec.key_len, spec.val_len
    toks, mask = T.retrieval_sequence(np.random.default_rng(3), 50, 7, spec)
    assert toks[0] == T.BOS and len(toks) == 1 + 50 * P + 7 * Q
    pairs = toks[1:1 + 50 * P].reshape(50, P)
    assert (pairs[:, -1] == T.SEP).all()
    keys, vals = _split(pairs, spec)
    table = {tuple(a): tuple(b) for a, b in zip(keys, vals)}
    assert len(table) == 50                                          # distinct keys
    assert (keys >= T.SYM).all() and (keys < T.SYM + spec.key_symbols).all() and (vals < spec.vocab).all()
    if spec.val_symbols:                                             # values never read as keys
        assert (vals >= T.SYM + spec.key_symbols).all()
    qs = toks[1 + 50 * P:].reshape(7, Q)
    for q in qs:
        assert q[0] == T.QUERY and q[-1] == T.EOS and table[tuple(q[1:k + 1])] == tuple(q[k + 1:k + 1 + nv])
    assert len({tuple(q[1:k + 1]) for q in qs}) == 7
    a = spec.retrieval_answer_len
    assert (toks[mask].reshape(7, a) == qs[:, -a:]).all()
    x, y, m = T.retrieval_batch(np.random.default_rng(4), 2, 1000, 8, spec)
    assert x.shape[1] <= 1000 and m.sum(1).tolist() == [8 * a, 8 * a]
    with pytest.raises(SpecError, match="distinct keys"):
        T.retrieval_sequence(np.random.default_rng(0), spec.keys + 1, 1, spec)


@pytest.mark.parametrize("spec", RETRIEVAL_SPECS[1:])      # vocabularies with keys for 8K-token contexts
def test_question_set_is_fixed_and_held_out(spec):
    qs = T.question_set(12, spec)
    assert [q.text() for q in qs] == [q.text() for q in T.question_set(24, spec)[:12]]
    assert [q.prompt for q in qs] == [q.prompt for q in T.question_set(12, spec)]
    k = spec.key_len
    for q in qs:
        assert q.answer[-1] == T.EOS and q.prompt[0] == T.BOS
        if q.task == "arith":
            a, op, b = _check_problem(q.prompt[1:] + q.answer)
            assert T.held_out(np.array([a]), np.array([op]), np.array([b]))[0]
        else:
            assert q.length - spec.pair_len < len(q.prompt) <= q.length and q.prompt[-k - 1] == T.QUERY
            ctx = np.array(q.prompt[1:-k - 1]).reshape(-1, spec.pair_len)
            table = {tuple(a): list(b) for a, b in zip(*_split(ctx, spec))}
            assert table[tuple(q.prompt[-k:])] + [T.EOS] == q.answer
    assert sorted({q.length for q in qs if q.task == "retrieval"}) == list(T.LENGTHS)
    assert T.decode_answer(qs[0].answer).endswith("<eos>")
    with pytest.raises(SpecError, match="retrieval length"):
        T.question(1, T.TaskSpec(vocab=128, key_len=1), lengths=(8192,))


def test_bad_task_specs_are_typed_errors():
    for kw in ({"vocab": 40}, {"digits": 0}, {"ops": ("*",)}, {"key_len": 3}, {"val_len": 0}, {"val_symbols": 480},
               {"order": "qa"}):
        with pytest.raises(SpecError):
            T.TaskSpec(**kw)
