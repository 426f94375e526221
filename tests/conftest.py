"""Test tiers: tests/nogpu (CI, never touches the CUDA driver) and tests/gpu (`-m gpu`, H200).

GPU tests run only when K3GEN_GPU=1 is set: probing for a GPU would call the driver, which CI
must never do. With K3GEN_GPU=1, a run that passes zero GPU tests fails.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from k3gen.config import settings

# `from numerics import rel_rms, assert_close, poison` (tests/numerics.py) in every test module,
# whatever pytest's import mode.
_TESTS = str(Path(__file__).resolve().parent)
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)

GPU = settings().gpu_tests
_gpu_passed = 0


def pytest_configure(config):
    # Each xdist worker's torch would size its intra-op pool to every core: n workers oversubscribe the
    # CPU n times over (H200, session 51: ten workers, each writing its own copy of a random
    # checkpoint that one process writes in seconds, were all still at it a minute later).
    n = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if n > 1:
        import torch
        torch.set_num_threads(max(1, (os.cpu_count() or n) // n))


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace(os.sep, "/") and "gpu" not in item.keywords:
            item.add_marker(pytest.mark.gpu)
    if GPU:
        return
    skip = pytest.mark.skip(reason="GPU test: set K3GEN_GPU=1 on a machine with an NVIDIA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_runtest_logreport(report):
    global _gpu_passed
    if report.when == "call" and report.passed and "gpu" in report.keywords:
        _gpu_passed += 1


def pytest_sessionfinish(session, exitstatus):
    if GPU and _gpu_passed == 0 and exitstatus == 0 and session.config.getoption("-m") == "gpu":
        session.exitstatus = 1
        print("\nK3GEN_GPU=1 but no GPU test passed: a GPU run that executes zero GPU tests is a failure")


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    """One kernel cache per test session, so tests never depend on the user's cache."""
    return tmp_path_factory.mktemp("k3gen-cache")


@pytest.fixture(autouse=True)
def _isolated_cache(cache_dir, monkeypatch):
    if "K3GEN_CACHE_DIR" not in os.environ or not GPU:
        monkeypatch.setenv("K3GEN_CACHE_DIR", str(cache_dir))


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op thread for a module (`pytestmark = pytest.mark.usefixtures("one_torch_thread")`):
    small tensors gain nothing from two, and on a shared 2-core machine a second thread waits on the
    other tenant (training steps measured 5x slower)."""
    import torch
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
