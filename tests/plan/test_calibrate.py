"""`nemo-tlt plan --calibrate`: on a synthetic `--compare-baseline` run folder whose times
were generated token by token from known costs, with per-step jitter and a context term
the cost model lacks, the fit comes close to those costs and the predicted phases to the
measured ones; a run measured under changing load misses its speedup target; a pair's
prediction never uses its own timings; without noise a pipelined run's phases equal an
event-driven reference."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from nemo_tlt.plan.calibrate import calibrate
from nemo_tlt.plan.cli import main
from nemo_tlt.rl.reporting.report import pair_figures, summarize_pairs

ROWS = 8        # per worker: 2 workers x 2 prompts x group 4
ACCEPT = 4      # accepted tokens per SD step; every length is a multiple, so SD steps are whole
COSTS = dict(a=0.010, b=0.0004, p_base=0.2, c=0.02, d=0.003, p_tlt=0.05, u0=0.07, u1=0.0006)
FIXED = {"tlt": dict(logprob=2e-5, weight_sync=0.008, other=0.001, gap=0.04),
         "baseline": dict(logprob=3e-5, weight_sync=0.009, other=0.0008, gap=0.002)}
# The measured machine is not the model: every decode step's time is off by up to JITTER
# (uniform, from a Generator seeded by pair, mode and step), and it also pays CONTEXT_S per running
# row per token already generated (attention over the context, a term the model lacks);
# the update and the fixed phases are off by up to PHASE_JITTER.
JITTER, CONTEXT_S, PHASE_JITTER = 0.10, 1e-7, 0.05
# What the fit and the predictions meet on that machine (the code on these data: costs within
# 9 %, speedup within 0.4 %, rollout and step phases within 2 %, the update within 12 %: with
# even / odd steps as folds its slope is fitted on two steps of near token counts), and
# what a wrong model does not (without the per-row term of SD steps, with workers not matched
# by rank, without the rollout's gap: a cost off by 100 %, a phase by 3-23 %, the speedup by 3-4 %).
FIT_RTOL, SPEEDUP_RTOL, PHASE_RTOL, UPDATE_RTOL = 0.12, 0.02, 0.03, 0.15
LOADED = 2.0    # a slowdown of some runs' generation that the cost model cannot know of
# per step: (longest of worker 0, longest of worker 1, length of every other row)
STEPS = [(40, 16, 8), (120, 48, 12), (64, 100, 4), (200, 24, 16), (28, 60, 8), (88, 88, 20)]
CONFIG = """workers:
  num_workers: 2
grpo:
  prompts_per_step: 4
  group_size: 4
rollout:
  sd_policy: threshold
  threshold: {threshold_on: 16, threshold_off: 16}
  bandit: {arms: ['4_1_4', '6_2_12']}
"""


def decode(lengths: list[int], mode: str, rng: np.random.Generator | None = None) -> tuple[float, list[float]]:
    """One worker's rollout step by step: every running row advances 1 token (plain) or
    ACCEPT tokens (SD). (seconds, when each row finished); with ``rng`` on the measured
    machine (JITTER, CONTEXT_S), without it exactly as the cost model says."""
    c = COSTS
    per_step, per_row, prefill, adv = ((c["a"], c["b"], c["p_base"], 1) if mode == "baseline"
                                       else (c["c"], c["d"], c["p_tlt"], ACCEPT))
    t, done, ends = prefill, 0, [prefill] * len(lengths)
    while any(n > done for n in lengths):
        running = sum(n > done for n in lengths)
        dt = per_step + per_row * running
        if rng is not None:
            dt = (dt + CONTEXT_S * running * done) * rng.uniform(1 - JITTER, 1 + JITTER)
        t += dt
        done += adv
        for i, n in enumerate(lengths):
            if done >= n > done - adv:
                ends[i] = t
    return t, ends


def record(pair: int, step: int, mode: str, slow: float) -> dict:
    rng = np.random.default_rng([pair, ("tlt", "baseline").index(mode), step])  # the same in every run folder
    l0, l1, q = STEPS[step]
    workers = [[l0] + [q] * (ROWS - 1), [l1] + [q] * (ROWS - 1)]
    tokens = sum(map(sum, workers))
    gen = [slow * decode(w, mode, rng)[0] for w in workers]
    fx = {k: v * rng.uniform(1 - PHASE_JITTER, 1 + PHASE_JITTER) for k, v in FIXED[mode].items()}
    update = (COSTS["u0"] + COSTS["u1"] * tokens) * rng.uniform(1 - PHASE_JITTER, 1 + PHASE_JITTER)
    r = {"step": step, "mode": mode, "resp_len_max": max(l0, l1), "tokens": tokens,
         "plain_steps": l0 + l1 if mode == "baseline" else 0, "sd_steps": (l0 + l1) // ACCEPT if mode == "tlt" else 0,
         "mean_accept_len": float(ACCEPT) if mode == "tlt" else 0.0, "rollout_gen_s": gen,
         "rollout_s": max(gen) + fx["gap"], "logprob_s": fx["logprob"],
         "update_s": update, "weight_sync_s": fx["weight_sync"], "other_s": fx["other"]}
    r["step_s"] = sum(r[k] for k in ("rollout_s", "logprob_s", "update_s", "weight_sync_s", "other_s"))
    return r


def write_run(root: Path, pairs: int = 3, slow: dict | None = None) -> Path:
    """A run folder as `nemo-tlt train --compare-baseline` lays it out; `slow` scales the
    generation times of some (pair, mode) runs."""
    slow = slow or {}
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.yaml").write_text(CONFIG)
    figures = []
    for k in range(1, pairs + 1):
        recs = {}
        for mode in ("tlt", "baseline"):
            recs[mode] = [record(k, s, mode, slow.get((k, mode), 1.0)) for s in range(len(STEPS))]
            (root / f"pair{k}" / mode).mkdir(parents=True)
            (root / f"pair{k}" / mode / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs[mode]))
        figures.append(pair_figures(("tlt", "baseline"), recs["tlt"], recs["baseline"]))
    (root / "report.json").write_text(json.dumps({**summarize_pairs(figures), "pairs": figures}))
    return root


def fitted(fit: dict) -> list[float]:
    return [fit["decode_step_s"], fit["decode_per_row_s"], fit["baseline_prefill_s"], fit["sd_step_s"],
            fit["sd_per_row_s"], fit["tlt_prefill_s"], fit["update_s"], fit["update_per_token_s"]]


def test_fit_comes_close_to_the_generating_costs(tmp_path):
    out = calibrate(write_run(tmp_path))
    assert out["method"]["folds"].startswith("one per pair")
    for fit in out["fits"].values():
        np.testing.assert_allclose(fitted(fit), list(COSTS.values()), rtol=FIT_RTOL)


@pytest.mark.parametrize("folds", ["pairs", "steps"])
def test_predicted_phases_come_close_to_the_measured(tmp_path, folds):
    out = calibrate(write_run(tmp_path), folds)
    assert out["method"]["folds"] == ("one per pair (leave one pair out)" if folds == "pairs" else "even / odd steps")
    assert out["predicted_speedup"] == pytest.approx(out["measured_speedup"], rel=SPEEDUP_RTOL)
    assert {"tlt.rollout", "baseline.rollout", "tlt.update", "baseline.update", "tlt.step"} <= set(out["phases"])
    for name, v in out["phases"].items():
        rtol = UPDATE_RTOL if name.endswith(".update") else PHASE_RTOL
        assert v["predicted_s"] == pytest.approx(v["measured_s"], rel=rtol), name
    assert out["targets"]["speedup_met"] and all(out["targets"]["phases_met"].values())


def test_a_run_whose_machine_slowed_between_pairs_misses_its_speedup_target(tmp_path):
    """The TLT runs of pairs 2 and 3 generated LOADED x slower (the machine got busier after
    pair 1). Each pair is predicted from the other two, so no prediction follows its own
    pair: the median over pairs of the predicted speedups is off the measured one (the
    report's median) by more than the 15 % target, while the phases, means over pairs,
    still meet theirs."""
    out = calibrate(write_run(tmp_path, slow={(2, "tlt"): LOADED, (3, "tlt"): LOADED}))
    assert out["predicted_speedup"] > 1.15 * out["measured_speedup"]
    assert out["targets"]["speedup_met"] is False
    assert all(out["targets"]["phases_met"].values())


def test_a_pair_is_predicted_without_its_own_timings(tmp_path):
    clean = calibrate(write_run(tmp_path / "clean"))
    slowed = calibrate(write_run(tmp_path / "slowed", slow={(1, "tlt"): 2.0, (1, "baseline"): 3.0}))
    p1c, p1s = clean["pairs"][0], slowed["pairs"][0]
    for mode in ("tlt", "baseline"):  # pair 1's prediction comes from pairs 2 and 3 only
        assert p1s[f"{mode}.step"]["predicted_s"] == pytest.approx(p1c[f"{mode}.step"]["predicted_s"], rel=1e-9)
        assert p1s[f"{mode}.step"]["measured_s"] > p1c[f"{mode}.step"]["measured_s"]
    assert slowed["pairs"][1]["predicted_speedup"] != pytest.approx(clean["pairs"][1]["predicted_speedup"])


def test_cli_writes_the_json(tmp_path, capsys):
    run = write_run(tmp_path / "run", pairs=2)
    assert main(["--calibrate", str(run), "--out", str(tmp_path / "cal.json")]) == 0
    out = json.loads((tmp_path / "cal.json").read_text())
    assert {"predicted_speedup", "measured_speedup", "phases"} <= set(out)
    assert main(["--calibrate", str(tmp_path / "nowhere")]) == 2
    assert "report.json" in capsys.readouterr().err


# ---- a run whose TLT update was pipelined into the rollout's tail ---------------------
# a rank's group work: u0 + u1 x its tokens; then, in both modes, the step (after the meet in TLT).
# These runs are generated exactly by the cost model (no jitter), so the prediction must equal
# the event-driven reference below to rounding.
PIPE = dict(u0=0.03, u1=0.002, opt=0.02, logprob=0.0)


def _work_left(workers: list[list[int]], mode: str, work: float) -> tuple[list[float], float]:
    """(generation seconds per worker, worker-seconds of update work left when the last one
    ends), event by event: a group's work (its token share of workers x ``work``) joins a
    queue when its last row finishes, and every worker whose decoding has ended drains the
    queue at one worker-second a second. Between two events (a group finishing, a worker
    ending) the draining rate is constant; the queue may run dry in between."""
    runs = [decode(w, mode) for w in workers]
    total = sum(map(sum, workers))
    events = [(max(ends[g:g + 4]), len(workers) * work * sum(w[g:g + 4]) / total)
              for w, (_, ends) in zip(workers, runs) for g in range(0, len(w), 4)]
    events += [(s, None) for s, _ in runs]  # None: a worker goes idle
    last = max(s for s, _ in runs)
    t, idle, queued, left = 0.0, 0, 0.0, len(workers) * work
    for when, joining in sorted(events, key=lambda e: e[0]):
        drained = min(queued, idle * (min(when, last) - t))
        queued, left, t = queued - drained, left - drained, min(when, last)
        if joining is None:
            idle += 1
        else:
            queued += joining
    return [s for s, _ in runs], left


def piped_record(step: int, mode: str, piped: bool = True) -> dict:
    l0, l1, q = STEPS[step]
    lens = [q + ACCEPT * (i % 3) for i in range(16)]  # groups differ, so which rows share a worker matters
    lens[0], lens[4] = l0, l1        # sequence p x 4 + g; prompt p on worker p % 2: ids 0-3, 8-11 on worker 0
    workers = [[lens[i] for i in (0, 1, 2, 3, 8, 9, 10, 11)], [lens[i] for i in (4, 5, 6, 7, 12, 13, 14, 15)]]
    group_work = [PIPE["u0"] + PIPE["u1"] * sum(w) for w in workers]
    work = float(np.mean(group_work))
    fx = FIXED[mode]
    if mode == "tlt" and piped:
        gen, left = _work_left(workers, mode, work)
        rollout, update = max(gen) + fx["gap"] + left / 2, PIPE["opt"]
    else:  # log-probs, then the update as long as the busiest rank's, then the step
        gen = [decode(w, mode)[0] for w in workers]
        rollout, update = max(gen) + fx["gap"], max(group_work) + PIPE["opt"]
    r = {"step": step, "mode": mode, "resp_len_max": max(l0, l1), "tokens": sum(lens), "resp_lens": lens,
         "plain_steps": l0 + l1 if mode == "baseline" else 0, "mean_accept_len": float(ACCEPT) if mode == "tlt" else 0.0,
         "rollout_gen_s": gen, "rollout_s": rollout, "logprob_s": PIPE["logprob"], "update_s": update,
         "update_work_s": PIPE["logprob"] + work + PIPE["opt"], "weight_sync_s": fx["weight_sync"],
         "other_s": fx["other"]}
    r["step_s"] = sum(r[k] for k in ("rollout_s", "logprob_s", "update_s", "weight_sync_s", "other_s"))
    return r


def write_piped_run(root: Path, pairs: int = 3, piped: bool = True) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.yaml").write_text(CONFIG + f"policy:\n  pipelined_update: {str(piped).lower()}\n")
    figures = []
    for k in range(1, pairs + 1):
        recs = {m: [piped_record(s, m, piped) for s in range(len(STEPS))] for m in ("tlt", "baseline")}
        for mode, rs in recs.items():
            (root / f"pair{k}" / mode).mkdir(parents=True)
            (root / f"pair{k}" / mode / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rs))
        figures.append(pair_figures(("tlt", "baseline"), recs["tlt"], recs["baseline"]))
    (root / "report.json").write_text(json.dumps({**summarize_pairs(figures), "pairs": figures}))
    return root


@pytest.mark.parametrize("folds", ["pairs", "steps"])
def test_a_pipelined_run_is_predicted_from_the_update_work_and_when_groups_finish(tmp_path, folds):
    out = calibrate(write_piped_run(tmp_path), folds)
    for fit in out["fits"].values():  # the update's work per rank (the step's included), from update_work_s
        assert fit["update_tokens"] == "of a rank"
        np.testing.assert_allclose([fit["update_s"], fit["update_per_token_s"]], [PIPE["u0"] + PIPE["opt"], PIPE["u1"]],
                                   rtol=1e-6)
        assert fit["fixed_s"]["tlt"]["update"] == pytest.approx(PIPE["opt"])
        assert fit["fixed_s"]["tlt"]["rollout_gap"] == pytest.approx(FIXED["tlt"]["gap"], rel=1e-6)
    for name, v in out["phases"].items():
        # TLT's rollout phase holds the work left after its slowest worker (by the event-driven
        # reference, without noise: equal to rounding); the baseline's update is its busiest rank's work
        assert v["predicted_s"] == pytest.approx(v["measured_s"], rel=1e-6, abs=1e-9), name
    assert out["predicted_speedup"] == pytest.approx(out["measured_speedup"], rel=1e-6)


def test_lengths_by_worker_follow_the_prompt_sharding_or_are_refused():
    from nemo_tlt.plan.calibrate import lengths_by_worker
    lens = list(range(16))  # 4 prompts x group 4, 2 workers: prompts 0, 2 on worker 0
    assert lengths_by_worker((8, 8), 4, lens) == ((0, 1, 2, 3, 8, 9, 10, 11), (4, 5, 6, 7, 12, 13, 14, 15))
    assert lengths_by_worker((12, 8), 4, list(range(20))) == (tuple(range(4)) + tuple(range(8, 12)) + tuple(range(16, 20)),
                                                            tuple(range(4, 8)) + tuple(range(12, 16)))
    with pytest.raises(ValueError, match="resp_lens must hold 4 x 4 lengths"):
        lengths_by_worker((8, 8), 4, lens[:12])  # not this layout's sequences


def test_a_synchronous_run_with_log_probs_counts_them_once(tmp_path, monkeypatch):
    monkeypatch.setitem(PIPE, "logprob", 0.05)  # a separate log-prob pass: its own phase, inside update_work_s
    out = calibrate(write_piped_run(tmp_path, piped=False), "steps")
    for name, v in out["phases"].items():
        assert v["predicted_s"] == pytest.approx(v["measured_s"], rel=1e-6, abs=1e-9), name
    assert out["predicted_speedup"] == pytest.approx(out["measured_speedup"], rel=1e-6)


def test_bad_records_and_layouts_are_refused_naming_the_file_and_field(tmp_path):
    run = write_piped_run(tmp_path / "run", pairs=2)
    path = run / "pair2" / "tlt" / "metrics.jsonl"
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    del recs[3]["rollout_gen_s"]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    with pytest.raises(ValueError, match=r"pair2/tlt/metrics.jsonl step 3: no field 'rollout_gen_s'"):
        calibrate(run)
    run = write_piped_run(tmp_path / "short", pairs=2)
    path = run / "pair1" / "baseline" / "metrics.jsonl"
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    recs[2]["resp_lens"] = recs[2]["resp_lens"][:12]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    with pytest.raises(ValueError, match=r"pair1/baseline/metrics.jsonl step 2: resp_lens must hold 4 x 4 lengths"):
        calibrate(run)
    run = write_piped_run(tmp_path / "tp", pairs=2)
    (run / "config.yaml").write_text(CONFIG.replace("rollout:\n", "rollout:\n  tensor_parallel: 2\n"))
    with pytest.raises(ValueError, match="rollout.tensor_parallel=2"):
        calibrate(run)


def test_a_row_of_length_zero_ends_with_the_prefill():
    from nemo_tlt.plan.simulator import finish_times
    trace = [(0.0, 0.5, 3, "prefill"), (0.5, 1.0, 2, ""), (1.5, 2.0, 1, "")]
    np.testing.assert_allclose(finish_times(np.array([0, 3, 7, 3]), trace), [0.5, 1.5, 3.5, 1.5])
