"""The benchmark package without a GPU: the registry read from bench/cases/, listing, errors, and
bench/results/ keeping only the newest run of each benchmark name. Nothing here times anything."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def _bench(*args):
    return subprocess.run([sys.executable, "-m", "bench", *args], capture_output=True, text=True, cwd=ROOT)


def test_every_case_module_registers_the_benchmark_of_its_name():
    from bench.cases import registry
    cases = registry()
    modules = sorted(p.stem for p in (ROOT / "bench" / "cases").glob("*.py") if not p.stem.startswith("_"))
    assert set(modules) <= set(cases), set(modules) - set(cases)
    # CPU cases: the build timing and the B300 projections of the tcgen05 MLA decode, MLA prefill, FP8 GEMM,
    # KDA prefill and MoE experts (computed from byte counts, nothing runs); every other case measures on the GPU.
    cpu = {"build", "mla_decode_b300", "fp8_block_gemm_b300", "mla_prefill_b300", "kda_prefill_b300",
           "moe_experts_b300"}
    assert all(cases[n].bench_case.device == "cpu" for n in cpu)
    assert all(fn.bench_case.device == "gpu" for name, fn in cases.items() if name not in cpu)


def test_names_the_gpu_tests_and_tools_import_stay_reachable():
    import bench.cases as c
    from bench.cases import fp8_block_gemm_specs  # noqa: F401  (tests/gpu/test_fp8_block_gemm.py)
    assert callable(c.mla_decode_heads) and callable(c.fp8_block_gemm_sweep)


def test_list_needs_no_gpu():
    p = _bench("--list")
    assert p.returncode == 0, p.stderr
    names = {line.split()[0] for line in p.stdout.splitlines()}
    assert {"build", "kda_decode", "mla_decode", "fp8_block_gemm", "kv_cache_write"} <= names


def test_unknown_benchmark_is_a_one_line_error():
    p = _bench("--op", "no_such_op")
    assert p.returncode == 2
    assert len(p.stderr.strip().splitlines()) == 1 and "no_such_op" in p.stderr


def test_prune_keeps_only_the_newest_run_of_the_name(tmp_path):
    from bench.harness import prune
    for f in ("mla_decode-20261130-141208.json", "mla_decode-20261130-141208.png", "mla_decode-20261129-213534.json",
              "mla_decode-20261129-213534.png", "mla_decode_bars-20261130-141157.json",
              "mla_decode_bars-20261130-062816.log", "fp8_block_gemm_sweep-20261130-0440-tiled.json"):
        (tmp_path / f).write_text("{}")
    gone = prune(tmp_path, "mla_decode", keep="mla_decode-20261130-141208")
    assert sorted(p.name for p in gone) == ["mla_decode-20261129-213534.json", "mla_decode-20261129-213534.png"]
    assert prune(tmp_path, "mla_decode_bars", keep="mla_decode_bars-20261201-000000") == [
        tmp_path / "mla_decode_bars-20261130-141157.json"]   # the cited .log stays
    assert prune(tmp_path, "fp8_block_gemm_sweep", keep="x")[0].name == "fp8_block_gemm_sweep-20261130-0440-tiled.json"


def test_results_hold_one_run_per_name():
    from bench.harness import STAMP
    runs: dict = {}
    for p in (ROOT / "bench" / "results").glob("*.json"):
        m = STAMP.search(p.stem)
        assert m, p.name
        runs.setdefault(p.stem[:m.start()], []).append(p.name)
        assert p.with_suffix(".png").exists(), f"{p.name} has no PNG"
    assert all(len(v) == 1 for v in runs.values()), runs
