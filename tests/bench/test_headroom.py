"""The per-bucket oracle: the best fixed arm's work per bucket at the fastest arm's throughput there."""
from __future__ import annotations

import pytest

from nemo_tlt.bench.headroom import bucket_seconds, bucket_tokens, per_bucket_oracle
from nemo_tlt.rollout.protocol import StepTrace


def _trace(*steps):
    """(running, seconds) or (running, seconds, tokens) per step; tokens default to one per row."""
    return [StepTrace(running=st[0], shape="a", tokens=st[2] if len(st) > 2 else st[0], mean_accept=1.0,
                      seconds=st[1]) for st in steps]


def bucket_of(running: int) -> int:   # buckets [1, 4), [4, inf)
    return int(running >= 4)


def test_bucket_seconds_and_tokens_sum_steps_per_bucket():
    trace = _trace((8, 0.5, 20), (5, 0.25, 9), (2, 1.0, 4), (1, 0.5, 3))
    assert bucket_seconds(trace, bucket_of) == {1: 0.75, 0: 1.5}
    assert bucket_tokens(trace, bucket_of) == {1: 29, 0: 7}


def test_oracle_takes_the_fastest_arm_in_each_bucket():
    traces = {"wide": _trace((8, 3.0), (1, 1.0)),      # slow with many rows, fast at the tail
              "narrow": _trace((8, 1.0), (1, 2.5))}    # the other way round
    h = per_bucket_oracle(traces, bucket_of)
    assert h["best_per_bucket"] == {0: "wide", 1: "narrow"}
    assert h["oracle_steps_s"] == pytest.approx(2.0)
    assert h["best_fixed"] == "narrow" and h["best_fixed_steps_s"] == pytest.approx(3.5)
    assert h["oracle_vs_best_fixed"] == pytest.approx(2.0 / 3.5)


def test_an_arm_that_did_less_work_in_a_bucket_does_not_win_it_for_free():
    # The same throughput in both buckets (8 tokens/s with many rows, 2 with few), but "deep"
    # emits more tokens per step, so more of the rollout's work falls in its first bucket.
    traces = {"chain": _trace((8, 1.0, 8), (8, 1.0, 8), (2, 2.0, 4)),   # 16 + 4 tokens, 4.0 s
              "deep": _trace((8, 2.25, 18), (2, 1.0, 2))}               # 18 + 2 tokens, 3.25 s
    h = per_bucket_oracle(traces, bucket_of)
    # Least seconds per bucket would be chain's 2.0 + deep's 1.0 = 3.0 s: headroom that is
    # only work moved between buckets. Priced by throughput there is none.
    assert h["best_fixed"] == "deep" and h["best_fixed_steps_s"] == pytest.approx(3.25)
    assert h["oracle_steps_s"] == pytest.approx(3.25) and h["oracle_vs_best_fixed"] == pytest.approx(1.0)
    assert h["best_per_bucket"] == {0: "deep", 1: "deep"}  # ties go to the best fixed arm


def test_an_arm_that_skipped_a_bucket_does_not_compete_there():
    traces = {"deep": _trace((8, 2.0, 8)),                # its rows finished in one step: no tail steps
              "chain": _trace((8, 1.0, 7), (1, 1.5, 1))}
    h = per_bucket_oracle(traces, bucket_of)
    # deep is best throughout (2.0 s against 2.5 s); only its bucket is priced, at chain's 7 tokens/s
    assert h["best_per_bucket"] == {1: "chain"} and h["oracle_steps_s"] == pytest.approx(8 / 7)


def test_one_arm_has_no_headroom_and_no_arms_is_refused():
    assert per_bucket_oracle({"a": _trace((8, 1.0), (1, 2.0))}, bucket_of)["oracle_vs_best_fixed"] == 1.0
    with pytest.raises(ValueError, match="no fixed-arm traces"):
        per_bucket_oracle({}, bucket_of)


def test_a_reference_arm_fixes_the_work_priced_and_must_be_one_of_the_traces():
    traces = {"tree": _trace((8, 1.0, 16), (1, 1.0, 2)),                  # 2.0 s
              "plain": _trace((8, 0.4, 8), (8, 0.4, 8), (1, 0.5, 2))}    # 1.3 s: the best arm
    assert per_bucket_oracle(traces, bucket_of)["best_fixed"] == "plain"
    h = per_bucket_oracle(traces, bucket_of, reference="tree")
    # tree's 16 tokens with many rows at plain's 20 tokens/s, its 2 at the tail at plain's 4/s
    assert h["best_fixed"] == "tree" and h["best_fixed_steps_s"] == pytest.approx(2.0)
    assert h["oracle_steps_s"] == pytest.approx(1.3) and h["best_per_bucket"] == {1: "plain", 0: "plain"}
    with pytest.raises(ValueError, match="reference 'other' is not one of the traces"):
        per_bucket_oracle(traces, bucket_of, reference="other")


def test_buckets_without_tokens_or_time_keep_the_references_seconds_in_bucket_order():
    traces = {"a": _trace((8, 1.0, 8), (1, 0.5, 0)),   # no tokens with one row
              "b": _trace((8, 0.5, 8), (1, 0.1, 1))}
    h = per_bucket_oracle(traces, bucket_of, reference="a")
    assert list(h["best_per_bucket"]) == [0, 1] and h["best_per_bucket"] == {0: "a", 1: "b"}
    assert h["oracle_steps_s"] == pytest.approx(0.5 + 0.5)  # a's 0.5 s without tokens, 8 tokens at b's 16/s
    untimed = {"a": _trace((8, 0.0, 8)), "b": _trace((8, 0.0, 8))}  # a timer that read 0 for every step
    assert per_bucket_oracle(untimed, bucket_of)["oracle_steps_s"] == 0.0
