"""Scoring and reporting of the accuracy table: exact match with a 95% Wilson interval per cell, per
task and per retrieval context length; the differences in points to the FP32 reference row; the
number of questions whose answer differs from the first cell of the same group (path, KV, SSM:
batch size, graphs and speculative decoding must not change an answer); a rich table, results.json
and results.png."""
from __future__ import annotations

import json
import math
from pathlib import Path

Z95 = 1.959963984540054


def wilson(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of k successes in n trials (0..1)."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return (0.0 if k == 0 else max(0.0, min(p, c - h))), (1.0 if k == n else min(1.0, max(p, c + h)))


def _stat(oks: list[bool]) -> dict:
    k, n = sum(oks), len(oks)
    lo, hi = wilson(k, n)
    return {"n": n, "correct": k, "em": k / n if n else 0.0, "ci": [lo, hi]}


def score(cell_name: str, group, questions, answers: list, extra: dict | None = None) -> dict:
    """The record of one cell: exact match overall, per task and per retrieval length, and its answers."""
    oks = [a == q.answer for q, a in zip(questions, answers)]
    rec = {"cell": cell_name, "group": list(group), **_stat(oks)}
    rec["by_task"] = {t: _stat([o for q, o in zip(questions, oks) if q.task == t])
                      for t in sorted({q.task for q in questions})}
    rec["by_length"] = {str(L): _stat([o for q, o in zip(questions, oks) if q.task == "retrieval" and q.length == L])
                        for L in sorted({q.length for q in questions if q.task == "retrieval"})}
    rec["answers"] = {str(q.qid): a for q, a in zip(questions, answers)}
    rec.update(extra or {})
    return rec


def compare(cells: list[dict]) -> None:
    """Adds to each cell: `delta_vs_reference` (points vs the first fp32 reference cell on the checkpoint)
    with `flips_vs_reference` [questions it lost, questions it gained], and `differs_from` /
    `answers_differ` (vs the first cell of its group), each on the questions both ran."""
    ref = next((c for c in cells if c["group"][0] == "fp32" and c["group"][3] == "checkpoint"), None)
    first: dict[tuple, dict] = {}
    for c in cells:
        if ref is not None:
            common = set(c["answers"]) & set(ref["answers"])
            c["delta_vs_reference"] = _em_on(c, common) - _em_on(ref, common) if common else None
            mine, theirs = c["correct_ids"] & common, ref["correct_ids"] & common
            c["flips_vs_reference"] = [len(theirs - mine), len(mine - theirs)]
        g = tuple(c["group"])
        base = first.setdefault(g, c)
        if base is not c:
            common = sorted(set(c["answers"]) & set(base["answers"]), key=int)
            diff = [q for q in common if c["answers"][q] != base["answers"][q]]
            c["differs_from"], c["answers_differ"], c["differing_ids"] = base["cell"], len(diff), diff[:50]


def _em_on(c: dict, ids) -> float:
    """Exact match (points) of cell c on the question ids `ids` (its per-question record)."""
    ok = c.get("correct_ids")
    return 100.0 * sum(1 for i in ids if i in ok) / len(ids)


def finalize(cells: list[dict], questions) -> None:
    """The per-question correctness sets compare() reads."""
    want = {str(q.qid): q.answer for q in questions}
    for c in cells:
        c["correct_ids"] = {i for i, a in c["answers"].items() if want.get(i) == a}


def _pct(s: dict) -> str:
    return f"{100 * s['em']:.1f}" if s["n"] else "-"


def table(cells: list[dict], title: str = "exact match (%)"):
    """A rich Table (the Markdown text where rich is not installed)."""
    try:
        from rich.table import Table
    except ImportError:
        return f"{title}\n{markdown(cells)}"
    lengths = sorted({L for c in cells for L in c["by_length"]}, key=int)
    t = Table(title=title)
    for col in ["cell", "N", "EM", "95% CI", "arith", "retrieval"] + [_len(L) for L in lengths]:
        t.add_column(col, justify="left" if col == "cell" else "right")
    for col in ("vs ref (pts)", "lost/gained", "answers differ", "s"):
        t.add_column(col, justify="right")
    for c in cells:
        bt = c["by_task"]
        row = [c["cell"], str(c["n"]), _pct(c), f"{100 * c['ci'][0]:.1f}-{100 * c['ci'][1]:.1f}",
               _pct(bt["arith"]) if "arith" in bt else "-", _pct(bt["retrieval"]) if "retrieval" in bt else "-"]
        row += [_pct(c["by_length"][L]) if L in c["by_length"] else "-" for L in lengths]
        d = c.get("delta_vs_reference")
        fl = c.get("flips_vs_reference")
        row += ["" if d is None else f"{d:+.2f}", "" if fl is None else f"-{fl[0]}/+{fl[1]}",
                "" if "answers_differ" not in c else f"{c['answers_differ']} vs {_short(c['differs_from'])}",
                f"{c.get('seconds', 0):.1f}"]
        t.add_row(*row)
    return t


def _len(L) -> str:
    return f"{int(L) // 1024}K" if int(L) % 1024 == 0 else str(L)


def _short(name: str) -> str:
    return name.split(" ", 3)[-1] if name.startswith(("kernel", "reference")) else name


def markdown(cells: list[dict]) -> str:
    """The table as Markdown (for README / bench/NOTES.md)."""
    lengths = sorted({L for c in cells for L in c["by_length"]}, key=int)
    head = ["cell", "N", "EM %", "95% CI", "arith", "retrieval"] + [_len(L) for L in lengths] + \
        ["vs ref (pts)", "lost/gained", "answers differ"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in cells:
        bt = c["by_task"]
        d = c.get("delta_vs_reference")
        row = [c["cell"], str(c["n"]), _pct(c), f"{100 * c['ci'][0]:.1f}-{100 * c['ci'][1]:.1f}",
               _pct(bt["arith"]) if "arith" in bt else "-", _pct(bt["retrieval"]) if "retrieval" in bt else "-"]
        row += [_pct(c["by_length"][L]) if L in c["by_length"] else "-" for L in lengths]
        fl = c.get("flips_vs_reference")
        row += ["" if d is None else f"{d:+.2f}", "" if fl is None else f"-{fl[0]}/+{fl[1]}",
                str(c.get("answers_differ", ""))]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def write(cells: list[dict], out, meta: dict) -> dict:
    """results.json (cells without the per-question sets' Python types), results.md and results.png."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"meta": meta, "cells": [{k: v for k, v in c.items() if k != "correct_ids"} for c in cells]}
    (out / "results.json").write_text(json.dumps(doc, indent=1))
    (out / "results.md").write_text(markdown(cells) + "\n")
    try:
        plot(cells, out / "results.png", meta.get("title", "K3 accuracy"))
    except ImportError:       # no matplotlib (the device machine): `eval --merge DIR --out DIR` redraws it
        pass
    return doc


def plot(cells: list[dict], path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    n = len(cells)
    fig, (a, b) = plt.subplots(1, 2, figsize=(14, max(3.0, 0.35 * n + 1.5)), gridspec_kw={"width_ratios": [3, 2]})
    y = list(range(n))[::-1]
    em = [100 * c["em"] for c in cells]
    lo = [max(0.0, 100 * (c["em"] - c["ci"][0])) for c in cells]
    hi = [max(0.0, 100 * (c["ci"][1] - c["em"])) for c in cells]
    a.barh(y, em, xerr=[lo, hi], color=["#888" if c["group"][0] == "fp32" else "#4878a8" for c in cells],
           capsize=3)
    a.set_yticks(y, [c["cell"] for c in cells], fontsize=7)
    a.set_xlabel("exact match (%), 95% Wilson interval")
    a.set_xlim(max(0.0, min([100 * c["ci"][0] for c in cells] + [100.0]) - 5), 100.5)
    a.set_title(title, fontsize=9)
    for c in cells:
        Ls = sorted(c["by_length"], key=int)
        if Ls:
            b.plot([int(L) for L in Ls], [100 * c["by_length"][L]["em"] for L in Ls], marker="o", label=c["cell"],
                   linewidth=1)
    b.set_xscale("log", base=2)
    lows = [100 * c["by_length"][L]["em"] for c in cells for L in c["by_length"]]
    b.set_ylim(max(0.0, min(lows + [100.0]) - 5), 101)
    b.set_xlabel("retrieval context (tokens)")
    b.set_ylabel("exact match (%)")
    b.set_title("retrieval by context length", fontsize=9)
    if any(c["by_length"] for c in cells) and n <= 16:
        b.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def load(paths) -> tuple[list[dict], list[dict]]:
    """(cells, metas) of results.json files or folders holding one, in order."""
    cells, metas = [], []
    for p in paths:
        p = Path(p)
        d = json.loads((p / "results.json" if p.is_dir() else p).read_text())
        metas.append(d["meta"])
        cells += d["cells"]
    return cells, metas


__all__ = ["wilson", "score", "compare", "finalize", "table", "markdown", "write", "plot", "load"]
