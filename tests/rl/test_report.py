"""The TLT-vs-baseline figures of report.json: per-pair ratios on the steps after the
first, medians over pairs, the update-time control ratio and its noisy flag,
reward / rollout identity across every run of every pair, and for runs that sampled
different tokens the per-token figures and the reward curves with intervals."""
from __future__ import annotations

import math

import pytest

from nemo_tlt.rl.reporting.plots import decode_strips, plot_worker_timeline, process_runs, resume_times, timeline_segments, \
    worker_labels
from nemo_tlt.rl.reporting.report import compare_pairs, control_is_noisy, format_pairs, median_over_pairs, pair_figures, \
    reward_curves, summarize_pairs


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


def test_the_control_is_the_update_work_where_records_have_it():
    """Pipelined: TLT's update after the rollout is short, its work is not; the control compares work."""
    tlt = [{**r, "update_work_s": 2.0} for r in records([9.0, 2.0, 2.0], update_s=[5.0, 0.1, 0.1])]
    base = [{**r, "update_work_s": 2.2} for r in records([9.0, 4.0, 4.0], update_s=[5.0, 2.2, 2.2])]
    p = pair_figures(("tlt", "baseline"), tlt, base)
    assert p["control_ratio"] == pytest.approx(1.1) and p["tlt_update_s"] == pytest.approx(0.1)
    assert p["tlt_update_work_s"] == pytest.approx(2.0)


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
              "control_ratio": c, "tlt_update_s": 0.1 * s, "baseline_update_s": 1.0, "tlt_update_work_s": 1.0,
              "baseline_update_work_s": c} for s, c in ((1.2, 1.02), (1.9, 0.97), (1.5, 1.0))]
    out = summarize_pairs(quiet)
    assert out["speedup"] == pytest.approx(1.5) and out["rollout_speedup"] == pytest.approx(3.0)
    assert out["control_ratio"] == pytest.approx(1.0)
    assert out["tlt_update_s"] == pytest.approx(0.15) and out["baseline_update_work_s"] == pytest.approx(1.0)
    assert out["noisy"] is False and out["note"] is None
    # the first-run advantage: the update (same work) 25% slower in the baseline runs
    noisy = summarize_pairs([{**p, "control_ratio": 1.25} for p in quiet])
    assert noisy["noisy"] is True and "too noisy" in noisy["note"] and "1.25" in noisy["note"]


def test_compare_pairs_takes_medians_and_checks_every_run():
    p1 = (("tlt", "baseline"), summary(records([5.0, 2.0, 2.0])), summary(records([5.0, 4.0, 4.0])))
    p2 = (("baseline", "tlt"), summary(records([5.0, 2.5, 2.5])), summary(records([5.0, 3.0, 3.0])))
    out = compare_pairs([p1, p2], group_size=2)
    assert [p["order"] for p in out["pairs"]] == [["tlt", "baseline"], ["baseline", "tlt"]]
    assert out["speedup"] == pytest.approx((2.0 + 1.2) / 2)  # median of two: their mean
    assert out["rewards_identical"] and out["rollouts_identical"] and out["steps_compared"] == 3
    table = format_pairs(out).splitlines()
    assert "tlt, baseline" in table[1] and "2.00x" in table[1] and "baseline, tlt" in table[2] and "1.20x" in table[2]
    assert table[-1].startswith("median") and "1.60x" in table[-1]


def test_identity_covers_the_runs_of_later_pairs():
    same = (("tlt", "baseline"), summary(records([1.0, 1.0])), summary(records([1.0, 1.0])))
    other_rewards = summary(records([1.0, 1.0], rewards=[[0.0, 1.0], [1.0, 1.0]]))
    out = compare_pairs([same, (("baseline", "tlt"), summary(records([1.0, 1.0])), other_rewards)], group_size=2)
    assert not out["rewards_identical"] and out["rollouts_identical"]
    other_tokens = summary(records([1.0, 1.0], digest="e"))
    out = compare_pairs([same, (("baseline", "tlt"), other_tokens, summary(records([1.0, 1.0])))], group_size=2)
    assert out["rewards_identical"] and not out["rollouts_identical"]


# ---- sampled runs: per-token figures, reward curves with intervals ---------------------

def tokened(step_s, work, tokens, digest="d", rewards=None):
    """Step records with update work and response tokens per step."""
    return [{**r, "update_work_s": w, "tokens": t}
            for r, w, t in zip(records(step_s, rewards=rewards, digest=digest), work, tokens)]


def test_per_token_figures_equal_the_raw_ones_on_identical_tokens():
    # figures where dividing both by the tokens first would round differently
    tlt = tokened([9.0, 1.5, 1.5], [5.0, 1.7, 1.7], [37, 41, 53])
    base = tokened([9.0, 1.3, 1.3], [5.0, 1.1, 1.1], [37, 41, 53])
    p = pair_figures(("tlt", "baseline"), tlt, base)
    assert p["tlt_mean_tokens"] == p["baseline_mean_tokens"] == 47.0  # steps after the first
    assert p["control_ratio_per_token"] == p["control_ratio"] and p["speedup_per_token"] == p["speedup"]


def _different_lengths(digests=("t", "b")):
    # TLT: 2.0 s/step, 2.0 s of update work on 100 tokens; baseline: 3.9 s, 2.6 s on 130 tokens
    tlt = tokened([9.0, 2.0, 2.0], [5.0, 2.0, 2.0], [999, 100, 100], digest=digests[0])
    base = tokened([9.0, 3.9, 3.9], [5.0, 2.6, 2.6], [999, 120, 140], digest=digests[1])
    return tlt, base


def test_per_token_figures_divide_by_each_runs_tokens():
    p = pair_figures(("tlt", "baseline"), *_different_lengths())
    assert p["tlt_mean_tokens"] == 100.0 and p["baseline_mean_tokens"] == 130.0
    assert p["control_ratio"] == pytest.approx(1.3)
    assert p["control_ratio_per_token"] == pytest.approx((2.6 / 130) / (2.0 / 100))  # 1.0
    assert p["speedup"] == pytest.approx(1.95) and p["speedup_per_token"] == pytest.approx((3.9 / 130) / (2.0 / 100))
    out = summarize_pairs([p, {**p, "control_ratio_per_token": 3.0}, {**p, "speedup_per_token": 0.5}])
    assert out["control_ratio_per_token"] == pytest.approx(1.0) and out["speedup_per_token"] == pytest.approx(1.5)
    assert out["tlt_mean_tokens"] == 100.0 and out["baseline_mean_tokens"] == 130.0


def test_the_update_work_per_token_counts_the_prompts_it_processes():
    """The update's forward and backward run over prompt + response: 2.0 s on 50 prompt + 100
    response tokens against 2.6 s on 50 + 130 is 1.083x more work per token in the baseline
    (per response token alone it would read 1.0)."""
    tlt, base = _different_lengths()
    tlt = [{**r, "prompt_tokens": 50} for r in tlt]
    base = [{**r, "prompt_tokens": 50} for r in base]
    p = pair_figures(("tlt", "baseline"), tlt, base)
    assert p["control_ratio_per_token"] == pytest.approx((2.6 / 180) / (2.0 / 150))
    assert p["speedup_per_token"] == pytest.approx((3.9 / 130) / (2.0 / 100))  # the step: per response token
    assert p["tlt_mean_tokens"] == 100.0


def test_sampled_runs_check_the_noise_on_the_update_work_per_token():
    tlt, base = _different_lengths()
    sampled = compare_pairs([(("tlt", "baseline"), summary(tlt), summary(base))], group_size=2)
    # 30% more update work in the baseline, all of it from 30% more tokens: not noise
    assert not sampled["rollouts_identical"] and sampled["control_ratio"] == pytest.approx(1.3)
    assert sampled["noise_control"] == "control_ratio_per_token" and sampled["noisy"] is False
    assert "different tokens" in sampled["sampling_note"] and "intervals" in sampled["sampling_note"]
    # the same work on fewer tokens is: the machine slowed down
    slow = [{**r, "update_work_s": 2.0} for r in base]
    noisy = compare_pairs([(("tlt", "baseline"), summary(tlt), summary(slow))], group_size=2)
    assert noisy["control_ratio"] == pytest.approx(1.0) and noisy["noisy"] is True
    assert "per token" in noisy["note"] and "0.77" in noisy["note"]
    # identical rollouts: the identical work is the control, no sampling note
    same = compare_pairs([(("tlt", "baseline"), *(summary(r) for r in _different_lengths(("d", "d"))))],
                         group_size=2)
    assert same["rollouts_identical"] and same["noise_control"] == "control_ratio"
    assert same["noisy"] is True and same["sampling_note"] is None
    # records without token counts: the raw control, and the note says so
    bare = [{k: v for k, v in r.items() if k != "tokens"} for r in base]
    untokened = compare_pairs([(("tlt", "baseline"), summary(tlt), summary(bare))], group_size=2)
    assert untokened["noise_control"] == "control_ratio" and untokened["noisy"] is True
    assert untokened["sampling_note"].endswith("the noise check uses control_ratio")


def _runs(*per_run):
    """Runs of step records from each run's rewards per step (sequences in id order)."""
    return [records([1.0] * len(r), rewards=list(r)) for r in per_run]


# two prompt groups of 2 sequences per step, two steps, two runs a mode; group means per run:
#   TLT      step 0: (0.5, 1.0), (0.0, 1.0) -> m = (0.25, 1.0);  step 1: (1.0, 0.5), (1.0, 0.0) -> (1.0, 0.25)
#   baseline step 0: (0.0, 0.5), (0.0, 0.5) -> m = (0.0, 0.5);   step 1: (0.5, 0.0), (0.0, 0.0) -> (0.25, 0.0)
_TLT = _runs(([1, 0, 1, 1], [1, 1, 0, 1]), ([0, 0, 1, 1], [1, 1, 0, 0]))
_BASE = _runs(([0, 0, 1, 0], [1, 0, 0, 0]), ([0, 0, 1, 0], [0, 0, 0, 0]))


def test_reward_curves_are_over_prompt_groups_with_the_runs_averaged_in_each():
    out = reward_curves({"tlt": _TLT, "baseline": _BASE}, group_size=2)
    assert out["confidence"] == 0.95
    tlt = out["tlt"]
    assert tlt["steps"] == [0, 1] and tlt["prompts"] == [2, 2] and tlt["runs"] == [2, 2]
    assert tlt["mean"] == [0.625, 0.625]
    # two groups, 0.25 and 1.0: sd = 0.75 / sqrt(2), sd / sqrt(2) = 0.375
    assert tlt["low"][0] == pytest.approx(0.625 - 1.96 * 0.375)
    assert tlt["high"][0] == pytest.approx(0.625 + 1.96 * 0.375)
    assert out["baseline"]["mean"] == [0.25, 0.125]
    assert out["baseline"]["high"][1] == pytest.approx(0.125 + 1.96 * 0.125)


def test_reward_difference_is_paired_by_step_and_prompt_group():
    diff = reward_curves({"tlt": _TLT, "baseline": _BASE}, group_size=2)["reward_difference"]
    # d(s, p) = m_tlt - m_base: step 0 (0.25, 0.5), step 1 (0.75, 0.25); mean 0.4375
    d = [0.25, 0.5, 0.75, 0.25]
    var = sum((x - 0.4375) ** 2 for x in d) / 3  # 0.171875 / 3
    half = 1.96 * math.sqrt(var) / math.sqrt(4)
    assert diff["mean"] == pytest.approx(0.4375) and diff["cells"] == 4 and diff["runs"] == {"tlt": 2, "baseline": 2}
    assert diff["low"] == pytest.approx(0.4375 - half) and diff["high"] == pytest.approx(0.4375 + half)
    assert diff["tlt_mean"] == pytest.approx(0.625) and diff["baseline_mean"] == pytest.approx(0.1875)
    assert diff["interval_contains_zero"] is False
    assert "tlt_n" not in diff and "baseline_n" not in diff


def test_a_repeated_run_does_not_narrow_the_intervals():
    """Runs of a mode share seeds and prompts (with vLLM: identical tokens); four copies of a
    run are one run's worth of evidence, not four (pooling sequences would narrow by 2x)."""
    tlt, base = _TLT[:1], _BASE[:1]
    once = reward_curves({"tlt": tlt, "baseline": base}, group_size=2)
    four = reward_curves({"tlt": tlt * 4, "baseline": base * 4}, group_size=2)
    for key in ("mean", "low", "high", "interval_contains_zero", "tlt_mean", "baseline_mean", "cells"):
        assert four["reward_difference"][key] == once["reward_difference"][key], key
    assert four["reward_difference"]["runs"] == {"tlt": 4, "baseline": 4}
    for mode in ("tlt", "baseline"):
        assert {k: v for k, v in four[mode].items() if k != "runs"} == \
            {k: v for k, v in once[mode].items() if k != "runs"}
    # so do the pairs of a comparison repeating one pair
    pair = (("tlt", "baseline"), summary(tlt[0]), summary(base[0]))
    assert compare_pairs([pair] * 4, group_size=2)["reward_curves"]["reward_difference"]["high"] == \
        once["reward_difference"]["high"]


def test_rewards_that_are_not_whole_prompt_groups_are_refused():
    with pytest.raises(ValueError, match=r"step 0: 4 rewards are not whole prompt groups of grpo.group_size=3"):
        reward_curves({"tlt": _TLT}, group_size=3)
    with pytest.raises(ValueError, match=r"step 0: TLT has 2 prompt groups, the baseline 1"):
        reward_curves({"tlt": _TLT, "baseline": _runs(([0, 1], [1, 1]))}, group_size=2)


def test_identical_runs_differ_by_exactly_zero_reward(tmp_path):
    from nemo_tlt.rl.reporting.plots import plot_reward_curves
    rewards = [[0.0, 1.0, 0.5, 1.0], [1.0, 0.25, 0.0, 0.0]]
    out = compare_pairs([(("tlt", "baseline"), summary(records([2.0, 2.0], rewards=rewards)),
                          summary(records([3.0, 3.0], rewards=rewards)))], group_size=2)
    diff = out["reward_curves"]["reward_difference"]
    # paired: every cell differs by exactly 0, so does the interval
    assert diff["mean"] == diff["low"] == diff["high"] == 0.0 and diff["interval_contains_zero"] is True
    assert diff["cells"] == 4 and diff["tlt_mean"] == diff["baseline_mean"]
    assert out["reward_curves"]["tlt"] == out["reward_curves"]["baseline"]
    assert plot_reward_curves(out["reward_curves"], tmp_path / "curves.png").stat().st_size > 0
    # identical over several pairs too
    tlt, base = summary(records([2.0, 2.0], rewards=rewards)), summary(records([3.0, 3.0], rewards=rewards))
    diff = compare_pairs([(("tlt", "baseline"), tlt, base)] * 3, group_size=2)["reward_curves"]["reward_difference"]
    assert diff["mean"] == diff["low"] == diff["high"] == 0.0 and diff["interval_contains_zero"] is True


# ---- the worker timeline of a multi-node, resumed run --------------------------------

def _timed(step, t, nodes=None):
    rec = {"step": step, "t_end": t + 4.0, "decode_segments": [[0, t + 0.1, t + 2.0, "plain"]],
           "timeline": [[0, "busy", t], [1, "busy", t], [1, "idle", t + 2.5]]}
    if nodes is not None:
        rec["rank_nodes"] = nodes
    return rec


def test_a_resumed_run_continues_after_the_steps_before_it():
    # steps 0, 1 in the first process; the requeued process times step 2 from its own start
    recs = [_timed(0, 0.0), _timed(1, 4.0), _timed(2, 1.0)]
    parts = process_runs(recs)
    assert [(off, [r["step"] for r in part]) for off, part in parts] == [(0.0, [0, 1]), (8.0, [2])]
    assert resume_times(recs) == [8.0]
    segs = timeline_segments(recs)
    # rank 0's BUSY of step 1 ends with its process (t 8), the resumed step starts at 8 + 1
    assert segs[0] == [(0.0, 4.0, "busy"), (4.0, 8.0, "busy"), (9.0, 13.0, "busy")]
    assert decode_strips(recs)[0][-1] == (9.1, 11.0, "plain")
    assert resume_times([_timed(0, 0.0), _timed(1, 4.0)]) == []
    # the resumed process's first step may end later than the last step before it:
    # run_started tells the processes apart
    started = [{**_timed(0, 0.0), "run_started": 100.0}, {**_timed(1, 4.0), "run_started": 100.0},
               {**_timed(2, 5.0), "run_started": 200.0}]
    assert resume_times(started) == [8.0]


def test_timeline_rows_name_their_node_on_several_nodes(tmp_path):
    assert worker_labels([_timed(0, 0.0, nodes=[0, 1])]) == {0: "worker 0 (node 0)", 1: "worker 1 (node 1)"}
    assert worker_labels([_timed(0, 0.0, nodes=[0, 0])]) == {0: "worker 0", 1: "worker 1"}
    assert worker_labels([_timed(0, 0.0)]) == {0: "worker 0", 1: "worker 1"}  # records before rank_nodes
    recs = [_timed(0, 0.0, [0, 1]), _timed(1, 4.0, [0, 1]), _timed(2, 1.0, [0, 1])]
    out = plot_worker_timeline({"tlt": recs}, tmp_path / "timeline.png")
    assert out.stat().st_size > 0


def test_the_step_record_maps_ranks_to_nodes():
    from nemo_tlt.rl.reporting.records import IdleResult, RankState, RankStep, step_record

    def rank(k, node):
        return RankStep(rank=k, node=node, ids=[k], tokens=[[1, 2]], rewards=[1.0], gen_s=1.0, sd_steps=0,
                        plain_steps=2, accept_lengths=[], segments=[], idle=IdleResult(idle_s=k + 1.0),
                        update={**{u: 0.0 for u in ("loss", "pg_loss", "kl", "clip_frac", "approx_kl")},
                                "grad_norm": 0.0, "loss_tokens": 2},
                        state=RankState(), weights="w")

    times = {"step_s": 1.0, "rollout_s": 0.5, "logprob_s": 0.1, "update_s": 0.1, "weight_sync_s": 0.1}
    rec = step_record(0, "tlt", 3, [rank(2, 1), rank(0, 0), rank(1, 0)], times, [], 0.0, 1.0)
    assert rec["rank_nodes"] == [0, 0, 1] and rec["run_started"] == 0.0
    assert rec["idle_s_per_node"] == {"0": 3.0, "1": 3.0}


# ---- validation records --------------------------------------------------------------

def _plot_record(step: int) -> dict:
    return {**_timed(step, 4.0 * step), "mode": "tlt", "reward_mean": 0.1 * step, "rollout_s": 2.0,
            "logprob_s": 0.5, "update_s": 1.0, "weight_sync_s": 0.1, "other_s": 0.1, "drafter_train_s": 0.0,
            "sd_steps": 1, "mean_accept_len": 2.0}


def _validation(step: int, accuracy: bool = True) -> dict:
    rec = {"step": step, "mode": "tlt", "split": "validation", "mean_reward": 0.2 * step, "mean_response_len": 9.0,
           "num_prompts": 4}
    return {**rec, "accuracy": 0.25 * step} if accuracy else rec


def test_validation_records_make_a_validation_curve_mixed_in_or_apart(tmp_path):
    from nemo_tlt.rl.reporting.plots import write_plots
    steps = [_plot_record(k) for k in range(4)]
    mixed = steps[:2] + [_validation(1)] + steps[2:] + [_validation(3)]
    plots = write_plots({"tlt": mixed}, tmp_path / "a")
    assert set(plots) == {"reward_vs_step", "step_time_breakdown", "accept_length", "worker_timeline",
                          "validation_vs_step"}
    assert (tmp_path / "a" / "validation_vs_step.png").stat().st_size > 0
    apart = write_plots({"tlt": steps}, tmp_path / "b", validation={"tlt": [_validation(1, False)]})
    assert (tmp_path / "b" / "validation_vs_step.png").stat().st_size > 0 and "validation_vs_step" in apart
    assert "validation_vs_step" not in write_plots({"tlt": steps}, tmp_path / "c")  # none: no curve


def test_a_resumed_metrics_file_keeps_the_validation_records_of_the_kept_steps(tmp_path):
    from nemo_tlt.rl.reporting.loggers import LoggerConfig
    from nemo_tlt.rl.reporting.report import MetricsWriter, read_metrics, read_validation
    first = MetricsWriter(tmp_path, logger=LoggerConfig(tensorboard=False))
    for rec in [_plot_record(0), _plot_record(1), _validation(1), _plot_record(2), _plot_record(3), _validation(3)]:
        first.write(rec)
    first.close()
    # the checkpoint held steps 0-2: steps 3 (and its validation) will be redone
    resumed = MetricsWriter(tmp_path, [_plot_record(k) for k in range(3)], logger=LoggerConfig(tensorboard=False))
    resumed.close()
    kept = read_metrics(tmp_path / "metrics.jsonl")
    assert [(r["step"], r.get("split")) for r in kept] == [(0, None), (1, None), (1, "validation"), (2, None)]
    assert read_validation(tmp_path) == [_validation(1)]


def test_final_policy_identity_compares_the_last_records_digests():
    def run(*digests):
        return summary([{**r, "policy_digest": d} for r, d in zip(records([5.0, 2.0]), digests)])
    same = compare_pairs([(("tlt", "baseline"), run("a", "z"), run("b", "z"))], group_size=2)
    assert same["final_policy_identical"]
    differ = compare_pairs([(("tlt", "baseline"), run("a", "z"), run("a", "y"))], group_size=2)
    assert not differ["final_policy_identical"] and differ["rewards_identical"]
    unhashed = compare_pairs([(("tlt", "baseline"), run("a", None), run("a", None))], group_size=2)
    assert unhashed["final_policy_identical"] is None  # debug.weight_digests off at the last step: unknown
