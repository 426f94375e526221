"""The eval command's output: rich's console and progress bars where rich is installed, plain lines
otherwise (the device machine may lack it; the results files are the same either way)."""
from __future__ import annotations

import sys
import time


class _PlainConsole:
    def print(self, x="") -> None:
        print(x if isinstance(x, str) else str(x), flush=True)


class _PlainProgress:
    """One line per task when it completes (and every ~30 s while it runs)."""

    def __init__(self):
        self.tasks: dict[int, list] = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def add_task(self, desc: str, total: int) -> int:
        self.tasks[len(self.tasks)] = [desc, total, 0, time.perf_counter(), time.perf_counter()]
        return len(self.tasks) - 1

    def advance(self, task: int, n: int) -> None:
        t = self.tasks[task]
        t[2] += n
        now = time.perf_counter()
        if t[2] >= t[1] or now - t[4] > 30:
            t[4] = now
            print(f"{t[0]}: {t[2]}/{t[1]} {now - t[3]:.1f}s", file=sys.stderr, flush=True)


def console():
    try:
        from rich.console import Console
    except ImportError:
        return _PlainConsole()
    return Console(highlight=False, width=None if sys.stdout.isatty() else 220)


def progress():
    try:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    except ImportError:
        return _PlainProgress()
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=Console(stderr=True), transient=False)


__all__ = ["console", "progress"]
