"""``sensitivity(plan)``: the predicted speedup with each assumption at both ends of a stated
range, one at a time (``nemo-tlt plan CONFIG --sensitivity [--markdown]``).

Contract: every row of ``RANGES`` changes one input of the plan's simulation (after
measured inputs, if any, replaced the assumed ones) and leaves the rest as planned; the
plan's memory and reshard are not recomputed (weight sync seconds depend on none of the
inputs varied). Each end reports the speedup without and with the pipelined update (the
update's share of idle capacity chosen as in the plan). With measured lengths both length
rows start from the samples as measured (``PlanInputs.measured_lengths``, before the plan
rescaled and clipped them, so a tail clipped at the planned median keeps its ratio where
it fits): ``lengths.median`` moves their median, ``lengths.sigma`` stretches their shape
(every ratio to the median raised to the power sigma / the measured samples' log-sigma),
and the planned value shown is the planned samples' median and the measured log-sigma.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from nemo_tlt.model.hf_io import read_config
from nemo_tlt.plan.build import plan_inputs, plan_shapes, sim_parts, simulate_both
from nemo_tlt.plan.config import PlanConfig
from nemo_tlt.plan.measured import PlanInputs, length_summary, scale_lengths
from nemo_tlt.plan.memory import training_memory
from nemo_tlt.plan.reshard_plan import plan_stream_reshard
from nemo_tlt.weights.layout import ParallelLayout

Variant = Callable[[PlanConfig, PlanInputs, float], tuple[PlanConfig, PlanInputs]]


def _accepted(plan: PlanConfig, inputs: PlanInputs, factor: float):
    acc = tuple(float(np.clip(a * factor, 1.0, s.depth + 1)) for a, s in zip(inputs.accepted, plan.sd.shapes))
    return plan, replace(inputs, accepted=acc)


def _sd(name: str) -> Variant:
    return lambda plan, inputs, v: (replace(plan, sd=replace(plan.sd, **{name: v})), inputs)


def _cluster(name: str) -> Variant:
    def apply(plan, inputs, v):
        plan = replace(plan, cluster=replace(plan.cluster, **{name: v}))
        if name == "draft_overhead_ms":
            inputs = replace(inputs, draft_overhead_ms=v)
        return plan, inputs
    return apply


def _median(plan: PlanConfig, inputs: PlanInputs, v: float):
    model = inputs.lengths
    if inputs.measured_lengths:  # from the lengths as measured: what the plan clipped may fit now
        model = replace(model, samples=scale_lengths(inputs.measured_lengths, v, model.max_len))
    return plan, replace(inputs, lengths=replace(model, median=v))


def _measured_median(plan: PlanConfig, inputs: PlanInputs) -> float:
    """The median the plan's samples were given (``measured.length_scaling``)."""
    if plan.measured.length_scaling == "median":
        return float(plan.lengths.median)
    return float(np.median(inputs.measured_lengths))


def _sigma(plan: PlanConfig, inputs: PlanInputs, v: float):
    model = inputs.lengths
    if inputs.measured_lengths:
        log_sigma = length_summary(inputs.measured_lengths)["log_sigma"]
        stretch = v / log_sigma if log_sigma > 0 else 1.0
        model = replace(model, samples=scale_lengths(inputs.measured_lengths, _measured_median(plan, inputs),
                                                     model.max_len, stretch))
    return plan, replace(inputs, lengths=replace(model, sigma=v))


# name -> (low, high, how it is applied, what the value means)
RANGES: dict[str, tuple[float, float, Variant, str]] = {
    "sd.accepted": (0.5, 1.25, _accepted, "factor on every arm's accepted length (clipped to [1, depth + 1])"),
    "sd.drift": (0.1, 0.6, _sd("drift"), "drafter quality lost per policy update"),
    "sd.recover_gpu_s": (150.0, 2400.0, _sd("recover_gpu_s"), "idle GPU-s of drafter training restoring 63%"),
    "cluster.flops_efficiency": (0.3, 0.7, _cluster("flops_efficiency"), "achieved fraction of peak FLOP/s"),
    "cluster.hbm_efficiency": (0.5, 0.9, _cluster("hbm_efficiency"), "achieved fraction of HBM bandwidth"),
    "cluster.forward_overhead_ms": (0.5, 2.0, _cluster("forward_overhead_ms"), "fixed ms per target forward"),
    "cluster.draft_overhead_ms": (0.1, 0.5, _cluster("draft_overhead_ms"), "fixed ms per drafter pass"),
    "lengths.median": (1000.0, 4000.0, _median, "median response length, tokens"),
    "lengths.sigma": (0.5, 1.5, _sigma, "lognormal sigma of response lengths (tail heaviness)"),
}


def _planned_value(name: str, plan: PlanConfig, inputs: PlanInputs) -> Any:
    if name == "sd.accepted":
        return list(inputs.accepted)
    if name == "cluster.draft_overhead_ms":
        return inputs.draft_overhead_ms
    if name == "lengths.median" and inputs.measured_lengths:
        return _measured_median(plan, inputs)
    if name == "lengths.sigma" and inputs.measured_lengths:
        return length_summary(inputs.measured_lengths)["log_sigma"]
    block, key = name.split(".")
    return getattr(getattr(plan, block), key)


def sensitivity(plan: PlanConfig, measured: Sequence[str] = ()) -> dict[str, Any]:
    """{'planned': speedups at the plan's inputs, 'rows': one per assumption, each end's speedups}."""
    cfg = read_config(Path(plan.model_config))
    inputs = plan_inputs(plan, measured)
    layout = ParallelLayout(plan.training.tensor_parallel, plan.training.pipeline_parallel)
    reshard_s = plan_stream_reshard(cfg, layout, plan.dp, plan.rollout.tensor_parallel, cluster=plan.cluster).seconds
    share_fixed = plan.sd.pipelined_share is not None

    def run(p: PlanConfig, i: PlanInputs) -> dict[str, float]:
        shape, _ = plan_shapes(cfg, p, i.lengths)
        costs, fixed, sim = sim_parts(cfg, p, i, shape, training_memory(cfg, shape), reshard_s)
        pu = simulate_both(costs, fixed, sim, share_fixed)["summary"]["pipelined_update"]
        return {"speedup": pu["speedup_without"], "speedup_pipelined": pu["speedup_with"],
                "update_share": pu["update_share"]}

    rows = []
    for name, (lo, hi, apply, meaning) in RANGES.items():
        row = {"assumption": name, "meaning": meaning, "planned": _planned_value(name, plan, inputs),
               "low": lo, "high": hi}
        for end, value in (("at_low", lo), ("at_high", hi)):
            row[end] = run(*apply(plan, inputs, value))
        rows.append(row)
    return {"model": plan.model_config, "planned": run(plan, inputs), "inputs": inputs.provenance,
            "method": "one assumption at a time at each end of its range, the rest as planned; "
                      f"{plan.steps} steps, seed {plan.seed}", "rows": rows}


def markdown_table(result: dict[str, Any]) -> str:
    p = result["planned"]
    lines = [f"planned: {p['speedup']:.2f}x, pipelined update {p['speedup_pipelined']:.2f}x",
             "", "| assumption | planned | range | speedup at low / high | pipelined update at low / high |",
             "|---|---|---|---|---|"]
    for r in result["rows"]:
        planned = r["planned"]
        planned = "/".join(f"{x:.4g}" for x in planned) if isinstance(planned, list) else f"{planned:.4g}"
        rng = f"x{r['low']:g} .. x{r['high']:g}" if r["assumption"] == "sd.accepted" else f"{r['low']:g} .. {r['high']:g}"
        lines.append(f"| `{r['assumption']}` ({r['meaning']}) | {planned} | {rng} | "
                     f"{r['at_low']['speedup']:.2f}x / {r['at_high']['speedup']:.2f}x | "
                     f"{r['at_low']['speedup_pipelined']:.2f}x / {r['at_high']['speedup_pipelined']:.2f}x |")
    return "\n".join(lines)
