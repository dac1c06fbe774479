"""The plan per rank and phase (``rank_phase_memory``) and its comparison with a measurement
(``compare_memory``): ratios, the 15% flags, and refusals of mismatched inputs."""
from __future__ import annotations

import pytest

from nemo_tlt.model.config import LMConfig
from nemo_tlt.plan.memory import RolloutShape, TrainingShape, rollout_memory, stage_training_memory
from nemo_tlt.plan.memory_check import compare_memory
from nemo_tlt.plan.rank_memory import PHASES, as_printed, rank_phase_memory
from nemo_tlt.weights.layout import ParallelLayout

CFG = LMConfig(family="llama", vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
               num_kv_heads=2)


def test_ratios_and_flags_per_rank_and_phase():
    predicted = {0: {"rollout": {"a": 100.0, "b": 15.0}, "update": {"a": 80.0}},
                 1: {"rollout": {"a": 100.0}, "update": {"a": 120.0}}}
    measured = {0: {"rollout": 100.0, "update": 100.0}, 1: {"rollout": 100.0, "update": 100.0}}
    got = compare_memory(predicted, measured)
    r0 = got["per_rank"][0]
    assert r0["rollout"] == {"predicted_bytes": 115.0, "measured_bytes": 100.0, "ratio": 1.15, "error": 0.15,
                             "within": True, "largest_term": "a"}
    assert r0["update"]["ratio"] == 0.8 and not r0["update"]["within"]
    assert got["per_rank"][1]["update"]["error"] == 0.2 and not got["per_rank"][1]["update"]["within"]
    assert got["per_phase"]["rollout"] == {"worst_error": 0.15, "within": True}
    assert got["per_phase"]["update"] == {"worst_error": -0.2, "within": False}
    assert not got["within_target"]
    assert compare_memory(predicted, measured, tolerance=0.25)["within_target"]


def test_zero_measured_and_mismatches():
    assert compare_memory({0: {"x": {"a": 0.0}}}, {0: {"x": 0.0}})["within_target"]
    assert not compare_memory({0: {"x": {"a": 1.0}}}, {0: {"x": 0.0}})["within_target"]
    with pytest.raises(ValueError, match="ranks differ"):
        compare_memory({0: {"x": {"a": 1.0}}}, {1: {"x": 1.0}})
    with pytest.raises(ValueError, match="rank 0: phases differ"):
        compare_memory({0: {"x": {"a": 1.0}}}, {0: {"y": 1.0}})


def test_rank_phase_memory_places_stages_and_co_resident_terms():
    training = TrainingShape(layout=ParallelLayout(2, 2), dp=1, micro_batch=1, seq_len=10, num_micro_batches=2,
                             distributed_optimizer=True, reserve_gib=0.0)
    rollout = RolloutShape(tp=2, concurrency=4, context=10, sd=False, workspace_gib=0.0, training_state="all",
                           reserve_gib=0.0)
    got = rank_phase_memory(CFG, training, rollout)
    assert sorted(got) == [0, 1, 2, 3] and all(tuple(got[r]) == PHASES for r in got)
    # megatron order: TP fastest, so ranks 2 and 3 hold the last stage (its logits)
    last, first = stage_training_memory(CFG, training, 1), stage_training_memory(CFG, training, 0)
    assert got[3]["update"]["logits"] == last["logits"] > 0 and got[0]["update"]["logits"] == 0
    engine = rollout_memory(CFG, rollout, first)["weights"]
    assert got[0]["update"]["engine_weights"] == engine
    assert as_printed(got[0]["update"], "update") == sum(first.values())
    assert got[0]["rollout"]["training_state"] == first["weights"] + first["gradients"] + first["optimizer"]
    assert got[2]["rollout"]["training_state"] == last["weights"] + last["gradients"] + last["optimizer"]
    assert got[1]["checkpoint"] == {"weights": first["weights"], "gradients": first["gradients"],
                                    "optimizer": first["optimizer"], "reserve": 0.0, "engine_weights": engine}
    assert got[0]["sync"]["reshard"] > 0
