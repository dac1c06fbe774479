"""Run reports: metrics JSONL + TensorBoard while a run goes, the TLT-vs-baseline
``report.json`` after it (its PNG plots: ``nemo_tlt.rl.plots``).

Contract
--------
* ``MetricsWriter`` (rank 0 only) appends one JSON object per RL step to
  ``<run>/metrics.jsonl``, and per validation pass one with ``"split": "validation"``
  (``nemo_tlt.rl.validation``); the numeric fields go to the sinks the ``logger:``
  block chooses (``nemo_tlt.rl.loggers``: TensorBoard under ``<run>/tb``, W&B, MLflow)
  as ``<mode>/<key>`` and ``<mode>/validation/<key>``. On resume it rewrites the JSONL
  from the checkpoint's records (and the validation records of those steps), so the
  file never holds steps the resumed run will redo.
* Plots of the same records: ``nemo_tlt.rl.plots`` (``write_plots``).
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
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from nemo_tlt.rl.loggers import LoggerConfig, build_sinks, finite_scalars

_SKIP_SCALARS = {"step", "mode", "rewards", "timeline", "decode_segments", "rollout_digest", "rollout_gen_s",
                 "run_started"}


VALIDATION = "validation"  # the "split" of a validation record (nemo_tlt.rl.validation)


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


def ratio(num: float, den: float) -> float:
    return num / den if den > 0 else float("nan")


def median_over_pairs(values: list[float]) -> float:
    """The median of per-pair figures (NaN for no pairs)."""
    return float(np.median(values)) if len(values) else float("nan")


def control_is_noisy(control_ratio: float, tolerance: float = CONTROL_TOLERANCE) -> bool:
    """True when the control phase differed by more than `tolerance` between the runs
    (or could not be measured): a speedup from such runs is mostly the machine's."""
    return not (1.0 - tolerance <= control_ratio <= 1.0 + tolerance)


def pair_figures(order: tuple[str, str], tlt: list[dict[str, Any]], baseline: list[dict[str, Any]]) -> dict:
    """One pair's figures from the step records of its TLT and baseline runs; `order`
    is the order the two ran in, e.g. ("baseline", "tlt")."""
    def mean(recs: list[dict[str, Any]], key: str) -> float:
        return mean_after_first([r[key] for r in recs])

    t_mean, b_mean = mean(tlt, "step_s"), mean(baseline, "step_s")
    t_rollout, b_rollout = mean(tlt, "rollout_s"), mean(baseline, "rollout_s")
    t_update, b_update = mean(tlt, "update_s"), mean(baseline, "update_s")
    # the control: the update's work, identical in both runs; with the pipelined update TLT
    # does part of it inside the rollout, so its work (not its phase) is what compares
    key = "update_work_s" if all("update_work_s" in r for r in tlt + baseline) else "update_s"
    t_work, b_work = mean(tlt, key), mean(baseline, key)
    return {"order": list(order), "tlt_mean_step_s": t_mean, "baseline_mean_step_s": b_mean,
            "speedup": ratio(b_mean, t_mean), "step_time_ratio": ratio(t_mean, b_mean),
            "rollout_speedup": ratio(b_rollout, t_rollout), "baseline_rollout_share": ratio(b_rollout, b_mean),
            "tlt_update_s": t_update, "baseline_update_s": b_update, "tlt_update_work_s": t_work,
            "baseline_update_work_s": b_work, "control_ratio": ratio(b_work, t_work)}


def summarize_pairs(pairs: list[dict[str, Any]], tolerance: float = CONTROL_TOLERANCE) -> dict[str, Any]:
    """Medians over pairs of the per-pair figures (``pair_figures``), the noisy flag and its note."""
    def med(key: str) -> float:
        return median_over_pairs([p[key] for p in pairs])

    control = med("control_ratio")
    noisy = control_is_noisy(control, tolerance)
    note = None
    if noisy:
        note = (f"the machine was too noisy for the speedup to mean much: the policy update's work, the same in "
                f"both runs, took {control:.2f}x as long in the baseline runs as in the TLT runs (median over "
                f"{len(pairs)} pair(s); outside [{1 - tolerance:.2f}, {1 + tolerance:.2f}])")
    return {"speedup": med("speedup"), "step_time_ratio": med("step_time_ratio"),
            "rollout_speedup": med("rollout_speedup"), "baseline_rollout_share": med("baseline_rollout_share"),
            # the phase split: update time left after the rollout, and the update's whole work
            "tlt_update_s": med("tlt_update_s"), "baseline_update_s": med("baseline_update_s"),
            "tlt_update_work_s": med("tlt_update_work_s"), "baseline_update_work_s": med("baseline_update_work_s"),
            "control_ratio": control, "noisy": noisy, "note": note}


def all_identical(values: list[Any]) -> bool:
    return all(v == values[0] for v in values[1:])


def run_block(summary: dict[str, Any]) -> dict[str, Any]:
    """A run's entry in report.json (see nemo_tlt.rl.loop.RLWorker.run for `summary`)."""
    recs = summary["records"]
    steps = [r["step_s"] for r in recs]
    return {"mode": summary["mode"], "step_times": steps, "mean_step_s_after_first": mean_after_first(steps),
            "wall_s": summary["wall_s"], "status": summary["status"], "out_dir": summary["out_dir"],
            "reward_mean": [r["reward_mean"] for r in recs],
            "rollout_s": [r["rollout_s"] for r in recs],
            "update_s": [r["update_s"] for r in recs],
            "mean_accept_len": [r["mean_accept_len"] for r in recs],
            "drafter_samples": [r["drafter_samples"] for r in recs],
            "drafter_train_s": [r["drafter_train_s"] for r in recs]}


def compare_pairs(pairs: list[tuple[tuple[str, str], dict[str, Any], dict[str, Any]]]) -> dict[str, Any]:
    """report.json figures from completed pairs of (order, TLT summary, baseline summary)."""
    per_pair = [pair_figures(order, t["records"], b["records"]) for order, t, b in pairs]
    runs = [s for _, t, b in pairs for s in (t, b)]
    return {
        **summarize_pairs(per_pair),
        "pairs": per_pair,
        "rewards_identical": all_identical([[r["rewards"] for r in s["records"]] for s in runs]),
        "rollouts_identical": all_identical([[r["rollout_digest"] for r in s["records"]] for s in runs]),
        # the policy each run ends with (records without the digest: None)
        "final_policy_identical": all_identical([s["records"][-1].get("policy_digest") if s["records"] else None
                                                 for s in runs]),
        "steps_compared": min(len(s["records"]) for s in runs) if runs else 0,
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
