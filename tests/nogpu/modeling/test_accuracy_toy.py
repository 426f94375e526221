"""Accuracy of a model trained here, on the CPU: tests/golden/acc_toy/ is the toy K3 (2 layers, KDA then
MLA, AttnRes, latent MoE, SiTU; 1.26 M parameters) trained 800 steps on the CPU
(`python -m model train --config toy --steps 800 --threads 1`, docs/ACCURACY.md) and exported in the
official MXFP4 layout. Measured on 400 held-out questions: 97.2% exact match through the FP32 reference
path (arithmetic 100%, retrieval 94.5%), 96.8% through K3Model's reference path for every KV and SSM
dtype. Here fewer questions and bounds with room for FP32 noise: a model, loader or serving change that
breaks the math drops these to chance."""
from __future__ import annotations

from pathlib import Path

import pytest

from model.config import config_from_json
from model.eval.command import task_spec
from model.eval.fp32 import teacher_forced_chunked, teacher_forced_loop
from model.eval.serve import Cell, run_cell
from model.train.export import read_canonical
from model.train.net import K3Train
from model.train.tasks import question_set

CK = Path(__file__).resolve().parents[2] / "golden" / "acc_toy"
LENGTHS = (64, 128, 192)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def toy():
    cfg = config_from_json(CK)
    spec = task_spec(CK, cfg)
    _, tensors = read_canonical(CK, cfg)
    return cfg, tensors, question_set(120, spec, LENGTHS)


def test_fp32_reference_path_answers(toy):
    cfg, tensors, qs = toy
    res = teacher_forced_chunked(K3Train(cfg, tensors=tensors, chunk=16, sub=16), qs, "cpu")
    ok = [r[0] for r in res]
    arith = [o for q, o in zip(qs, ok) if q.task == "arith"]
    assert all(arith) and sum(ok) / len(ok) >= 0.93, (sum(arith), sum(ok))
    # the oracle (model/reference.py, token-sequential KDA) answers the same
    assert [r[1] for r in teacher_forced_loop(cfg, tensors, qs[:16])] == [r[1] for r in res[:16]]


@pytest.mark.parametrize("kv,ssm", [("bf16", "fp32"), ("nvfp4", "bf16")])
def test_reference_serving_path_answers(toy, kv, ssm):
    cfg, _, qs = toy
    qs = qs[:40]
    plain = run_cell(Cell("reference", kv, ssm, batch=2), qs, CK, "sm90", "cpu")["answers"]
    spec = run_cell(Cell("reference", kv, ssm, batch=2, spec=3), qs, CK, "sm90", "cpu")
    ok = [a == q.answer for a, q in zip(plain, qs)]
    assert sum(ok) / len(ok) >= 0.9, sum(ok)
    assert spec["answers"] == plain and spec["accepted_per_verify"] > 0
