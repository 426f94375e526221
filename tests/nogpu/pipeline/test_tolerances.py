"""tests/numerics.py: the per-dtype tolerance table the GPU tests compare through; NaN never passes."""
import pytest
import torch

from numerics import TOLERANCES, assert_close, poison, rel_rms


def test_table_keeps_the_bounds_the_tests_use():
    assert TOLERANCES[torch.bfloat16].rel_rms == 1e-2 and TOLERANCES[torch.bfloat16].max_abs == 3e-2
    assert TOLERANCES[torch.float32].rel_rms == 1e-5


def test_rel_rms():
    e = torch.randn(64, 32, generator=torch.Generator().manual_seed(0))
    assert rel_rms(e, e) == 0.0 and rel_rms(torch.zeros(3), torch.zeros(3)) == 0.0
    assert rel_rms(e * 1.01, e) == pytest.approx(0.01, rel=1e-4)
    assert not rel_rms(poison(e.clone()), e) <= 1.0


def test_assert_close_per_dtype_and_nan_never_passes():
    e = torch.randn(1 << 16, generator=torch.Generator().manual_seed(1))
    assert_close(e.bfloat16(), e)
    assert_close(e * (1 + 1e-6), e, dtype=torch.float32)
    with pytest.raises(AssertionError, match="relative RMS"):
        assert_close(e * (1 + 1e-4), e, dtype="fp32")
    spike = e.clone()
    spike[7] += 0.2 * float(e.abs().max())   # rel RMS still small, one element far off
    with pytest.raises(AssertionError, match="max abs"):
        assert_close(spike.bfloat16(), e)
    nan = e.bfloat16()
    nan[3] = float("nan")
    with pytest.raises(AssertionError, match="NaN never passes"):
        assert_close(nan, e)
    with pytest.raises(AssertionError, match="NaN never passes"):
        assert_close(poison(torch.empty(4, dtype=torch.bfloat16)), torch.zeros(4))


def test_poison():
    assert torch.isnan(poison(torch.empty(3, dtype=torch.float32))).all()
    assert (poison(torch.empty(3, dtype=torch.uint8)) == 0xFF).all()
    assert (poison(torch.empty(3, dtype=torch.int32)) == -1).all()
