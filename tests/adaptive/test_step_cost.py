"""The online fit of step time ~ c_arm * running**b and the reward it scales."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from nemo_tlt.adaptive.step_cost import StepCostFit, pooled_slope, throughput_at


def _fill(fit: StepCostFit, b: float, costs: dict[str, float], runnings: dict[str, list[int]], rng=None):
    for arm, rs in runnings.items():
        for r in rs:
            noise = 1.0 if rng is None else math.exp(0.1 * rng.standard_normal())
            fit.add(arm, r, costs[arm] * r ** b * noise)


@pytest.mark.parametrize("b", [0.0, 0.35, 1.0])
def test_fit_recovers_the_exponent_although_arms_differ_in_cost_and_batch_sizes(b):
    # The cheap arm ran at large batches, the dear one at small: a naive slope over all
    # steps would mix the arms' cost levels into the exponent.
    fit = StepCostFit()
    _fill(fit, b, {"cheap": 0.01, "dear": 0.05}, {"cheap": [64, 48, 32, 24], "dear": [8, 6, 4, 2]})
    assert fit.exponent() == pytest.approx(b, abs=1e-9)
    naive = np.polyfit(np.log([64, 48, 32, 24, 8, 6, 4, 2]),
                       np.log([0.01 * r ** b for r in (64, 48, 32, 24)] + [0.05 * r ** b for r in (8, 6, 4, 2)]), 1)[0]
    assert abs(naive - b) > 0.2


def test_noisy_fit_is_close_and_clamped_to_zero_one():
    rng = np.random.default_rng(0)
    fit = StepCostFit()
    _fill(fit, 0.35, {"a": 0.02, "b": 0.03}, {"a": list(range(1, 65)), "b": list(range(1, 65))}, rng)
    assert fit.exponent() == pytest.approx(0.35, abs=0.05)
    steep = StepCostFit()
    _fill(steep, 1.6, {"a": 0.01}, {"a": [1, 2, 4, 8]})
    assert steep.exponent() == 1.0
    falling = StepCostFit()
    _fill(falling, -0.5, {"a": 0.01}, {"a": [1, 2, 4, 8]})
    assert falling.exponent() == 0.0


def test_prior_until_the_batch_sizes_spread():
    fit = StepCostFit(prior=0.25)
    assert fit.exponent() == 0.25
    _fill(fit, 1.0, {"a": 0.01}, {"a": [16, 16, 16]})     # no spread at all
    assert fit.exponent() == 0.25
    _fill(fit, 1.0, {"a": 0.01}, {"a": [2, 4]})
    assert fit.exponent() == pytest.approx(1.0)


def test_scaled_reward_is_flat_in_batch_size_when_the_model_holds():
    fit = StepCostFit()
    _fill(fit, 0.3, {"a": 0.01}, {"a": [1, 4, 16, 64]})
    # 3 tokens a row at any batch size: the same reward, and the same throughput at batch 8
    b = fit.exponent()
    rewards = [3 * r / (0.01 * r ** 0.3) / r ** (1 - b) for r in (1, 7, 40)]
    assert rewards == pytest.approx([300.0] * 3)
    at8 = [throughput_at(3 * r / (0.01 * r ** 0.3), r, 8, b) for r in (1, 7, 40)]
    assert at8 == pytest.approx([3 * 8 / (0.01 * 8 ** 0.3)] * 3)


def test_state_round_trip_and_bad_state():
    fit = StepCostFit()
    _fill(fit, 0.4, {"a": 0.01, "b": 0.02}, {"a": [2, 8], "b": [3, 9]})
    restored = StepCostFit()
    restored.load_state_dict(json.loads(json.dumps(fit.state_dict())))
    assert restored.exponent() == fit.exponent()
    for bad in (None, {}, {"stats": {"a": [1, 2]}}, {"stats": {"a": ["x"] * 5}}):
        with pytest.raises(ValueError, match="step-cost state"):
            restored.load_state_dict(bad)
    with pytest.raises(ValueError, match="prior"):
        StepCostFit(prior=2)


def test_pooled_slope_ignores_single_step_arms():
    assert pooled_slope({"a": [1.0, 0.5, 0.1, 0.25, 0.05]}) == (0.0, 0.0)
