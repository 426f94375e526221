"""`torchrun --nproc-per-node 2 -m model generate --tp 2`: the tokens of the one-rank command, printed once
(rank 0), checked equal on every rank; --tp/--ep checked before any work."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from model.cli import generate_main

import dist_cases as C

ARGS = ["--path", "reference", "--spec", "3", "--max-new", "5", "--prompt-ids", "4,8,15,16,4,8,15", "--batch", "2"]


@pytest.fixture(scope="module")
def config_json(tmp_path_factory):
    p = tmp_path_factory.mktemp("cfg") / "config.json"
    p.write_text(json.dumps(C.tiny4_dict()))
    return str(p)


def _tokens(out: str) -> list[str]:
    return re.findall(r"^\[\d+\] \[.*\]$", out, flags=re.M)


def test_torchrun_tp2_prints_the_tp1_tokens_once(config_json, capsys):
    assert generate_main(["--config", config_json] + ARGS) == 0
    tp1 = _tokens(capsys.readouterr().out)
    assert len(tp1) == 2
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        "-m", "model", "generate", "--config", config_json, "--tp", "2", "--dist-timeout", "60"] + ARGS,
                       capture_output=True, text=True, env=env, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    assert _tokens(r.stdout) == tp1, r.stdout
    assert "TP2 on 2 ranks" in r.stdout and "the same on every rank" in r.stdout


@pytest.mark.parametrize("extra,needle", [
    (["--tp", "2"], "WORLD_SIZE=1"),                    # not launched by torchrun
    (["--tp", "4", "--ep", "3"], "ep=3"),
    (["--tp", "3"], "kda_heads"),                      # 4 KDA heads do not split three ways
])
def test_parallel_arguments_checked_first(config_json, capsys, extra, needle):
    from model.cli import main
    assert main(["generate", "--config", config_json] + ARGS + extra) == 2
    err = capsys.readouterr().err
    assert needle in err and "error" in err
