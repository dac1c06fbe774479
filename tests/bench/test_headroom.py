"""The per-bucket oracle: fastest arm per bucket, summed, against the best fixed arm."""
from __future__ import annotations

import pytest

from nemo_tlt.bench.headroom import bucket_seconds, per_bucket_oracle
from nemo_tlt.rollout.protocol import StepTrace


def _trace(*steps):
    return [StepTrace(running=r, shape="a", tokens=r, mean_accept=1.0, seconds=s) for r, s in steps]


def bucket_of(running: int) -> int:   # buckets [1, 4), [4, inf)
    return int(running >= 4)


def test_bucket_seconds_sums_steps_per_bucket():
    assert bucket_seconds(_trace((8, 0.5), (5, 0.25), (2, 1.0), (1, 0.5)), bucket_of) == {1: 0.75, 0: 1.5}


def test_oracle_takes_the_fastest_arm_in_each_bucket():
    traces = {"wide": _trace((8, 3.0), (1, 1.0)),      # slow with many rows, fast at the tail
              "narrow": _trace((8, 1.0), (1, 2.5))}    # the other way round
    h = per_bucket_oracle(traces, bucket_of)
    assert h["best_per_bucket"] == {0: "wide", 1: "narrow"}
    assert h["oracle_steps_s"] == pytest.approx(2.0)
    assert h["best_fixed"] == "narrow" and h["best_fixed_steps_s"] == pytest.approx(3.5)
    assert h["oracle_vs_best_fixed"] == pytest.approx(2.0 / 3.5)


def test_an_arm_that_skipped_a_bucket_does_not_win_it_for_free():
    traces = {"deep": _trace((8, 2.0)),                 # its rows finished in one step: no tail steps
              "chain": _trace((8, 1.0), (1, 1.5))}
    h = per_bucket_oracle(traces, bucket_of)
    # chain in both buckets (2.5 s) is worse than deep throughout (2.0 s): the oracle is that
    assert h["best_per_bucket"] == {0: "deep", 1: "deep"} and h["oracle_steps_s"] == pytest.approx(2.0)
    assert h["oracle_vs_best_fixed"] == 1.0


def test_one_arm_has_no_headroom_and_no_arms_is_refused():
    assert per_bucket_oracle({"a": _trace((8, 1.0), (1, 2.0))}, bucket_of)["oracle_vs_best_fixed"] == 1.0
    with pytest.raises(ValueError, match="no fixed-arm traces"):
        per_bucket_oracle({}, bucket_of)
