"""Intervals for two policies run on the same seeds."""

from __future__ import annotations

import pytest

from dynpart.simulations.reporting.paired import difference_interval


def test_the_difference_interval_is_students_t_of_the_paired_differences():
    # differences 1, 2, 3: mean 2, sd 1, t(0.975, 2) = 4.303: 2 -+ 4.303 / sqrt(3)
    lo, hi = difference_interval([1.0, 2.0, 3.0], [0.0, 0.0, 0.0])
    assert lo == pytest.approx(2 - 2.4843, abs=1e-3) and hi == pytest.approx(2 + 2.4843, abs=1e-3)
    # only the differences count: the same shift on every seed is a point
    assert difference_interval([95.1, 96.3, 94.2], [95.0, 96.2, 94.1]) == pytest.approx((0.1, 0.1))
    assert difference_interval([1.0], [0.0]) is None
