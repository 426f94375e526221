"""`k3gen` command line: build | list | show | inspect | bench | cache | collect-env, and the model's
generate | plan-memory | eval | train (resolved by name when they run: k3gen never imports model/).

Every argument and K3GEN_* setting is parsed and range-checked before any work starts; a bad one is
one line `k3gen[ CMD]: error: ...` on stderr and exit 2. Errors always go to stderr, results to stdout.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from k3gen.errors import K3genError

KV_CHOICES = ("bf16", "fp8", "nvfp4")
SSM_CHOICES = ("fp32", "bf16")
# `--arch` takes the short family names and the full target names `k3gen list` prints
# (k3gen.targets.ARCH_ALIASES maps the first onto the second).
ARCH_SHORT = ("sm90", "sm100", "sm103", "sm107")
ARCH_FULL = ("sm100-mxfp4", "sm103-nvfp4", "sm107-nvfp4")
ARCH_CHOICES = ARCH_SHORT + ARCH_FULL
MODEL_PRESETS = "k3, small, tiny, kimi_linear_48b"
MAX_DRAFTS = 7          # k3gen.targets.check_serving: max_drafts in 0..7


class UsageError(K3genError):
    """Arguments that parse but do not fit together (argparse's own errors are one line too)."""


class _Parser(argparse.ArgumentParser):
    """argparse, but an error is one line on stderr (what went wrong and where help is), exit 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


class _Help(argparse.HelpFormatter):
    """Help that names each option's default (where it has one worth naming)."""
    def _get_help_string(self, action):
        h = action.help or ""
        named = action.default not in (None, False, argparse.SUPPRESS) and action.option_strings
        return h + " (default: %(default)s)" if named and "default" not in h else h


def _int_at_least(lo: int, what: str):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer ({what})") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"{v} is out of range: {what}")
        return v
    parse.__name__ = "int"
    return parse


def _drafts(text: str) -> tuple[int, ...]:
    out = []
    for part in text.split(","):
        part = part.strip()
        if not part.lstrip("-").isdigit() or not 0 <= int(part) <= MAX_DRAFTS:
            raise argparse.ArgumentTypeError(f"{text!r}: each draft count is an integer in 0..{MAX_DRAFTS}")
        if int(part) not in out:
            out.append(int(part))
    return tuple(out)


def _console(stderr: bool = False):
    from rich.console import Console
    # Logs and CI capture output: a fixed wide console keeps kernel names whole there.
    tty = (sys.stderr if stderr else sys.stdout).isatty()
    return Console(highlight=False, stderr=stderr, width=None if tty else 200)


def _targets(arch: str | None):
    from k3gen.targets import TARGETS, get_target
    return [get_target(arch)] if arch else list(TARGETS.values())


def arch_name(target) -> str:
    """The short `--arch` name of a target (every name printed is one `--arch` accepts)."""
    from k3gen.targets import ARCH_ALIASES
    return next((k for k, v in ARCH_ALIASES.items() if v == target.name), target.name)


def _not_a_file(path: str | None, what: str) -> None:
    if path and Path(path).exists() and not Path(path).is_dir():
        raise UsageError(f"{what} {path} is a file; give a folder")


# -- build ------------------------------------------------------------------------------------

def cmd_build(a) -> int:
    from k3gen.pipeline import build as B
    from k3gen.ir.dtypes import KvDtype, SsmDtype
    from k3gen.targets import ServingOptions, build_specs, check_serving, get_target

    t_start = time.perf_counter()
    con = _console()
    _not_a_file(a.out, "--out")
    _not_a_file(a.generated, "--generated")
    if a.model is None and (a.tp is not None or a.drafts is not None):
        raise UsageError("--tp and --drafts choose what a model runs: add --model")
    target = get_target(a.arch)
    kv = KvDtype(a.kv) if a.kv else None
    ssm = SsmDtype(a.ssm) if a.ssm else None
    if kv is not None:
        check_serving(target, ServingOptions(kv=kv, ssm=ssm or target.ssm_dtypes[0]))
    root = Path(a.generated) if a.generated else B.GENERATED_ROOT
    if a.model:
        return _build_model(a, con, target, kv, ssm, root, t_start)
    all_specs = build_specs(target)
    if a.check:
        problems = B.check_generated(target, all_specs, root)
        if problems:
            for p in problems:
                con.print(f"[red]{p}[/red]")
            con.print(f"generated/{target.module_name} drifted from k3gen: run `k3gen build --arch {a.arch}` "
                      "and commit the result")
            return 1
        con.print(f"generated/{target.module_name}: up to date ({len(all_specs)} kernels)")
        return 0
    _cache_usable()
    if target.frozen:
        _guard_frozen(target, all_specs, root)
    changed = B.write_generated(target, all_specs, root)
    _compile(a, con, target, build_specs(target, kv, ssm), t_start,
             f"generated/{target.module_name}: {len(changed)} files updated")
    return 0


def _build_model(a, con, target, kv, ssm, root: Path, t_start: float) -> int:
    """`--model`: exactly what that model's rank runs (targets.model_specs) over the serving settings
    asked for; the committed tree is not rewritten (`--check` says whether it holds them)."""
    from k3gen.pipeline import build as B
    from k3gen.targets import DEFAULT_DRAFTS, get_model, serving_sweep, sweep_specs
    drafts = DEFAULT_DRAFTS if a.drafts is None else a.drafts
    model = get_model(a.model)
    specs = sweep_specs(target, model, (a.tp or 1,), serving_sweep(target, kv, ssm, drafts))
    label = f"{model.name} TP{a.tp or 1}"
    if a.check:
        d = root / target.module_name
        want = B.generated_files(target, specs)
        bad = sorted(n for n, c in want.items() if n.endswith(".cu") and (not (d / n).exists()
                                                                          or (d / n).read_text() != c))
        for n in bad:
            con.print(f"[red]not in generated/{target.module_name}: {n}[/red]")
        con.print(f"{label}: {len(specs) - len(bad)} of {len(specs)} kernels in generated/{target.module_name}")
        return 1 if bad else 0
    _cache_usable()
    _compile(a, con, target, specs, t_start, label)
    return 0


def _cache_usable() -> None:
    from k3gen.pipeline.store import KernelCache
    KernelCache().ensure_usable()


def _clock(s: float) -> str:
    s = int(round(s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


class PlainProgress:
    """Progress for logs and CI (no terminal): one plain line on stderr at the start, then at most
    every `every` seconds while kernels finish or compile, and at the end:
    `k3gen build sm90: 12/46 kernels done (3 cached), compiling kda_prefill__h12-fp32, 35s elapsed, ETA 1m40s`."""

    def __init__(self, label: str, total: int, every: float, out=None, clock=time.monotonic):
        self.label, self.total, self.every, self.out, self.clock = label, total, every, out, clock
        self.t0 = clock()
        self.done = self.cached = 0
        self.current: list[str] = []
        self.last: float | None = None
        self.printed = ""

    def finished(self, art, built: bool) -> None:
        self.done += 1
        self.cached += not built
        self.current = [c for c in self.current if c != _short(art)]
        self._maybe()

    def running(self, arts) -> None:
        self.current = [_short(a) for a in arts]
        self._maybe()

    def close(self) -> None:
        self._maybe(force=True)

    def line(self) -> str:
        now = self.clock() - self.t0
        compiled = self.done - self.cached
        left = self.total - self.done
        eta = _clock(now / compiled * left) if compiled and left else "0s" if not left else "?"
        cur = ""
        if self.current and left:
            more = len(self.current) - 2
            cur = ", compiling " + ", ".join(self.current[:2]) + (f" (+{more})" if more > 0 else "")
        return (f"{self.label}: {self.done}/{self.total} kernels done ({self.cached} cached){cur}, "
                f"{_clock(now)} elapsed, ETA {eta}")

    def _maybe(self, force: bool = False) -> None:
        now, text = self.clock(), self.line()
        if (force and text != self.printed) or self.last is None or now - self.last >= self.every:
            self.last, self.printed = now, text
            print(text, file=self.out or sys.stderr, flush=True)


def _short(art) -> str:
    """op__slug of a kernel's file stem (the hash8 tail tells a reader nothing)."""
    return "__".join(art.spec.file_stem.split("__")[:2])


def _compile(a, con, target, specs, t_start: float, note: str) -> None:
    from k3gen.config import settings
    from k3gen.pipeline import build as B
    label = f"k3gen build {arch_name(target)}"
    if sys.stderr.isatty():
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
        with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), TextColumn("{task.fields[now]}"), console=_console(stderr=True),
                      transient=True) as prog:
            task = prog.add_task(label, total=len(specs), now="")
            results = B.build_many(
                specs, jobs=a.jobs, progress=lambda art, built: prog.advance(task),
                running=lambda arts: prog.update(task, now=", ".join(_short(x) for x in arts[:2])),
                tick=1.0)
    else:
        plain = PlainProgress(label, len(specs), settings().progress_seconds)
        results = B.build_many(specs, jobs=a.jobs, progress=plain.finished, running=plain.running,
                               tick=settings().progress_seconds)
        plain.close()
    con.print(build_table(target, results))
    if a.out:
        d = B.write_bundle(Path(a.out), target, results)
        con.print(f"cubins written to {d}")
    built = sum(r.built for r in results)
    con.print(f"{len(results)} kernels, {built} compiled, {len(results) - built} from cache; "
              f"{note}; {time.perf_counter() - t_start:.1f}s")


def build_table(target, results):
    """One row per kernel; a kernel with several functions lists each on its own line inside it."""
    from rich.table import Table

    from k3gen.pipeline.inspect import KernelResources
    table = Table(title=f"k3gen build {arch_name(target)} ({target.name}, {target.arch})", title_justify="left")
    for col in ("kernel", "functions", "regs", "smem", "spills", "notable SASS", "time"):
        table.add_column(col, justify="right" if col in ("regs", "smem", "time") else "left")
    for r in results:
        res = [KernelResources(**x) for x in r.resources]
        fn = [x.function if len(x.function) <= 48 else x.function[:45] + "..." for x in res]
        table.add_row(_short(r.artifact), "\n".join(fn) or "-", "\n".join(str(x.registers) for x in res),
                      "\n".join(str(x.shared) for x in res),
                      "\n".join("[red]yes[/red]" if x.spills else "no" for x in res),
                      "\n".join(x.notable() or "-" for x in res),
                      f"{r.meta.get('compile_seconds', 0):.2f}s" if r.built else "cached")
    return table


def _guard_frozen(target, specs, root: Path) -> None:
    """A frozen target's landed kernel sources may never change; new ones may be added."""
    from k3gen.pipeline import build as B
    from k3gen.errors import SpecError
    want = B.generated_files(target, specs)
    d = root / target.module_name
    for name, content in want.items():
        p = d / name
        if name.endswith(".cu") and p.exists() and p.read_text() != content:
            raise SpecError("generated", str(p), "unchanged bytes",
                            f"{target.name} is frozen: its landed kernels may not change")


# -- list / show / inspect ----------------------------------------------------------------------

def _find_spec(name: str, arch: str | None):
    from k3gen.targets import build_specs
    name = name.strip()
    if not name:
        raise UsageError("the kernel name is empty; give a kernel name or file stem (`k3gen list` shows them)")
    exact, prefix = [], []
    for t in _targets(arch):
        for s in build_specs(t):
            if name in (s.kernel_name, s.file_stem, s.file_stem + ".cu"):
                exact.append(s)
            elif s.file_stem.startswith(name):
                prefix.append(s)
    hits = exact or prefix
    if not hits:
        raise K3genError(f"no kernel named {name!r}; `k3gen list` shows them")
    targets = sorted({arch_name(s.target) for s in hits})
    if len(targets) > 1:
        raise K3genError(f"{name!r} exists for several targets ({', '.join(targets)}): add --arch")
    stems = sorted({s.file_stem for s in hits})
    if len(stems) > 1:
        more = f" and {len(stems) - 3} more" if len(stems) > 3 else ""
        raise K3genError(f"{name!r} matches {len(stems)} kernels ({', '.join(stems[:3])}{more}): "
                         "give a whole name or a longer prefix")
    return hits[0]


def cmd_list(a) -> int:
    from rich.table import Table

    from k3gen.ops import registry
    from k3gen.targets import build_specs
    con = _console()
    t = Table("arch", "kernel", "op", "variant", "lowering", "file",
              title="kernels (the arch column is what --arch takes; variant: the op's variants.py entry)",
              title_justify="left")
    for tgt in _targets(a.arch):
        for s in build_specs(tgt):
            t.add_row(arch_name(tgt), s.kernel_name, s.op, s.impl.name, s.lowering, s.file_stem)
    con.print(t)
    con.print("ops: " + ", ".join(sorted(registry())))
    return 0


def cmd_show(a) -> int:
    from k3gen.pipeline.build import lower
    spec = _find_spec(a.kernel, a.arch)
    print(lower(spec).source, end="")
    return 0


def _launch_smem(spec, meta: dict) -> int | None:
    """The dynamic shared memory the main kernel launches with (the cubin's `shared` is only the
    static part): a CuTe kernel's from its launch ABI, an NVRTC kernel's from its variant's plan."""
    abi = meta.get("params")
    if isinstance(abi, dict) and "dynamic_smem" in abi:
        return int(abi["dynamic_smem"])
    plan = getattr(spec.impl, "plan", None)
    try:
        smem = getattr(plan(spec), "smem_bytes", None) if callable(plan) else None
    except Exception:  # noqa: BLE001  (a plan that needs launch-time inputs has no one value)
        return None
    return int(smem) if isinstance(smem, int) else None


def cmd_inspect(a) -> int:
    from rich.table import Table

    from k3gen.pipeline.build import build_one
    from k3gen.pipeline.inspect import KernelResources, sass_text
    con = _console()
    spec = _find_spec(a.kernel, a.arch)
    _cache_usable()
    r = build_one(spec)
    con.print(f"[bold]{spec.kernel_name}[/bold]  {arch_name(spec.target)} ({spec.target.arch})  {spec.file_stem}")
    con.print(f"spec: {spec.canonical()}")
    con.print(f"cache key: {r.artifact.key}  ({'compiled' if r.built else 'cached'})")
    dyn = _launch_smem(spec, r.meta)
    if dyn is not None:
        con.print(f"{r.meta.get('entry', spec.kernel_name)}: launched with {dyn} B of dynamic shared memory")
    for res in (KernelResources(**x) for x in r.resources):
        con.print(f"{res.function}: registers {res.registers}, shared {res.shared} B (static), local {res.local} B "
                  f"({'SPILLS' if res.spills else 'no spills'}), stack {res.stack} B")
        t = Table("opcode", "count", title="SASS opcodes", title_justify="left")
        for op, n in sorted(res.sass.items(), key=lambda kv: -kv[1]):
            t.add_row(op, str(n))
        con.print(t)
    if a.sass:
        print(sass_text(r.cubin))
    return 0


# -- cache / env / bench ----------------------------------------------------------------------

def cmd_cache(a) -> int:
    from k3gen.pipeline.store import KernelCache, clear_checkpoints
    c = KernelCache()
    c.ensure_usable()
    if a.action == "info":
        print(f"cache: {c.root}\nentries: {len(c.entries())}\nsize: {c.size_bytes() / 1e6:.2f} MB")
    elif a.action == "verify":
        v = c.scan()
        print(f"{c.root}: {v.good} entries good, {len(v.removed)} corrupt"
              + (" (removed; rebuilt on next use)" if v.removed else "")
              + (f", {len(v.busy)} being built (not checked)" if v.busy else ""))
        for d in v.removed:
            print(f"  removed: {d.kernel}: {d.why} [{d.key[:16]}]")
        return 1 if v.removed else 0
    else:
        print(f"removed {c.clear()} entries and {clear_checkpoints(c.root)} random checkpoints from {c.root}")
    return 0


def cmd_collect_env(a) -> int:
    from k3gen.envinfo import collect_env
    env = collect_env(query_gpu=not a.no_gpu)
    if a.json:
        print(json.dumps(env, indent=1, sort_keys=True))
        return 0
    con = _console()
    for k, v in env.items():
        if isinstance(v, dict):
            con.print(f"[bold]{k}[/bold]")
            for kk, vv in v.items():
                con.print(f"  {kk}: {vv}", markup=False)
        else:
            con.print(f"[bold]{k}[/bold]: ", end="")
            con.print(str(v), markup=False)
    return 0


def cmd_bench(a) -> int:
    # By name, when the command runs: bench/ imports k3gen, never the other way (DESIGN's layer rule).
    import importlib
    try:
        entry = importlib.import_module("bench.__main__")
    except ModuleNotFoundError as e:
        raise K3genError(f"k3gen bench needs the bench/ package of the repository ({e})") from e
    return entry.run(a)


# -- parser -----------------------------------------------------------------------------------

def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="k3gen", formatter_class=_Help, description="Kernel generator for Kimi K3 (KDA + MLA) "
                "on SM90 / SM100-family GPUs. Settings: K3GEN_* variables (`k3gen collect-env` shows them).")
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND", required=True, parser_class=_Parser)

    def cmd(name, **kw):
        return sub.add_parser(name, formatter_class=_Help, **kw)
    arch_help = f"target GPU family: {', '.join(ARCH_SHORT)} (or the full names {', '.join(ARCH_FULL)})"

    b = cmd("build", help="generate sources and compile cubins for a target",
            description="Write generated/<target>/ (sources, manifest.json, kernels.py) and compile cubins "
            "into the cache. Needs no GPU. Progress goes to stderr: a bar on a terminal, else a plain line "
            "every K3GEN_PROGRESS_SECONDS.")
    b.add_argument("--arch", required=True, choices=ARCH_CHOICES, metavar="ARCH", help=arch_help)
    b.add_argument("--kv", choices=KV_CHOICES, help="KV cache dtype to compile: {bf16,fp8,nvfp4} "
                   "(default: all the target allows)")
    b.add_argument("--ssm", choices=SSM_CHOICES, help="recurrent-state storage dtype: {fp32,bf16} "
                   "(default: all the target allows)")
    b.add_argument("--model", metavar="NAME", help=f"build exactly what this model runs: a preset ({MODEL_PRESETS}) "
                   "or a HF config.json / checkpoint folder; the committed tree is left as is (default: the "
                   "target's whole tree)")
    b.add_argument("--tp", type=_int_at_least(1, "the tensor-parallel degree is >= 1"),
                   help="with --model: tensor-parallel degree of the rank, >= 1 (default: 1)")
    b.add_argument("--drafts", metavar="M,..", type=_drafts,
                   help=f"with --model: max_drafts settings to cover, each in 0..{MAX_DRAFTS} (default: 0,3,7)")
    b.add_argument("--out", metavar="DIR", help="also write the cubins here, a bundle for K3GEN_PREBUILT "
                   "(default: none)")
    b.add_argument("--check", action="store_true", help="only check that generated/ is up to date")
    b.add_argument("-j", "--jobs", type=_int_at_least(0, "the number of compile processes is >= 0"), default=0,
                   metavar="N", help="parallel compile processes, 0: K3GEN_JOBS or one per core (default: 0)")
    b.add_argument("--generated", metavar="DIR", help=argparse.SUPPRESS)
    b.set_defaults(fn=cmd_build)

    ls = cmd("list", help="list kernels of every target")
    ls.add_argument("--arch", choices=ARCH_CHOICES, metavar="ARCH", help=arch_help + " (default: every target)")
    ls.set_defaults(fn=cmd_list)

    sh = cmd("show", help="print a kernel's generated source")
    sh.add_argument("kernel", help="kernel name, file stem or a unique prefix of one (see `k3gen list`)")
    sh.add_argument("--arch", choices=ARCH_CHOICES, metavar="ARCH",
                    help=arch_help + " (default: the one target holding the kernel)")
    sh.set_defaults(fn=cmd_show)

    ins = cmd("inspect", help="registers, shared memory, spills and SASS of a kernel")
    ins.add_argument("kernel", help="kernel name, file stem or a unique prefix of one (see `k3gen list`)")
    ins.add_argument("--arch", choices=ARCH_CHOICES, metavar="ARCH",
                     help=arch_help + " (default: the one target holding the kernel)")
    ins.add_argument("--sass", action="store_true", help="print the full SASS")
    ins.set_defaults(fn=cmd_inspect)

    be = cmd("bench", help="benchmark kernels on the GPU against the copy ceiling and peers "
             "(`build`: the build times, on the CPU)")
    be.add_argument("--op", default="kv_cache_write", help="benchmark name (`--list` names them)")
    be.add_argument("--out", metavar="DIR", help="folder for the JSON and PNG (default: bench/results/)")
    be.add_argument("--quick", action="store_true", help="fewer shapes and repetitions")
    be.add_argument("--list", action="store_true", help="list the benchmarks (no GPU needed)")
    be.set_defaults(fn=cmd_bench)

    ca = cmd("cache", help="inspect, verify (and repair) or clear the kernel cache")
    ca.add_argument("action", choices=("info", "verify", "clear"),
                    help="info: folder, entries, size; verify: check every entry, remove damaged ones; "
                    "clear: remove every entry")
    ca.set_defaults(fn=cmd_cache)

    ce = cmd("collect-env", help="versions, toolchain, settings in effect and GPU, for bug reports")
    ce.add_argument("--json", action="store_true", help="print JSON")
    ce.add_argument("--no-gpu", action="store_true", help="do not query the GPU")
    ce.set_defaults(fn=cmd_collect_env)
    for name, (_, doc) in EXTERNAL.items():
        sub.add_parser(name, help=doc, add_help=False)
    return p


# Subcommands served by other packages of the repository, resolved by name only when they run:
# k3gen never imports model/ (DESIGN's layer rule); `python -m model ...` is the same entry.
EXTERNAL = {
    "generate": ("model.cli:generate_main", "run the Kimi K3 model (python -m model generate)"),
    "plan-memory": ("model.cli:plan_main", "sequences x tokens of a config that fit a GPU (python -m model "
                    "plan-memory)"),
    "eval": ("model.cli:eval_main", "exact match of a trained checkpoint per serving setting (python -m model eval)"),
    "train": ("model.cli:train_main", "train the small K3 of the accuracy table (python -m model train)"),
}


def _external(name: str, argv: list[str]) -> int:
    import importlib
    mod, fn = EXTERNAL[name][0].split(":")
    try:
        entry = getattr(importlib.import_module(mod), fn)
    except ModuleNotFoundError as e:
        raise K3genError(f"k3gen {name} needs the model/ package of the repository ({e})") from e
    return entry(argv, prog=f"k3gen {name}")


def main(argv=None) -> int:
    from k3gen.config import check_all
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] in EXTERNAL:
            check_all()
            return _external(argv[0], argv[1:]) or 0
        a = parser().parse_args(argv)
        if a.fn is not cmd_collect_env:   # which reports a bad setting instead
            check_all()   # after the arguments (so --help works whatever the environment), before any work
        return a.fn(a) or 0
    except K3genError as e:   # one line for a bad input; a compile error carries its log below it
        print(f"k3gen: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:   # a folder given that cannot be written, a disk full: no traceback for those
        print(f"k3gen: error: {e.strerror or e}" + (f": {e.filename}" if e.filename else ""), file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("k3gen: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
