"""Ranks as spawned processes on the CPU (gloo), for the tensor/expert parallel tests: each rank gets
torchrun's environment (MASTER_ADDR/PORT, RANK, WORLD_SIZE, LOCAL_RANK) so model/dist.py's env:// set-up
runs as under torchrun, one thread each (two cores, up to four ranks), and reports its result or its
error's type; the parent waits with a deadline and kills what is left (a hang fails the test)."""
from __future__ import annotations

import os
import socket
import traceback
from pathlib import Path

import torch
import torch.multiprocessing as mp

# The most any test here waits for its ranks: far above a run (seconds), below CI's patience.
DEADLINE_S = 240.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn, rank: int, world: int, port: int, out: str, args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    try:
        res = {"ok": True, "value": fn(rank, world, *args)}
    except BaseException as e:           # noqa: BLE001 - reported to the parent
        res = {"ok": False, "type": type(e).__name__, "mro": [c.__name__ for c in type(e).__mro__],
               "message": str(e), "trace": traceback.format_exc()}
    torch.save(res, Path(out) / f"rank{rank}.pt")


def run_ranks(fn, world: int, tmp: Path, *args, deadline_s: float = DEADLINE_S) -> list[dict]:
    """fn(rank, world, *args) on `world` spawned ranks; returns each rank's {"ok", "value"} or
    {"ok": False, "type", "mro", "message", "trace"} (type "exit" and its "exitcode" when it left no
    result). AssertionError if a rank is still running at the deadline (it is killed)."""
    import time
    ctx = mp.get_context("spawn")
    out = Path(tmp)
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, str(out), args)) for r in range(world)]
    for p in procs:
        p.start()
    end = time.monotonic() + deadline_s
    for p in procs:
        p.join(max(0.0, end - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for r in hung:
        procs[r].kill()
        procs[r].join()
    assert not hung, f"ranks {hung} of {world} still running after {deadline_s:.0f}s (a hang)"
    res = []
    for r, p in enumerate(procs):
        f = out / f"rank{r}.pt"
        if f.is_file():
            res.append(torch.load(f, weights_only=False))
        else:                            # it exited without a word (os._exit, a signal)
            res.append({"ok": False, "type": "exit", "mro": [], "message": f"exit code {p.exitcode}",
                        "trace": "", "exitcode": p.exitcode})
    return res


def values(results: list[dict]) -> list:
    """Every rank's value; a rank's error is raised here with its trace."""
    for r, x in enumerate(results):
        if not x["ok"]:
            raise AssertionError(f"rank {r} raised {x['type']}: {x['message']}\n{x['trace']}")
    return [x["value"] for x in results]
