"""The pipelined update (a modelled design): work on finished groups runs on idle replicas
during the tail; a step is never predicted slower than without it, and equals it when
nothing can overlap."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from nemo_tlt.plan.simulator import LengthModel, pipelined_overlap, recommend_share, simulate

from test_simulator import COSTS, FIXED, sim


def test_overlap_by_hand():
    # replica 0 idle from t=1, replica 1 runs to t=3; half the work finished at t=1
    groups, ends = [(1.0, 0.5), (3.0, 0.5)], [1.0, 3.0]
    assert pipelined_overlap(groups, ends, 1.0) == pytest.approx(0.5)      # capacity 1/2 x 2 s, capped by work
    assert pipelined_overlap(groups, ends, 1.0, share=0.25) == pytest.approx(0.25)
    assert pipelined_overlap([(3.0, 1.0)], ends, 1.0) == 0.0               # nothing finished before the end
    assert pipelined_overlap([(1.0, 1.0)], [1.0, 1.0], 1.0) == 0.0          # nobody idle before the end


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("group", [1, 4])
def test_never_slower_at_the_same_drafter(seed, group):
    cfg = sim(seed=seed, steps=3, group_size=group, drafter_training=False)
    plain, piped = simulate(COSTS, FIXED, cfg), simulate(COSTS, FIXED, replace(cfg, pipelined_update=True))
    assert [s.rollout_s for s in plain] == [s.rollout_s for s in piped]
    for a, b in zip(plain, piped):
        assert b.step_s <= a.step_s
        assert b.step_s == pytest.approx(a.step_s - b.overlap_s)
    assert sum(s.overlap_s for s in piped) > 0.0


def test_equal_when_nothing_overlaps():
    same_length = LengthModel(median=1000, sigma=0.0, max_len=8192)   # every replica ends at once
    for cfg in (sim(replicas=1, sequences=8), sim(group_size=4, lengths=same_length)):
        plain, piped = simulate(COSTS, FIXED, cfg), simulate(COSTS, FIXED, replace(cfg, pipelined_update=True))
        assert [s.step_s for s in piped] == [s.step_s for s in plain]
        assert all(s.overlap_s == 0.0 for s in piped)


def test_the_chosen_share_never_predicts_a_slower_step():
    cfg = sim(steps=4, group_size=4)  # drafter training on: the update's idle time is the drafter's loss
    share = recommend_share(COSTS, FIXED, cfg)
    piped = simulate(COSTS, FIXED, replace(cfg, pipelined_update=True, update_share=share))
    plain = simulate(COSTS, FIXED, cfg)
    assert np.mean([s.step_s for s in piped]) <= np.mean([s.step_s for s in plain])
    off = simulate(COSTS, FIXED, replace(cfg, pipelined_update=True, update_share=0.0))
    assert [s.step_s for s in off] == [s.step_s for s in plain]


def test_plan_reports_both_and_the_chosen_share_is_not_slower(monkeypatch):
    """On the 70B plan at rollout TP 8 (8 replicas; a layout the RL loop does not run yet, so
    without its training config), giving the update all idle capacity starves drafter training
    and is slower than not pipelining; the chosen share is not."""
    from pathlib import Path

    from nemo_tlt.plan.build import make_plan
    from nemo_tlt.plan.config import load_plan_config

    conf = Path(__file__).resolve().parents[2] / "conf"
    monkeypatch.chdir(conf.parent)
    load = lambda *kv: load_plan_config(conf / "llama3.3-70b_plan.yaml", ["steps=3", "train_config=null",
                                                                    "rollout.tensor_parallel=8", *kv])  # noqa: E731
    chosen = make_plan(load("sd.pipelined_update=true"), simulate_steps=True)[0]["simulation"]
    greedy = make_plan(load("sd.pipelined_update=true", "sd.pipelined_share=1.0"), simulate_steps=True)[0]["simulation"]
    off = make_plan(load(), simulate_steps=True)[0]["simulation"]
    assert greedy["pipelined_update"]["speedup_with"] < greedy["pipelined_update"]["speedup_without"]
    assert chosen["pipelined_update"]["speedup_with"] >= chosen["pipelined_update"]["speedup_without"]
    assert chosen["speedup"] == chosen["pipelined_update"]["speedup_with"]          # modelled: the headline
    assert off["speedup"] == off["pipelined_update"]["speedup_without"] == chosen["pipelined_update"]["speedup_without"]
