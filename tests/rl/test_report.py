"""The TLT-vs-baseline figures of report.json: per-pair ratios on the steps after the
first, medians over pairs, the update-time control ratio and its noisy flag, and
reward / rollout identity across every run of every pair."""
from __future__ import annotations

import math

import pytest

from nemo_tlt.rl.report import (compare_pairs, control_is_noisy, format_pairs, median_over_pairs, pair_figures,
                                summarize_pairs)


def records(step_s, update_s=None, rollout_s=None, rewards=None, digest="d"):
    n = len(step_s)
    update_s = update_s or [1.0] * n
    rollout_s = rollout_s or [s - u for s, u in zip(step_s, update_s)]
    rewards = rewards or [[0.0, 1.0]] * n
    return [{"step": i, "step_s": step_s[i], "update_s": update_s[i], "rollout_s": rollout_s[i],
             "rewards": rewards[i], "rollout_digest": f"{digest}{i}"} for i in range(n)]


def summary(recs):
    return {"records": recs}


def test_pair_figures_skip_the_first_step_and_take_the_update_as_control():
    tlt = records([9.0, 2.0, 2.0], update_s=[5.0, 1.0, 1.0])
    base = records([9.0, 3.0, 3.0], update_s=[5.0, 1.1, 1.1])
    p = pair_figures(("baseline", "tlt"), tlt, base)
    assert p["order"] == ["baseline", "tlt"]
    assert p["tlt_mean_step_s"] == 2.0 and p["baseline_mean_step_s"] == 3.0
    assert p["speedup"] == pytest.approx(1.5) and p["step_time_ratio"] == pytest.approx(2 / 3)
    assert p["control_ratio"] == pytest.approx(1.1)
    assert p["rollout_speedup"] == pytest.approx(1.9 / 1.0)
    assert p["baseline_rollout_share"] == pytest.approx(1.9 / 3.0)


def test_median_over_pairs():
    assert median_over_pairs([1.2, 1.8, 1.4]) == pytest.approx(1.4)
    assert median_over_pairs([1.2, 1.6]) == pytest.approx(1.4)
    assert math.isnan(median_over_pairs([]))


@pytest.mark.parametrize("ratio, noisy", [(1.0, False), (0.9, False), (1.1, False), (0.89, True), (1.25, True),
                                          (float("nan"), True)])
def test_control_ratio_outside_ten_percent_is_noisy(ratio, noisy):
    assert control_is_noisy(ratio) is noisy


def test_summary_is_the_median_over_pairs_and_flags_a_noisy_machine():
    quiet = [{"speedup": s, "step_time_ratio": 1 / s, "rollout_speedup": 2 * s, "baseline_rollout_share": 0.7,
              "control_ratio": c} for s, c in ((1.2, 1.02), (1.9, 0.97), (1.5, 1.0))]
    out = summarize_pairs(quiet)
    assert out["speedup"] == pytest.approx(1.5) and out["rollout_speedup"] == pytest.approx(3.0)
    assert out["control_ratio"] == pytest.approx(1.0)
    assert out["noisy"] is False and out["note"] is None
    # the first-run advantage: the update (same work) 25% slower in the baseline runs
    noisy = summarize_pairs([{**p, "control_ratio": 1.25} for p in quiet])
    assert noisy["noisy"] is True and "too noisy" in noisy["note"] and "1.25" in noisy["note"]


def test_compare_pairs_takes_medians_and_checks_every_run():
    p1 = (("tlt", "baseline"), summary(records([5.0, 2.0, 2.0])), summary(records([5.0, 4.0, 4.0])))
    p2 = (("baseline", "tlt"), summary(records([5.0, 2.5, 2.5])), summary(records([5.0, 3.0, 3.0])))
    out = compare_pairs([p1, p2])
    assert [p["order"] for p in out["pairs"]] == [["tlt", "baseline"], ["baseline", "tlt"]]
    assert out["speedup"] == pytest.approx((2.0 + 1.2) / 2)  # median of two: their mean
    assert out["rewards_identical"] and out["rollouts_identical"] and out["steps_compared"] == 3
    table = format_pairs(out).splitlines()
    assert "tlt, baseline" in table[1] and "2.00x" in table[1] and "baseline, tlt" in table[2] and "1.20x" in table[2]
    assert table[-1].startswith("median") and "1.60x" in table[-1]


def test_identity_covers_the_runs_of_later_pairs():
    same = (("tlt", "baseline"), summary(records([1.0, 1.0])), summary(records([1.0, 1.0])))
    other_rewards = summary(records([1.0, 1.0], rewards=[[0.0, 1.0], [1.0, 1.0]]))
    out = compare_pairs([same, (("baseline", "tlt"), summary(records([1.0, 1.0])), other_rewards)])
    assert not out["rewards_identical"] and out["rollouts_identical"]
    other_tokens = summary(records([1.0, 1.0], digest="e"))
    out = compare_pairs([same, (("baseline", "tlt"), other_tokens, summary(records([1.0, 1.0])))])
    assert out["rewards_identical"] and not out["rollouts_identical"]
