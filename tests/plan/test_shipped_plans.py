"""conf/*_plan.yaml: the 32B and 70B plans fit 8 x H100 80GB nodes, agree with the training
configs they name, and a disagreement between the two files is refused naming both keys."""
from __future__ import annotations

from pathlib import Path

import pytest

from nemo_tlt.plan.build import make_plan
from nemo_tlt.plan.config import load_plan_config

CONF = Path(__file__).resolve().parents[2] / "conf"


@pytest.mark.parametrize("name,nodes", [("qwen2.5-32b", 4), ("llama3.3-70b", 8)])
def test_shipped_plan_fits(name, nodes, monkeypatch):
    monkeypatch.chdir(CONF.parent)
    plan = load_plan_config(CONF / f"{name}_plan.yaml")
    out, _ = make_plan(plan)
    assert plan.cluster.nodes == nodes and plan.cluster.gpus_per_node == 8
    assert out["fits"], out["refusal"]
    assert out["reshard"]["within_two_layers"]


def test_plan_refuses_disagreeing_train_config(monkeypatch):
    monkeypatch.chdir(CONF.parent)
    with pytest.raises(ValueError, match=r"training.tensor_parallel=4 disagrees with .*policy.tensor_parallel=8"):
        load_plan_config(CONF / "qwen2.5-32b_plan.yaml", ["training.tensor_parallel=4"])
