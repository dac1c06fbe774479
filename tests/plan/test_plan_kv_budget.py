"""The plan under a KV budget (``rollout.kv_cache_gib``): its KV term is min(budget, what the rows
need), the rows a replica decodes at once and their slots follow the engine's rule
(``nemo_tlt.model.kv_budget``; the engine's side: tests/rollout/test_kv_budget.py), a budget
that holds no row is refused by name, and the plan's budget must be its training run's; a
``rollout.kv_cache_fraction`` is of what the GPU does not hold when the rollout starts."""
from __future__ import annotations

from pathlib import Path

import pytest

from nemo_tlt.config import load_config
from nemo_tlt.model.config import LMConfig
from nemo_tlt.plan.build import make_plan
from nemo_tlt.plan.cluster import GIB
from nemo_tlt.plan.config import load_plan_config
from nemo_tlt.plan.memory import (
    RolloutShape, kv_budget_rows, kv_budget_slots, resolve_kv_fraction, rollout_kv_slot_bytes, rollout_memory,
)

CONF = Path(__file__).resolve().parents[2] / "conf"
PLAN, TRAIN = CONF / "qwen2.5-32b_plan.yaml", CONF / "qwen2.5-32b_grpo.yaml"
# 2 layers, 2 KV heads of 16: 2 x 2 x 2 x 16 x 2 B = 256 B per token at TP 1, the drafter's layer 128 B more
CFG = LMConfig(family="llama", vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
               num_kv_heads=2)
TRAINING = {"weights": 0.0, "gradients": 0.0, "optimizer": 0.0}


def test_kv_term_rows_and_slots_by_hand():
    assert rollout_kv_slot_bytes(CFG, 1, sd=False) == 256 and rollout_kv_slot_bytes(CFG, 1, sd=True) == 384
    assert rollout_kv_slot_bytes(CFG, 2, sd=True) == 128 + 128  # the target's heads split, the drafter's not
    need = 256 * 4 * 10                                          # 4 rows of 10 tokens
    unbounded = RolloutShape(tp=1, concurrency=4, context=10, sd=True)
    assert rollout_memory(CFG, unbounded, TRAINING)["kv_cache"] == need
    assert kv_budget_rows(CFG, unbounded) is None and kv_budget_slots(CFG, unbounded, 4) is None
    budget = 2 * 384 * 10 / GIB                                  # two rows of 10 tokens, target and drafter
    bound = RolloutShape(tp=1, concurrency=4, context=10, sd=True, kv_cache_gib=budget)
    assert rollout_memory(CFG, bound, TRAINING)["kv_cache"] == 2 * 384 * 10 < need
    assert kv_budget_rows(CFG, bound) == 2
    assert kv_budget_slots(CFG, bound, 4) == 5 and kv_budget_slots(CFG, bound, 2) == 10
    roomy = RolloutShape(tp=1, concurrency=4, context=10, sd=True, kv_cache_gib=1.0)
    assert rollout_memory(CFG, roomy, TRAINING)["kv_cache"] == need
    with pytest.raises(ValueError, match=r"rollout\.kv_cache_gib must be > 0"):
        RolloutShape(tp=1, concurrency=4, context=10, kv_cache_gib=0.0)


def test_plan_with_a_budget(monkeypatch):
    monkeypatch.chdir(CONF.parent)
    free = make_plan(load_plan_config(PLAN, ["train_config=null"]))[0]
    assert free["kv_cache_tokens_per_replica"]["budget_rows"] is None
    out = make_plan(load_plan_config(PLAN, ["train_config=null", "rollout.kv_cache_gib=4.0"]))[0]
    assert free["memory_gib"]["rollout"]["kv_cache"] > 4.0 == out["memory_gib"]["rollout"]["kv_cache"]
    assert out["fits"]
    # 64 layers x 2 KV heads of 128 per GPU (TP 4) + the drafter's 8 heads: 69632 B per token; 17408 tokens a row
    assert out["kv_cache_tokens_per_replica"]["budget_rows"] == 4 * GIB // (17408 * 69632) == 3
    tiny = make_plan(load_plan_config(PLAN, ["train_config=null", "rollout.kv_cache_gib=0.5"]))[0]
    assert not tiny["fits"] and "rollout.kv_cache_gib=0.5 holds no row of 17408 tokens" in tiny["refusal"]
    with pytest.raises(ValueError, match=r"rollout\.kv_cache_gib must be > 0"):
        load_plan_config(PLAN, ["train_config=null", "rollout.kv_cache_gib=-1.0"])


def test_the_plans_budget_is_its_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(CONF.parent)

    def plan(train: list[str], overrides: list[str]):
        path = tmp_path / "train.yaml"
        path.write_text(load_config(TRAIN, train).to_yaml())
        return load_plan_config(PLAN, [f"train_config={path}", *overrides])

    with pytest.raises(ValueError, match=r"plan rollout\.kv_cache_gib=4\.0 disagrees with .*: "
                                         r"rollout\.kv_cache_gib=None"):
        plan([], ["rollout.kv_cache_gib=4.0"])
    assert plan(["rollout.kv_cache_gib=4.0"], ["rollout.kv_cache_gib=4.0"]).rollout.kv_cache_gib == 4.0


def test_a_fraction_is_of_what_the_gpu_does_not_hold_at_rollout_start():
    """``rollout.kv_cache_fraction`` f: the budget is f x (GPU - weights - drafter - the drafter
    trainer's state - resident training state - reserve), the engine's reading of free memory
    when a rollout starts; the transients (logits, workspace, harvest buffer) are not held yet."""
    training = {"weights": 3.0 * GIB, "gradients": 5.0 * GIB, "optimizer": 7.0 * GIB}
    common = dict(tp=1, concurrency=4, context=10, sd=True, harvest_bytes=GIB, workspace_gib=2.0, reserve_gib=1.0,
                  gpu_gib=40.0, kv_cache_fraction=0.5)
    offload = RolloutShape(**common, training_state="offload")
    terms = rollout_memory(CFG, offload, training)
    held = terms["weights"] + terms["drafter"] + (terms["drafter_training"] - GIB) + terms["reserve"]
    budget = int(0.5 * (40 * GIB - held))
    assert resolve_kv_fraction(CFG, offload, training).kv_cache_gib * GIB == budget
    assert kv_budget_rows(CFG, resolve_kv_fraction(CFG, offload, training)) == budget // (384 * 10)
    resident = RolloutShape(**common, training_state="all")  # 15 GiB more held: a smaller budget
    assert resolve_kv_fraction(CFG, resident, training).kv_cache_gib * GIB == int(0.5 * (25 * GIB - held))
    assert resolve_kv_fraction(CFG, RolloutShape(tp=1, concurrency=4, context=10), training).kv_cache_gib is None
    # the KV term is what the rows need while that is below the budget, the budget past it
    small = RolloutShape(**{**common, "gpu_gib": (held + 2 * 2 * 384 * 10) / GIB}, training_state="offload")
    assert rollout_memory(CFG, small, training)["kv_cache"] == 2 * 384 * 10 < 256 * 4 * 10
    with pytest.raises(ValueError, match=r"rollout\.kv_cache_fraction must be <= 1, got 1\.5"):
        RolloutShape(**{**common, "kv_cache_fraction": 1.5})
    with pytest.raises(ValueError, match=r"two budgets for one KV cache"):
        RolloutShape(**common, kv_cache_gib=1.0)


def test_plan_with_a_fraction(monkeypatch):
    monkeypatch.chdir(CONF.parent)
    out = make_plan(load_plan_config(PLAN, ["train_config=null", "rollout.kv_cache_fraction=0.5"]))[0]
    roll = out["memory_gib"]["rollout"]
    held = roll["weights"] + roll["drafter"] + roll["training_state"] + roll["reserve"]
    trainer = roll["drafter_training"] - 256 / 1024  # the plan's harvest buffer: 256 MiB
    budget = out["kv_cache_tokens_per_replica"]["budget_gib"]
    assert budget == pytest.approx(0.5 * (out["gpu_memory_gib"] - held - trainer), abs=2e-3)
    assert out["kv_cache_tokens_per_replica"]["budget_rows"] == int(budget * GIB) // (17408 * 69632)
    tiny = make_plan(load_plan_config(PLAN, ["train_config=null", "rollout.kv_cache_fraction=0.001"]))[0]
    assert not tiny["fits"] and "rollout.kv_cache_fraction=0.001 (0.05" in tiny["refusal"]
    with pytest.raises(ValueError, match=r"rollout\.kv_cache_fraction must be <= 1"):
        load_plan_config(PLAN, ["train_config=null", "rollout.kv_cache_fraction=2.0"])
    with pytest.raises(ValueError, match=r"two budgets for one KV cache"):
        load_plan_config(PLAN, ["train_config=null", "rollout.kv_cache_fraction=0.5", "rollout.kv_cache_gib=4.0"])


def test_the_plans_fraction_is_its_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(CONF.parent)
    path = tmp_path / "train.yaml"
    path.write_text(load_config(TRAIN, ["rollout.kv_cache_fraction=0.8"]).to_yaml())
    with pytest.raises(ValueError, match=r"plan rollout\.kv_cache_fraction=None disagrees with .*: "
                                         r"rollout\.kv_cache_fraction=0\.8"):
        load_plan_config(PLAN, [f"train_config={path}"])
    assert load_plan_config(PLAN, [f"train_config={path}", "rollout.kv_cache_fraction=0.8"]).rollout.kv_cache_fraction == 0.8


def test_an_unresolved_fraction_is_not_taken_for_no_budget():
    shape = RolloutShape(tp=1, concurrency=4, context=10, sd=True, gpu_gib=1.0, kv_cache_fraction=0.5)
    for fn in (lambda: kv_budget_rows(CFG, shape), lambda: kv_budget_slots(CFG, shape, 4)):
        with pytest.raises(ValueError, match="kv_cache_fraction is not resolved"):
            fn()
