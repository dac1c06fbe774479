"""The plan's memory per rank and per phase of one colocated RL step, by term.

Contract: ``rank_phase_memory(cfg, training, rollout)`` -> ``{rank: {phase: {term: bytes}}}``
for every rank of a world of ``training.layout.tp x pp x training.dp`` ranks, ranks in
megatron-core's order (TP fastest, then DP, then PP: ``reshard_plan.megatron_rank``). Pure: it
only arranges the terms of ``nemo_tlt.plan.memory`` and the reshard's schedule
(``nemo_tlt.plan.reshard_plan``) by what each phase holds on the rank:

* ``rollout``: ``rollout_memory`` (the engine's weights, KV cache, logits, the drafter's terms,
  the training state the rank keeps, allowances) with the training terms of the rank's own
  pipeline stage (``nemo-tlt plan`` uses the fullest stage's);
* ``update``: ``stage_training_memory`` of the rank's stage, plus ``engine_weights`` and
  ``drafter``: the colocated engine keeps its weights (and the drafter) while the policy
  updates; ``nemo-tlt plan``'s training phase does not count them;
* ``sync``: the training state (weights, gradients, optimizer), the reserve allowance, the engine's weights and
  ``reshard``: the largest transient the streaming reshard holds on the rank
  (``RankCost.peak``);
* ``checkpoint``: the training state, the reserve and the engine's weights: what the rank holds while it
  saves; what a save itself copies is not modelled.

``CO_RESIDENT`` names the terms added to what ``nemo-tlt plan`` prints for a phase, so a
comparison can report the plan as printed beside the plan with what the code holds.
"""
from __future__ import annotations

from nemo_tlt.model.config import LMConfig
from nemo_tlt.plan.memory import RolloutShape, TrainingShape, rollout_memory, stage_training_memory
from nemo_tlt.plan.reshard_plan import megatron_rank, plan_stream_reshard

PHASES = ("rollout", "update", "sync", "checkpoint")
STATE = ("weights", "gradients", "optimizer")
# phase -> terms that are not in `nemo-tlt plan`'s phase of that name (update: its "training")
CO_RESIDENT = {"rollout": (), "update": ("engine_weights", "drafter"),
               "sync": ("engine_weights", "reshard"), "checkpoint": ("engine_weights",)}


def rank_phase_memory(cfg: LMConfig, training: TrainingShape,
                      rollout: RolloutShape) -> dict[int, dict[str, dict[str, float]]]:
    """Bytes per rank, phase and term (see the module docstring)."""
    layout, dp = training.layout, training.dp
    reshard = plan_stream_reshard(cfg, layout, dp, rollout.tp)
    out: dict[int, dict[str, dict[str, float]]] = {}
    for p in range(layout.pp):
        stage = stage_training_memory(cfg, training, p)
        roll = rollout_memory(cfg, rollout, stage)
        state = {k: stage[k] for k in (*STATE, "reserve")}
        engine = {"engine_weights": roll["weights"]}
        for d in range(dp):
            for t in range(layout.tp):
                rank = megatron_rank(p, t, d, layout, dp)
                out[rank] = {
                    "rollout": roll,
                    "update": {**stage, **engine, "drafter": roll["drafter"]},
                    "sync": {**state, **engine, "reshard": float(reshard.per_rank[rank].peak)},
                    "checkpoint": {**state, **engine},
                }
    return dict(sorted(out.items()))


def as_printed(terms: dict[str, float], phase: str) -> float:
    """A phase's bytes without the terms ``nemo-tlt plan`` does not count in it (``CO_RESIDENT``)."""
    return sum(v for k, v in terms.items() if k not in CO_RESIDENT[phase])
