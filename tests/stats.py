"""Chi-square helpers for the sampling law tests (no scipy: the bound below is exact enough)."""

from __future__ import annotations

import math
from collections import Counter

__all__ = ["chi2_sf_upper", "chi_square"]


def chi2_sf_upper(statistic: float, df: int) -> float:
    """An upper bound on P(chi2_df >= statistic): exact for even df, else the (larger) value at df + 1.

    For even df = 2m: P(chi2 >= x) = exp(-x/2) sum_{j<m} (x/2)^j / j!  (a Poisson tail).
    chi2_{df+1} stochastically dominates chi2_df, so rounding df up only makes the bound larger.
    """
    m = (df + 1) // 2
    half = statistic / 2
    return math.exp(-half) * sum(half**j / math.factorial(j) for j in range(m))


def chi_square(outcomes: Counter, law: dict) -> tuple[float, int]:
    """Pearson's statistic of observed counts against a law (a dict outcome → probability), and its
    degrees of freedom."""
    runs = sum(outcomes.values())
    statistic = sum((outcomes.get(o, 0) - runs * p) ** 2 / (runs * p) for o, p in law.items())
    return statistic, len(law) - 1
