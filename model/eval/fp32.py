"""The FP32 reference path of the accuracy harness: exact match by teacher forcing.

Greedy decoding emits a question's answer (EOS included) iff, fed the prompt and the answer's own
earlier tokens, the model's argmax at every answer position is the answer's token (by induction over
the positions: while the emitted prefix equals the answer's, greedy sees exactly the teacher-forced
input). So one forward over prompt + answer[:-1] decides exact match, with no decode loop.

Two implementations of the same FP32 function (tests/nogpu/modeling/test_eval_harness.py checks
they agree): "chunked" runs model/train/net.py's batched forward (chunked KDA, one causal attention;
questions padded on the right, which a causal model never reads), fast enough for 8K-token
contexts on a GPU; "loop" runs model/reference.py's `Fp32Reference.prefill` one question at a time
(token-sequential KDA), the project's oracle.
"""
from __future__ import annotations

from contextlib import nullcontext

import torch

from model.train.tasks import PAD, Question


def _inputs(q: Question) -> list[int]:
    return q.prompt + q.answer[:-1]


def _score(q: Question, logits: torch.Tensor) -> tuple[bool, list[int]]:
    """logits [>= len(inputs), vocab] of one question -> (exact match, argmax at answer positions)."""
    P, A = len(q.prompt), len(q.answer)
    pred = logits[P - 1:P - 1 + A].argmax(-1).tolist()
    return pred == q.answer, pred


def batches(questions: list[Question], max_tokens: int) -> list[list[int]]:
    """Indices of `questions` grouped by input length (longest first), each group's padded size
    [n, longest] within max_tokens (at least one question per group)."""
    order = sorted(range(len(questions)), key=lambda i: -len(_inputs(questions[i])))
    out, cur = [], []
    for i in order:
        longest = len(_inputs(questions[cur[0]])) if cur else len(_inputs(questions[i]))
        if cur and (len(cur) + 1) * longest > max_tokens:
            out.append(cur)
            cur = []
        cur.append(i)
    return out + ([cur] if cur else [])


@torch.no_grad()
def teacher_forced_chunked(net, questions: list[Question], device, max_tokens: int = 65536, on_done=None):
    """[(exact match, argmax tokens)] per question through a K3Train `net` (FP32, no TF32)."""
    results: list = [None] * len(questions)
    was_training = net.training
    net.eval()
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        for idx in batches(questions, max_tokens):
            seqs = [_inputs(questions[i]) for i in idx]
            T = max(len(s) for s in seqs)
            toks = torch.full((len(seqs), T), PAD, dtype=torch.long)
            for r, s in enumerate(seqs):
                toks[r, :len(s)] = torch.tensor(s)
            logits = net(toks.to(device)).float().cpu()
            for r, i in enumerate(idx):
                results[i] = _score(questions[i], logits[r])
            if on_done:
                on_done(len(idx))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
        net.train(was_training)
    return results


@torch.no_grad()
def teacher_forced_loop(cfg, tensors: dict, questions: list[Question], device="cpu", on_done=None):
    """The same through model/reference.py's Fp32Reference, one question at a time."""
    from model.reference import Fp32Reference
    ctx = torch.device(device) if str(device) != "cpu" else nullcontext()
    with ctx:          # the reference makes its state with the default device
        ref = Fp32Reference(cfg, {n: t.to(device) for n, t in tensors.items()})
        out = []
        for q in questions:
            out.append(_score(q, ref.prefill(torch.tensor(_inputs(q), device=device)).float().cpu()))
            if on_done:
                on_done(1)
    return out


__all__ = ["teacher_forced_chunked", "teacher_forced_loop", "batches"]
