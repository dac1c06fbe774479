"""The bootstrap interval of a figure over rounds."""
from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import bootstrap

from nemo_tlt.bench.interval import bootstrap_interval


def test_the_interval_matches_scipys_paired_percentile_bootstrap():
    rng = np.random.default_rng(0)
    a, b = rng.normal(1.0, 0.1, 15), rng.normal(1.05, 0.1, 15)
    ours = bootstrap_interval(lambda idx: np.median(b[idx]) / np.median(a[idx]), 15, np.random.default_rng(1),
                              samples=4000, level=0.9)
    ref = bootstrap((a, b), lambda x, y: np.median(y) / np.median(x), paired=True, vectorized=False,
                    n_resamples=4000, confidence_level=0.9, method="percentile", random_state=2).confidence_interval
    assert ours == pytest.approx((ref.low, ref.high), abs=0.01)
    assert ours[0] < np.median(b) / np.median(a) < ours[1]


def test_identical_rounds_give_a_point_and_wider_spread_a_wider_interval():
    same = bootstrap_interval(lambda idx: float(np.ones(5)[idx].mean()), 5, np.random.default_rng(0))
    assert same == (1.0, 1.0)
    x = np.random.default_rng(3).normal(0.0, 1.0, 20)
    narrow = bootstrap_interval(lambda idx: float(np.median(x[idx])), 20, np.random.default_rng(0))
    wide = bootstrap_interval(lambda idx: float(np.median(3.0 * x[idx])), 20, np.random.default_rng(0))
    assert wide[1] - wide[0] == pytest.approx(3.0 * (narrow[1] - narrow[0]))


@pytest.mark.parametrize("kwargs, match", [({"n": 0}, "n must be an int >= 1"),
                                           ({"samples": 0}, "samples must be an int >= 1"),
                                           ({"level": 1.0}, r"level must lie in \(0, 1\)")])
def test_bad_arguments_are_refused(kwargs, match):
    args = {"n": 3, "samples": 10, "level": 0.9} | kwargs
    with pytest.raises(ValueError, match=match):
        bootstrap_interval(lambda idx: 0.0, args["n"], np.random.default_rng(0), args["samples"], args["level"])
