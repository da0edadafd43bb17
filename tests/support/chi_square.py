"""Chi-square goodness of fit for the statistical sampler tests (no scipy needed)."""

from __future__ import annotations

import math

import numpy as np

PASS_P = 1e-4  # a correct rule must not look this unlikely
FAIL_P = 1e-12  # a broken rule must look at least this unlikely


def chi2_sf(x: float, df: int) -> float:
    """Survival function of the chi-square distribution (closed form for integer df)."""
    if x <= 0.0:
        return 1.0
    h = x / 2.0
    if df % 2 == 0:  # Q(k, h) = e^-h sum_{j<k} h^j / j!
        return math.fsum(math.exp(j * math.log(h) - h - math.lgamma(j + 1)) for j in range(df // 2))
    # Q(k + 1/2, h) = erfc(sqrt h) + e^-h sum_{j=1..k} h^(j-1/2) / Gamma(j+1/2)
    tail = math.fsum(
        math.exp((j - 0.5) * math.log(h) - h - math.lgamma(j + 0.5))
        for j in range(1, (df - 1) // 2 + 1)
    )
    return math.erfc(math.sqrt(h)) + tail


def chi2_pvalue(counts: np.ndarray, expected_p: np.ndarray) -> float:
    """Goodness-of-fit p-value of ``counts`` against ``expected_p`` (any shape).

    A hit where the expected probability is 0 gives p = 0 (the token can never be produced).
    """
    counts = np.asarray(counts, dtype=np.float64).ravel()
    p = np.asarray(expected_p, dtype=np.float64).ravel()
    if counts[p == 0].sum() > 0:
        return 0.0
    support = p > 0
    expected = counts.sum() * p[support]
    assert expected.min() >= 5, "test design: too few expected counts for chi-square"
    stat = float(np.sum((counts[support] - expected) ** 2 / expected))
    return chi2_sf(stat, int(support.sum()) - 1)
