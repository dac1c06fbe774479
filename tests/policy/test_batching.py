"""Micro-batch plans: length-sorted, at most ``size`` rows, and with ``max_tokens`` at most
that many padded tokens (a longer sequence alone), a function of the lengths alone."""
from __future__ import annotations

import pytest

from nemo_tlt.policy.batching import micro_batches, plan_micro_batches


def test_fixed_size_plan_is_length_sorted_chunks():
    assert plan_micro_batches([5, 3, 9, 3, 7], 2) == [[1, 3], [0, 4], [2]]


def test_token_budget_batches_short_rows_and_splits_long_ones():
    lengths = [10, 400, 12, 11, 390, 20]
    plan = plan_micro_batches(lengths, 4, max_tokens=512)
    assert plan == [[0, 3, 2, 5], [4], [1]]
    for idx in plan:  # within budget, unless a row alone exceeds it
        assert len(idx) * max(lengths[i] for i in idx) <= 512 or len(idx) == 1
    assert plan_micro_batches(lengths, 4, max_tokens=0) == [[0, 3, 2, 5], [4, 1]]
    assert plan_micro_batches([600], 4, max_tokens=512) == [[0]]


def test_micro_batches_follow_the_plan():
    batch = [([1, 2], [3] * 8), ([1], [4]), ([1, 2, 3], [5] * 30), ([1], [6, 7])]
    mbs = micro_batches(batch, 4, max_tokens=40)
    assert [mb.index.tolist() for mb in mbs] == [[1, 3, 0], [2]]
    assert [tuple(mb.input_ids.shape) for mb in mbs] == [(3, 10), (1, 33)]


@pytest.mark.parametrize("size", [1, 3])
def test_every_sequence_once(size):
    lengths = [7, 1, 50, 3, 3, 19, 2]
    plan = plan_micro_batches(lengths, size, max_tokens=20)
    assert sorted(i for idx in plan for i in idx) == list(range(len(lengths)))
    assert all(len(idx) <= size for idx in plan)
