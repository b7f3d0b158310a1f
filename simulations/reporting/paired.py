"""95% intervals for comparing two policies run on the same seeds (paired samples), with
Student's t: a handful of seeds is the common case, where a bootstrap's intervals are far too
narrow (simulations/replay/seeds.py)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from scipy import stats

CONFIDENCE = 0.95


def _t2_over_n(n: int) -> float:
    return float(stats.t.ppf(0.5 + CONFIDENCE / 2, n - 1)) ** 2 / n


def difference_interval(a: Sequence[float], b: Sequence[float]) -> tuple[float, float] | None:
    """The 95% t-interval of mean(a - b) over paired samples (an additive figure: allocation
    points); None with fewer than 2 samples."""
    n = len(a)
    if n < 2 or len(b) != n:
        return None
    d = np.array(a, dtype=float) - np.array(b, dtype=float)
    half = math.sqrt(_t2_over_n(n)) * float(d.std(ddof=1))
    return float(d.mean()) - half, float(d.mean()) + half


def ratio_interval(a: np.ndarray, b: np.ndarray) -> tuple[float, float] | None:
    """Fieller's 95% interval for mean(a) / mean(b) over paired samples: the ratios R for which
    mean(a) - R mean(b) is within Student's t quantile of its standard error (the per-seed
    differences a - R b). Unlike a t-interval of the differences divided by mean(b), it counts
    the uncertainty of mean(b) too. Its set is cut at a ratio of 0 (waits are never negative, so
    the true ratio is not below 0: a change of more than -100% is no answer). None with fewer than
    2 samples, or where mean(b) is not clearly above 0 (the interval would be unbounded)."""
    n = len(a)
    if n < 2:
        return None
    q = _t2_over_n(n)
    cov = np.cov(a, b, ddof=1)
    ma, mb = float(a.mean()), float(b.mean())
    qa = mb * mb - q * float(cov[1, 1])
    qb = ma * mb - q * float(cov[0, 1])
    qc = ma * ma - q * float(cov[0, 0])
    if qa <= 0:
        return None
    # with qa > 0 the quadratic is <= 0 at mean(a) / mean(b), so its discriminant is >= 0: a
    # negative one is rounding (a = c b on every seed: a single point)
    root = math.sqrt(max(0.0, qb * qb - qa * qc))
    return max(0.0, (qb - root) / qa), max(0.0, (qb + root) / qa)
