"""`k3gen` command line: build | list | show | inspect | bench | cache | collect-env, and the model's
generate | plan-memory (resolved by name when they run: k3gen never imports model/)."""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from k3gen.errors import K3genError

KV_CHOICES = ("bf16", "fp8", "nvfp4")
SSM_CHOICES = ("fp32", "bf16")
ARCH_CHOICES = ("sm90", "sm100", "sm103", "sm107")


def _console():
    import sys

    from rich.console import Console
    # Logs and CI capture output: a fixed wide console keeps kernel names whole there.
    return Console(highlight=False, width=None if sys.stdout.isatty() else 200)


def _targets(arch: str | None):
    from k3gen.targets import TARGETS, get_target
    return [get_target(arch)] if arch else list(TARGETS.values())


# -- build ------------------------------------------------------------------------------------

def cmd_build(a) -> int:
    from k3gen.pipeline import build as B
    from k3gen.ir.dtypes import KvDtype, SsmDtype
    from k3gen.targets import ServingOptions, build_specs, check_serving, get_target

    t_start = time.perf_counter()
    con = _console()
    target = get_target(a.arch)
    kv = KvDtype(a.kv) if a.kv else None
    ssm = SsmDtype(a.ssm) if a.ssm else None
    if kv is not None:
        check_serving(target, ServingOptions(kv=kv, ssm=ssm or target.ssm_dtypes[0]))
    root = Path(a.generated) if a.generated else B.GENERATED_ROOT
    if a.model:
        return _build_model(a, con, target, kv, ssm, root, t_start)
    if a.tp is not None or a.drafts is not None:
        raise K3genError("--tp and --drafts choose what a model runs: add --model")
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
    drafts = DEFAULT_DRAFTS if a.drafts is None else tuple(int(x) for x in a.drafts.split(",") if x.strip())
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
    _compile(a, con, target, specs, t_start, label)
    return 0


def _compile(a, con, target, specs, t_start: float, note: str) -> None:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from k3gen.pipeline import build as B
    from k3gen.pipeline.inspect import KernelResources
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=con, transient=True) as prog:
        task = prog.add_task(f"{target.name}: compiling", total=len(specs))
        results = B.build_many(specs, jobs=a.jobs, progress=lambda art, built: prog.advance(task))
    table = Table(title=f"k3gen build {target.name} ({target.arch})", title_justify="left")
    for col in ("kernel", "arch", "regs", "smem", "spills", "notable SASS", "time"):
        table.add_column(col, justify="right" if col in ("regs", "smem", "time") else "left")
    for r in results:
        for res in (KernelResources(**x) for x in r.resources):
            table.add_row(r.artifact.spec.kernel_name, r.meta.get("arch", ""), str(res.registers),
                          str(res.shared), "[red]yes[/red]" if res.spills else "no", res.notable() or "-",
                          f"{r.meta.get('compile_seconds', 0):.2f}s" if r.built else "cached")
    con.print(table)
    if a.out:
        d = B.write_bundle(Path(a.out), target, results)
        con.print(f"cubins written to {d}")
    built = sum(r.built for r in results)
    con.print(f"{len(results)} kernels, {built} compiled, {len(results) - built} from cache; "
              f"{note}; {time.perf_counter() - t_start:.1f}s")


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
    hits = []
    for t in _targets(arch):
        for s in build_specs(t):
            if name in (s.kernel_name, s.file_stem, s.file_stem + ".cu") or s.file_stem.startswith(name):
                hits.append(s)
    if not hits:
        raise K3genError(f"no kernel named {name!r}; `k3gen list` shows them")
    if len(hits) > 1 and arch is None:
        targets = sorted({s.target.name for s in hits})
        if len(targets) > 1:
            raise K3genError(f"{name!r} exists for several targets ({', '.join(targets)}): add --arch")
    return hits[0]


def cmd_list(a) -> int:
    from rich.table import Table

    from k3gen.ops import registry
    from k3gen.targets import build_specs
    con = _console()
    t = Table(title="kernels", title_justify="left")
    for c in ("target", "kernel", "op", "lowering", "file"):
        t.add_column(c)
    for tgt in _targets(a.arch):
        for s in build_specs(tgt):
            t.add_row(tgt.name, s.kernel_name, s.op, s.lowering, s.file_stem)
    con.print(t)
    con.print("ops: " + ", ".join(sorted(registry())))
    return 0


def cmd_show(a) -> int:
    from k3gen.pipeline.build import lower
    spec = _find_spec(a.kernel, a.arch)
    print(lower(spec).source, end="")
    return 0


def cmd_inspect(a) -> int:
    from rich.table import Table

    from k3gen.pipeline.build import build_one
    from k3gen.pipeline.inspect import KernelResources, sass_text
    con = _console()
    spec = _find_spec(a.kernel, a.arch)
    r = build_one(spec)
    con.print(f"[bold]{spec.kernel_name}[/bold]  {spec.target.name} ({spec.target.arch})  {spec.file_stem}")
    con.print(f"spec: {spec.canonical()}")
    con.print(f"cache key: {r.artifact.key}  ({'compiled' if r.built else 'cached'})")
    for res in (KernelResources(**x) for x in r.resources):
        con.print(f"{res.function}: registers {res.registers}, shared {res.shared} B, local {res.local} B "
                  f"({'SPILLS' if res.spills else 'no spills'}), stack {res.stack} B")
        t = Table(title="SASS opcodes", title_justify="left")
        t.add_column("opcode")
        t.add_column("count", justify="right")
        for op, n in sorted(res.sass.items(), key=lambda kv: -kv[1]):
            t.add_row(op, str(n))
        con.print(t)
    if a.sass:
        print(sass_text(r.cubin))
    return 0


# -- cache / env / bench ----------------------------------------------------------------------

def cmd_cache(a) -> int:
    from k3gen.pipeline.store import KernelCache
    c = KernelCache()
    if a.action == "info":
        print(f"cache: {c.root}\nentries: {len(c.entries())}\nsize: {c.size_bytes() / 1e6:.2f} MB")
    elif a.action == "verify":
        good, bad = c.verify()
        print(f"{good} entries good, {len(bad)} corrupt (removed; rebuilt on next use)")
        for k in bad:
            print(f"  corrupt: {k}")
        return 1 if bad else 0
    else:
        print(f"removed {c.clear()} entries from {c.root}")
    return 0


def collect_env(query_gpu: bool = True) -> dict:
    import platform
    from importlib.metadata import PackageNotFoundError, version

    from k3gen.pipeline.toolchain import cuda_include_dir, nvrtc_version, tool
    from k3gen.config import describe
    env = {"python": platform.python_version(), "platform": platform.platform(), "packages": {}}
    for pkg in ("k3gen", "torch", "cuda-bindings", "cuda-core", "nvidia-cuda-nvrtc", "nvidia-cuda-runtime",
                "nvidia-cuda-cuobjdump", "nvidia-cuda-nvdisasm", "nvidia-cutlass-dsl", "jinja2", "sympy",
                "triton", "fla-core"):
        try:
            env["packages"][pkg] = version(pkg)
        except PackageNotFoundError:
            env["packages"][pkg] = None
    try:
        env["nvrtc"] = nvrtc_version()
    except Exception as e:  # noqa: BLE001 - reported, not fatal
        env["nvrtc"] = f"unavailable: {e}"
    env["cuda_include"] = str(cuda_include_dir())
    env["cuobjdump"] = tool("cuobjdump")
    env["nvdisasm"] = tool("nvdisasm")
    env["settings"] = {n: v for n, v, _ in describe()}
    env["gpu"] = None
    if query_gpu:
        try:
            import torch
            if torch.cuda.is_available():
                p = torch.cuda.get_device_properties(0)
                env["gpu"] = {"name": p.name, "cc": f"{p.major}.{p.minor}", "sms": p.multi_processor_count,
                              "memory_gb": round(p.total_memory / 2**30, 1), "torch_cuda": torch.version.cuda}
        except Exception as e:  # noqa: BLE001
            env["gpu"] = f"unavailable: {e}"
    return env


def cmd_collect_env(a) -> int:
    env = collect_env(query_gpu=not a.no_gpu)
    if a.json:
        print(json.dumps(env, indent=1, sort_keys=True))
        return 0
    con = _console()
    for k, v in env.items():
        if isinstance(v, dict):
            con.print(f"[bold]{k}[/bold]")
            for kk, vv in v.items():
                con.print(f"  {kk}: {vv}")
        else:
            con.print(f"[bold]{k}[/bold]: {v}")
    return 0


def cmd_bench(a) -> int:
    # By name, when the command runs: bench/ imports k3gen, never the other way (DESIGN's layer rule).
    import importlib
    try:
        harness = importlib.import_module("bench.harness")
    except ModuleNotFoundError as e:
        raise K3genError(f"k3gen bench needs the bench/ package of the repository ({e})") from e
    return harness.list_cases() if a.list else harness.main(a)


# -- parser -----------------------------------------------------------------------------------

def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="k3gen", description="Kernel generator for Kimi K3 (KDA + MLA) on "
                                "SM90 / SM100-family GPUs.")
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND", required=True)

    b = sub.add_parser("build", help="generate sources and compile cubins for a target",
                       description="Write generated/<target>/ (sources, manifest.json, kernels.py) and "
                       "compile cubins into the cache. Needs no GPU.")
    b.add_argument("--arch", required=True, choices=ARCH_CHOICES, help="target GPU family")
    b.add_argument("--kv", choices=KV_CHOICES, help="KV cache dtype to compile (default: all the target allows)")
    b.add_argument("--ssm", choices=SSM_CHOICES, help="recurrent-state storage dtype")
    b.add_argument("--model", metavar="NAME", help="build exactly what this model runs: a preset (k3, small, "
                   "tiny, kimi_linear_48b) or a HF config.json / checkpoint folder; the committed tree is left as is")
    b.add_argument("--tp", type=int, help="with --model: tensor-parallel degree of the rank (default 1)")
    b.add_argument("--drafts", metavar="M,..", help="with --model: max_drafts settings to cover (default 0,3,7)")
    b.add_argument("--out", metavar="DIR", help="also write the cubins here (a bundle for K3GEN_PREBUILT)")
    b.add_argument("--check", action="store_true", help="only check that generated/ is up to date")
    b.add_argument("-j", "--jobs", type=int, default=0, help="parallel compile processes (default: cores)")
    b.add_argument("--generated", metavar="DIR", help=argparse.SUPPRESS)
    b.set_defaults(fn=cmd_build)

    ls = sub.add_parser("list", help="list kernels of every target")
    ls.add_argument("--arch", choices=ARCH_CHOICES)
    ls.set_defaults(fn=cmd_list)

    sh = sub.add_parser("show", help="print a kernel's generated source")
    sh.add_argument("kernel", help="kernel name or file stem (see `k3gen list`)")
    sh.add_argument("--arch", choices=ARCH_CHOICES)
    sh.set_defaults(fn=cmd_show)

    ins = sub.add_parser("inspect", help="registers, shared memory, spills and SASS of a kernel")
    ins.add_argument("kernel")
    ins.add_argument("--arch", choices=ARCH_CHOICES)
    ins.add_argument("--sass", action="store_true", help="print the full SASS")
    ins.set_defaults(fn=cmd_inspect)

    be = sub.add_parser("bench", help="benchmark kernels on the GPU against the copy ceiling and peers "
                        "(`build`: the build times, on the CPU)")
    be.add_argument("--op", default="kv_cache_write", help="benchmark name (see --list)")
    be.add_argument("--out", default=None, help="folder for the JSON and PNG (default: bench/results/)")
    be.add_argument("--quick", action="store_true", help="fewer shapes and repetitions")
    be.add_argument("--list", action="store_true", help="list the benchmarks")
    be.set_defaults(fn=cmd_bench)

    ca = sub.add_parser("cache", help="inspect or clear the kernel cache")
    ca.add_argument("action", choices=("info", "verify", "clear"))
    ca.set_defaults(fn=cmd_cache)

    ce = sub.add_parser("collect-env", help="versions, toolchain and settings, for bug reports")
    ce.add_argument("--json", action="store_true")
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
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in EXTERNAL:
        try:
            return _external(argv[0], argv[1:]) or 0
        except K3genError as e:
            print(f"k3gen: error: {e}", file=sys.stderr)
            return 2
    p = parser()
    a = p.parse_args(argv)
    try:
        return a.fn(a) or 0
    except K3genError as e:
        print(f"k3gen: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
