"""The plan's fixed step costs follow what the code does: one micro-batch per megatron schedule
call (the pipeline bubble is never filled: pp x the ideal training time) and, with the
training state offloaded during the rollout, the optimizer state and weights over PCIe both
ways but not the gradients, which are released (every update zeroes them first)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from nemo_tlt.model.hf_io import read_config
from nemo_tlt.plan.build import fixed_costs, plan_inputs, plan_shapes
from nemo_tlt.plan.config import load_plan_config
from nemo_tlt.plan.costs import training_seconds
from nemo_tlt.plan.memory import training_memory

CONF = Path(__file__).resolve().parents[2] / "conf"


def test_fixed_costs_of_the_shipped_70b_plan():
    plan = load_plan_config(str(CONF / "llama3.3-70b_plan.yaml"), [])
    assert plan.training.pipeline_parallel == 2 and plan.rollout.training_state == "offload"
    cfg = read_config(Path(plan.model_config))
    inputs = plan_inputs(plan)
    shape, _ = plan_shapes(cfg, plan, inputs.lengths)
    assert shape.num_micro_batches > 1  # several micro-batches, each its own schedule call
    mem = training_memory(cfg, shape)
    fixed = fixed_costs(cfg, plan, shape, mem, 0.0, inputs.lengths)
    b = plan.batch
    mean_len = float(np.mean(inputs.lengths.draw(100_000, np.random.default_rng(plan.seed))))
    tokens = int(b.prompts * b.group_size * (plan.rollout.prompt_len + mean_len))
    ideal = training_seconds(cfg, plan.cluster, tokens, 1, 1, True)  # no pipeline
    # one micro-batch per schedule: the two stages take turns, twice the ideal time
    assert fixed.logprob_s == pytest.approx(2 * ideal["logprob_s"])
    assert fixed.update_s == pytest.approx(2 * ideal["update_s"])
    moved = mem["optimizer"] + mem["weights"]
    assert fixed.offload_s == pytest.approx(2 * moved / (plan.cluster.pcie_gbps * 1e9))
