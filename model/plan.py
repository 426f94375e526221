"""`k3gen plan-memory`: how many sequences x tokens of the real K3 config fit one GPU at a given
TP/EP and checkpoint layout, for every KV/SSM dtype combination: weights per rank from
model/params.py (the serving form of the layout), cache from the IR's byte expressions (model/cache.py)."""
from __future__ import annotations


from k3gen.errors import K3genError, SpecError

from model.cache import CacheCapacityError, cache_bytes, plan_capacity
from model.config import TargetConfig, get_config
from model.params import weight_bytes_per_rank

CONTEXTS = (4096, 32768, 131072)


def plan_rows(config: str, arch: str, tp: int, gpu_gib: float, util: float, max_drafts: int,
              contexts=CONTEXTS, ep: int = 1, layout: str = "nvfp4") -> tuple[list[dict], int, int]:
    cfg = get_config(config)
    weights = weight_bytes_per_rank(cfg, tp, ep, layout)
    budget = int(gpu_gib * 2**30 * util) - weights
    rows = []
    for kv in ("bf16", "fp8", "nvfp4"):
        for ssm in ("fp32", "bf16"):
            try:
                t = TargetConfig(arch=arch, kv=kv, ssm=ssm, tp=tp, max_drafts=max_drafts)
            except K3genError as e:
                rows.append({"kv": kv, "ssm": ssm, "error": str(e)})
                continue
            b = cache_bytes(cfg, t)
            row = {"kv": kv, "ssm": ssm, "token_bytes": b.per_page / b.page, "seq_bytes": b.per_slot, "fits": {}}
            for ctx in contexts:
                try:
                    row["fits"][ctx] = plan_capacity(cfg, t, budget, ctx)[0]
                except CacheCapacityError:
                    row["fits"][ctx] = 0
            rows.append(row)
    return rows, weights, budget


def human_params(n: int) -> str:
    """2.78 T, 104.2 B, 6.19 M: three significant digits or more."""
    for unit, v in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= v:
            x = n / v
            return f"{x:.2f} {unit}" if x < 100 else f"{x:.1f} {unit}"
    return str(n)


def check_plan(a) -> None:
    """Argument checks argparse cannot make alone (each value's own range it does)."""
    if a.tp % a.ep:
        raise SpecError("--ep", a.ep, f"a divisor of --tp {a.tp}", "routed experts split over ep of the tp ranks")


def run(a) -> int:
    """`k3gen plan-memory`: the arguments are checked before the table; a typed error propagates to
    the command line's main (one line on stderr, exit 2)."""
    from rich.console import Console
    from rich.table import Table
    import sys
    con = Console(highlight=False, width=None if sys.stdout.isatty() else 160)
    from model.params import count_params
    ep, layout = a.ep, a.layout
    check_plan(a)
    rows, weights, budget = plan_rows(a.config, a.arch, a.tp, a.gpu_gib, a.util, a.max_drafts,
                                      ep=ep, layout=layout)
    if all("error" in r for r in rows):   # the arguments, not a dtype combination, are at fault
        raise K3genError(rows[0]["error"])
    n = count_params(get_config(a.config))
    # Two short lines: rich wraps a title to the table's width, which would split a figure.
    table = Table(title=f"{a.config}: {human_params(n.total)} params, {human_params(n.active)} active per token; "
                        f"{layout} TP{a.tp} EP{ep}: weights {weights / 2**30:.1f} GiB/rank\n"
                        f"on {a.gpu_gib:g} GiB x {a.util:g}: cache budget {budget / 2**30:.1f} GiB",
                  title_justify="left")
    for col in ("KV", "SSM", "KV bytes/token", "state bytes/seq") + tuple(f"seqs x {c // 1024}K tokens" for c in CONTEXTS):
        table.add_column(col, justify="left" if col in ("KV", "SSM") else "right")
    for r in rows:
        if "error" in r:
            table.add_row(r["kv"], r["ssm"], "[red]" + r["error"] + "[/red]", "", *[""] * len(CONTEXTS))
            continue
        table.add_row(r["kv"], r["ssm"], f"{r['token_bytes']:,.0f}", f"{r['seq_bytes'] / 2**20:,.1f} MiB",
                      *[f"{r['fits'][c]:,}" for c in CONTEXTS])
    con.print(table)
    if budget <= 0:
        print(f"{a.config}: the weights alone exceed the budget: raise --tp or --gpu-gib", file=sys.stderr)
        return 1
    return 0
