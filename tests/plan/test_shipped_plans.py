"""conf/*_plan.yaml: the 32B and 70B plans agree with the training configs they name, so they
plan what those runs do; on 8 x H100 80GB nodes their training phase fits and their rollout
phase does not: every worker's rollout engine serves the whole model (rollout TP 1), whose bf16
weights alone are 61 GiB (32B) and 131 GiB (70B). At rollout TP 4 / 8, which the RL loop does not
run, both would fit. A disagreement between the two files is refused naming both keys."""
from __future__ import annotations

from pathlib import Path

import pytest

from nemo_tlt.plan.build import make_plan
from nemo_tlt.plan.config import load_plan_config

CONF = Path(__file__).resolve().parents[2] / "conf"
SHIPPED = [("qwen2.5-32b", 4, 4), ("llama3.3-70b", 8, 8)]  # (name, nodes, a rollout TP that would fit)


@pytest.mark.parametrize("name,nodes,rollout_tp", SHIPPED)
def test_shipped_plan_plans_its_run_and_names_what_does_not_fit(name, nodes, rollout_tp, monkeypatch):
    monkeypatch.chdir(CONF.parent)
    plan = load_plan_config(CONF / f"{name}_plan.yaml")  # checked against its training config
    out, _ = make_plan(plan)
    assert plan.cluster.nodes == nodes and plan.cluster.gpus_per_node == 8
    assert plan.train_config and out["layout"]["rollout"]["tp"] == 1
    assert out["memory_total_gib"]["training"] < plan.cluster.memory_gib
    assert not out["fits"] and "largest term rollout.weights" in out["refusal"], out["refusal"]
    assert out["memory_gib"]["rollout"]["weights"] > plan.cluster.memory_gib / 2
    assert out["reshard"]["within_two_layers"]


@pytest.mark.parametrize("name,nodes,rollout_tp", SHIPPED)
def test_shipped_plan_would_fit_at_a_rollout_tp_the_loop_does_not_run(name, nodes, rollout_tp, monkeypatch):
    monkeypatch.chdir(CONF.parent)
    plan = load_plan_config(CONF / f"{name}_plan.yaml", ["train_config=null", f"rollout.tensor_parallel={rollout_tp}"])
    out, _ = make_plan(plan)
    assert out["fits"], out["refusal"]
    assert out["reshard"]["within_two_layers"]


def test_plan_refuses_disagreeing_train_config(monkeypatch):
    monkeypatch.chdir(CONF.parent)
    with pytest.raises(ValueError, match=r"training.tensor_parallel=4 disagrees with .*policy.tensor_parallel=8"):
        load_plan_config(CONF / "qwen2.5-32b_plan.yaml", ["training.tensor_parallel=4"])
