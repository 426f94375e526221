"""The layer rule of DESIGN.md, no import cycles, and the size limit, read from the source (no imports run)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
PKG = ROOT / "k3gen"
CODE = (".py", ".cuh", ".j2", ".sh", ".md")  # text people read; results/*.json are data
MAX_LINES = 600


def _module(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """Every module a file imports, at module level or inside functions (lazy imports are edges too)."""
    tree = ast.parse(path.read_text(), str(path))
    me = _module(path)
    pkg = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names)  # `from pkg import submodule`
    return out


def _py_files(*roots: Path):
    for r in roots:
        for p in sorted(r.rglob("*.py")):
            if "__pycache__" not in p.parts:
                yield p


def _graph() -> dict[str, set[str]]:
    files = list(_py_files(PKG, ROOT / "model", ROOT / "bench"))
    mods = {_module(p): p for p in files}
    graph = {}
    for m, p in mods.items():
        graph[m] = {i for i in _imports(p) if i in mods and i != m}
    return graph


def _violations(prefix: str, allowed: tuple[str, ...], files) -> list[str]:
    bad = []
    for p in files:
        for i in sorted(_imports(p)):
            if i.startswith(prefix) and not i.startswith(allowed) and i != "k3gen":
                bad.append(f"{p.relative_to(ROOT)} imports {i}")
    return bad


def test_op_contracts_import_only_the_ir_arch_and_numerics():
    files = [p for p in _py_files(PKG / "ops") if p.name in ("spec.py", "variants.py")]
    assert len(files) >= 2 * 9
    allowed = ("k3gen.ir", "k3gen.arch", "k3gen.numerics", "k3gen.errors")
    bad = [v for v in _violations("k3gen.", allowed, files)
           if not any(v.endswith(s) or f"{s}." in v.split(" imports ")[1] + "."
                      for s in (".spec", ".variants"))]
    # Another op's spec/variants is a contract too (mla_q_absorb builds on the GEMM's spec).
    bad = [v for v in bad if not v.split(" imports ")[1].rsplit(".", 1)[-1] in ("spec", "variants")
           and not any(v.split(" imports ")[1].startswith(f"k3gen.ops.{o}.{s}") for o in _op_names()
                       for s in ("spec", "variants"))]
    assert not bad, bad


def _op_names():
    return sorted(d.name for d in (PKG / "ops").iterdir() if (d / "spec.py").exists())


def test_ir_is_arch_free_and_at_the_bottom():
    bad = _violations("k3gen.", ("k3gen.ir", "k3gen.errors"), _py_files(PKG / "ir"))
    assert not bad, bad


def test_arch_imports_only_the_ir():
    bad = _violations("k3gen.", ("k3gen.ir", "k3gen.errors", "k3gen.arch"), _py_files(PKG / "arch"))
    assert not bad, bad


def test_pipeline_never_imports_the_runtime():
    bad = _violations("k3gen.runtime", (), _py_files(PKG / "pipeline"))
    assert not bad, bad


def test_k3gen_never_imports_the_model_or_the_benchmarks():
    bad = _violations("model", (), _py_files(PKG)) + _violations("bench", (), _py_files(PKG))
    assert not bad, bad


def test_no_import_cycles():
    graph = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    cycles: list[list[str]] = []
    counter = [0]

    def strong(v: str) -> None:  # Tarjan, recursive (the graph is a few hundred modules)
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    # A package __init__ that re-exports its own submodules is not a cycle in the layering sense.
    cycles = [c for c in cycles if not all(m.startswith(c[0] + ".") or m == c[0] for m in c)]
    assert not cycles, cycles


@pytest.mark.parametrize("root", ["k3gen", "model", "bench", "tools", "tests", "README.md"])
def test_no_code_file_over_the_size_limit(root):
    long = []
    top = ROOT / root
    for p in sorted(top.rglob("*") if top.is_dir() else [top]):
        if p.is_file() and p.suffix in CODE and "__pycache__" not in p.parts:
            n = len(p.read_text(errors="replace").splitlines())
            if n > MAX_LINES:
                long.append(f"{p.relative_to(ROOT)}: {n} lines")
    assert not long, long


def test_a_mutated_import_breaks_the_rule(tmp_path, monkeypatch):
    """The checker itself can fail: a spec that imports the runtime is reported."""
    f = tmp_path / "spec.py"
    f.write_text("from k3gen.runtime.launcher import Launcher\n")
    monkeypatch.setattr(f"{__name__}.ROOT", tmp_path)
    assert _violations("k3gen.", ("k3gen.ir",), [f]) == ["spec.py imports k3gen.runtime.launcher",
                                                          "spec.py imports k3gen.runtime.launcher.Launcher"]
