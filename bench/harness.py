"""Timing and reporting of `python -m bench` / `k3gen bench`.

GPU cases (DESIGN.md, PERF.md): warm up, capture the launches in a CUDA graph, rotate through
enough independent input sets that each replay runs with a cold L2, report the median per
launch (CUDA events), achieved TB/s on the op's byte count, percent of the large-copy ceiling
and of a same-size copy measured in the same run, and the ratio to the peer when a case has one.
CPU cases (`device="cpu"`, the build benchmark) return rows of seconds against a bar.
Each run writes NAME-YYYYMMDD-HHMMSS.json and .png; into bench/results/ by default, where the
older runs of the same name are removed (git history keeps them).
"""
from __future__ import annotations

import json
import os
import platform
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

L2_BYTES = 60 * 2**20
COLD_FOOTPRINT = 4 * L2_BYTES
RESULTS = Path(__file__).resolve().parent / "results"
STAMP = re.compile(r"-\d{8}(-\d{4,6})?(-[\w.]+)?$")   # NAME-YYYYMMDD[-HHMMSS][-tag]


@dataclass(frozen=True)
class CaseInfo:
    device: str   # "gpu": called as fn(ceiling, quick) -> [Row]; "cpu": fn(quick) -> [dict]
    doc: str


def case(fn=None, *, device: str = "gpu"):
    """Mark a function of bench/cases/<op>.py as the benchmark of its name (bench.cases.registry)."""
    def mark(f):
        first = " ".join((f.__doc__ or "").strip().split("\n\n")[0].split())
        f.bench_case = CaseInfo(device, first)
        return f
    return mark(fn) if fn is not None else mark


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


def fill_tbps(nbytes: int = 2**30) -> float:
    """Pure-write bandwidth of the same run (eager fill_ of a 1 GiB FP32 buffer, median of 5 x 8):
    verify moves 4-5x more bytes out than in, so its reachable fraction of the copy ceiling sits
    between the copy (1:1) and this figure."""
    import torch
    b = torch.empty(nbytes // 4, device="cuda")
    for _ in range(3):
        b.fill_(1.0)
    torch.cuda.synchronize()
    us = statistics.median(_events_time(lambda: [b.fill_(1.0) for _ in range(8)], 5)) / 8
    del b
    return nbytes / us / 1e6


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


def plot_seconds(rows: list[dict], path: Path, title: str) -> None:
    """CPU cases: measured seconds next to the bar of each row."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(max(5, 1.2 * len(rows)), 3.5))
    xs = list(range(len(rows)))
    ax.bar([x - 0.2 for x in xs], [r["seconds"] for r in rows], width=0.4, label="measured")
    ax.bar([x + 0.2 for x in xs], [r.get("bar_s") or 0 for r in rows], width=0.4, label="bar", color="grey")
    ax.set_yscale("log")
    ax.set_xticks(xs, [r["case"] for r in rows], fontsize=8)
    ax.set_ylabel("seconds")
    ax.set_title(title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def replot(json_path: Path) -> Path:
    """The PNG of a written JSON run (for a run whose PNG did not come back from the device)."""
    doc = json.loads(Path(json_path).read_text())
    png = Path(json_path).with_suffix(".png")
    rows, meta = doc["rows"], doc.get("meta", {})
    if rows and "pct_copy" in rows[0]:
        plot([Row(**r) for r in rows], png, f"{meta.get('op', png.stem)} on {meta.get('gpu', '?')}")
    else:
        plot_seconds(rows, png, f"{meta.get('op', png.stem)} on {meta.get('host', '?')}")
    return png


def prune(out: Path, name: str, keep: str) -> list[Path]:
    """Remove the older JSON/PNG runs of benchmark `name` in `out` (the run stamped `keep` stays)."""
    gone = []
    for p in sorted(out.glob(f"{name}-*")):
        if p.suffix in (".json", ".png") and p.stem != keep and STAMP.fullmatch(p.stem[len(name):]):
            p.unlink()
            gone.append(p)
    return gone


def write_run(doc: dict, out: Path | None, name: str, draw) -> Path:
    """NAME-STAMP.json and .png (drawn by `draw(path)`) into `out`, bench/results/ by default."""
    out = Path(out) if out else RESULTS
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    jp = out / f"{stem}.json"
    jp.write_text(json.dumps(doc, indent=1))
    draw(jp.with_suffix(".png"))
    if out.resolve() == RESULTS:
        prune(out, name, stem)
    print(f"wrote {jp} and {jp.with_suffix('.png')}")
    return jp


def print_seconds(rows: list[dict], title: str) -> None:
    from rich.console import Console
    from rich.table import Table
    t = Table(title=title, title_justify="left")
    for c in ("case", "seconds", "bar s", "meets bar", "detail"):
        t.add_column(c, justify="right" if c in ("seconds", "bar s") else "left")
    for r in rows:
        bar = r.get("bar_s")
        t.add_row(r["case"], f"{r['seconds']:.2f}", f"< {bar:g}" if bar else "-",
                  "-" if r.get("meets_bar") is None else ("yes" if r["meets_bar"] else "[red]NO[/red]"),
                  r.get("detail", ""))
    Console(width=None if sys.stdout.isatty() else 200).print(t)


def run_cpu(name: str, fn, a) -> int:
    t0 = time.time()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None   # other work on the CPUs skews these
    rows = fn(quick=a.quick)
    print_seconds(rows, f"k3gen bench {name} ({os.cpu_count()} CPUs{', quick' if a.quick else ''})")
    doc = {"meta": {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
                    "elapsed_s": time.time() - t0, "op": name, "quick": bool(a.quick),
                    "loadavg_1m_at_start": load}, "rows": rows}
    write_run(doc, a.out, name, lambda png: plot_seconds(rows, png, f"{name} ({os.cpu_count()} CPUs)"))
    return 0


def list_cases() -> int:
    from bench.cases import registry
    for name, fn in registry().items():
        info = fn.bench_case
        doc = info.doc if len(info.doc) <= 90 else info.doc[:87] + "..."
        print(f"{name:<22} {info.device}  {doc}")
    return 0


def main(a) -> int:
    from bench.cases import registry
    from k3gen.errors import DeviceError, K3genError
    cases = registry()
    fn = cases.get(a.op)
    if fn is None:
        raise K3genError(f"no benchmark named {a.op!r}; known: {', '.join(cases)}")
    if fn.bench_case.device == "cpu":
        return run_cpu(a.op, fn, a)
    import torch
    if not torch.cuda.is_available():
        raise DeviceError(f"benchmark {a.op!r} needs a CUDA GPU")
    t0 = time.time()
    ceiling = copy_ceiling_tbps()
    rows = fn(ceiling=ceiling, quick=a.quick)
    print_table(rows, ceiling)
    p = torch.cuda.get_device_properties(0)
    doc = {"meta": {"gpu": p.name, "sms": p.multi_processor_count, "torch": torch.__version__,
                    "elapsed_s": time.time() - t0, "op": a.op},
           "ceiling": {"copy_2GiB_TBps": ceiling}, "rows": [asdict(r) for r in rows]}
    write_run(doc, a.out, a.op, lambda png: plot(rows, png, f"{a.op} on {p.name}"))
    return 0
