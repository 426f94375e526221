"""The accuracy harness (`python -m model eval`, model/eval/) on the CPU with a small random model: the
Wilson interval, teacher forcing decides exactly what greedy decoding emits (both FP32
implementations), and the command runs the FP32 rows and a grid of reference-path cells (batch sizes,
n-gram speculative decoding) into a table, results.json/md/png; the reference path gives every batch
size and speculative decoding the answers of batch 1."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from model.cli import main
from model.config import config_from_dict
from model.eval import report as R
from model.eval.fp32 import batches, teacher_forced_chunked, teacher_forced_loop
from model.reference import Fp32Reference
from model.train.config import TOY_TASK, toy_config
from model.train.export import export_checkpoint, read_canonical, save_fp32
from model.train.net import K3Train
from model.train.tasks import EOS, Question, question_set

CFG = config_from_dict(toy_config())
SPEC = TOY_TASK


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("run")
    net = K3Train(CFG, seed=11)
    with torch.no_grad():
        for n, p in net.p.items():
            if n.endswith("res_proj/weight"):
                p.normal_(0, 0.3, generator=torch.Generator().manual_seed(1))
    folder = export_checkpoint(net.tensors(), CFG, toy_config(), d / "checkpoint")
    (folder / "tasks.json").write_text(json.dumps(dataclasses.asdict(SPEC)))
    save_fp32(net.tensors(), d / "fp32.safetensors")
    return d


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_wilson_interval():
    assert R.wilson(0, 10) == pytest.approx((0.0, 0.27753), abs=1e-5)
    assert R.wilson(10, 10) == pytest.approx((0.72247, 1.0), abs=1e-5)
    lo, hi = R.wilson(5, 10)
    assert lo == pytest.approx(0.23659, abs=1e-5) and hi == pytest.approx(1 - lo)
    lo, hi = R.wilson(990, 1000)
    assert lo < 0.99 < hi and hi - lo < 0.015
    assert R.wilson(0, 0) == (0.0, 1.0)


def test_batches_cover_every_question_once():
    qs = question_set(9, SPEC, lengths=(64, 160))
    got = batches(qs, max_tokens=400)
    assert sorted(i for b in got for i in b) == list(range(9))
    for b in got:
        assert len(b) == 1 or len(b) * max(len(qs[i].prompt) + len(qs[i].answer) - 1 for i in b) <= 400


def test_teacher_forcing_decides_greedy_exact_match(ckpt):
    """Questions whose answer is the model's own greedy output (every token, EOS or not) must score
    as matches with that output as the prediction; the same answer with its last token changed must not."""
    cfg, stored = read_canonical(ckpt / "checkpoint")
    ref = Fp32Reference(cfg, stored)
    qs = []
    for q in question_set(6, SPEC, lengths=(48, 80)):
        lg = ref.prefill(torch.tensor(q.prompt))[-1]
        greedy = []
        for _ in range(4):
            greedy.append(int(lg.argmax()))
            lg = ref.decode(greedy[-1])
        qs.append(Question(q.qid, q.task, q.length, q.prompt, greedy))
        qs.append(Question(q.qid + 100, q.task, q.length, q.prompt, greedy[:-1] + [(greedy[-1] + 1) % cfg.vocab]))
    net = K3Train(cfg, tensors=stored, chunk=16, sub=16)
    for res in (teacher_forced_chunked(net, qs, "cpu", max_tokens=300), teacher_forced_loop(cfg, stored, qs)):
        for j, (ok, pred) in enumerate(res):
            assert ok == (j % 2 == 0), j
            assert pred == qs[j - j % 2].answer


def _results(out) -> dict[str, dict]:
    return {c["cell"]: c for c in json.loads((out / "results.json").read_text())["cells"]}


def test_eval_command_on_the_reference_path(ckpt, tmp_path, capsys):
    out = tmp_path / "e"
    args = ["eval", "--checkpoint", str(ckpt / "checkpoint"), "--questions", "6", "--lengths", "32,48",
            "--batch", "1,2", "--spec", "0,3", "--fp32-weights", str(ckpt / "fp32.safetensors"), "--out", str(out)]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "95% CI" in text and "reference kv=bf16 ssm=fp32 b=2 spec=3" in text
    cells = _results(out)
    base = "reference kv=bf16 ssm=fp32 b=1"
    assert list(cells) == ["fp32 reference", "fp32 reference (FP32 master weights)", base, base[:-1] + "2",
                           base + " spec=3", base[:-1] + "2 spec=3"]
    from model.eval.command import _cells
    from types import SimpleNamespace
    grid = _cells(SimpleNamespace(fp32="off", fp32_weights=None, batch=[(2, False), (1, False)], spec=[3, 0],
                                  kv=["bf16", "nvfp4"], ssm=["fp32"]), "reference")
    assert [(c.spec, c.batch, c.kv) for c in grid] == [(0, 1, "bf16"), (0, 1, "nvfp4"), (0, 2, "bf16"), (0, 2, "nvfp4"),
                                                       (3, 1, "bf16"), (3, 1, "nvfp4"), (3, 2, "bf16"), (3, 2, "nvfp4")]
    for name, c in cells.items():
        assert c["n"] == 6 and set(c["by_task"]) == {"arith", "retrieval"} and set(c["by_length"]) == {"32", "48"}
        assert c["ci"][0] <= c["em"] <= c["ci"][1]
        assert all(len(a) == len(q.answer) for a, q in zip(c["answers"].values(), question_set(6, SPEC, (32, 48))))
        if name.startswith("reference") and name != base:
            assert c["differs_from"] == base and c["answers_differ"] == 0, name
    assert cells[base + " spec=3"]["accepted_per_verify"] >= 0
    assert "delta_vs_reference" in cells[base]
    assert (out / "results.png").stat().st_size > 10_000
    assert (out / "results.md").read_text().count("\n") == 2 + len(cells)
    # the oracle implementation of the FP32 row gives the same answers
    assert main(["eval", "--checkpoint", str(ckpt / "checkpoint"), "--questions", "6", "--lengths", "32,48",
                 "--path", "none", "--fp32", "loop", "--out", str(tmp_path / "loop")]) == 0
    assert _results(tmp_path / "loop")["fp32 reference"]["answers"] == cells["fp32 reference"]["answers"]
    # merged runs: one table
    assert main(["eval", "--merge", str(out), str(tmp_path / "loop"), "--out", str(tmp_path / "m")]) == 0
    merged = json.loads((tmp_path / "m" / "results.json").read_text())["cells"]
    assert len(merged) == len(cells) + 1 and merged[-1]["answers_differ"] == 0


def test_eval_errors_are_one_line(ckpt, tmp_path, capsys):
    ck = str(ckpt / "checkpoint")
    assert main(["eval", "--checkpoint", ck, "--path", "reference", "--batch", "1,8g", "--out", str(tmp_path)]) == 2
    assert "CUDA graphs" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["eval", "--checkpoint", ck, "--batch", "3"])
    assert "batch sizes are 1, 2, 4, 8" in capsys.readouterr().err
    assert main(["eval", "--checkpoint", str(tmp_path / "none"), "--out", str(tmp_path)]) == 2
    assert "--checkpoint" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["eval", "--checkpoint", ck, "--kv", "fp4"])
    assert "fp4" in capsys.readouterr().err
    assert EOS == 2
