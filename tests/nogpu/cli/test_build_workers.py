"""`k3gen build` without a terminal: workers die with a SIGKILLed parent, progress lines reach the
log, the table has one row per kernel. No wall-clock assertion: only bounded waits for a condition."""
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

from k3gen.cli import PlainProgress, build_table

TINY = ["build", "--arch", "sm90", "--model", "tiny", "--kv", "bf16", "--ssm", "fp32", "--drafts", "0", "-j", "2"]


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, start time) from /proc/<pid>/stat, or None once the process is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    f = text[text.rindex(")") + 2:].split()   # the name may hold spaces: read after its ')'
    return f[0], int(f[1]), int(f[19])


def _children(pid: int) -> dict[int, int]:
    out = {}
    for d in os.listdir("/proc"):
        if d.isdigit() and (s := _stat(int(d))) and s[1] == pid:
            out[int(d)] = s[2]
    return out


def _alive(pid: int, start: int) -> bool:
    s = _stat(pid)
    return s is not None and s[2] == start and s[0] not in ("Z", "X")


def _until(cond, limit: float) -> bool:
    end = time.monotonic() + limit
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.1)
    return cond()


def test_sigkill_of_the_build_leaves_no_worker(tmp_path):
    log = tmp_path / "stderr.log"
    workers = {}
    env = {**os.environ, "K3GEN_CACHE_DIR": str(tmp_path / "cache"), "K3GEN_PROGRESS_SECONDS": "0.2"}
    with open(log, "w") as err:
        p = subprocess.Popen([sys.executable, "-m", "k3gen", *TINY], stdout=subprocess.DEVNULL, stderr=err, env=env)
    try:
        # Compiling has begun once the pool's workers exist and the first progress line is out.
        assert _until(lambda: len(_children(p.pid)) >= 2 and "kernels done" in log.read_text(), 180), \
            log.read_text()
        workers = _children(p.pid)
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
        assert _until(lambda: not any(_alive(w, s) for w, s in workers.items()), 60), \
            [w for w, s in workers.items() if _alive(w, s)]
    finally:
        if p.poll() is None:
            p.kill()
        for w, s in workers.items():   # a failed run must not leave its orphans to the next test
            if _alive(w, s):
                os.kill(w, signal.SIGKILL)
    first = log.read_text().splitlines()[0]
    # The count is the tiny model's spec list (targets.model_specs), which grows with the model's ops.
    assert re.match(r"k3gen build sm90: 0/[1-9][0-9]* kernels done \(0 cached\), compiling ", first), first
    assert "elapsed, ETA" in first


def test_a_worker_whose_parent_is_gone_exits():
    # The initializer's check: a worker started for a parent that is not its parent ends at once.
    code = "from k3gen.pipeline.stages import _worker_init; _worker_init(1); print('alive')"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and "alive" not in p.stdout
    code = "import os; from k3gen.pipeline.stages import _worker_init; _worker_init(os.getppid()); print('alive')"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "alive" in p.stdout


def _art(stem):
    return SimpleNamespace(spec=SimpleNamespace(file_stem=stem))


def test_plain_progress_lines_are_periodic_and_complete():
    t = [0.0]
    lines = []
    prog = PlainProgress("k3gen build sm90", 4, every=10.0, clock=lambda: t[0],
                         out=SimpleNamespace(write=lambda s: lines.append(s) if s.strip() else None,
                                             flush=lambda: None))
    prog.finished(_art("kv_cache_write__bf16-p64__12345678"), False)   # cached: at once
    prog.running([_art("kda_decode__h2-bounded-fp32__abcdef12"), _art("mla_vb_gate__h2__00000000")])
    t[0] = 5.0
    prog.finished(_art("kda_decode__h2-bounded-fp32__abcdef12"), True)   # within 10 s of the last: quiet
    t[0] = 12.0
    prog.running([_art("mla_vb_gate__h2__00000000")])                   # heartbeat: a line
    t[0] = 20.0
    prog.finished(_art("mla_vb_gate__h2__00000000"), True)
    prog.finished(_art("act_quant_fp8__k256-fp32__11111111"), True)
    prog.close()
    assert lines == [
        "k3gen build sm90: 1/4 kernels done (1 cached), 0s elapsed, ETA ?",
        "k3gen build sm90: 2/4 kernels done (1 cached), compiling mla_vb_gate__h2, 12s elapsed, ETA 24s",
        "k3gen build sm90: 4/4 kernels done (1 cached), 20s elapsed, ETA 0s",
    ]


def test_build_table_has_one_row_per_kernel_naming_its_functions():
    from k3gen.targets import TARGETS

    def res(fn, regs):
        return {"function": fn, "registers": regs, "shared": 0, "local": 0, "stack": 0, "constant0": 0,
                "sass": {"HGMMA.64x": 2}}
    results = [SimpleNamespace(artifact=_art("mla_decode__h2-t1__aaaaaaaa"), built=True,
                               meta={"compile_seconds": 1.0},
                               resources=[res("k3gen_mla_decode", 168), res("k3gen_mla_decode_combine", 44)]),
               SimpleNamespace(artifact=_art("kv_cache_write__bf16-p64__bbbbbbbb"), built=False, meta={},
                               resources=[res("k3gen_kv_cache_write", 32)])]
    t = build_table(TARGETS["sm90"], results)
    assert t.row_count == 2
    cells = [list(c._cells) for c in t.columns]
    assert cells[0] == ["mla_decode__h2-t1", "kv_cache_write__bf16-p64"]
    assert cells[1][0].splitlines() == ["k3gen_mla_decode", "k3gen_mla_decode_combine"]
    assert cells[2][0].splitlines() == ["168", "44"] and cells[-1] == ["1.00s", "cached"]
