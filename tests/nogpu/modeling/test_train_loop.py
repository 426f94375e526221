"""The training run (model/train/loop.py, `python -m model train`) on the CPU at toy scale: the loss
falls, a run stopped and resumed is bitwise the run that was not stopped, the schedule switches to
quantization-aware training at its fraction, and the command writes the checkpoint the eval reads."""
from __future__ import annotations

import json

import pytest
import torch

from model.cli import main
from model.train.config import TOY_TASK, get_train_config
from model.train.loop import Trainer, lr_at, ret_length


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _log(folder) -> list[dict]:
    return [json.loads(line) for line in (folder / "train_log.jsonl").read_text().splitlines()]


def test_toy_loss_falls(tmp_path):
    torch.manual_seed(0)
    tc = get_train_config("toy", log_every=5, arith_seqs=8, ret_tokens=0)
    tr = Trainer(tc, tmp_path, "cpu")
    s = tr.run(steps=30, echo=lambda _: None)
    assert s["stopped"] == "done" and s["steps"] == 30
    log = [r for r in _log(tmp_path) if "loss_arith" in r]
    first, last = log[0]["loss_arith"], sum(r["loss_arith"] for r in log[-2:]) / 2
    assert first > 4.0 and last < 0.5 * first, (first, last)     # ln(128) ~ 4.85 at start
    assert (tmp_path / "checkpoint" / "config.json").is_file() and (tmp_path / "fp32.safetensors").is_file()


def test_stop_and_resume_is_the_straight_run(tmp_path):
    tc = get_train_config("toy", ret_tokens=512, len_min=40, len_start=60, len_max=96, ret_queries=3, arith_seqs=4,
                          qat_frac=0.5, log_every=1)
    a = Trainer(tc, tmp_path / "a", "cpu")
    a.run(steps=6, echo=lambda _: None)
    b = Trainer(tc, tmp_path / "b", "cpu")
    assert b.run(steps=6, stop_at_step=3, echo=lambda _: None)["stopped"] == "stop-after"
    c = Trainer(tc, tmp_path / "b", "cpu")
    c.load_state()
    assert c.step == 3
    assert c.run(steps=6, echo=lambda _: None)["stopped"] == "done"
    for n, p in a.net.p.items():
        assert torch.equal(p, c.net.p[n]), n
    log = [r for r in _log(tmp_path / "a") if "loss_arith" in r]
    assert [r["qat"] for r in log] == [False, False, False, True, True, True]
    assert all("loss_ret" in r and 40 <= r["ret_len"] <= 96 for r in log)


def test_preflight_compares_with_the_reference():
    tr = Trainer(get_train_config("toy"), "unused", "cpu")
    assert tr.preflight(T=24) < 1e-5


def test_schedules():
    tc = get_train_config("acc")
    assert lr_at(tc, 0, 0.0) < lr_at(tc, tc.warmup, 0.0) == pytest.approx(tc.lr)
    assert lr_at(tc, 10**6, 1.0) == pytest.approx(tc.lr * tc.min_lr_frac)
    import numpy as np
    rng = np.random.default_rng(0)
    early = [ret_length(tc, rng, 0.0) for _ in range(200)]
    late = [ret_length(tc, rng, 0.9) for _ in range(200)]
    assert max(early) <= tc.len_start and min(early) >= tc.len_min
    assert max(late) > 4096 and max(late) <= tc.len_max


def test_train_command_writes_what_eval_reads(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--config", "toy", "--steps", "2", "--out", str(out)]) == 0
    ck = out / "checkpoint"
    assert json.loads((ck / "tasks.json").read_text()) == {"vocab": 128, "digits": 2, "ops": ["+"], "key_len": 1, "val_len": 1,
                                                           "val_symbols": 32, "order": "kv"}
    assert json.loads((out / "summary.json").read_text())["steps"] == 2
    from model.eval.command import task_spec
    from model.config import config_from_json
    assert task_spec(ck, config_from_json(ck)) == TOY_TASK
    assert main(["train", "--config", "toy", "--steps", "2", "--out", str(out)]) == 2        # state.pt is there
    assert "--resume" in capsys.readouterr().err
    assert main(["train", "--config", "toy", "--steps", "3", "--out", str(out), "--resume"]) == 0
    assert json.loads((out / "summary.json").read_text())["steps"] == 3


def test_overrides_tied_start_and_few_pairs_first(tmp_path, capsys):
    from model.train.command import apply_overrides
    from k3gen.errors import SpecError
    tc = apply_overrides(get_train_config("toy"), ["lr=1e-3", "tied_init=true", "task.order=vk", "ret_query_every=16"])
    assert (tc.lr, tc.tied_init, tc.task.order, tc.ret_query_every) == (1e-3, True, "vk", 16)
    for bad in (["lr"], ["nope=1"], ["lr=fast"], ["tied_init=maybe"], ["task.order=qa"], ["model=x"]):
        with pytest.raises(SpecError):
            apply_overrides(get_train_config("toy"), bad)
    tr = Trainer(tc, tmp_path, "cpu")
    e, h = tr.net.w("model.embed_tokens.weight"), tr.net.w("lm_head.weight")
    assert torch.equal(h, e * e.shape[1] ** -0.5) and h.data_ptr() != e.data_ptr()   # a shared start, not tied
    # a 40-token sequence asks 40 // 16 = 2 keys among as many pairs as fit
    import numpy as np
    from model.train import loop
    seen = []
    real = loop.retrieval_batch
    loop.retrieval_batch = lambda rng, b, L, q, spec: seen.append((L, q)) or real(rng, b, L, q, spec)
    try:
        rng_len = loop.ret_length
        loop.ret_length = lambda tc, rng, p: 40
        tr.train_step(0.0)
    finally:
        loop.retrieval_batch, loop.ret_length = real, rng_len
    assert seen == [(40, 2)]
    assert main(["train", "--config", "toy", "--steps", "1", "--out", str(tmp_path / "r"), "--set", "task.order=vk"]) == 0
    assert json.loads((tmp_path / "r" / "checkpoint" / "tasks.json").read_text())["order"] == "vk"
    assert json.loads((tmp_path / "r" / "summary.json").read_text())["settings"]["task"]["order"] == "vk"
    assert main(["train", "--config", "toy", "--steps", "1", "--out", str(tmp_path / "s"), "--set", "lr=x"]) == 2
    assert "--set" in capsys.readouterr().err


def test_init_starts_from_a_finished_runs_weights(tmp_path, capsys):
    from pathlib import Path
    from model.train.export import read_canonical
    golden = Path(__file__).resolve().parents[2] / "golden" / "acc_toy"
    _, want = read_canonical(golden)
    tc = get_train_config("toy", tied_init=True)
    tr = Trainer(tc, tmp_path / "t", "cpu", init=want, init_from=str(golden))
    for n, t in want.items():                      # the tied start must not overwrite the loaded head
        assert torch.equal(tr.net.w(n).detach(), t.float()), n
    out = tmp_path / "run"
    assert main(["train", "--config", "toy", "--steps", "1", "--out", str(out), "--init", str(golden),
                 "--set", "lr=1e-12", "--set", "warmup=1", "--set", "balance_rate=0"]) == 0
    assert _log(out)[0] == {"step": 0, "init": str(golden)}
    assert json.loads((out / "summary.json").read_text())["init"] == str(golden)
    from model.train.export import load_fp32
    got = load_fp32(out / "fp32.safetensors")
    # one step at lr 1e-12 moves nothing measurable: the run started from the golden weights
    assert max(float((got[n] - want[n]).abs().max()) for n in want) < 1e-6
    bad = tmp_path / "acc"
    assert main(["train", "--config", "acc", "--steps", "1", "--out", str(bad), "--init", str(golden)]) == 2
    assert "--init" in capsys.readouterr().err and not (bad / "state.pt").exists()
    assert main(["train", "--config", "toy", "--steps", "1", "--out", str(tmp_path / "x"), "--init",
                 str(tmp_path / "none.bin")]) == 2
