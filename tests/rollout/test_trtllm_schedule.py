"""TLT's SD policies as TensorRT-LLM draft_len_schedule values (pure; no TensorRT-LLM needed)."""
from __future__ import annotations

import numpy as np
import pytest

from nemo_tlt.adaptive.bandit import BanditConfig, BegMab
from nemo_tlt.adaptive.learned_policy import LearnedSDConfig, LearnedSDPolicy
from nemo_tlt.adaptive.sd_policy import AdaptiveSDPolicy, FixedSDPolicy, SDPolicyConfig
from nemo_tlt.rollout.trtllm_schedule import (compress_schedule, draft_len_schedule, draft_lengths,
                                              schedule_length)
from nemo_tlt.speculative.tree_shape import TreeShape


def test_compress_keys_are_inclusive_upper_bounds_and_trailing_zeros_drop():
    assert compress_schedule([4, 4, 2, 2, 2, 0, 0]) == {2: 4, 5: 2}
    assert compress_schedule([0, 0]) == {}
    assert compress_schedule([3, 0, 3]) == {1: 3, 2: 0, 3: 3}


@pytest.mark.parametrize("lengths", [[4, 4, 2, 2, 2, 0, 0], [3, 0, 3, 1], [1], [2, 2, 2, 2]])
def test_compressed_schedule_reads_back_every_batch_size(lengths):
    schedule = compress_schedule(lengths)
    assert [schedule_length(schedule, b) for b in range(1, len(lengths) + 1)] == lengths


def test_none_and_plain_fixed_policy_never_speculate():
    assert draft_len_schedule(None, 4, 16) == {}
    assert draft_len_schedule(FixedSDPolicy(None), 4, 16) == {}


def test_fixed_shape_maps_its_depth_clipped_to_max_draft_len():
    assert draft_len_schedule(FixedSDPolicy(TreeShape(3, 2, 4)), 4, 16) == {16: 3}
    assert draft_len_schedule(FixedSDPolicy(TreeShape(6, 1, 6)), 4, 16) == {16: 4}


def test_threshold_policy_speculates_up_to_threshold_on_with_each_buckets_greedy_arm():
    bandit = BegMab(BanditConfig(arms=["4_1_4", "2_1_2"], bucket_edges=[2, 4], epsilon=0.0), np.random.default_rng(0))
    # bucket [2, 4): arm 2_1_2 earns more; bucket [1, 2): untried (first arm)
    bandit.update(3, TreeShape(4, 1, 4), 10.0)
    bandit.update(3, TreeShape(2, 1, 2), 50.0)
    policy = AdaptiveSDPolicy(SDPolicyConfig(threshold_on=6, threshold_off=9), bandit)
    assert draft_lengths(policy, 4, 10) == [4, 2, 2, 4, 4, 4, 0, 0, 0, 0]
    assert draft_len_schedule(policy, 4, 10) == {1: 4, 3: 2, 6: 4}
    assert not policy.sd_on  # read without choose(): no side effect


def test_learned_policy_maps_plain_buckets_to_zero_and_honours_max_sd_running():
    policy = LearnedSDPolicy(LearnedSDConfig(arms=["3_1_3"], min_pulls=1, window=4, max_sd_running=6))
    assert draft_lengths(policy, 8, 8) == [3, 3, 3, 3, 3, 3, 0, 0]  # nothing measured: the first tree
    for running, arm, tokens in [(1, None, 1), (1, TreeShape(3, 1, 3), 4), (4, None, 4), (4, TreeShape(3, 1, 3), 2)]:
        policy.costs.record(running, 0 if arm is None else 1, tokens, 0.01)
    # the tree keeps 4 tokens a row at 1 row, 0.5 at 4 (plain: 1 a row, the same step time): the
    # tree up to 2 rows (halfway, in log batch size), plain from 3 on; above 6 bounded off
    assert draft_lengths(policy, 8, 8) == [3, 3, 0, 0, 0, 0, 0, 0]


def test_unknown_policy_kind_is_refused_by_name():
    class Mine:
        def choose(self, n):
            return None

    with pytest.raises(ValueError, match="Mine cannot be mapped"):
        draft_lengths(Mine(), 4, 4)
