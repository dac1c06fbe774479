"""Tests for the SD on/off policy: hysteresis, bandit wiring, protocol, state."""
from __future__ import annotations

import json

import numpy as np
import pytest

from nemo_tlt.adaptive.bandit import BanditConfig, BegMab
from nemo_tlt.adaptive.sd_policy import AdaptiveSDPolicy, FixedSDPolicy, SDPolicyConfig, SpecPolicy
from nemo_tlt.speculative.tree_shape import TreeShape

ARMS = (TreeShape(8, 4, 32), TreeShape(4, 2, 8), TreeShape(2, 1, 2))
SHAPE = TreeShape(6, 2, 8)


def make_bandit(seed: int = 0, epsilon: float = 0.1) -> BegMab:
    return BegMab(BanditConfig(arms=ARMS, bucket_edges=(4, 16), epsilon=epsilon), np.random.default_rng(seed))


def count_switches(policy, running: list[int]) -> tuple[list[bool], int]:
    modes = [policy.choose(n) is not None for n in running]
    return modes, sum(a != b for a, b in zip(modes, modes[1:]))


# A long-tail rollout: the batch drains from 128, then hovers around 32 (sequences
# finishing while a few re-enter after tool calls / scheduling), then around 48.
DRAIN = list(range(128, 32, -8))
AROUND_ON = [33, 32, 33, 31, 34, 32, 33, 30, 33, 32] * 3
AROUND_OFF = [47, 49, 47, 50, 46, 49, 47] * 3


def test_hysteresis_does_not_flap_around_threshold_on():
    policy = AdaptiveSDPolicy(SDPolicyConfig(threshold_on=32, threshold_off=48), fixed_shape=SHAPE)
    modes, switches = count_switches(policy, DRAIN + AROUND_ON)
    assert not any(modes[: len(DRAIN)])  # large batch: plain decoding
    assert switches == 1  # turns on once, stays on while hovering in (32, 48]
    assert modes[-1]


def test_hysteresis_turns_off_once_above_threshold_off_and_stays_off():
    policy = AdaptiveSDPolicy(SDPolicyConfig(threshold_on=32, threshold_off=48), fixed_shape=SHAPE)
    modes, switches = count_switches(policy, [20] + AROUND_OFF)
    assert modes[:2] == [True, True]  # 20 -> on; 47 <= 48 keeps it on
    assert modes[2] is False  # 49 > 48 -> off
    assert not any(modes[2:])  # 47/46 are above threshold_on, so it stays off
    assert switches == 1


def test_without_hysteresis_the_same_sequence_flaps():
    # Guards the test above: a single threshold does switch on every crossing.
    policy = AdaptiveSDPolicy(SDPolicyConfig(threshold_on=32, threshold_off=32), fixed_shape=SHAPE)
    _, switches = count_switches(policy, DRAIN + AROUND_ON)
    assert switches > 10


def test_threshold_boundaries_are_inclusive_on_exclusive_off():
    policy = AdaptiveSDPolicy(SDPolicyConfig(threshold_on=8, threshold_off=16), fixed_shape=SHAPE)
    assert policy.choose(9) is None
    assert policy.choose(8) == SHAPE and policy.sd_on
    assert policy.choose(16) == SHAPE
    assert policy.choose(17) is None and not policy.sd_on


@pytest.mark.parametrize("reward, scale", [("throughput", 1.0), ("per_row", 0.5)])
def test_bandit_chooses_shapes_and_observe_feeds_rewards(reward, scale):
    bandit = make_bandit(epsilon=0.0)
    policy = AdaptiveSDPolicy(SDPolicyConfig(threshold_on=32, threshold_off=48, reward=reward), bandit=bandit)
    assert policy.choose(64) is None
    policy.observe(64, None, 64, 0.5)  # plain steps teach the bandit nothing
    assert all(sum(s.pulls) == 0 for s in bandit.stats())

    tokens = {ARMS[0]: 30, ARMS[1]: 60, ARMS[2]: 10}
    for expected in ARMS:  # untried arms come in order
        shape = policy.choose(2)
        assert shape == expected
        policy.observe(2, shape, tokens[shape], 0.1)
    stats = bandit.bucket_stats(bandit.bucket_of(2))
    # tokens / elapsed_s, per running row (2 here) for "per_row"
    assert stats.medians == pytest.approx(tuple(scale * r for r in (300.0, 600.0, 100.0)))
    assert policy.choose(2) == ARMS[1]
    assert policy.choose(10) == ARMS[0]  # another bucket, untried


def test_per_row_reward_compares_arms_tried_at_different_batch_sizes_of_a_bucket():
    # In one bucket, arm 0 ran while 7 rows were left (3 tokens a row), arm 1 at 4 rows
    # (4 tokens a row), at the same step time: arm 1 is the better tree.
    picks = {}
    for reward in ("throughput", "per_row"):
        bandit = BegMab(BanditConfig(ARMS[:2], (4, 8), epsilon=0.0), np.random.default_rng(0))
        policy = AdaptiveSDPolicy(SDPolicyConfig(threshold_on=8, threshold_off=8, reward=reward), bandit=bandit)
        for rows, per_row in ((7, 3), (4, 4)):
            shape = policy.choose(rows)
            policy.observe(rows, shape, rows * per_row, 0.1)
        picks[reward] = policy.choose(4)
    assert picks == {"throughput": ARMS[0], "per_row": ARMS[1]}


def test_scaled_reward_ranks_arms_whose_steps_cost_running_to_the_half():
    # Step time = 0.01 * running**0.5 (cost grows, but slower than the batch). Arm 1
    # makes 3.3 tokens a row, arm 0 3.0: arm 1 is better. In the bucket [8, 64) one arm
    # ran at batch 60, the other at 10. Per row, the arm pulled at 60 looks worse (its
    # step was dearer); by throughput, the arm pulled at 10 looks worse (fewer rows).
    # Scaled by the fitted running**0.5, arm 1 wins either way.
    def best(reward: str, big_batch_arm: int) -> TreeShape:
        bandit = BegMab(BanditConfig(ARMS[:2], (8, 64), epsilon=0.0), np.random.default_rng(0))
        policy = AdaptiveSDPolicy(SDPolicyConfig(threshold_on=64, threshold_off=64, reward=reward), bandit=bandit)
        # The tail bucket [1, 8) has both arms at batch sizes 1..4: the fit finds 0.5 there.
        steps = [(a, r) for r in (1, 2, 4) for a in (0, 1)]
        steps += [(big_batch_arm, 60), (1 - big_batch_arm, 10)]
        for arm, rows in steps:
            policy.observe(rows, ARMS[arm], round(rows * (3.0, 3.3)[arm]), 0.01 * rows ** 0.5)
        if reward == "scaled":
            assert policy.step_cost.exponent() == pytest.approx(0.5, abs=0.02)
        return bandit.bucket_stats(bandit.bucket_of(10)).best_arm

    for big_batch_arm in (0, 1):
        assert best("scaled", big_batch_arm) == ARMS[1]
    assert best("per_row", big_batch_arm=1) == ARMS[0]      # fooled: arm 1 ran at the dear batch
    assert best("throughput", big_batch_arm=0) == ARMS[0]   # fooled: arm 0 ran with more rows


def test_scaled_reward_divides_throughput_by_running_to_one_minus_b():
    # Step time = 0.01 * running**0.25: throughput grows like running**0.75, so the
    # scaled reward must divide by running**0.75 (at b = 0.5 above, b and 1 - b agree).
    # Arm 1 keeps 3.3 tokens a row, arm 0 3.0; whichever ran at batch 60, arm 1 wins.
    for big_batch_arm in (0, 1):
        bandit = BegMab(BanditConfig(ARMS[:2], (8, 64), epsilon=0.0), np.random.default_rng(0))
        policy = AdaptiveSDPolicy(SDPolicyConfig(threshold_on=64, threshold_off=64, reward="scaled"), bandit=bandit)
        steps = [(a, r) for r in (1, 2, 4) for a in (0, 1)] + [(big_batch_arm, 60), (1 - big_batch_arm, 10)]
        for arm, rows in steps:
            policy.observe(rows, ARMS[arm], round(rows * (3.0, 3.3)[arm]), 0.01 * rows ** 0.25)
        assert policy.step_cost.exponent() == pytest.approx(0.25, abs=0.02)
        assert bandit.size_exponent == pytest.approx(0.75, abs=0.02)
        assert bandit.bucket_stats(bandit.bucket_of(10)).best_arm == ARMS[1], big_batch_arm


def test_observe_rejects_bad_outcomes():
    policy = AdaptiveSDPolicy(SDPolicyConfig(), bandit=make_bandit())
    for args, match in [
        ((2, ARMS[0], 5, 0.0), "elapsed_s"),
        ((2, ARMS[0], 5, float("nan")), "elapsed_s"),
        ((2, ARMS[0], -1, 0.1), "tokens_generated"),
        ((0, ARMS[0], 5, 0.1), "num_running"),
        ((2, SHAPE, 5, 0.1), "arm"),  # not one of the bandit's arms
    ]:
        with pytest.raises(ValueError, match=match):
            policy.observe(*args)
    with pytest.raises(ValueError, match="num_running"):
        policy.choose(0)


def test_fixed_policies():
    always = FixedSDPolicy(SHAPE)
    never = FixedSDPolicy(None)
    for n in (128, 3, 1):
        assert always.choose(n) == SHAPE
        assert never.choose(n) is None
    always.observe(3, SHAPE, 10, 0.1)
    with pytest.raises(ValueError, match="shape"):
        FixedSDPolicy("6_2_8")  # type: ignore[arg-type]


def test_policies_satisfy_protocol():
    assert isinstance(FixedSDPolicy(None), SpecPolicy)
    assert isinstance(AdaptiveSDPolicy(SDPolicyConfig(), fixed_shape=SHAPE), SpecPolicy)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(threshold_on=0), "threshold_on"),
        (dict(threshold_on=32, threshold_off=16), "threshold_off"),
        (dict(threshold_off=2.5), "threshold_off"),
        (dict(reward="tokens"), "reward"),
    ],
)
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SDPolicyConfig(**kwargs)


def test_constructor_validation():
    with pytest.raises(ValueError, match="not both"):
        AdaptiveSDPolicy(SDPolicyConfig(), bandit=make_bandit(), fixed_shape=SHAPE)
    with pytest.raises(ValueError, match="give a bandit or a fixed_shape"):
        AdaptiveSDPolicy(SDPolicyConfig())
    with pytest.raises(ValueError, match="fixed_shape"):
        AdaptiveSDPolicy(SDPolicyConfig(), fixed_shape="6_2_8")  # type: ignore[arg-type]


def test_state_roundtrip_restores_mode_and_bandit():
    def run(policy: AdaptiveSDPolicy, running: list[int], env: np.random.Generator) -> list[str | None]:
        out = []
        for n in running:
            shape = policy.choose(n)
            policy.observe(n, shape, int(env.integers(1, 50)), float(env.uniform(0.01, 0.1)))
            out.append(None if shape is None else shape.name)
        return out

    config = SDPolicyConfig(threshold_on=8, threshold_off=20)
    policy = AdaptiveSDPolicy(config, bandit=make_bandit(seed=1))
    run(policy, [30, 12, 8, 6, 5, 5, 4, 3, 12, 15], np.random.default_rng(0))
    state = json.loads(json.dumps(policy.state_dict()))
    assert state["sd_on"] is True  # 12 and 15 are inside the hysteresis band
    tail = [14, 9, 3, 3, 2, 2, 2, 1, 1, 1] * 5
    original = run(policy, tail, np.random.default_rng(1))

    restored = AdaptiveSDPolicy(config, bandit=make_bandit(seed=77))
    restored.load_state_dict(state)
    assert run(restored, tail, np.random.default_rng(1)) == original

    with pytest.raises(ValueError, match="bandit"):
        AdaptiveSDPolicy(config, fixed_shape=SHAPE).load_state_dict(state)
    with pytest.raises(ValueError, match="shape"):
        FixedSDPolicy(SHAPE).load_state_dict(FixedSDPolicy(None).state_dict())
