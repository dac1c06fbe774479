"""Run reports: metrics JSONL + TensorBoard while a run goes, the TLT-vs-baseline
``report.json`` after it (its PNG plots: ``nemo_tlt.rl.reporting.plots``).

Contract
--------
* ``MetricsWriter`` (rank 0 only) appends one JSON object per RL step to
  ``<run>/metrics.jsonl``, and per validation pass one with ``"split": "validation"``
  (``nemo_tlt.rl.data.validation``); the numeric fields go to the sinks the ``logger:``
  block chooses (``nemo_tlt.rl.reporting.loggers``: TensorBoard under ``<run>/tb``, W&B, MLflow)
  as ``<mode>/<key>`` and ``<mode>/validation/<key>``. On resume it rewrites the JSONL
  from the checkpoint's records (and the validation records of those steps), so the
  file never holds steps the resumed run will redo.
* Plots of the same records: ``nemo_tlt.rl.reporting.plots`` (``write_plots``).
* TLT and its baseline run in pairs of alternating order. ``pair_figures`` compares
  the two runs of one pair on means over the steps after the first (the first pays
  one-time warm-up); ``compare_pairs`` gives the ``report.json`` figures as medians
  over pairs. Its ``control_ratio`` is the baseline / TLT ratio of the policy update's
  work (``update_work_s``: worker-seconds of log-probs, gradients and step per worker,
  wherever and whenever they ran; records without it: ``update_s``), work that is identical
  in both runs: outside
  [1 - CONTROL_TOLERANCE, 1 + CONTROL_TOLERANCE] the machine's speed changed between
  the runs of a pair enough to swamp the speedup, and the report says so
  (``noisy``, ``note``). ``rewards_identical`` / ``rollouts_identical`` compare every
  run of every pair, ``final_policy_identical`` the digests of the policies they end with.
  The step-time breakdown shows ``update_s``, the update after the rollout; with
  ``policy.pipelined_update`` the part done during the tail shows in the worker timeline
  (an "update" strip) and in ``update_work_s``.
* Per pair also the mean response tokens per step of each run (``tlt_mean_tokens``,
  ``baseline_mean_tokens``: the records' ``tokens``, steps after the first; NaN where a
  record lacks them) and the per-token figures ``control_ratio_per_token`` (update work
  per prompt + response token, baseline / TLT: the update processes both) and
  ``speedup_per_token`` (step seconds per response token, baseline / TLT), each the raw
  ratio times TLT / baseline mean tokens:
  on identical tokens exactly the raw ``control_ratio`` / ``speedup``. The report gives
  their medians over pairs.
* Sampled runs: where the runs drew different tokens (``rollouts_identical`` false, e.g.
  ``grpo.acceptance: rejection``, where speculative and plain decoding sample the same
  distribution but not the same draws) no work is identical across them; the noise
  check then uses ``control_ratio_per_token`` (the closest control; ``control_ratio``
  where records lack ``tokens``), ``noise_control`` names the figure it used, and
  ``sampling_note`` says why rewards compare as curves with intervals and that
  step-time figures also reflect the sampled lengths (None when the rollouts are
  identical: the figures are then as with coupled sampling).
* ``reward_curves`` (the function of that name; always given) compares rewards by
  prompt group. The unit is one prompt group at one step, a cell (s, p): sequence i of a
  step's ``rewards`` (id order) belongs to prompt group i // G (G: ``grpo.group_size``,
  passed in as ``group_size``; a step's rewards must be whole groups). Sequences are not
  the unit: those of one group share their prompt (correlated), and the runs of a mode use
  the same seeds and prompts, so with an engine that draws the same tokens each time
  (vLLM) they repeat the same sequences; counting them as independent draws made the
  intervals up to 2x too narrow. So m_mode(s, p) is the group's mean reward averaged over
  the mode's runs (a duplicated run changes nothing). Per mode and step the curve is the
  mean of m_mode(s, p) over the step's P prompt groups with the 95% interval
  mean -+ 1.96 * sd_p / sqrt(P) (normal approximation). ``reward_difference`` pairs the
  modes (same seed: same prompts at each step, so prompt difficulty cancels):
  d(s, p) = m_tlt(s, p) - m_baseline(s, p) over the cells of the steps both have, its mean
  with 95% interval mean -+ 1.96 * sd(d) / sqrt(cells) and ``interval_contains_zero``;
  ``cells`` and the ``runs`` of each mode are given. Exactly 0 for identical runs. Steps
  are not independent of one another (each trains on the one before), so the intervals
  are a guide, not a test. Plot: ``nemo_tlt.rl.reporting.plots.plot_reward_curves``.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from nemo_tlt.rl.reporting.loggers import LoggerConfig, build_sinks, finite_scalars

_SKIP_SCALARS = {"step", "mode", "rewards", "timeline", "decode_segments", "rollout_digest", "rollout_gen_s",
                 "run_started"}


VALIDATION = "validation"  # the "split" of a validation record (nemo_tlt.rl.data.validation)


def is_validation(record: dict[str, Any]) -> bool:
    return record.get("split") == VALIDATION


def split_records(recs: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(step records, validation records), each in the order given."""
    return [r for r in recs if not is_validation(r)], [r for r in recs if is_validation(r)]


def record_scalars(record: dict[str, Any]) -> dict[str, float]:
    """The scalars a record logs: ``<mode>/<key>`` for a step record,
    ``<mode>/validation/<key>`` for a validation record; finite numbers only."""
    prefix = f"{record['mode']}/validation/" if is_validation(record) else f"{record['mode']}/"
    values = {k: v for k, v in record.items() if k not in _SKIP_SCALARS and k != "split"}
    return {prefix + k: v for k, v in finite_scalars(values).items()}


class MetricsWriter:
    """metrics.jsonl + the configured scalar sinks (TensorBoard, W&B, MLflow) for one run
    (rank 0). Takes step records and validation records (``"split": "validation"``).

    ``previous``: a resumed run's step records from its checkpoint; the file is rewritten
    with them, keeping the validation records it held for those steps (so it never holds
    steps the resumed run will redo). ``logger`` unset: TensorBoard only. ``name``: the
    run's name in W&B / MLflow (default: the run folder); ``config``: plain config values
    for them."""

    def __init__(self, out_dir: str | Path, previous: list[dict[str, Any]] = (),
                 logger: LoggerConfig | None = None, name: str | None = None,
                 config: dict[str, Any] | None = None) -> None:
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl = self.out_dir / "metrics.jsonl"
        kept = _kept_validation(self.jsonl, previous)
        with open(self.jsonl, "w") as fh:
            for record in _interleave(list(previous), kept):
                fh.write(json.dumps(record) + "\n")
        self.sinks = build_sinks(logger or LoggerConfig(), self.out_dir, name or str(out_dir), config)

    def write(self, record: dict[str, Any]) -> None:
        with open(self.jsonl, "a") as fh:
            fh.write(json.dumps(record) + "\n")
        scalars, step = record_scalars(record), int(record["step"])
        for sink in self.sinks:
            sink.log(scalars, step)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def _kept_validation(path: Path, previous: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The validation records of an earlier process's file for the steps in ``previous``."""
    if not previous or not path.is_file():
        return []
    last = max(int(r["step"]) for r in previous)
    return [r for r in read_metrics(path) if is_validation(r) and int(r["step"]) <= last]


def _interleave(steps: list[dict[str, Any]], validation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Step records with each validation record after the step record of its step."""
    out, pending = [], list(validation)
    for record in steps:
        out.append(record)
        out.extend(v for v in pending if int(v["step"]) == int(record["step"]))
        pending = [v for v in pending if int(v["step"]) != int(record["step"])]
    return out + pending


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def read_validation(out_dir: str | Path) -> list[dict[str, Any]]:
    """The validation records of a run folder's metrics.jsonl (none if it has no file)."""
    path = Path(out_dir) / "metrics.jsonl"
    return [r for r in read_metrics(path) if is_validation(r)] if path.is_file() else []


def mean_after_first(values: list[float]) -> float:
    """Mean over the steps after the first (all of them when there is only one)."""
    tail = values[1:] if len(values) > 1 else values
    return float(np.mean(tail)) if tail else float("nan")


CONTROL_TOLERANCE = 0.1
Z95 = 1.96  # the two-sided 95% quantile of the normal distribution


def ratio(num: float, den: float) -> float:
    return num / den if den > 0 else float("nan")


def median_over_pairs(values: list[float]) -> float:
    """The median of per-pair figures (NaN for no pairs)."""
    return float(np.median(values)) if len(values) else float("nan")


def control_is_noisy(control_ratio: float, tolerance: float = CONTROL_TOLERANCE) -> bool:
    """True when the control phase differed by more than `tolerance` between the runs
    (or could not be measured): a speedup from such runs is mostly the machine's."""
    return not (1.0 - tolerance <= control_ratio <= 1.0 + tolerance)


def mean_tokens(recs: list[dict[str, Any]], with_prompts: bool = False) -> float:
    """Mean response tokens per step (the records' ``tokens``; ``with_prompts``: plus their
    ``prompt_tokens``, what the policy update processes; 0 in records without them) over the
    steps after the first; NaN when any record lacks ``tokens``."""
    if not all("tokens" in r for r in recs):
        return float("nan")
    return mean_after_first([float(r["tokens"] + (r.get("prompt_tokens", 0) if with_prompts else 0))
                             for r in recs])


def per_token(raw_ratio: float, tlt_tokens: float, baseline_tokens: float) -> float:
    """A baseline / TLT ratio of per-step figures turned into the ratio of the figures per
    response token: ``raw_ratio * tlt_tokens / baseline_tokens``. Equal token means give
    ``raw_ratio`` exactly; NaN where the baseline's tokens are unknown or not positive."""
    return raw_ratio * ratio(tlt_tokens, baseline_tokens)


def pair_figures(order: tuple[str, str], tlt: list[dict[str, Any]], baseline: list[dict[str, Any]]) -> dict:
    """One pair's figures from the step records of its TLT and baseline runs; `order`
    is the order the two ran in, e.g. ("baseline", "tlt"). Means are over the steps after
    the first; per-token figures divide those means by the mean tokens (the step time by the
    response tokens, the update's work by prompt + response tokens)."""
    def mean(recs: list[dict[str, Any]], key: str) -> float:
        return mean_after_first([r[key] for r in recs])

    t_mean, b_mean = mean(tlt, "step_s"), mean(baseline, "step_s")
    t_rollout, b_rollout = mean(tlt, "rollout_s"), mean(baseline, "rollout_s")
    t_update, b_update = mean(tlt, "update_s"), mean(baseline, "update_s")
    # the control: the update's work, identical in both runs; with the pipelined update TLT
    # does part of it inside the rollout, so its work (not its phase) is what compares
    key = "update_work_s" if all("update_work_s" in r for r in tlt + baseline) else "update_s"
    t_work, b_work = mean(tlt, key), mean(baseline, key)
    t_tokens, b_tokens = mean_tokens(tlt), mean_tokens(baseline)
    speedup, control = ratio(b_mean, t_mean), ratio(b_work, t_work)
    return {"order": list(order), "tlt_mean_step_s": t_mean, "baseline_mean_step_s": b_mean,
            "speedup": speedup, "step_time_ratio": ratio(t_mean, b_mean),
            "rollout_speedup": ratio(b_rollout, t_rollout), "baseline_rollout_share": ratio(b_rollout, b_mean),
            "tlt_update_s": t_update, "baseline_update_s": b_update, "tlt_update_work_s": t_work,
            "baseline_update_work_s": b_work, "control_ratio": control,
            "tlt_mean_tokens": t_tokens, "baseline_mean_tokens": b_tokens,
            # the update processes prompts and responses: its work per token counts both
            "control_ratio_per_token": per_token(control, mean_tokens(tlt, True), mean_tokens(baseline, True)),
            "speedup_per_token": per_token(speedup, t_tokens, b_tokens)}


PER_TOKEN_CONTROL = "control_ratio_per_token"


def sampling_note(control_key: str) -> str:
    """The report's ``sampling_note`` for runs that drew different tokens; `control_key`:
    the figure the noise check read (``noise_control_key``)."""
    return ("the runs drew different tokens (speculative and plain decoding sample the same distribution but not "
            "the same draws, e.g. with grpo.acceptance: rejection; with coupled sampling this means the runs "
            "diverged), so rewards are compared as curves with 95% intervals (reward_curves), not bitwise, and "
            "step-time figures also reflect the sampled response lengths: the *_per_token figures normalise by "
            f"tokens (the step time by response tokens, the update's work by prompt + response tokens), and the "
            f"noise check uses {control_key}")


def noise_control_key(pairs: list[dict[str, Any]], rollouts_identical: bool) -> str:
    """The per-pair figure the noise check reads: ``control_ratio`` (identical work) when
    the runs sampled identical tokens, else ``control_ratio_per_token`` (work per prompt +
    response token, the closest control), unless a pair lacks it (records without ``tokens``)."""
    if rollouts_identical:
        return "control_ratio"
    values = [p.get(PER_TOKEN_CONTROL, float("nan")) for p in pairs]
    return PER_TOKEN_CONTROL if values and all(math.isfinite(v) for v in values) else "control_ratio"


def summarize_pairs(pairs: list[dict[str, Any]], tolerance: float = CONTROL_TOLERANCE,
                    rollouts_identical: bool = True) -> dict[str, Any]:
    """Medians over pairs of the per-pair figures (``pair_figures``; a figure a pair lacks
    counts as NaN), the noisy flag and its note. The noise check reads the figure
    ``noise_control_key`` picks (named in ``noise_control``); ``sampling_note`` is the
    function's sentence when the rollouts were not identical, else None."""
    def med(key: str) -> float:
        return median_over_pairs([p.get(key, float("nan")) for p in pairs])

    control_key = noise_control_key(pairs, rollouts_identical)
    noise = med(control_key)
    noisy = control_is_noisy(noise, tolerance)
    note = None
    if noisy:
        work = ("the policy update's work, the same in both runs," if control_key == "control_ratio" else
                "the policy update's work per token, prompt and response (the runs sampled different tokens),")
        note = (f"the machine was too noisy for the speedup to mean much: {work} took {noise:.2f}x as long in "
                f"the baseline runs as in the TLT runs (median over {len(pairs)} pair(s); outside "
                f"[{1 - tolerance:.2f}, {1 + tolerance:.2f}])")
    control = med("control_ratio")
    return {"speedup": med("speedup"), "step_time_ratio": med("step_time_ratio"),
            "rollout_speedup": med("rollout_speedup"), "baseline_rollout_share": med("baseline_rollout_share"),
            # the phase split: update time left after the rollout, and the update's whole work
            "tlt_update_s": med("tlt_update_s"), "baseline_update_s": med("baseline_update_s"),
            "tlt_update_work_s": med("tlt_update_work_s"), "baseline_update_work_s": med("baseline_update_work_s"),
            "control_ratio": control,
            # per token: what compares when the runs sampled different lengths
            "tlt_mean_tokens": med("tlt_mean_tokens"), "baseline_mean_tokens": med("baseline_mean_tokens"),
            "control_ratio_per_token": med(PER_TOKEN_CONTROL), "speedup_per_token": med("speedup_per_token"),
            "noise_control": control_key, "noisy": noisy, "note": note,
            "sampling_note": None if rollouts_identical else sampling_note(control_key)}


def all_identical(values: list[Any]) -> bool:
    return all(v == values[0] for v in values[1:])


def _identical_or_none(values: list[Any]) -> bool | None:
    """`all_identical`, or None when a value is missing (nothing to compare)."""
    return None if any(v is None for v in values) else all_identical(values)


def run_block(summary: dict[str, Any]) -> dict[str, Any]:
    """A run's entry in report.json (see nemo_tlt.rl.loop.RLWorker.run for `summary`)."""
    recs = summary["records"]
    steps = [r["step_s"] for r in recs]
    return {"mode": summary["mode"], "step_times": steps, "mean_step_s_after_first": mean_after_first(steps),
            "wall_s": summary["wall_s"], "status": summary["status"], "out_dir": summary["out_dir"],
            "reward_mean": [r["reward_mean"] for r in recs],
            "rollout_s": [r["rollout_s"] for r in recs],
            "update_s": [r["update_s"] for r in recs],
            "tokens": [r.get("tokens") for r in recs],
            "mean_accept_len": [r["mean_accept_len"] for r in recs],
            "drafter_samples": [r["drafter_samples"] for r in recs],
            "drafter_train_s": [r["drafter_train_s"] for r in recs]}


def interval(values: np.ndarray) -> tuple[float, float, float]:
    """(mean, low, high): the mean with its 95% normal-approximation interval,
    mean -+ 1.96 * sd / sqrt(n) (sample sd, n - 1); NaN bounds for fewer than 2 values."""
    n = len(values)
    mean = float(np.mean(values)) if n else float("nan")
    half = Z95 * float(np.std(values, ddof=1)) / math.sqrt(n) if n > 1 else float("nan")
    return mean, mean - half, mean + half


def group_means(rewards: list[float], group_size: int, step: int) -> np.ndarray:
    """The mean reward of each prompt group of one step's ``rewards`` (id order: sequence
    i in group i // group_size); ValueError unless they are whole groups."""
    if group_size < 1 or not rewards or len(rewards) % group_size:
        raise ValueError(f"step {step}: {len(rewards)} rewards are not whole prompt groups of "
                         f"grpo.group_size={group_size}")
    return np.asarray(rewards, dtype=float).reshape(-1, group_size).mean(axis=1)


def prompt_group_means(runs: list[list[dict[str, Any]]], group_size: int) -> dict[int, tuple[np.ndarray, int]]:
    """Per step: (m(s, p) for each prompt group p, the number of runs averaged), where
    m(s, p) is the group's mean reward averaged over the `runs` (lists of step records)
    that have the step; ValueError where they disagree on the number of prompt groups."""
    per_step: dict[int, list[np.ndarray]] = {}
    for recs in runs:
        for r in recs:
            step = int(r["step"])
            per_step.setdefault(step, []).append(group_means([float(x) for x in r["rewards"]], group_size, step))
    out: dict[int, tuple[np.ndarray, int]] = {}
    for step in sorted(per_step):
        groups = per_step[step]
        if len({len(g) for g in groups}) > 1:
            raise ValueError(f"step {step}: the runs have {sorted({len(g) for g in groups})} prompt groups")
        out[step] = (np.mean(np.stack(groups), axis=0), len(groups))
    return out


def reward_curve(runs: list[list[dict[str, Any]]], group_size: int) -> dict[str, list]:
    """One mode's curve, per step: ``steps``, ``mean``, ``low``, ``high`` (95% interval over
    the step's prompt groups, runs averaged within a group: ``prompt_group_means``),
    ``prompts`` (prompt groups, the units) and ``runs`` (runs averaged)."""
    cells = prompt_group_means(runs, group_size)
    stats = [interval(m) for m, _ in cells.values()]
    return {"steps": list(cells), "mean": [m for m, _, _ in stats], "low": [lo for _, lo, _ in stats],
            "high": [hi for _, _, hi in stats], "prompts": [len(m) for m, _ in cells.values()],
            "runs": [k for _, k in cells.values()]}


def reward_difference(tlt: dict[int, tuple[np.ndarray, int]],
                      baseline: dict[int, tuple[np.ndarray, int]]) -> dict[str, Any]:
    """TLT minus baseline, paired by (step, prompt group) cell over the steps both have
    (``prompt_group_means`` of each mode): the mean of d(s, p) = m_tlt(s, p) - m_base(s, p)
    with its 95% interval (mean -+ 1.96 * sd(d) / sqrt(cells), normal approximation);
    ``interval_contains_zero``: low <= 0 <= high (False where the interval is NaN, fewer than
    2 cells); ``tlt_mean`` / ``baseline_mean`` over the same cells; ``cells``; ``runs`` per
    mode (the most a compared step averaged). ValueError where a step's prompt groups differ in
    number between the modes (they cannot be the same prompts)."""
    steps = sorted(set(tlt) & set(baseline))
    for step in steps:
        if len(tlt[step][0]) != len(baseline[step][0]):
            raise ValueError(f"step {step}: TLT has {len(tlt[step][0])} prompt groups, the baseline "
                             f"{len(baseline[step][0])}; the modes must see the same prompts")
    t = np.concatenate([np.zeros(0), *(tlt[s][0] for s in steps)])
    b = np.concatenate([np.zeros(0), *(baseline[s][0] for s in steps)])
    diff, low, high = interval(t - b)
    t_mean, b_mean = (float(np.mean(v)) if len(v) else float("nan") for v in (t, b))
    return {"mean": diff, "low": low, "high": high, "interval_contains_zero": bool(low <= 0.0 <= high),
            "tlt_mean": t_mean, "baseline_mean": b_mean, "cells": len(t),
            "runs": {"tlt": max((tlt[s][1] for s in steps), default=0),
                     "baseline": max((baseline[s][1] for s in steps), default=0)}}


def reward_curves(runs_by_mode: dict[str, list[list[dict[str, Any]]]], group_size: int) -> dict[str, Any]:
    """Reward curves with 95% intervals by prompt group (the module's contract): per mode
    (each a list of runs' step records) a ``reward_curve``, plus ``reward_difference``
    (``tlt`` minus ``baseline``, paired by (step, prompt group); present when both modes
    are given) and ``confidence`` (0.95). `group_size`: sequences per prompt group
    (``grpo.group_size``). Identical runs: the difference is exactly 0."""
    out: dict[str, Any] = {"confidence": 0.95}
    out.update({mode: reward_curve(runs, group_size) for mode, runs in runs_by_mode.items()})
    if "tlt" in runs_by_mode and "baseline" in runs_by_mode:
        out["reward_difference"] = reward_difference(prompt_group_means(runs_by_mode["tlt"], group_size),
                                                     prompt_group_means(runs_by_mode["baseline"], group_size))
    return out


def compare_pairs(pairs: list[tuple[tuple[str, str], dict[str, Any], dict[str, Any]]], *,
                  group_size: int) -> dict[str, Any]:
    """report.json figures from completed pairs of (order, TLT summary, baseline summary):
    ``summarize_pairs`` over ``pair_figures``, identity across every run, ``reward_curves``
    (`group_size`: the runs' ``grpo.group_size``, sequences per prompt group)."""
    per_pair = [pair_figures(order, t["records"], b["records"]) for order, t, b in pairs]
    runs = [s for _, t, b in pairs for s in (t, b)]
    rollouts_identical = all_identical([[r["rollout_digest"] for r in s["records"]] for s in runs])
    return {
        **summarize_pairs(per_pair, rollouts_identical=rollouts_identical),
        "pairs": per_pair,
        "rewards_identical": all_identical([[r["rewards"] for r in s["records"]] for s in runs]),
        "rollouts_identical": rollouts_identical,
        # the policy each run ends with; None where a run's last step was not hashed (debug.weight_digests)
        "final_policy_identical": _identical_or_none([s["records"][-1].get("policy_digest") if s["records"] else None
                                                      for s in runs]),
        "steps_compared": min(len(s["records"]) for s in runs) if runs else 0,
        "reward_curves": reward_curves({"tlt": [t["records"] for _, t, _ in pairs],
                                        "baseline": [b["records"] for _, _, b in pairs]}, group_size),
    }


def format_pairs(report: dict[str, Any]) -> str:
    """The per-pair table printed at the end of a comparison (``compare_pairs``' output)."""
    lines = [f"{'pair':<6}{'order':<16}{'TLT s/step':>11}{'base s/step':>12}{'speedup':>9}{'update b/t':>12}"]
    for k, p in enumerate(report["pairs"], 1):
        lines.append(f"{k:<6}{', '.join(p['order']):<16}{p['tlt_mean_step_s']:>11.2f}"
                     f"{p['baseline_mean_step_s']:>12.2f}{p['speedup']:>8.2f}x{p['control_ratio']:>12.2f}")
    lines.append(f"{'median':<6}{'':<16}{'':>11}{'':>12}{report['speedup']:>8.2f}x{report['control_ratio']:>12.2f}")
    return "\n".join(lines)


# ---- plots -------------------------------------------------------------------------

def progress_bar(cfg, mode: str, start: int):
    """A tqdm bar over the run's RL steps (None with ``progress: false``)."""
    if not cfg.progress:
        return None
    from tqdm.auto import tqdm
    return tqdm(total=cfg.steps, initial=start, desc=f"RL steps ({mode})", unit="step", leave=True)
