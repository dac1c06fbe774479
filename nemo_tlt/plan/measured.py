"""Measured plan inputs: response lengths, accepted lengths per arm and calibrated costs,
read from a `nemo-tlt train` run folder or a `nemo-tlt bench rollout` JSON.

Contract
--------
* ``read_measured(path)`` reads one source: a run folder (its ``metrics.jsonl``, or every
  ``pair<k>/<mode>/metrics.jsonl`` of a ``--compare-baseline`` folder) or a bench JSON
  (``nemo-tlt bench rollout``, default or ``--workload longtail``). It returns what the
  source holds, each value with where it came from:
  - response lengths: a run's per-sequence ``resp_lens`` (baseline runs of a comparison
    only, as both modes roll out the same sequences), a long-tail bench's
    ``response_lengths.samples``;
  - accepted length per tree shape (tokens per row per verify step, token-weighted): a
    run's ``accept_by_arm`` summed over its TLT steps; a long-tail bench's fixed arms
    (``longtail_fixed_<arm>``); a default bench's ``sd_coupled`` at its ``--shape``
    (sampled, as RL rollouts are);
  - the drafter's fixed per-pass overhead relative to a target forward's
    (``draft_overhead_ratio``): from ``nemo_tlt.plan.calibrate`` on a ``--compare-baseline``
    folder, (c / a - 1) / depth, c and a the fitted fixed seconds of an SD and a plain step
    and depth that of the run's deepest arm, averaged over folds. It is the one fitted
    quantity that is a ratio of like to like (host and launch work of the same engine
    code per pass); the per-row costs are a CPU's compute and do not transfer to a GPU's
    roofline.
* ``resolve_inputs(plan, sources)`` builds the simulator's inputs: each measured value
  replaces the assumed one (the first source that holds it wins), and ``provenance`` says,
  input by input, ``measured`` (and from where) or ``assumed``.
* Lengths are rescaled: a small model's lengths do not carry over to a 32B reasoning model
  in tokens, their shape does. With ``measured.length_scaling: median`` (the default) every
  sample is multiplied by ``lengths.median`` / the samples' median (the ratios of the tail
  to the median are kept), then clipped to ``batch.max_response_len``; ``none`` uses them
  as measured. A run's lengths are themselves clipped at its ``max_new_tokens``, so the
  far tail is cut where the run cut it.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from nemo_tlt.plan.config import PlanConfig
from nemo_tlt.plan.simulator import LengthModel


@dataclass
class Measured:
    """What one source holds (None / empty: nothing of that kind)."""

    source: str
    lengths: tuple[int, ...] = ()
    accepted: dict[str, float] = field(default_factory=dict)
    draft_overhead_ratio: float | None = None
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class PlanInputs:
    """The simulator's inputs after measurements replaced assumptions."""

    lengths: LengthModel
    accepted: tuple[float, ...]        # per plan arm, in the order of ``sd.arms``
    draft_overhead_ms: float
    provenance: dict[str, Any]
    # the measured response lengths as read (before rescaling and clipping; empty: assumed
    # lengths), so that a variant of the plan (``nemo_tlt.plan.sensitivity``) rescales the
    # measured shape, not the clipped one
    measured_lengths: tuple[int, ...] = ()


def _jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _add_arms(total: dict[str, list[int]], recs: list[dict[str, Any]]) -> None:
    for r in recs:
        for arm, (tokens, rows) in r.get("accept_by_arm", {}).items():
            acc = total.setdefault(arm, [0, 0])
            acc[0] += tokens
            acc[1] += rows


def read_run_dir(path: Path) -> Measured:
    out = Measured(source=str(path))
    compare = sorted(path.glob("pair*/*/metrics.jsonl"))
    files = compare or ([path / "metrics.jsonl"] if (path / "metrics.jsonl").is_file() else [])
    if not files:
        raise FileNotFoundError(f"{path}: no metrics.jsonl (nor pair<k>/<mode>/metrics.jsonl); expected a "
                                "`nemo-tlt train` run folder")
    lengths: list[int] = []
    arms: dict[str, list[int]] = {}
    for f in files:
        recs = [r for r in _jsonl(f) if "step" in r and r.get("split") != "validation"]
        mode = recs[0]["mode"] if recs else ""
        if mode != "tlt" or not compare:  # a comparison's TLT runs repeat its baseline's sequences
            lengths += [n for r in recs for n in r.get("resp_lens", [])]
        if mode == "tlt":
            _add_arms(arms, recs)
    out.lengths = tuple(lengths)
    if not lengths:
        out.notes.append("its records keep no resp_lens (written before step records kept them)")
    out.accepted = {a: t / n for a, (t, n) in sorted(arms.items()) if n}
    if not out.accepted:
        out.notes.append("its records keep no accept_by_arm of a TLT run")
    if compare and (path / "report.json").is_file():
        out.draft_overhead_ratio = _calibrated_ratio(path)
    return out


def _calibrated_ratio(path: Path) -> float:
    from nemo_tlt.plan.calibrate import calibrate
    from nemo_tlt.speculative.tree_shape import TreeShape

    result = calibrate(path, "steps")
    depth = TreeShape.parse(result["method"]["arm"]).depth
    ratios = [(f["sd_step_s"] / f["decode_step_s"] - 1.0) / depth for f in result["fits"].values()
              if f["decode_step_s"] > 0]
    if not ratios:
        raise ValueError(f"{path}: the calibration fitted no fixed plain-step cost; no drafter overhead ratio")
    return max(0.0, float(np.mean(ratios)))


def read_bench_json(path: Path) -> Measured:
    data = json.loads(path.read_text())
    if data.get("benchmark") != "rollout":
        raise ValueError(f"{path}: not a `nemo-tlt bench rollout` JSON (benchmark={data.get('benchmark')!r})")
    out = Measured(source=str(path))
    results = data["results"]
    if data.get("workload") == "longtail":
        prefix = "longtail_fixed_"
        out.accepted = {k[len(prefix):]: float(v["mean_accept_len"]) for k, v in results.items()
                        if k.startswith(prefix)}
        out.lengths = tuple(int(n) for n in data["response_lengths"].get("samples", []))
        if not out.lengths:
            out.notes.append("its response_lengths keep no samples (written before the bench kept them)")
    else:
        out.accepted = {data["config"]["shape"]: float(results["sd_coupled"]["mean_accept_len"])}
        out.notes.append("a default-workload bench (batch 1, short answers): no response lengths")
    return out


def read_measured(path: str | Path) -> Measured:
    p = Path(path)
    if p.is_dir():
        return read_run_dir(p)
    if p.is_file():
        return read_bench_json(p)
    raise FileNotFoundError(f"{p}: neither a run folder nor a bench JSON")


def scale_lengths(samples: Sequence[int], median: float, max_len: int, stretch: float = 1.0) -> tuple[int, ...]:
    """Samples with their median moved to ``median``; ``stretch`` raises every ratio to the
    median to that power (1: the measured shape; for lognormal lengths it scales sigma)."""
    x = np.asarray(samples, dtype=np.float64)
    med = float(np.median(x))
    scaled = median * (x / med) ** stretch
    return tuple(int(n) for n in np.clip(np.rint(scaled), 1, max_len))


def length_summary(samples: Sequence[int]) -> dict[str, float]:
    x = np.asarray(samples, dtype=np.float64)
    med = float(np.median(x))
    return {"n": int(x.size), "median": med, "p90_over_median": float(np.percentile(x, 90)) / med,
            "max_over_median": float(x.max()) / med, "log_sigma": float(np.std(np.log(x)))}


def resolve_inputs(plan: PlanConfig, sources: Sequence[Measured]) -> PlanInputs:
    """The plan's inputs with each measured value in place of the assumed one (module docstring)."""
    b = plan.batch
    prov: dict[str, Any] = {}
    lengths = LengthModel(plan.lengths.median, plan.lengths.sigma, b.max_response_len)
    prov["lengths"] = {"source": "assumed", "median": plan.lengths.median, "sigma": plan.lengths.sigma,
                       "distribution": "lognormal, clipped to batch.max_response_len"}
    with_lengths = next((m for m in sources if m.lengths), None)
    if with_lengths is not None:
        scaling = plan.measured.length_scaling
        samples = (scale_lengths(with_lengths.lengths, plan.lengths.median, b.max_response_len)
                   if scaling == "median" else tuple(min(n, b.max_response_len) for n in with_lengths.lengths))
        lengths = replace(lengths, samples=samples)
        prov["lengths"] = {"source": "measured", "from": with_lengths.source,
                           "measured": length_summary(with_lengths.lengths),
                           "scaling": ("median set to lengths.median, ratios to the median kept"
                                       if scaling == "median" else "none (as measured)"),
                           "used": length_summary(samples)}
    accepted, arms_prov = [], {}
    for arm, assumed in zip(plan.sd.arms, plan.sd.accepted):
        src = next((m for m in sources if arm in m.accepted), None)
        if src is None:
            accepted.append(assumed)
            arms_prov[arm] = {"source": "assumed", "value": assumed}
        else:
            shape_max = int(arm.split("_")[0]) + 1
            value = float(min(max(src.accepted[arm], 1.0), shape_max))
            accepted.append(value)
            arms_prov[arm] = {"source": "measured", "from": src.source, "value": value}
    prov["sd.accepted"] = arms_prov
    unused = sorted({a for m in sources for a in m.accepted} - set(plan.sd.arms))
    if unused:
        prov["sd.accepted_not_used"] = {"arms": unused, "why": "not among sd.arms (matched by exact name)"}
    draft_ms = plan.cluster.draft_overhead_ms
    prov["cluster.draft_overhead_ms"] = {"source": "assumed", "value": draft_ms}
    with_ratio = next((m for m in sources if m.draft_overhead_ratio is not None), None)
    if with_ratio is not None:
        draft_ms = with_ratio.draft_overhead_ratio * plan.cluster.forward_overhead_ms
        prov["cluster.draft_overhead_ms"] = {
            "source": "calibrated", "from": with_ratio.source, "value": draft_ms,
            "draft_overhead_ratio": with_ratio.draft_overhead_ratio,
            "how": "(fitted fixed s of an SD step / of a plain step - 1) / depth of the run's deepest arm, "
                   "times cluster.forward_overhead_ms"}
    notes = {m.source: m.notes for m in sources if m.notes}
    if notes:
        prov["notes"] = notes
    if not math.isfinite(draft_ms):
        raise ValueError(f"calibrated drafter overhead is not finite: {draft_ms}")
    return PlanInputs(lengths, tuple(accepted), draft_ms, prov,
                      with_lengths.lengths if with_lengths is not None else ())
