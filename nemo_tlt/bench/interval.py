"""How far a benchmark figure over rounds could move with other rounds: a bootstrap interval.

A figure such as "adaptive / best fixed arm on each method's median round" comes from a
few rounds on a noisy machine. Resampling the rounds (whole rounds, so the methods of one
round stay paired) and recomputing the figure each time gives the spread of the figure
itself: the percentile interval. ``scipy.stats.bootstrap(..., paired=True,
method="percentile")`` computes the same, but scipy is not a runtime dependency of the
package (only of the ``dev`` extra) and the benchmarks run from the plain install; this is
that method in a few lines of numpy.
"""
from __future__ import annotations

from typing import Callable

import numpy as np


def bootstrap_interval(statistic: Callable[[np.ndarray], float], n: int, rng: np.random.Generator,
                       samples: int = 2000, level: float = 0.9) -> tuple[float, float]:
    """The central ``level`` percentile interval of ``statistic(idx)`` over ``samples``
    resamples ``idx`` of ``range(n)`` drawn with replacement from ``rng``."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"bootstrap_interval: n must be an int >= 1, got {n!r}")
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise ValueError(f"bootstrap_interval: samples must be an int >= 1, got {samples!r}")
    if not 0.0 < level < 1.0:
        raise ValueError(f"bootstrap_interval: level must lie in (0, 1), got {level!r}")
    values = np.array([statistic(rng.integers(0, n, size=n)) for _ in range(samples)])
    tail = (1.0 - level) / 2.0
    lo, hi = np.quantile(values, [tail, 1.0 - tail])
    return float(lo), float(hi)
