"""Tests for the BEG-MAB bandit: convergence on synthetic rewards, config validation, state."""
from __future__ import annotations

import copy
import json

import numpy as np
import pytest

from nemo_tlt.adaptive.bandit import BanditConfig, BegMab
from nemo_tlt.speculative.tree_shape import TreeShape

ARM_STRINGS = ["8_4_32", "6_2_8", "4_4_16", "2_1_2"]
ARMS = tuple(TreeShape.parse(s) for s in ARM_STRINGS)
EDGES = (8, 32)  # buckets [1, 8), [8, 32), [32, inf)
BUCKET_BATCHES = [(1, 7), (8, 31), (32, 128)]  # inclusive batch-size ranges per bucket

# Mean throughput (tokens/s) per bucket x arm; each bucket has a different best arm
# (small batches like deep trees, large batches like cheap ones).
MEANS = np.array(
    [
        [1000.0, 800.0, 700.0, 600.0],
        [700.0, 800.0, 1000.0, 600.0],
        [600.0, 700.0, 800.0, 1000.0],
    ]
)
NOISE_STD = 100.0  # half the smallest gap: a single reward can mislead the greedy choice
EPSILON = 0.1
N_PER_BUCKET = 300
TAIL = 150  # the "last pulls" on which convergence is judged
TAIL_MARGIN = 0.07
REGRET_FRACTION = 0.35


class UniformPicker:
    """A stub that ignores rewards and picks uniformly; it must fail the criteria."""

    def __init__(self, rng: np.random.Generator) -> None:
        self._rng = rng

    def select(self, batch_size: int) -> TreeShape:
        return ARMS[int(self._rng.integers(len(ARMS)))]

    def update(self, batch_size: int, arm: TreeShape, reward: float) -> None:
        pass


def simulate(picker, seed: int) -> list[list[int]]:
    """Interleave N_PER_BUCKET pulls per bucket; return the chosen arm indices per bucket."""
    env = np.random.default_rng(seed + 1000)
    order = np.repeat(np.arange(len(BUCKET_BATCHES)), N_PER_BUCKET)
    env.shuffle(order)
    chosen: list[list[int]] = [[] for _ in BUCKET_BATCHES]
    for bucket in order:
        lo, hi = BUCKET_BATCHES[bucket]
        batch = int(env.integers(lo, hi + 1))
        arm = picker.select(batch)
        index = ARMS.index(arm)
        reward = max(0.0, MEANS[bucket, index] + NOISE_STD * env.standard_normal())
        picker.update(batch, arm, reward)
        chosen[bucket].append(index)
    return chosen


def convergence_report(chosen: list[list[int]]) -> list[tuple[float, float, float]]:
    """Per bucket: (best-arm fraction in the tail, cumulative regret, regret bound).

    Regret is measured against the true means. Bound: REGRET_FRACTION * N * mean_gap,
    with mean_gap the gap of the best arm over an arm drawn uniformly. Once the
    bandit has locked on, epsilon-greedy's expected regret is about
    epsilon * N * mean_gap plus one pull of each bad arm (~0.11 * N * mean_gap here);
    a uniform picker's expected regret is exactly N * mean_gap, ~2.9x the bound, and
    its tail best-arm fraction is 1/4 against the required 1 - epsilon - margin = 0.83
    (a converged bandit expects 1 - epsilon + epsilon/4 = 0.925). Over 300 seeds
    about 1% of bandit runs miss (an early unlucky reward keeps a second-best arm
    greedy for a while) and no uniform run passes; the seeds below are fixed.
    """
    report = []
    for bucket, picks in enumerate(chosen):
        means = MEANS[bucket]
        best = int(np.argmax(means))
        gaps = means.max() - means
        tail_fraction = float(np.mean(np.asarray(picks[-TAIL:]) == best))
        regret = float(gaps[np.asarray(picks)].sum())
        bound = REGRET_FRACTION * len(picks) * float(gaps.mean())
        report.append((tail_fraction, regret, bound))
    return report


def meets_criteria(chosen: list[list[int]]) -> bool:
    return all(
        tail >= 1.0 - EPSILON - TAIL_MARGIN and regret < bound
        for tail, regret, bound in convergence_report(chosen)
    )


def make_bandit(seed: int = 0, epsilon: float = EPSILON, window: int = 32) -> BegMab:
    config = BanditConfig(arms=ARMS, bucket_edges=EDGES, epsilon=epsilon, window=window)
    return BegMab(config, np.random.default_rng(seed))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bandit_converges_to_best_arm_per_bucket(seed):
    chosen = simulate(make_bandit(seed), seed)
    report = convergence_report(chosen)
    assert meets_criteria(chosen), report


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_uniform_picker_fails_the_same_criteria(seed):
    chosen = simulate(UniformPicker(np.random.default_rng(seed)), seed)
    assert not meets_criteria(chosen), convergence_report(chosen)


def test_same_seed_same_choices_and_different_seed_differs():
    a = simulate(make_bandit(7), 7)
    b = simulate(make_bandit(7), 7)
    c = simulate(make_bandit(8), 7)
    assert a == b
    assert a != c


def test_untried_arms_first_in_order_even_when_always_exploring():
    bandit = make_bandit(epsilon=1.0)
    for expected in ARMS:
        assert bandit.select(3) == expected
        assert bandit.select(3) == expected  # untried until a reward arrives
        bandit.update(3, expected, 1.0)
    # Buckets learn independently: bucket 1 is still untried.
    assert bandit.select(10) == ARMS[0]


def test_min_pulls_round_robins_before_exploiting():
    config = BanditConfig(arms=ARMS, bucket_edges=EDGES, epsilon=0.0, min_pulls=3)
    bandit = BegMab(config, np.random.default_rng(0))
    reward = {arm: float(i + 1) for i, arm in enumerate(ARMS)}
    reward[ARMS[0]] = 10.0
    picks = []
    for _ in range(3 * len(ARMS)):
        arm = bandit.select(2)
        picks.append(arm)
        # arm 0's first pull is unlucky; with one pull it would never be chosen again
        bandit.update(2, arm, 0.1 if len(picks) == 1 else reward[arm])
    assert picks == list(ARMS) * 3
    assert bandit.select(2) == ARMS[0]   # median of (0.1, 10, 10)


@pytest.mark.parametrize("value", [0, -1, 33, 2.0, True])
def test_bad_min_pulls_rejected(value):
    with pytest.raises(ValueError, match="min_pulls"):
        BanditConfig(arms=ARMS, bucket_edges=EDGES, window=32, min_pulls=value)


def test_exploration_rate_matches_epsilon():
    bandit = make_bandit(seed=3, epsilon=0.4)
    for i, arm in enumerate(ARMS):
        bandit.update(2, arm, 100.0 if i == 2 else 1.0)
    picks = [ARMS.index(bandit.select(2)) for _ in range(2000)]
    # Greedy arm 2 with prob 1 - eps + eps/4 = 0.7; each other arm eps/4 = 0.1.
    counts = np.bincount(picks, minlength=len(ARMS)) / len(picks)
    assert abs(counts[2] - 0.7) < 0.04, counts
    for i in (0, 1, 3):
        assert abs(counts[i] - 0.1) < 0.03, counts


def test_greedy_uses_median_not_mean():
    bandit = make_bandit(epsilon=0.0, window=5)
    for r in (1.0, 1.0, 1.0, 1.0, 1000.0):  # mean 200.8, median 1
        bandit.update(1, ARMS[0], r)
    for arm in ARMS[1:]:
        bandit.update(1, arm, 2.0)
    assert bandit.select(1) == ARMS[1]  # median 2 beats 1; tie among 1..3 -> lowest


def test_ties_go_to_lowest_index():
    bandit = make_bandit(epsilon=0.0)
    for arm in ARMS:
        bandit.update(40, arm, 5.0)
    assert bandit.select(40) == ARMS[0]


def test_window_slides():
    bandit = make_bandit(epsilon=0.0, window=3)
    for r in (10.0, 10.0, 10.0, 1.0, 1.0):  # window keeps [10, 1, 1]: median 1
        bandit.update(1, ARMS[0], r)
    for arm in ARMS[1:]:
        bandit.update(1, arm, 5.0)
    stats = bandit.bucket_stats(0)
    assert stats.medians[0] == 1.0
    assert stats.pulls == (5, 1, 1, 1)
    assert bandit.select(1) == ARMS[1]


def test_bucket_of_and_bounds():
    bandit = make_bandit()
    assert [bandit.bucket_of(b) for b in (1, 7, 8, 31, 32, 10_000)] == [0, 0, 1, 1, 2, 2]
    assert bandit.bucket_of(np.int64(9)) == 1
    assert bandit.config.bucket_bounds(0) == (1, 8)
    assert bandit.config.bucket_bounds(2) == (32, None)
    for bad in (0, -1, True, 2.5):
        with pytest.raises(ValueError, match="batch_size"):
            bandit.bucket_of(bad)


def test_stats_and_log_dict():
    bandit = make_bandit(epsilon=0.0)
    assert bandit.bucket_stats(1).best_arm is None
    bandit.update(10, ARMS[1], 50.0)
    bandit.update(10, ARMS[3], 70.0)
    stats = bandit.stats()
    assert len(stats) == 3
    assert stats[1].pulls == (0, 1, 0, 1)
    assert stats[1].medians == (None, 50.0, None, 70.0)
    assert stats[1].best_arm == ARMS[3]
    assert stats[1].label == "[8,32)" and stats[2].label == "[32,inf)"
    logs = bandit.log_dict()
    assert logs["bandit/bucket1[8,32)/pulls/6_2_8"] == 1.0
    assert logs["bandit/bucket1[8,32)/median_reward/2_1_2"] == 70.0
    assert logs["bandit/bucket1[8,32)/best_arm_index"] == 3.0


@pytest.mark.parametrize(
    "arm, reward",
    [
        (TreeShape(3, 3, 3), 1.0),
        ("8_4_32", 1.0),
        (ARMS[0], -1.0),
        (ARMS[0], float("nan")),
        (ARMS[0], float("inf")),
    ],
)
def test_update_rejects_bad_input(arm, reward):
    with pytest.raises(ValueError, match="arm|reward"):
        make_bandit().update(3, arm, reward)


# ---- state ----


def test_state_roundtrip_through_json_gives_identical_future_choices():
    seed = 5
    bandit = make_bandit(seed)
    env = np.random.default_rng(99)

    def step(b: BegMab, e: np.random.Generator) -> int:
        batch = int(e.integers(1, 64))
        arm = b.select(batch)
        b.update(batch, arm, float(e.uniform(0.0, 1000.0)))
        return ARMS.index(arm)

    for _ in range(150):
        step(bandit, env)
    state = json.loads(json.dumps(bandit.state_dict()))
    env_copy = copy.deepcopy(env)
    original = [step(bandit, env) for _ in range(150)]

    restored = make_bandit(seed=12345)  # a different generator: the state must overwrite it
    restored.load_state_dict(state)
    assert [step(restored, env_copy) for _ in range(150)] == original
    assert restored.state_dict() == json.loads(json.dumps(bandit.state_dict()))


@pytest.mark.parametrize(
    "config, match",
    [
        (BanditConfig(arms=ARMS[:3], bucket_edges=EDGES), "arms"),
        (BanditConfig(arms=ARMS[::-1], bucket_edges=EDGES), "arms"),
        (BanditConfig(arms=ARMS, bucket_edges=(8, 64)), "bucket_edges"),
        (BanditConfig(arms=ARMS, bucket_edges=(8,)), "bucket_edges"),
        (BanditConfig(arms=ARMS, bucket_edges=EDGES, window=16), "window"),
    ],
)
def test_load_refuses_mismatched_config(config, match):
    state = make_bandit().state_dict()
    with pytest.raises(ValueError, match=match):
        BegMab(config, np.random.default_rng(0)).load_state_dict(state)


def test_load_refuses_malformed_state():
    bandit = make_bandit()
    good = bandit.state_dict()
    bad_pulls = copy.deepcopy(good)
    bad_pulls["pulls"][0][0] = 2  # window holds 0 rewards for 2 pulls
    other_rng = BegMab(bandit.config, np.random.Generator(np.random.MT19937(0))).state_dict()
    for state, match in [(bad_pulls, "windows"), (other_rng, "rng"), ({"arms": []}, "version"), ([], "dict")]:
        with pytest.raises(ValueError, match=match):
            make_bandit().load_state_dict(state)


# ---- config validation ----


def test_string_arms_builds_config():
    config = BanditConfig(ARM_STRINGS, [8, 32], epsilon=0.2, window=4)
    assert config.arms == ARMS
    assert config.bucket_edges == EDGES
    assert config.num_buckets == 3


@pytest.mark.parametrize("bad", ["8_4", "a_b_c", "8_4_1000", "0_1_1", "", "8_4_32_1"])
def test_string_arms_rejects_malformed_arm_naming_its_index(bad):
    with pytest.raises(ValueError, match=r"BanditConfig\.arms\[1\]") as info:
        BanditConfig(["8_4_32", bad], [8])
    if bad:
        assert repr(bad) in str(info.value)


def test_string_arms_rejects_a_bare_string():
    with pytest.raises(ValueError, match="BanditConfig.arms"):
        BanditConfig("8_4_32", [8])


@pytest.mark.parametrize(
    "edges",
    [(), (8, 8), (32, 8), (0, 8), (-1,), (1, 8), (8.0,), (True, 8)],
)
def test_bad_bucket_edges_rejected(edges):
    with pytest.raises(ValueError, match="bucket_edges"):
        BanditConfig(arms=ARMS, bucket_edges=edges)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(arms=()), "arms"),
        (dict(arms=(ARMS[0], ARMS[1], ARMS[0])), r"arms\[2\]"),
        (dict(arms=("8_4",)), r"arms\[0\]"),
        (dict(arms=(428,)), r"arms\[0\]=428: .*quote each arm"),
        (dict(epsilon=-0.1), "epsilon"),
        (dict(epsilon=1.5), "epsilon"),
        (dict(epsilon=float("nan")), "epsilon"),
        (dict(window=0), "window"),
        (dict(window=2.0), "window"),
    ],
)
def test_bad_config_fields_rejected(kwargs, match):
    base = dict(arms=ARMS, bucket_edges=EDGES)
    base.update(kwargs)
    with pytest.raises(ValueError, match=match):
        BanditConfig(**base)


def test_config_accepts_lists_and_is_frozen():
    config = BanditConfig(arms=list(ARMS), bucket_edges=[8, 32])
    assert config.arms == ARMS and config.bucket_edges == EDGES
    hash(config)
    with pytest.raises(AttributeError):
        config.epsilon = 0.5  # type: ignore[misc]


def test_bandit_requires_numpy_generator():
    config = BanditConfig(arms=ARMS, bucket_edges=EDGES)
    with pytest.raises(ValueError, match="rng"):
        BegMab(config, np.random.RandomState(0))  # type: ignore[arg-type]


# ---- batch-size exponent ----


def test_size_exponent_rescales_every_stored_reward_when_ranking():
    bandit = BegMab(BanditConfig(ARMS[:2], (16,), epsilon=0.0), np.random.default_rng(0))
    bandit.update(12, ARMS[0], 120.0)   # 10 tokens/s a row at 12 rows
    bandit.update(3, ARMS[1], 60.0)     # 20 tokens/s a row at 3 rows
    stats = lambda: bandit.bucket_stats(0)  # noqa: E731
    assert stats().best_arm == ARMS[0] and stats().medians == (120.0, 60.0)   # raw throughput
    bandit.set_size_exponent(1.0)       # already stored rewards are rescaled too
    assert stats().best_arm == ARMS[1] and stats().medians == pytest.approx((10.0, 20.0))
    bandit.set_size_exponent(0.5)
    assert stats().medians == pytest.approx((120.0 / 12 ** 0.5, 60.0 / 3 ** 0.5))
    for bad in (-0.1, 1.5, True, "1"):
        with pytest.raises(ValueError, match="size_exponent"):
            bandit.set_size_exponent(bad)


def test_state_keeps_batch_sizes_and_exponent_and_reads_version_1():
    bandit = BegMab(BanditConfig(ARMS[:2], (16,), epsilon=0.0), np.random.default_rng(0))
    bandit.update(12, ARMS[0], 120.0)
    bandit.update(3, ARMS[1], 60.0)
    bandit.set_size_exponent(1.0)
    state = json.loads(json.dumps(bandit.state_dict()))
    restored = BegMab(bandit.config, np.random.default_rng(0))
    restored.load_state_dict(state)
    assert restored.size_exponent == 1.0 and restored.bucket_stats(0) == bandit.bucket_stats(0)
    # A version-1 state held plain rewards, normalised as they were earned: batch size 1.
    old = dict(state, version=1, windows=[[[120.0], [60.0]], [[], []]])
    del old["size_exponent"]
    restored.load_state_dict(old)
    assert restored.bucket_stats(0).medians == (120.0, 60.0)
    bad = copy.deepcopy(state)
    bad["windows"][0][0] = [[120.0, 0]]
    with pytest.raises(ValueError, match="batch_size >= 1"):
        restored.load_state_dict(bad)
