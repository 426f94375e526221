"""`k3gen generate` / `plan-memory`: every bad input is one typed line on stderr and exit 2, found
before any work (no table, no checkpoint written); a random checkpoint is made once per config and
seed in the cache folder, reused, and removed by `k3gen cache clear`."""
import multiprocessing as mp
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from k3gen.pipeline.store import cached_checkpoint, checkpoints_root, clear_checkpoints


@pytest.fixture
def cache(tmp_path):
    return tmp_path / "cache"


def run(cache, *args, entry=("k3gen",)):
    # No GPU whatever the machine: the "needs a GPU" cases hold on a GPU host too.
    env = {**os.environ, "K3GEN_CACHE_DIR": str(cache), "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([sys.executable, "-m", *entry, *args], capture_output=True, text=True, env=env)


def assert_one_line_error(p, needle):
    assert p.returncode == 2, (p.returncode, p.stderr, p.stdout)
    assert "Traceback" not in p.stderr, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "error:" in lines[0], p.stderr
    assert needle in lines[0], p.stderr


def checkpoints(cache) -> list[Path]:
    d = checkpoints_root(cache)
    return sorted(p for p in d.iterdir() if p.is_dir()) if d.is_dir() else []


TINY = ("generate", "--config", "tiny", "--path", "reference")

GENERATE_CASES = [
    (("--prompt-ids", "1,a"), "'a' in '1,a' is not an integer token id"),
    (("--prompt-ids", "1,2,999999"), "--prompt-ids=999999 is not allowed; allowed: token ids in [0, 512)"),
    (("--prompt-ids=-1,2",), "--prompt-ids=-1 is not allowed; allowed: token ids in [0, 512)"),
    (("--prompt-ids=",), "the prompt is empty"),
    (("--prompt-ids", " , "), "the prompt is empty"),
    (("--batch", "0"), "argument --batch: 0 is out of range"),
    (("--batch", "two"), "'two' is not an integer"),
    (("--max-new", "0"), "argument --max-new: 0 is out of range"),
    (("--max-new", "-1"), "argument --max-new: -1 is out of range"),
    (("--spec", "8"), "argument --spec: 8 is out of range: the draft count is in 0..7"),
    (("--spec", "-1"), "argument --spec: -1 is out of range"),
    (("--spec", "2", "--temperature", "0.7"), "--spec=2 is not allowed; allowed: 0 (speculative decoding is greedy"),
    (("--temperature", "-1"), "argument --temperature: -1 is out of range"),
    (("--temperature", "nan"), "argument --temperature: nan is out of range"),
    (("--max-seq-len", "4"), "--max-seq-len=4 is not allowed; allowed: >= 24"),
    (("--max-seq-len", "9", "--max-new", "2"), "--max-seq-len=9 is not allowed; allowed: >= 10"),
    (("--max-seq-len", "0"), "argument --max-seq-len: 0 is out of range"),
    (("--graphs",), "--graphs=True is not allowed"),
    (("--prefill-chunk", "0"), "argument --prefill-chunk: 0 is out of range: the piece length is >= 1 token"),
    (("--kv", "nvfp4", "--prefill-chunk", "4"), "--prefill-chunk=4 is not allowed; allowed: no chunked prefill "
     "with --kv nvfp4 (SPEC.md section 5"),
    (("--arch", "sm89"), "invalid choice: 'sm89'"),
    (("--kv", "int4"), "invalid choice: 'int4'"),
    (("--arch", "sm100", "--kv", "nvfp4"), "kv='nvfp4' is not allowed"),
    (("--config", "nope"), "config='nope' is not allowed"),
    (("--checkpoint", "/no/such/folder"), "--checkpoint='/no/such/folder' is not allowed"),
]


@pytest.mark.parametrize("args,needle", GENERATE_CASES, ids=lambda v: " ".join(v) if isinstance(v, tuple) else None)
def test_generate_bad_input(cache, args, needle):
    p = run(cache, *TINY, *args)
    assert_one_line_error(p, needle)
    assert checkpoints(cache) == [], "a bad input must be refused before the checkpoint is written"


@pytest.mark.parametrize("args,needle", [
    (("--path", "kernel"), "--path='kernel' is not allowed; allowed: reference (no CUDA GPU"),
    (("--graphs",), "--graphs=True is not allowed; allowed: False (no CUDA GPU"),
])
def test_generate_gpu_asked_for_without_one(cache, args, needle):
    p = run(cache, "generate", "--config", "tiny", *args)
    assert_one_line_error(p, needle)
    assert checkpoints(cache) == []


def test_python_m_model_prints_the_same_one_line_errors(cache):
    assert_one_line_error(run(cache, *TINY, "--prompt-ids", "1,2,999999", entry=("model",)),
                          "python -m model generate: error: --prompt-ids=999999")
    assert_one_line_error(run(cache, "plan-memory", "--tp", "0", entry=("model",)), "argument --tp: 0 is out of range")


@pytest.mark.parametrize("args,needle", [
    (("--tp", "0"), "argument --tp: 0 is out of range"),
    (("--tp", "-2"), "argument --tp: -2 is out of range"),
    (("--ep", "0"), "argument --ep: 0 is out of range"),
    (("--ep", "3"), "--ep=3 is not allowed; allowed: a divisor of --tp 8"),
    (("--ep", "x"), "'x' is not an integer"),
    (("--util", "2"), "argument --util: 2 is out of range: the fraction is in (0, 1]"),
    (("--util", "0"), "argument --util: 0 is out of range"),
    (("--util", "-0.5"), "argument --util: -0.5 is out of range"),
    (("--gpu-gib", "-5"), "argument --gpu-gib: -5 is out of range"),
    (("--gpu-gib", "0"), "argument --gpu-gib: 0 is out of range"),
    (("--gpu-gib", "inf"), "argument --gpu-gib: inf is out of range"),
    (("--max-drafts", "9"), "argument --max-drafts: 9 is out of range: the draft count is in 0..7"),
    (("--max-drafts", "-1"), "argument --max-drafts: -1 is out of range"),
    (("--arch", "sm89"), "invalid choice: 'sm89'"),
    (("--layout", "int8"), "invalid choice: 'int8'"),
])
def test_plan_memory_bad_input(cache, args, needle):
    p = run(cache, "plan-memory", *args)
    assert_one_line_error(p, needle)
    assert p.stdout == "", "the error comes before the table"


def test_help_names_choices_and_defaults(cache):
    g = run(cache, "generate", "--help").stdout
    for text in ("--prompt-ids", "(default: 1,2,3,4,5,6,7,8", "0..7", "(default: 16)", "(default: 512)",
                 "{auto,reference,kernel}", "{bf16,fp8,nvfp4}", "sm90", "k3gen cache clear",
                 "--prefill-chunk N", "pieces of at most N tokens"):
        assert text in " ".join(g.split()), text
    pm = run(cache, "plan-memory", "--help").stdout
    for text in ("(default: 8)", "(default: 0.9)", "(default: 141.0)", "(0, 1]", "{mxfp4,nvfp4,bf16}"):
        assert text in " ".join(pm.split()), text


def test_random_checkpoint_is_cached_once_reused_and_cleared(cache):
    p1 = run(cache, *TINY, "--max-new", "2")
    assert p1.returncode == 0, p1.stderr
    [ck] = checkpoints(cache)
    assert "written to" in p1.stdout and str(ck) in p1.stdout and " MB" in p1.stdout
    before = {f.name: (f.stat().st_ino, f.stat().st_mtime_ns) for f in ck.iterdir()}
    folder = (ck.stat().st_ino, ck.stat().st_mtime_ns)
    assert any(n.endswith(".safetensors") for n in before)

    p2 = run(cache, *TINY, "--max-new", "2")
    assert p2.returncode == 0, p2.stderr
    assert checkpoints(cache) == [ck]
    assert "reused from" in p2.stdout and str(ck) in p2.stdout
    assert {f.name: (f.stat().st_ino, f.stat().st_mtime_ns) for f in ck.iterdir()} == before
    assert (ck.stat().st_ino, ck.stat().st_mtime_ns) == folder
    # same checkpoint, same greedy tokens
    assert [x for x in p1.stdout.splitlines() if x.startswith("[0]")] == \
           [x for x in p2.stdout.splitlines() if x.startswith("[0]")]

    c = run(cache, "cache", "clear")
    assert c.returncode == 0, c.stderr
    assert "1 random checkpoints" in c.stdout
    assert checkpoints(cache) == [] and not ck.exists()


def test_another_seed_is_another_checkpoint(cache):
    for seed in ("0", "1"):
        assert run(cache, *TINY, "--max-new", "1", "--seed", seed).returncode == 0
    assert len(checkpoints(cache)) == 2


def _slow_writer(root, log, ready):
    def write(d):
        with open(log, "a") as f:
            f.write("w\n")
        (d / "part").write_text("x")
        time.sleep(0.5)            # the other process arrives while this one writes
        (d / "done").write_text("y")
    ready.wait()
    folder, written = cached_checkpoint("k-s0-0123", write, root=root)
    assert (folder / "done").exists()


def test_concurrent_writers_write_once(tmp_path):
    log = tmp_path / "log"
    ctx = mp.get_context("spawn")
    ready = ctx.Event()
    ps = [ctx.Process(target=_slow_writer, args=(tmp_path, log, ready)) for _ in range(3)]
    for p in ps:
        p.start()
    ready.set()
    for p in ps:
        p.join(60)
    assert [p.exitcode for p in ps] == [0, 0, 0]
    assert log.read_text() == "w\n"
    base = checkpoints_root(tmp_path)
    assert sorted(p.name for p in base.iterdir() if p.is_dir()) == ["k-s0-0123"]


def test_a_killed_write_leaves_no_checkpoint_and_is_cleaned_up(tmp_path):
    def fail(d):
        (d / "half").write_text("x")
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        cached_checkpoint("k-s0-1", fail, root=tmp_path)
    base = checkpoints_root(tmp_path)
    assert not (base / "k-s0-1").exists()
    stale = base / ".tmp-k-s0-2-abc123"        # what a SIGKILLed writer leaves
    stale.mkdir()
    folder, written = cached_checkpoint("k-s0-1", lambda d: (d / "ok").write_text("y"), root=tmp_path)
    assert written and (folder / "ok").exists() and not stale.exists()
    assert cached_checkpoint("k-s0-1", lambda d: pytest.fail("rewritten"), root=tmp_path) == (folder, False)
    assert clear_checkpoints(tmp_path) == 1 and not base.exists()
