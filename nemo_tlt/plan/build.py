"""``make_plan(config)``: the plan JSON (memory by term, fit, reshard) and, on request, the simulation.

Contract: pure orchestration over ``memory``, ``reshard_plan``, ``costs`` and
``simulator``; never allocates model-sized memory. ``fits`` is false (and ``refusal``
says which phase, term and overflow) when a phase exceeds the GPU's memory.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from nemo_tlt.model.config import LMConfig
from nemo_tlt.model.hf_io import read_config
from nemo_tlt.plan.cluster import GIB
from nemo_tlt.plan.config import PlanConfig
from nemo_tlt.plan.measured import PlanInputs, read_measured, resolve_inputs
from nemo_tlt.plan.costs import RolloutCosts, training_seconds
from nemo_tlt.plan.memory import (
    PlanDoesNotFit, RolloutShape, TrainingShape, check_fit, kv_budget_rows, parameter_count, resolve_kv_fraction,
    rollout_memory, to_gib, training_memory,
)
from nemo_tlt.plan.rank_memory import PHASES, rank_phase_memory
from nemo_tlt.plan.reshard_plan import plan_stream_reshard
from nemo_tlt.plan.simulator import (
    FixedCosts, LengthModel, SimConfig, paged_kv_peak_tokens, recommend, recommend_share, simulate, summarize,
)
from nemo_tlt.weights.layout import ParallelLayout
from nemo_tlt.weights.megatron_layout import check_tp


def plan_shapes(cfg: LMConfig, plan: PlanConfig, lengths: LengthModel) -> tuple[TrainingShape, RolloutShape]:
    t, b = plan.training, plan.batch
    sequences = b.prompts * b.group_size
    seq_len = plan.rollout.prompt_len + b.max_response_len
    per_dp = sequences // plan.dp
    training = TrainingShape(layout=ParallelLayout(t.tensor_parallel, t.pipeline_parallel), dp=plan.dp,
                             micro_batch=t.micro_batch, seq_len=seq_len,
                             num_micro_batches=max(1, per_dp // t.micro_batch),
                             sequence_parallel=t.sequence_parallel, recompute=t.recompute,
                             distributed_optimizer=t.distributed_optimizer, grad_bytes=t.grad_bytes,
                             reserve_gib=t.reserve_gib, layer_spec=t.layer_spec)
    kv_tokens = paged_kv_peak_tokens(lengths, sequences // plan.replicas, plan.rollout.prompt_len,
                                     np.random.default_rng(plan.seed))
    rollout = RolloutShape(tp=plan.rollout.tensor_parallel, concurrency=sequences // plan.replicas, context=seq_len,
                           kv_tokens=kv_tokens,
                           sd=plan.sd.enabled, sd_rows=plan.sd.threshold,
                           max_num_verify=max(s.num_verify for s in plan.sd.shapes),
                           drafter_training=plan.sd.drafter_training, harvest_bytes=plan.sd.harvest_mb * 2 ** 20,
                           workspace_gib=plan.rollout.workspace_gib, training_state=plan.rollout.training_state,
                           reserve_gib=plan.rollout.reserve_gib, kv_cache_gib=plan.rollout.kv_cache_gib,
                           kv_cache_fraction=plan.rollout.kv_cache_fraction, gpu_gib=plan.cluster.memory_gib)
    return training, rollout


def plan_inputs(plan: PlanConfig, measured: Sequence[str] = ()) -> PlanInputs:
    """The simulator's inputs: the plan's assumptions, with what the plan's ``measured`` sources
    and then ``measured`` (CLI ``--measured``) hold in their place."""
    return resolve_inputs(plan, [read_measured(p) for p in (*plan.measured.sources, *measured)])


def phase_fit(per_rank: dict[int, dict[str, dict[str, float]]], gpu_gib: float) -> dict[str, dict[str, Any]]:
    """Per phase of the step (``rank_memory.PHASES``), the fullest rank's bytes as GiB with what
    the code holds then (the engine's weights beside the update, the reshard's transient in the
    sync), its rank, the margin to the GPU's memory and whether it fits."""
    out = {}
    for phase in PHASES:
        rank, gib = max(((r, sum(p[phase].values()) / GIB) for r, p in per_rank.items()), key=lambda x: x[1])
        out[phase] = {"gib": round(gib, 3), "rank": rank, "margin_gib": round(gpu_gib - gib, 3),
                      "fits": gib <= gpu_gib}
    return out


def make_plan(plan: PlanConfig, simulate_steps: bool = False,
              measured: Sequence[str] = ()) -> tuple[dict[str, Any], dict | None]:
    """(plan JSON, simulation traces or None)."""
    cfg = read_config(Path(plan.model_config))
    inputs = plan_inputs(plan, measured)
    check_tp(cfg, plan.training.tensor_parallel)
    layout = ParallelLayout(plan.training.tensor_parallel, plan.training.pipeline_parallel)
    layout.stage_layer_counts(cfg.num_layers)  # refuses a PP that does not split the layers
    training_shape, rollout_shape = plan_shapes(cfg, plan, inputs.lengths)
    train_mem = training_memory(cfg, training_shape)
    budgeted = resolve_kv_fraction(cfg, rollout_shape, train_mem)  # the fullest stage's ranks' budget
    roll_mem = rollout_memory(cfg, budgeted, train_mem)
    memory = {"training": train_mem, "rollout": roll_mem}
    reshard = plan_stream_reshard(cfg, layout, plan.dp, plan.rollout.tensor_parallel, cluster=plan.cluster)
    out: dict[str, Any] = {
        "model": plan.model_config, "parameters": parameter_count(cfg),
        "layout": {"gpus": plan.cluster.world, "training": {"tp": layout.tp, "pp": layout.pp, "dp": plan.dp},
                   "rollout": {"tp": plan.rollout.tensor_parallel, "replicas": plan.replicas,
                               "sequences_per_replica": rollout_shape.concurrency}},
        "gpu_memory_gib": plan.cluster.memory_gib,
        "memory_gib": {k: to_gib(v) for k, v in memory.items()},
        "memory_total_gib": {k: round(sum(v.values()) / GIB, 3) for k, v in memory.items()},
        "kv_cache_tokens_per_replica": {"paged_peak": rollout_shape.kv_tokens,
                                        "worst_case": rollout_shape.concurrency * rollout_shape.context,
                                        "budget_gib": (None if budgeted.kv_cache_gib is None
                                                       else round(budgeted.kv_cache_gib, 3)),
                                        "budget_rows": kv_budget_rows(cfg, budgeted)},
        "reshard": reshard.to_dict(),
        "assumptions": {"flops_efficiency": plan.cluster.flops_efficiency,
                        "hbm_efficiency": plan.cluster.hbm_efficiency,
                        "training_state_during_rollout": plan.rollout.training_state},
        "inputs": inputs.provenance,
    }
    try:
        check_fit(memory, plan.cluster.memory_gib)
        out["fits"], out["refusal"] = True, None
    except PlanDoesNotFit as err:
        out["fits"], out["refusal"] = False, str(err)
    if out["kv_cache_tokens_per_replica"]["budget_rows"] == 0:
        out["fits"] = False
        setting = (f"rollout.kv_cache_gib={plan.rollout.kv_cache_gib}" if plan.rollout.kv_cache_fraction is None else
                   f"rollout.kv_cache_fraction={plan.rollout.kv_cache_fraction} ({budgeted.kv_cache_gib:.4g} GiB)")
        out["refusal"] = (out["refusal"] or "") + (f" {setting} holds no row of "
                                                   f"{rollout_shape.context} tokens (prompt_len + max_response_len)")
    out["phases_gib"] = phase_fit(rank_phase_memory(cfg, training_shape, rollout_shape), plan.cluster.memory_gib)
    tight = [p for p, row in out["phases_gib"].items() if not row["fits"]]
    if tight:
        out["fits"] = False
        out["refusal"] = (out["refusal"] or "") + f" phase(s) {tight} exceed the GPU on their fullest rank"
    if not reshard.within_two_layers:
        out["fits"] = False
        out["refusal"] = (out["refusal"] or "") + " reshard peak exceeds two layers per rank"
    if not simulate_steps:
        return out, None
    costs, fixed, sim = sim_parts(cfg, plan, inputs, training_shape, train_mem, reshard.seconds)
    runs = simulate_both(costs, fixed, sim, share_fixed=plan.sd.pipelined_share is not None)
    out["simulation"] = {**runs["summary"],
                         "phases_s": {k: round(v, 3) for k, v in fixed.__dict__.items()},
                         "recommended": recommend(costs, fixed, sim)}
    return out, {"tlt": runs["tlt"], "baseline": runs["baseline"]}


def sim_parts(cfg: LMConfig, plan: PlanConfig, inputs: PlanInputs, shape: TrainingShape,
              train_mem: dict[str, float], reshard_s: float) -> tuple[RolloutCosts, FixedCosts, SimConfig]:
    cluster = replace(plan.cluster, draft_overhead_ms=inputs.draft_overhead_ms)
    costs = RolloutCosts(cfg, cluster, plan.rollout.tensor_parallel)
    return costs, fixed_costs(cfg, plan, shape, train_mem, reshard_s, inputs.lengths), sim_config(plan, inputs)


def simulate_both(costs: RolloutCosts, fixed: FixedCosts, sim: SimConfig, share_fixed: bool = False) -> dict[str, Any]:
    """The baseline and TLT with and without the pipelined update; ``summary`` (the plan
    JSON's ``simulation`` figures) follows ``sim.pipelined_update`` and reports the other too.
    The update's share of the idle capacity is ``sim.update_share`` with ``share_fixed``,
    else the best of ``SHARES`` (``recommend_share``)."""
    base = simulate(costs, fixed, sim.baseline())
    plain = simulate(costs, fixed, replace(sim, pipelined_update=False))
    share = sim.update_share if share_fixed else recommend_share(costs, fixed, sim)
    piped = simulate(costs, fixed, replace(sim, pipelined_update=True, update_share=share))
    chosen = piped if sim.pipelined_update else plain
    summary = {k: round(v, 4) for k, v in summarize(chosen, base).items()}
    with_, without = summarize(piped, base), summarize(plain, base)
    summary["pipelined_update"] = {
        "modelled": sim.pipelined_update,
        "note": ("the simulator's model of the RL loop's policy.pipelined_update (torch policy backend only; "
                 "the 32B / 70B training configs use megatron), not measured at this size"),
        "speedup_with": round(with_["speedup"], 4), "speedup_without": round(without["speedup"], 4),
        "tlt_step_s_with": round(with_["tlt_step_s"], 4), "tlt_step_s_without": round(without["tlt_step_s"], 4),
        "update_overlap_s": round(with_["update_overlap_s"], 4), "update_share": share,
        "final_drafter_quality_with": round(with_["final_drafter_quality"], 4)}
    return {"summary": summary, "tlt": chosen, "baseline": base}


def sim_config(plan: PlanConfig, inputs: PlanInputs) -> SimConfig:
    return SimConfig(steps=plan.steps, seed=plan.seed, sequences=plan.batch.prompts * plan.batch.group_size,
                     replicas=plan.replicas, prompt_len=plan.rollout.prompt_len, sd=plan.sd.enabled,
                     drafter_training=plan.sd.drafter_training, threshold=plan.sd.threshold,
                     arms=tuple(zip(plan.sd.shapes, inputs.accepted)), epsilon=plan.sd.epsilon,
                     drift=plan.sd.drift, recover_gpu_s=plan.sd.recover_gpu_s, lengths=inputs.lengths,
                     group_size=plan.batch.group_size, pipelined_update=plan.sd.pipelined_update,
                     update_share=1.0 if plan.sd.pipelined_share is None else plan.sd.pipelined_share)


def fixed_costs(cfg: LMConfig, plan: PlanConfig, shape: TrainingShape, train_mem: dict[str, float],
                reshard_s: float, model: LengthModel) -> FixedCosts:
    """Log-prob and update at the expected token count, weight sync, and (when the trainer's
    state is offloaded during rollout) moving it to host memory and back over PCIe."""
    b = plan.batch
    mean_len = float(np.mean(model.draw(100_000, np.random.default_rng(plan.seed))))
    tokens = int(b.prompts * b.group_size * (plan.rollout.prompt_len + mean_len))
    # the policy runs megatron's schedule once per micro-batch (nemo_tlt.policy.megatron_forward):
    # no micro-batch fills another's pipeline bubble
    train = training_seconds(cfg, plan.cluster, tokens, plan.training.pipeline_parallel, 1,
                             plan.training.recompute == "full")
    offload = 0.0
    if plan.rollout.training_state != "all":
        # gradients are released, not moved (every update zeroes them first: nemo_tlt.model.offload)
        moved = train_mem["optimizer"]
        if plan.rollout.training_state == "offload":
            moved += train_mem["weights"]
        offload = 2 * moved / (plan.cluster.pcie_gbps * 1e9)
    return FixedCosts(logprob_s=train["logprob_s"], update_s=train["update_s"], weight_sync_s=reshard_s,
                      offload_s=offload)
