"""`k3gen bench`: time kernels on the GPU against the copy ceiling of the same run.

Method (DESIGN.md, PERF.md): warm up, capture the launches in a CUDA graph, rotate through
enough independent input sets that each replay runs with a cold L2, report the median per
launch, achieved TB/s on the op's byte count, percent of the large-copy ceiling and of a
same-size copy, and the ratio to the peer when a case has one.
"""
from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

L2_BYTES = 60 * 2**20
COLD_FOOTPRINT = 4 * L2_BYTES


@dataclass
class Row:
    op: str
    case: str
    us: float
    bytes: int
    tbps: float
    pct_copy: float
    pct_same_copy: float
    copy_same_us: float
    peer: str = ""
    peer_us: float | None = None
    speedup: float | None = None
    extra: dict = field(default_factory=dict)


def _events_time(fn, reps: int) -> list[float]:
    import torch
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e3)
    return times


def time_graph(launches: list, reps: int = 30, warmup: int = 3) -> float:
    """Median microseconds per launch of a graph replaying `launches` (one per input set)."""
    import torch

    from k3gen.runtime.graphs import capture
    for f in launches[:warmup] or launches:
        f()
    for f in launches:   # every input set once eagerly: lazy set-up stays out of the capture
        f()
    torch.cuda.synchronize()

    def all_launches():
        for f in launches:
            f()
    g = capture(all_launches)
    g.replay()
    torch.cuda.synchronize()
    t = _events_time(g.replay, reps)
    return statistics.median(t) / len(launches)


EAGER_COPY_BYTES = 64 * 2**20


def copy_time_us(nbytes: int, reps: int = 30) -> float:
    """Median time of a device-to-device copy moving `nbytes` in total (read + write).

    Up to 64 MiB moved, graph replay over rotated FP32 buffers, like the kernels. Above that,
    eager copies back to back, timed with events (each copy outlasts its launch, and L2 is far
    smaller than the buffers): large captured memcpy nodes run erratically slow on the H200
    (2.6-2.75 TB/s for 210 MB-2 GiB moved in our runs and in anchors/h200_call1.json
    copy_curve) while the same copies launched eagerly reach ~4.25 TB/s, and the ceiling must
    be the best plain copy of the GPU.
    """
    import torch
    n = max(nbytes // 8, 64)
    if nbytes > EAGER_COPY_BYTES:
        a, b = torch.rand(n, device="cuda"), torch.empty(n, device="cuda")
        for _ in range(3):
            b.copy_(a)
        torch.cuda.synchronize()
        per = max(2, int(20e-3 / max(nbytes / 4.0e12, 1e-9)))
        samples = []
        for _ in range(max(3, reps // 4)):
            samples.append(statistics.median(_events_time(lambda: [b.copy_(a) for _ in range(per)], 1)) / per)
        return statistics.median(samples)
    sets = max(1, min(32, COLD_FOOTPRINT // max(n * 8, 1)))
    bufs = [(torch.rand(n, device="cuda"), torch.empty(n, device="cuda")) for _ in range(sets)]
    return time_graph([lambda a=a, b=b: b.copy_(a) for a, b in bufs], reps)


def copy_ceiling_tbps() -> float:
    """Large device-to-device copy, 2 GiB moved, after bringing the clocks up from idle."""
    import torch
    n = 2 * 2**30
    a = torch.rand(n // 8, device="cuda")
    b = torch.empty_like(a)
    t_end = time.perf_counter() + 0.5
    while time.perf_counter() < t_end:
        for _ in range(20):
            b.copy_(a)
        torch.cuda.synchronize()
    del a, b
    us = copy_time_us(n, reps=20)
    return n / us / 1e6


def sets_for(footprint: int) -> int:
    return int(max(2, min(64, -(-COLD_FOOTPRINT // max(footprint, 1)))))


def make_row(op: str, case: str, us: float, nbytes: int, ceiling: float, same_cache: dict, **kw) -> Row:
    if nbytes not in same_cache:
        same_cache[nbytes] = copy_time_us(nbytes)
    same = same_cache[nbytes]
    tbps = nbytes / us / 1e6
    r = Row(op, case, us, nbytes, tbps, 100 * tbps / ceiling, 100 * same / us, same, **kw)
    if r.peer_us:
        r.speedup = r.peer_us / us
    return r


def print_table(rows: list[Row], ceiling: float) -> None:
    from rich.console import Console
    from rich.table import Table
    import sys
    con = Console(width=None if sys.stdout.isatty() else 220)
    t = Table(title=f"k3gen bench (copy ceiling {ceiling:.2f} TB/s, same run)", title_justify="left")
    for c in ("op", "case", "median us", "MB", "TB/s", "% copy", "% same-size copy", "peer", "peer us", "x peer",
              "x chain"):
        t.add_column(c, justify="left" if c in ("op", "case", "peer") else "right")
    for r in rows:
        t.add_row(r.op, r.case, f"{r.us:.2f}", f"{r.bytes / 1e6:.2f}", f"{r.tbps:.2f}", f"{r.pct_copy:.0f}",
                  f"{r.pct_same_copy:.0f}", r.peer or "-", f"{r.peer_us:.2f}" if r.peer_us else "-",
                  f"{r.speedup:.2f}" if r.speedup else "-",
                  f"{r.extra['x_fla_chain']:.2f}" if r.extra.get("x_fla_chain") else "-")
    con.print(t)


def plot(rows: list[Row], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(max(6, 0.45 * len(rows)), 4))
    xs = list(range(len(rows)))
    ax.bar([x - 0.2 for x in xs], [r.pct_copy for r in rows], width=0.4, label="% of copy ceiling")
    ax.bar([x + 0.2 for x in xs], [r.pct_same_copy for r in rows], width=0.4, label="% of same-size copy")
    ax.axhline(100, color="grey", lw=0.5)
    ax.set_xticks(xs, [r.case for r in rows], rotation=70, ha="right", fontsize=7)
    ax.set_ylabel("%")
    ax.set_title(title)
    if any(r.speedup for r in rows):
        ax2 = ax.twinx()
        ax2.plot(xs, [r.speedup or float("nan") for r in rows], "k.", label="x peer")
        ax2.set_ylabel("speed-up over the peer (x)")
        ax2.legend(fontsize=7, loc="upper right")
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(a) -> int:
    import torch

    from k3gen.errors import DeviceError
    if not torch.cuda.is_available():
        raise DeviceError("k3gen bench needs a CUDA GPU")
    from bench import cases as bench_cases
    cases = getattr(bench_cases, a.op, None)
    if cases is None:
        raise DeviceError(f"no benchmark for op {a.op!r}")
    t0 = time.time()
    ceiling = copy_ceiling_tbps()
    rows = cases(ceiling=ceiling, quick=a.quick)
    print_table(rows, ceiling)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    p = torch.cuda.get_device_properties(0)
    doc = {"meta": {"gpu": p.name, "sms": p.multi_processor_count, "torch": torch.__version__,
                    "elapsed_s": time.time() - t0, "op": a.op},
           "ceiling": {"copy_2GiB_TBps": ceiling}, "rows": [asdict(r) for r in rows]}
    jp = out / f"{a.op}-{stamp}.json"
    jp.write_text(json.dumps(doc, indent=1))
    plot(rows, out / f"{a.op}-{stamp}.png", f"{a.op} on {p.name}")
    print(f"wrote {jp} and {jp.with_suffix('.png')}")
    return 0
