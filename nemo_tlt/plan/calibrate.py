"""``calibrate(run_dir)``: fit this machine's step costs from a ``nemo-tlt train --compare-baseline``
run folder and predict that run's TLT and baseline phase times with the simulator.

Contract
--------
* Input: ``<run_dir>/report.json`` (its ``speedup`` is the measured one), ``config.yaml``
  (workers, prompts x group size, SD threshold and arms) and
  ``pair<k>/<tlt|baseline>/metrics.jsonl``. Step 0 of every run is left out of fits and
  predictions, as the report leaves it out of its means (it pays one-time warm-up).
* Cost model (``LinearCosts``, the interface of ``RolloutCosts``): a plain decode step
  costs ``a + b x running rows``, an SD step ``c + d x running rows`` (its rows advance
  by the accepted length), a rollout's prefill and dispatch ``p`` (one per mode). The
  context length is not a term: at the demo's few hundred tokens it is below the
  noise. Update costs ``u0 + u1 x response tokens`` (the same work in both modes, fitted
  on both); log-prob, weight sync, ``other`` and the gap between the slowest worker's
  generation and ``rollout_s`` are per-mode means.
* Workload: the metrics keep no per-sequence lengths, so each worker's rows are
  rebuilt from what they do keep: the step's longest response, the baseline's plain
  decode steps (the sum over workers of each worker's longest response; the rollouts
  are identical in both modes) and the token total. The longest response goes to one
  worker, the remaining plain steps are shared evenly as the other workers' longest,
  and the remaining tokens evenly over the other rows. With costs linear in the
  running rows only a worker's longest response and token sum matter, so this loses
  nothing the model uses. Each worker is simulated by ``simulate_replica`` (with SD
  at <= the config's ``threshold_on`` running rows, one arm whose accepted length is
  measured, epsilon 0); ``rollout_s`` is the slowest worker plus the fitted gap.
* No circularity: the records are split into folds: ``folds="pairs"`` (the default)
  one fold per pair, ``folds="steps"`` (and always with one pair) even and odd steps,
  which asks the cost model to carry over to steps of other response lengths. Every
  number predicted for a fold uses costs fitted only on the other folds, and the
  accepted length of a predicted TLT step is the other folds' mean at the same step
  index (their mean over all steps when no other fold has that step). Nothing measured
  in a fold, timings or accepted lengths, enters that fold's prediction except its
  response lengths.
* Output (``calibrate``): ``predicted_speedup`` (median over pairs of predicted baseline /
  TLT mean step time, the report's statistic), ``measured_speedup`` (the report's),
  ``phases`` ({"<mode>.<phase>": {predicted_s, measured_s}}, means over pairs of the
  per-run means after the first step), per-pair figures, the fitted costs of every
  fold and what each was fitted from, and whether the targets (speedup within 15 %,
  every phase within 25 %) are met.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from scipy.optimize import nnls

from nemo_tlt.plan.simulator import SimConfig, simulate_replica
from nemo_tlt.speculative.tree_shape import TreeShape

MODES = ("tlt", "baseline")
PHASES = ("rollout", "logprob", "update", "weight_sync", "other", "step")
SPEEDUP_TOLERANCE, PHASE_TOLERANCE = 0.15, 0.25
FITTED_FROM = {
    "baseline_decode": "a, b (s per plain decode step, + per running row) and p: least squares (non-negative) "
                       "of the other folds' baseline per-worker generation times (rollout_gen_s) on the "
                       "simulated workload",
    "tlt_sd": "c, d (s per SD step, + per running row) and p: the same over the other folds' TLT per-worker "
              "generation times, with those folds' measured accepted lengths",
    "accepted_length": "the other folds' mean_accept_len at the same step index",
    "update": "u0 + u1 x response tokens: least squares over the other folds' update_s of both modes",
    "fixed": "log-prob, weight sync, other and rollout_s minus the slowest worker's generation: the other "
             "folds' means per mode",
}


@dataclass(frozen=True)
class LinearCosts:
    """Per-forward seconds linear in the running rows (``RolloutCosts``' interface); ``tp`` is 1."""
    decode_s: float = 0.0
    decode_row_s: float = 0.0
    sd_s: float = 0.0
    sd_row_s: float = 0.0
    prefill_s: float = 0.0
    tp: int = 1

    def decode_step(self, rows: int, context_tokens: float) -> float:
        return self.decode_s + self.decode_row_s * rows

    def sd_step(self, rows: int, context_tokens: float, shape: TreeShape) -> float:
        return self.sd_s + self.sd_row_s * rows

    def prefill(self, rows: int, prompt_tokens: int) -> float:
        return self.prefill_s


@dataclass(frozen=True)
class RunLayout:
    """What the run's config fixes: rows per worker, the SD threshold and the deepest arm."""
    rows: tuple[int, ...]
    threshold: int
    shape: TreeShape


@dataclass(frozen=True)
class StepRecord:
    pair: int
    mode: str
    step: int
    fold: int
    lengths: tuple[tuple[int, ...], ...]   # per worker
    gen_s: tuple[float, ...]
    accept: float
    tokens: int
    phases: dict[str, float]


def read_layout(run_dir: Path) -> RunLayout:
    from nemo_tlt.config import load_config

    path = run_dir / "config.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: expected the resolved config of a `nemo-tlt train` run")
    cfg = load_config(path)
    workers, prompts, group = cfg.workers.num_workers, cfg.grpo.prompts_per_step, cfg.grpo.group_size
    # whole prompt groups per worker, p % workers == rank (as nemo_tlt.rl.run.shard_prompts)
    rows = tuple(len(range(r, prompts, workers)) * group for r in range(workers))
    sd = cfg.rollout
    if sd.sd_policy == "learned":  # it may speculate at any batch size up to its optional bound
        shapes, threshold = sd.learned.arms, sd.learned.max_sd_running or max(rows)
    else:
        shapes, threshold = sd.bandit.arms, sd.threshold.threshold_on
    return RunLayout(rows, threshold, max(shapes, key=lambda s: s.depth))


def worker_lengths(rows: tuple[int, ...], longest: int, plain_steps: int, tokens: int) -> tuple[tuple[int, ...], ...]:
    """Per-worker response lengths rebuilt from the step's longest response, the sum of the
    workers' longest (the baseline's plain steps) and the token total (module docstring)."""
    w = len(rows)
    others_max = [max(1, min(longest, round((plain_steps - longest) / (w - 1))))] * (w - 1) if w > 1 else []
    maxima = [longest, *others_max]
    rest_rows = sum(n - 1 for n in rows)
    rest = max(0, tokens - sum(maxima))
    out = []
    for n, top in zip(rows, maxima):
        share = rest * (n - 1) // rest_rows if rest_rows else 0
        q, r = divmod(share, n - 1) if n > 1 else (0, 0)
        body = [min(top, max(1, q + (1 if i < r else 0))) for i in range(n - 1)]
        out.append(tuple([top, *body]))
    return tuple(out)


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise FileNotFoundError(f"{path}: expected the step records of one run of the comparison")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def read_records(run_dir: Path, layout: RunLayout, by_pair: bool = True) -> tuple[list[StepRecord], int]:
    """Every step after the first of every run, and the number of pairs."""
    pairs = sorted(int(p.name[4:]) for p in run_dir.glob("pair*") if p.name[4:].isdigit())
    if not pairs:
        raise FileNotFoundError(f"{run_dir}: no pair<k>/ folders; expected a `--compare-baseline` run folder")
    out = []
    for k in pairs:
        runs = {m: _read_jsonl(run_dir / f"pair{k}" / m / "metrics.jsonl") for m in MODES}
        base_by_step = {r["step"]: r for r in runs["baseline"]}
        for mode, recs in runs.items():
            for r in recs[1:]:
                base = base_by_step[r["step"]]
                fold = k if by_pair and len(pairs) > 1 else r["step"] % 2
                phases = {p: float(r[f"{p}_s"]) for p in PHASES}
                out.append(StepRecord(k, mode, r["step"], fold,
                                      worker_lengths(layout.rows, base["resp_len_max"], base["plain_steps"],
                                                     base["tokens"]),
                                      tuple(float(x) for x in r["rollout_gen_s"]), float(r["mean_accept_len"]),
                                      int(r["tokens"]), phases))
    return out, len(pairs)


def _sim_config(layout: RunLayout, lengths: tuple[int, ...], mode: str, accept: float) -> SimConfig:
    acc = float(np.clip(accept, 1.0, layout.shape.depth + 1))
    return SimConfig(steps=1, sequences=len(lengths), replicas=1, prompt_len=0, sd=mode == "tlt",
                     drafter_training=False, threshold=layout.threshold, arms=((layout.shape, acc),), epsilon=0.0)


def worker_seconds(costs: LinearCosts, layout: RunLayout, lengths: tuple[int, ...], mode: str, accept: float) -> float:
    cfg = _sim_config(layout, lengths, mode, accept)
    seconds, _ = simulate_replica(np.asarray(lengths), 0, costs, cfg, 1.0, np.random.default_rng(0))
    return seconds


# the per-step basis costs; the prefill column is 1 (one prefill per rollout)
_BASIS = {"baseline": (LinearCosts(decode_s=1.0), LinearCosts(decode_row_s=1.0)),
          "tlt": (LinearCosts(sd_s=1.0), LinearCosts(sd_row_s=1.0))}


def fit_rollout(records: list[StepRecord], layout: RunLayout, mode: str, accept: dict[int, float]) -> LinearCosts:
    """Non-negative least squares of per-worker generation seconds on the simulated workload:
    worker seconds are linear in the cost parameters, so each basis cost gives one column.
    Workers are matched by rank order of predicted and measured time (the records do not
    say which worker held the longest response)."""
    rows, target = [], []
    for rec in (r for r in records if r.mode == mode):
        acc = accept.get(rec.step, rec.accept)
        cols = np.array([[*(worker_seconds(b, layout, ls, mode, acc) for b in _BASIS[mode]), 1.0]
                         for ls in rec.lengths])
        order = np.argsort(cols[:, 0] + cols[:, 1])
        rows.extend(cols[order])
        target.extend(sorted(rec.gen_s))
    x, _ = nnls(np.asarray(rows), np.asarray(target))
    if mode == "baseline":
        return LinearCosts(decode_s=x[0], decode_row_s=x[1], prefill_s=x[2])
    return LinearCosts(sd_s=x[0], sd_row_s=x[1], prefill_s=x[2])


@dataclass(frozen=True)
class FoldFit:
    rollout: dict[str, LinearCosts]
    update: tuple[float, float]
    fixed: dict[str, dict[str, float]]    # mode -> {logprob, weight_sync, other, rollout_gap}
    accept: dict[int, float]              # step -> accepted length
    accept_mean: float

    def to_dict(self) -> dict[str, Any]:
        b, t = self.rollout["baseline"], self.rollout["tlt"]
        return {"decode_step_s": b.decode_s, "decode_per_row_s": b.decode_row_s, "baseline_prefill_s": b.prefill_s,
                "sd_step_s": t.sd_s, "sd_per_row_s": t.sd_row_s, "tlt_prefill_s": t.prefill_s,
                "update_s": self.update[0], "update_per_token_s": self.update[1],
                "accepted_length_by_step": {str(k): v for k, v in sorted(self.accept.items())},
                "fixed_s": self.fixed}


def fit_fold(train: list[StepRecord], layout: RunLayout) -> FoldFit:
    tlt = [r for r in train if r.mode == "tlt"]
    by_step: dict[int, list[float]] = {}
    for r in tlt:
        by_step.setdefault(r.step, []).append(r.accept)
    accept = {s: float(np.mean(v)) for s, v in by_step.items()}
    rollout = {m: fit_rollout(train, layout, m, accept) for m in MODES}
    design = np.array([[1.0, r.tokens] for r in train])
    u, _ = nnls(design, np.array([r.phases["update"] for r in train]))
    fixed = {}
    for m in MODES:
        recs = [r for r in train if r.mode == m]
        fixed[m] = {p: float(np.mean([r.phases[p] for r in recs])) for p in ("logprob", "weight_sync", "other")}
        fixed[m]["rollout_gap"] = float(np.mean([r.phases["rollout"] - max(r.gen_s) for r in recs]))
    return FoldFit(rollout, (float(u[0]), float(u[1])), fixed, accept, float(np.mean([r.accept for r in tlt])))


def predict(rec: StepRecord, fit: FoldFit, layout: RunLayout) -> dict[str, float]:
    """Predicted phase seconds of one step record from costs fitted on other folds."""
    acc = fit.accept.get(rec.step, fit.accept_mean)
    gen = max(worker_seconds(fit.rollout[rec.mode], layout, ls, rec.mode, acc) for ls in rec.lengths)
    fx = fit.fixed[rec.mode]
    out = {"rollout": gen + fx["rollout_gap"], "logprob": fx["logprob"],
           "update": fit.update[0] + fit.update[1] * rec.tokens,
           "weight_sync": fx["weight_sync"], "other": fx["other"]}
    out["step"] = sum(out.values())
    return out


def _close(pred: float, meas: float, tol: float) -> bool:
    return abs(pred - meas) <= tol * abs(meas)


def calibrate(run_dir: str | Path, folds: str = "pairs") -> dict[str, Any]:
    """The calibration JSON of a `--compare-baseline` run folder (module docstring)."""
    if folds not in ("pairs", "steps"):
        raise ValueError(f"folds must be 'pairs' or 'steps', got {folds!r}")
    run_dir = Path(run_dir)
    report_path = run_dir / "report.json"
    if not report_path.is_file():
        raise FileNotFoundError(f"{report_path}: expected the report of a `nemo-tlt train --compare-baseline` run")
    report = json.loads(report_path.read_text())
    if "speedup" not in report:
        raise ValueError(f"{report_path}: no 'speedup'; is this a `--compare-baseline` run?")
    layout = read_layout(run_dir)
    records, n_pairs = read_records(run_dir, layout, by_pair=folds == "pairs")
    fold_ids = sorted({r.fold for r in records})
    if len(fold_ids) < 2:
        raise ValueError(f"{run_dir}: calibration needs two folds (two pairs, or one pair of >= 3 steps)")
    fits, pred = {}, {}
    for f in fold_ids:
        fits[f] = fit_fold([r for r in records if r.fold != f], layout)
        for r in records:
            if r.fold == f:
                pred[id(r)] = predict(r, fits[f], layout)
    return _summarize(records, pred, fits, report, n_pairs > 1 and folds == "pairs", layout)


def _summarize(records, pred, fits, report, by_pair, layout) -> dict[str, Any]:
    pairs = sorted({r.pair for r in records})
    per_run: dict[tuple[int, str], dict[str, tuple[float, float]]] = {}
    for k in pairs:
        for m in MODES:
            recs = [r for r in records if r.pair == k and r.mode == m]
            per_run[k, m] = {p: (float(np.mean([pred[id(r)][p] for r in recs])),
                                 float(np.mean([r.phases[p] for r in recs]))) for p in PHASES}
    per_pair = [{"pair": k,
                 "predicted_speedup": per_run[k, "baseline"]["step"][0] / per_run[k, "tlt"]["step"][0],
                 "measured_speedup": per_run[k, "baseline"]["step"][1] / per_run[k, "tlt"]["step"][1],
                 **{f"{m}.step": {"predicted_s": per_run[k, m]["step"][0], "measured_s": per_run[k, m]["step"][1]}
                    for m in MODES}}
                for k in pairs]
    phases = {f"{m}.{p}": {"predicted_s": float(np.mean([per_run[k, m][p][0] for k in pairs])),
                           "measured_s": float(np.mean([per_run[k, m][p][1] for k in pairs]))}
              for m in MODES for p in PHASES}
    predicted = float(np.median([p["predicted_speedup"] for p in per_pair]))
    measured = float(report["speedup"])
    # phases under a millisecond are timer noise on this scale; the target is for the ones that cost time
    judged = {k: v for k, v in phases.items() if v["measured_s"] >= 1e-3}
    return {
        "predicted_speedup": predicted, "measured_speedup": measured,
        "phases": phases, "pairs": per_pair,
        "targets": {"speedup_within": SPEEDUP_TOLERANCE, "phase_within": PHASE_TOLERANCE,
                    "speedup_met": _close(predicted, measured, SPEEDUP_TOLERANCE),
                    "phases_met": {k: _close(v["predicted_s"], v["measured_s"], PHASE_TOLERANCE)
                                   for k, v in judged.items()},
                    "phases_not_judged": sorted(set(phases) - set(judged))},
        "method": {"folds": "one per pair (leave one pair out)" if by_pair else "even / odd steps",
                   "steps": "every step after the first", "fitted_from": FITTED_FROM,
                   "workers": len(layout.rows), "rows_per_worker": list(layout.rows),
                   "sd_threshold": layout.threshold, "arm": str(layout.shape)},
        "fits": {str(f): fit.to_dict() for f, fit in sorted(fits.items())},
    }
