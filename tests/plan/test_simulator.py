"""The RL-step simulator: deterministic for a seed, the baseline when SD and drafter
training are off, more speedup with a heavier tail, less when the rollout share falls."""
from __future__ import annotations

from dataclasses import replace

import pytest

from nemo_tlt.model.hf_io import read_config
from nemo_tlt.plan.cluster import ClusterSpec
from nemo_tlt.plan.costs import RolloutCosts
from nemo_tlt.plan.simulator import FixedCosts, LengthModel, SimConfig, simulate, summarize
from nemo_tlt.speculative.tree_shape import TreeShape

from test_model_configs import MODELS

COSTS = RolloutCosts(read_config(MODELS / "qwen2.5-7b"), ClusterSpec(nodes=1), 1)
FIXED = FixedCosts(logprob_s=5.0, update_s=15.0, weight_sync_s=0.5)
ARMS = ((TreeShape.parse("4_1_4"), 3.0), (TreeShape.parse("6_2_12"), 3.6))


def sim(**kw) -> SimConfig:
    base = dict(steps=3, seed=0, sequences=64, replicas=8, prompt_len=256, threshold=4, arms=ARMS,
                lengths=LengthModel(median=1000, sigma=1.0, max_len=8192))
    base.update(kw)
    return SimConfig(**base)


def speedup(cfg: SimConfig, fixed: FixedCosts = FIXED) -> float:
    return summarize(simulate(COSTS, fixed, cfg), simulate(COSTS, fixed, cfg.baseline()))["speedup"]


def test_deterministic_for_a_seed():
    steps = lambda cfg: [(s.step_s, s.quality, s.replica_s) for s in simulate(COSTS, FIXED, cfg)]  # noqa: E731
    assert steps(sim()) == steps(sim())
    assert steps(sim()) != steps(sim(seed=1))


def test_reduces_to_baseline_without_sd_and_drafter_training():
    off = sim(sd=False, drafter_training=False)
    tlt, base = simulate(COSTS, FIXED, off), simulate(COSTS, FIXED, sim().baseline())
    assert [s.step_s for s in tlt] == [s.step_s for s in base]
    assert summarize(tlt, base)["speedup"] == 1.0
    # ... and the baseline is plain decoding: no SD stretch, no drafter training.
    assert all(label in ("", "prefill") for step in base for trace in step.traces for *_, label in trace)
    assert all(step.trained_gpu_s == 0.0 for step in base)
    assert speedup(sim()) > 1.0


def test_speedup_grows_with_tail_heaviness():
    light, medium, heavy = (speedup(sim(lengths=LengthModel(median=1000, sigma=s, max_len=8192)))
                            for s in (0.3, 0.8, 1.4))
    assert 1.0 < light < medium < heavy


def test_speedup_shrinks_as_rollout_share_falls():
    shares = [FIXED, replace(FIXED, update_s=60.0), replace(FIXED, update_s=240.0)]
    results = [summarize(simulate(COSTS, f, sim()), simulate(COSTS, f, sim().baseline())) for f in shares]
    assert results[0]["rollout_share"] > results[1]["rollout_share"] > results[2]["rollout_share"]
    assert results[0]["speedup"] > results[1]["speedup"] > results[2]["speedup"] > 1.0


def test_drafter_training_keeps_acceptance_up():
    trained = simulate(COSTS, FIXED, sim(steps=4))
    stale = simulate(COSTS, FIXED, sim(steps=4, drafter_training=False))
    assert trained[-1].quality > stale[-1].quality
    assert stale[-1].quality == pytest.approx(0.7 ** 3)
    assert speedup(sim(steps=4)) > speedup(sim(steps=4, drafter_training=False))
