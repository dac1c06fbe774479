"""conf/*_plan.yaml: the 32B and 70B plans agree with the training configs they name, so they
plan what those runs do, and on 8 x H100 80GB nodes both phases fit: each rollout replica's
engine is split over rollout.tensor_parallel GPUs (4 for 32B, 8 for 70B). At rollout TP 1 (every
worker's engine serving the whole model: bf16 weights alone 61 GiB for 32B, 131 GiB for 70B) the
rollout would not fit, and the plan says which term. A disagreement between the two files is
refused naming both keys."""
from __future__ import annotations

from pathlib import Path

import pytest

from nemo_tlt.plan.build import make_plan
from nemo_tlt.plan.config import load_plan_config

CONF = Path(__file__).resolve().parents[2] / "conf"
SHIPPED = [("qwen2.5-32b", 4, 4), ("llama3.3-70b", 8, 8)]  # (name, nodes, the run's rollout TP)


@pytest.mark.parametrize("name,nodes,rollout_tp", SHIPPED)
def test_shipped_plan_plans_its_run_and_fits(name, nodes, rollout_tp, monkeypatch):
    monkeypatch.chdir(CONF.parent)
    plan = load_plan_config(CONF / f"{name}_plan.yaml")  # checked against its training config
    out, _ = make_plan(plan)
    assert plan.cluster.nodes == nodes and plan.cluster.gpus_per_node == 8
    assert plan.train_config and out["layout"]["rollout"]["tp"] == rollout_tp
    assert out["fits"], out["refusal"]
    assert max(out["memory_total_gib"].values()) < plan.cluster.memory_gib
    assert out["reshard"]["within_two_layers"]


@pytest.mark.parametrize("name,nodes,rollout_tp", SHIPPED)
def test_shipped_plan_would_not_fit_at_rollout_tp_1(name, nodes, rollout_tp, monkeypatch):
    monkeypatch.chdir(CONF.parent)
    plan = load_plan_config(CONF / f"{name}_plan.yaml", ["train_config=null", "rollout.tensor_parallel=1"])
    out, _ = make_plan(plan)
    assert out["memory_total_gib"]["training"] < plan.cluster.memory_gib
    assert not out["fits"] and "largest term rollout.weights" in out["refusal"], out["refusal"]
    assert out["memory_gib"]["rollout"]["weights"] > plan.cluster.memory_gib / 2


def test_plan_refuses_disagreeing_train_config(monkeypatch):
    monkeypatch.chdir(CONF.parent)
    with pytest.raises(ValueError, match=r"training.tensor_parallel=4 disagrees with .*policy.tensor_parallel=8"):
        load_plan_config(CONF / "qwen2.5-32b_plan.yaml", ["training.tensor_parallel=4"])


@pytest.mark.parametrize("name,nodes,rollout_tp", SHIPPED)
def test_shipped_plan_fits_every_phase_with_what_the_code_holds(name, nodes, rollout_tp, monkeypatch):
    """Per phase, the fullest rank with the engine's weights beside the update and the reshard's
    transient in the sync: the shipped plans fit each with a margin; a GPU that holds the printed
    training and rollout totals but not the update beside the engine's weights is refused."""
    monkeypatch.chdir(CONF.parent)
    out, _ = make_plan(load_plan_config(CONF / f"{name}_plan.yaml"))
    phases = out["phases_gib"]
    assert list(phases) == ["rollout", "update", "sync", "checkpoint"]
    assert all(p["fits"] and p["margin_gib"] > 10 for p in phases.values()), phases
    assert phases["update"]["gib"] > out["memory_total_gib"]["training"]  # the engine's weights beside it
    between = (max(out["memory_total_gib"].values()) + phases["update"]["gib"]) / 2
    tight, _ = make_plan(load_plan_config(CONF / f"{name}_plan.yaml", ["train_config=null",
                                                                        f"cluster.memory_gib={between}"]))
    assert not tight["fits"] and "phase(s) ['update'" in tight["refusal"], tight["refusal"]
