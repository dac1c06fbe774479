"""``calibrate(run_dir)``: fit this machine's step costs from a ``nemo-tlt train --compare-baseline``
run folder and predict that run's TLT and baseline phase times with the simulator.

Contract
--------
* Input: ``<run_dir>/report.json`` (its ``speedup`` is the measured one), ``config.yaml``
  (workers, prompts x group size, SD threshold and arms, ``policy.pipelined_update``) and
  ``pair<k>/<tlt|baseline>/metrics.jsonl``. Step 0 of every run is left out of fits and
  predictions, as the report leaves it out of its means (it pays one-time warm-up).
* Cost model (``LinearCosts``, the interface of ``RolloutCosts``): a plain decode step
  costs ``a + b x running rows``, an SD step ``c + d x running rows`` (its rows advance
  by the accepted length), a rollout's prefill and dispatch ``p`` (one per mode). The
  context length is not a term: at the demo's few hundred tokens it is below the
  noise. A rank's update work costs ``u0 + u1 x its tokens``, fitted on ``update_work_s``
  (each rank's seconds of log-probs, gradients and step, averaged over ranks: the same
  work in both modes, wherever it ran) on a rank's mean tokens. After the rollout the
  update phase lasts as long as the rank with the most tokens takes (its gradients are
  awaited), less the log-prob phase (timed apart). With ``policy.pipelined_update``
  TLT's update phase keeps only the combining and the optimizer step (its mean over the
  other folds), and the rest of the work runs in its rollout's tail (the baseline's never
  does): each group's share of it (by tokens) can run on the workers whose decoding has
  ended once its last row finished, and what is left when the slowest worker ends runs
  on all of them inside the rollout phase. Records from
  before ``update_work_s`` fit ``u0 + u1 x the step's tokens`` on the update phase of
  both modes, as before. Log-prob, weight sync, ``other`` and the gap between the
  slowest worker's generation and ``rollout_s`` (less that tail) are per-mode means.
* Workload: each worker's rows, group by group, come from the baseline record's
  per-sequence ``resp_lens`` (sequence p x group + g; prompt p on worker p % workers).
  Records written before they were kept are rebuilt from what they do keep: the step's
  longest response, the baseline's plain
  decode steps (the sum over workers of each worker's longest response; the rollouts
  are identical in both modes) and the token total. The longest response goes to one
  worker, the remaining plain steps are shared evenly as the other workers' longest,
  and the remaining tokens evenly over the other rows. With costs linear in the
  running rows only a worker's longest response and token sum matter, so this loses
  nothing the rollout model uses. Each worker is simulated by ``simulate_replica`` (with SD
  at <= the config's ``threshold_on`` running rows, one arm whose accepted length is
  measured, epsilon 0); ``rollout_s`` is the slowest worker plus the fitted gap (plus, for
  a pipelined TLT, the update work left after it). Rollout tensor parallelism (several
  ranks per replica) is refused: rows and generation times are taken per worker.
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

from nemo_tlt.plan.simulator import SimConfig, finish_times, group_work, pipelined_overlap, simulate_replica
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
    "update": "u0 + u1 x a rank's response tokens: least squares (non-negative) over the other folds' "
              "update_work_s of both modes (records without it: x the step's tokens, on update_s)",
    "fixed": "log-prob, weight sync, other and rollout_s minus the slowest worker's generation (and minus "
             "the update work left after it, pipelined): the other folds' means per mode; a pipelined TLT's "
             "update phase (combining and the optimizer step): the other folds' mean",
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
    """What the run's config fixes: rows per worker, the SD threshold and the deepest arm,
    the GRPO group size and whether TLT's update was pipelined into its rollout."""
    rows: tuple[int, ...]
    threshold: int
    shape: TreeShape
    group: int = 1
    pipelined: bool = False


@dataclass(frozen=True)
class StepRecord:
    pair: int
    mode: str
    step: int
    fold: int
    lengths: tuple[tuple[int, ...], ...]   # per worker (from resp_lens: whole groups, in order)
    gen_s: tuple[float, ...]
    accept: float
    tokens: int
    phases: dict[str, float]
    update_work: float | None = None       # update_work_s: the update's seconds of work per rank

    def rank_tokens(self) -> list[int]:
        return [sum(ls) for ls in self.lengths]


def read_layout(run_dir: Path) -> RunLayout:
    from nemo_tlt.config import load_config

    path = run_dir / "config.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: expected the resolved config of a `nemo-tlt train` run")
    cfg = load_config(path)
    if cfg.rollout.tensor_parallel != 1:
        raise ValueError(f"{path}: rollout.tensor_parallel={cfg.rollout.tensor_parallel}; calibration models one "
                         f"rollout replica per worker (rollout.tensor_parallel=1): its rows and generation times "
                         f"are per worker")
    workers, prompts, group = cfg.workers.num_workers, cfg.grpo.prompts_per_step, cfg.grpo.group_size
    # whole prompt groups per worker, p % workers == rank (as nemo_tlt.rl.run.shard_prompts)
    rows = tuple(len(range(r, prompts, workers)) * group for r in range(workers))
    sd = cfg.rollout
    # the learned policy may speculate at any batch size up to its optional bound
    threshold = ((sd.learned.max_sd_running or max(rows)) if sd.sd_policy == "learned"
                 else sd.threshold.threshold_on)
    return RunLayout(rows, threshold, max(sd.arms, key=lambda s: s.depth), group, bool(cfg.policy.pipelined_update))


def lengths_by_worker(rows: tuple[int, ...], group: int, resp_lens: list[int]) -> tuple[tuple[int, ...], ...]:
    """Each worker's response lengths, group by group, from a record's per-sequence
    ``resp_lens`` (sequence id p x group + g; prompt p on worker p % workers, as
    ``nemo_tlt.rl.rollout_replicas`` shards them). ValueError if they are not the layout's."""
    workers, prompts = len(rows), sum(rows) // group
    if not (isinstance(resp_lens, list) and len(resp_lens) == prompts * group
            and all(isinstance(n, int) and n >= 0 for n in resp_lens)):
        raise ValueError(f"resp_lens must hold {prompts} x {group} lengths >= 0 (config.yaml's "
                         f"grpo.prompts_per_step x grpo.group_size), got {resp_lens!r:.200}")
    return tuple(tuple(resp_lens[p * group + g] for p in range(w, prompts, workers) for g in range(group))
                 for w in range(workers))


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
        paths = {m: run_dir / f"pair{k}" / m / "metrics.jsonl" for m in MODES}
        runs = {m: _read_jsonl(path) for m, path in paths.items()}
        # the workload of each step, from the baseline's record (the rollouts are identical)
        lengths = {r.get("step"): _checked(paths["baseline"], r, _lengths, layout) for r in runs["baseline"][1:]}
        for mode, recs in runs.items():
            for r in recs[1:]:
                out.append(_checked(paths[mode], r, _record, k, mode, lengths, by_pair and len(pairs) > 1))
    return out, len(pairs)


def _checked(path: Path, r: dict[str, Any], read, *args):
    """``read(r, *args)``, its errors reworded to name the file, the step and the field."""
    try:
        return read(r, *args)
    except (KeyError, TypeError, ValueError) as e:
        what = f"no field {e}" if isinstance(e, KeyError) else str(e)
        raise ValueError(f"{path} step {r.get('step')!r}: {what} (expected the records of "
                         f"`nemo-tlt train --compare-baseline`)") from None


def _lengths(base: dict[str, Any], layout: RunLayout) -> tuple[tuple[int, ...], ...]:
    if "resp_lens" in base:
        return lengths_by_worker(layout.rows, layout.group, base["resp_lens"])
    return worker_lengths(layout.rows, base["resp_len_max"], base["plain_steps"], base["tokens"])


def _record(r: dict[str, Any], pair: int, mode: str, lengths: dict, by_pair: bool) -> StepRecord:
    if r["step"] not in lengths:
        raise ValueError("the baseline run of this pair has no record of this step")
    work = r.get("update_work_s")
    return StepRecord(pair, mode, r["step"], pair if by_pair else r["step"] % 2, lengths[r["step"]],
                      tuple(float(x) for x in r["rollout_gen_s"]), float(r["mean_accept_len"]), int(r["tokens"]),
                      {p: float(r[f"{p}_s"]) for p in PHASES}, None if work is None else float(work))


def _sim_config(layout: RunLayout, lengths: tuple[int, ...], mode: str, accept: float) -> SimConfig:
    acc = float(np.clip(accept, 1.0, layout.shape.depth + 1))
    return SimConfig(steps=1, sequences=len(lengths), replicas=1, prompt_len=0, sd=mode == "tlt",
                     drafter_training=False, threshold=layout.threshold, arms=((layout.shape, acc),), epsilon=0.0)


def worker_seconds(costs: LinearCosts, layout: RunLayout, lengths: tuple[int, ...], mode: str, accept: float) -> float:
    cfg = _sim_config(layout, lengths, mode, accept)
    return simulate_replica(np.asarray(lengths), 0, costs, cfg, 1.0, np.random.default_rng(0))[0]


def worker_run(costs: LinearCosts, layout: RunLayout, lengths: tuple[int, ...], mode: str,
               accept: float) -> tuple[float, np.ndarray]:
    """(seconds, when each row finished, in the order of ``lengths``) of one worker's rollout."""
    cfg = _sim_config(layout, lengths, mode, accept)
    rows = np.asarray(lengths)
    seconds, trace = simulate_replica(rows, 0, costs, cfg, 1.0, np.random.default_rng(0))
    return seconds, finish_times(rows, trace)


def pipelined_tail(runs: list[tuple[float, np.ndarray]], lengths: tuple[tuple[int, ...], ...], group: int,
                   work_s: float) -> float:
    """Seconds of the update's work (``work_s`` per rank, spread over the ranks) left when the
    slowest worker's rollout ends, if each group's share (by its tokens) can run on the
    workers already done once its last row finished (the simulator's ``pipelined_overlap``)."""
    groups = group_work([np.asarray(ls) for ls in lengths], [done for _, done in runs], group, work_s)
    return work_s - pipelined_overlap(groups, [s for s, _ in runs], work_s)


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
    fixed: dict[str, dict[str, float]]    # mode -> {logprob, weight_sync, other, rollout_gap[, update]}
    accept: dict[int, float]              # step -> accepted length
    accept_mean: float
    per_rank: bool = False                # update = u0 + u1 x a rank's tokens (from update_work_s), else x the step's

    def to_dict(self) -> dict[str, Any]:
        b, t = self.rollout["baseline"], self.rollout["tlt"]
        return {"decode_step_s": b.decode_s, "decode_per_row_s": b.decode_row_s, "baseline_prefill_s": b.prefill_s,
                "sd_step_s": t.sd_s, "sd_per_row_s": t.sd_row_s, "tlt_prefill_s": t.prefill_s,
                "update_s": self.update[0], "update_per_token_s": self.update[1],
                "update_tokens": "of a rank" if self.per_rank else "of the step",
                "accepted_length_by_step": {str(k): v for k, v in sorted(self.accept.items())},
                "fixed_s": self.fixed}


def fit_update(train: list[StepRecord]) -> tuple[tuple[float, float], bool]:
    """(u0, u1) and whether u1 is per token of a rank: least squares (non-negative) of
    ``update_work_s`` (each rank's seconds of update work, averaged over ranks; the same
    work in both modes, wherever it ran) on a rank's mean tokens when every record has it,
    else of the update phase's seconds on the step's tokens (records from before it)."""
    if all(r.update_work is not None for r in train):
        design = np.array([[1.0, float(np.mean(r.rank_tokens()))] for r in train])
        u, _ = nnls(design, np.array([r.update_work for r in train]))
        return (float(u[0]), float(u[1])), True
    u, _ = nnls(np.array([[1.0, r.tokens] for r in train]), np.array([r.phases["update"] for r in train]))
    return (float(u[0]), float(u[1])), False


def _piped(layout: RunLayout, mode: str, per_rank: bool) -> bool:
    """TLT's update ran in its rollout's tail (the baseline's never does) and its work is known."""
    return layout.pipelined and mode == "tlt" and per_rank


def _tail(rec: StepRecord, runs: list[tuple[float, np.ndarray]], layout: RunLayout, update: tuple[float, float],
          after_s: float) -> float:
    """The pipelined update's work left after the slowest worker: a rank's work less what
    runs after the meet in any case (``after_s``: combining the groups, the optimizer step)."""
    work = update[0] + update[1] * float(np.mean(rec.rank_tokens()))
    return pipelined_tail(runs, rec.lengths, layout.group, max(0.0, work - after_s))


def _runs(rec: StepRecord, costs: LinearCosts, layout: RunLayout, accept: float) -> list[tuple[float, np.ndarray]]:
    return [worker_run(costs, layout, ls, rec.mode, accept) for ls in rec.lengths]


def fit_fold(train: list[StepRecord], layout: RunLayout) -> FoldFit:
    tlt = [r for r in train if r.mode == "tlt"]
    by_step: dict[int, list[float]] = {}
    for r in tlt:
        by_step.setdefault(r.step, []).append(r.accept)
    accept = {s: float(np.mean(v)) for s, v in by_step.items()}
    rollout = {m: fit_rollout(train, layout, m, accept) for m in MODES}
    update, per_rank = fit_update(train)
    fixed = {}
    for m in MODES:
        recs = [r for r in train if r.mode == m]
        fixed[m] = {p: float(np.mean([r.phases[p] for r in recs])) for p in ("logprob", "weight_sync", "other")}
        tails = [0.0] * len(recs)
        if _piped(layout, m, per_rank):  # what is left for the update phase: combining the groups, the step
            fixed[m]["update"] = float(np.mean([r.phases["update"] for r in recs]))
            # a pipelined rollout phase also holds the update work left after the slowest worker's decode
            tails = [_tail(r, _runs(r, rollout[m], layout, accept.get(r.step, r.accept)), layout, update,
                           fixed[m]["update"]) for r in recs]
        fixed[m]["rollout_gap"] = float(np.mean([r.phases["rollout"] - max(r.gen_s) - t for r, t in zip(recs, tails)]))
    return FoldFit(rollout, update, fixed, accept, float(np.mean([r.accept for r in tlt])), per_rank)


def predict(rec: StepRecord, fit: FoldFit, layout: RunLayout) -> dict[str, float]:
    """Predicted phase seconds of one step record from costs fitted on other folds."""
    acc = fit.accept.get(rec.step, fit.accept_mean)
    runs = _runs(rec, fit.rollout[rec.mode], layout, acc)
    gen = max(s for s, _ in runs)
    fx = fit.fixed[rec.mode]
    u0, u1 = fit.update
    if _piped(layout, rec.mode, fit.per_rank):
        tail, update = _tail(rec, runs, layout, fit.update, fx["update"]), fx["update"]
    elif fit.per_rank:  # after the rollout, as long as the rank with the most tokens takes (its gradients
        # are awaited); its log-probs are a phase of their own, so they leave the update phase
        tail, update = 0.0, max(0.0, u0 + u1 * max(rec.rank_tokens()) - fx["logprob"])
    else:
        tail, update = 0.0, u0 + u1 * rec.tokens
    out = {"rollout": gen + fx["rollout_gap"] + tail, "logprob": fx["logprob"], "update": update,
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
