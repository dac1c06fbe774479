"""The prefill plan: least padded-token cost over contiguous chunks of sorted prompts."""
from __future__ import annotations

import itertools

import pytest

from nemo_tlt.rollout.prefill import prefill_chunks


def _cost(lens, chunks, overhead):
    return sum(overhead + (b - a) * lens[b - 1] for a, b in chunks)


def _brute_force(lens, overhead):
    n = len(lens)
    best = None
    for mask in itertools.product([False, True], repeat=n - 1):
        cuts = [0] + [i + 1 for i, m in enumerate(mask) if m] + [n]
        cost = _cost(lens, list(zip(cuts, cuts[1:])), overhead)
        best = cost if best is None else min(best, cost)
    return best


@pytest.mark.parametrize("lens,overhead", [([5, 5, 6, 30, 31, 80], 10), ([1, 2, 3, 4, 5, 6, 7], 3),
                                           ([4, 4, 4, 4], 0), ([2, 9, 9, 40, 41, 41, 90, 95], 64),
                                           ([3, 50], 1000)])
def test_chunks_cover_the_rows_at_the_least_cost(lens, overhead):
    chunks = prefill_chunks(lens, overhead)
    assert chunks[0][0] == 0 and chunks[-1][1] == len(lens)
    assert all(a < b for a, b in chunks) and all(b == c for (_, b), (c, _) in zip(chunks, chunks[1:]))
    assert _cost(lens, chunks, overhead) == _brute_force(lens, overhead)


def test_long_tailed_prompts_are_split_and_equal_ones_are_not():
    lens = [5] * 48 + [80] * 16
    assert prefill_chunks(lens, 64) == [(0, 48), (48, 64)]   # 48*5 + 16*80 + 128 < 64*80 + 64
    assert prefill_chunks([7] * 10, 0) == [(0, 10)]
    assert prefill_chunks(lens, 10**9) == [(0, 64)]


@pytest.mark.parametrize("bad,match", [([], "non-empty"), ([3, 2], "ascending")])
def test_bad_lengths_are_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        prefill_chunks(bad, 8)
    with pytest.raises(ValueError, match="overhead_tokens"):
        prefill_chunks([1], -1)
