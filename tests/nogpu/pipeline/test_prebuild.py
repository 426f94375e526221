"""The GPU run loads only prebuilt cubins (no JIT there), so the bundle tools/prebuild_gpu.py builds must
hold every spec a GPU test module or a benchmark names. The bundle's list is data (tests/gpu/specs.py,
the enumerator); this test reads the GPU modules' own lists and checks they did not drift from it."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

from k3gen.ir.spec import OpSpec  # noqa: E402
from k3gen.targets import get_target  # noqa: E402


def _prebuild():
    spec = importlib.util.spec_from_file_location("_prebuild_gpu", ROOT / "tools" / "prebuild_gpu.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _specs_in(obj, out: dict, depth: int = 0) -> None:
    if isinstance(obj, OpSpec):
        out[obj.digest()] = obj
    elif depth < 3 and isinstance(obj, dict):
        for v in obj.values():
            _specs_in(v, out, depth + 1)
    elif depth < 3 and isinstance(obj, (list, tuple, set)):
        for v in obj:
            _specs_in(v, out, depth + 1)


def _named_by_gpu_modules_and_benches() -> dict:
    named: dict = {}
    for f in sorted((ROOT / "tests" / "gpu").glob("test_*.py")):
        name = f"tests.gpu.{f.stem}"
        mod = sys.modules.get(name)
        if mod is None:
            mod = importlib.import_module(name)
        for v in vars(mod).values():
            _specs_in(v, named)
    from bench.cases import fp8_block_gemm_specs
    from bench.cases.fp8_block_gemm import sweep_specs
    from bench.cases.mla_decode import bars_specs, bench_specs, heads_sweep_specs
    for lst in (fp8_block_gemm_specs(), fp8_block_gemm_specs(quick=True), sweep_specs(), bench_specs(),
                bench_specs(quick=True), heads_sweep_specs(), bars_specs()):
        _specs_in(lst, named)
    return named


def _missing() -> list[str]:
    target = get_target("sm90")
    built = {s.digest() for s in _prebuild().collect(target)}
    named = _named_by_gpu_modules_and_benches()
    assert len(named) > 100
    return sorted(s.file_stem for d, s in named.items() if s.target == target and d not in built)


def test_the_bundle_holds_every_spec_the_gpu_tests_and_benches_name():
    missing = _missing()
    assert not missing, f"add these to tests/gpu/specs.py: {missing}"


def test_a_spec_left_out_is_reported(monkeypatch):
    """The check can fail: with the data module's mla_decode list emptied, the specs only it held are named."""
    from tests.gpu import specs as gpu_specs
    monkeypatch.setitem(gpu_specs.LISTS, "mla_decode", lambda: [])
    missing = _missing()
    assert missing and all(m.startswith("mla_decode__") for m in missing)
