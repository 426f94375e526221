"""One cell of the accuracy table on K3Model: a serving setting (path, KV dtype, SSM dtype, batch size,
CUDA graphs, n-gram speculative decoding) run over the question set by greedy generation through
model/generate.py's Generator (prefill, decode or verify + commit, graphs per batch size), exactly as
`k3gen generate` serves. Answers are the emitted tokens, len(answer) of them per question (the
answer ends with EOS, so an exact match also stopped where it should).

Questions are served in a fixed order (longest prompt first, then by id) in consecutive batches of
`batch`, so a cell's batches are the same every run and batch sizes can be compared question by
question (batch invariance: a question's answer must not depend on its batch).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from model.train.tasks import Question

MAX_DRAFTS = 3          # the n-gram drafter's draft count when speculative decoding is on


@dataclass(frozen=True)
class Cell:
    path: str           # "fp32" (teacher forcing, model/eval/fp32.py), "reference" or "kernel" (K3Model)
    kv: str = "bf16"
    ssm: str = "fp32"
    batch: int = 1
    graphs: bool = False
    spec: int = 0       # drafts per verify step; 0: plain decoding
    weights: str = "checkpoint"     # fp32 only: "checkpoint" (stored values) or "master" (FP32 training weights)

    @property
    def name(self) -> str:
        if self.path == "fp32":
            return "fp32 reference" + (" (FP32 master weights)" if self.weights == "master" else "")
        s = f"{self.path} kv={self.kv} ssm={self.ssm} b={self.batch}"
        return s + (" graphs" if self.graphs else "") + (f" spec={self.spec}" if self.spec else "")

    @property
    def group(self) -> tuple:
        """Cells of one group should give the same answers (batch, graphs and spec may not change them)."""
        return (self.path, self.kv, self.ssm, self.weights)


def serve_order(questions: list[Question]) -> list[int]:
    return sorted(range(len(questions)), key=lambda i: (-len(questions[i].prompt), questions[i].qid))


def run_cell(cell: Cell, questions: list[Question], checkpoint, arch: str, device: str, on_done=None) -> dict:
    """{"answers": [tokens per question], "seconds", "accepted_per_verify"} of a K3Model cell."""
    from model.config import config_from_json
    from model.generate import Generator, Request, build_model
    cfg = config_from_json(checkpoint)
    longest = max(len(q.prompt) + len(q.answer) for q in questions)
    t0 = time.perf_counter()
    m = build_model(cfg, arch, cell.kv, cell.ssm, cell.spec, cell.path, str(checkpoint), 0, device,
                    longest + cell.spec + 1, cell.batch)
    gen = Generator(m, graphs=cell.graphs)
    setup = time.perf_counter() - t0
    answers: list = [None] * len(questions)
    order = serve_order(questions)
    t1 = time.perf_counter()
    for s in range(0, len(order), cell.batch):
        idx = order[s:s + cell.batch]
        reqs = [Request(prompt=list(questions[i].prompt), max_new=len(questions[i].answer)) for i in idx]
        gen.generate(reqs, speculative=cell.spec > 0)
        for i, r in zip(idx, reqs):
            answers[i] = list(r.out)
        if on_done:
            on_done(len(idx))
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    out = {"answers": answers, "seconds": round(time.perf_counter() - t1, 2), "setup_seconds": round(setup, 2)}
    if cell.spec:
        acc = gen.accepted
        out["accepted_per_verify"] = round(sum(acc) / len(acc), 3) if acc else 0.0
    return out


__all__ = ["Cell", "run_cell", "serve_order", "MAX_DRAFTS"]
