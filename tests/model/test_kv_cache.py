"""KVCache row drops: only committed slots of moved rows move, memory stays within 2x of the
live rows; row-range views."""
from __future__ import annotations

import pytest
import torch

from nemo_tlt.model.kv_cache import KVCache, fill_holes_order, keep_rows, row_runs


def _filled_cache(batch: int, capacity: int = 12) -> KVCache:
    cache = KVCache(num_layers=2, batch=batch, num_kv_heads=2, capacity=capacity, head_dim=3)
    cache._buf.copy_(torch.randn(cache._buf.shape, generator=torch.Generator().manual_seed(0)))
    cache.lengths = torch.tensor([5, 7, 2, 9, 4, 6][:batch])
    return cache


def _committed(cache: KVCache) -> list[list[torch.Tensor]]:
    n = [int(x) for x in cache.lengths]
    return [[cache.k[l][b, :, : n[b]].clone() for l in range(2)] +
            [cache.v[l][b, :, : n[b]].clone() for l in range(2)] for b in range(cache.batch)]


def test_select_rows_keeps_committed_entries_in_the_given_order():
    cache = _filled_cache(6)
    before = _committed(cache)
    rows = torch.tensor([4, 1, 3, 5])
    cache.select_rows(rows)
    after = _committed(cache)
    assert cache.lengths.tolist() == [4, 7, 9, 6]
    for i, r in enumerate(rows.tolist()):
        for a, b in zip(after[i], before[r]):
            assert torch.equal(a, b)


def test_dropping_the_last_rows_copies_nothing_and_halving_frees_memory():
    cache = _filled_cache(6)
    full = cache.nbytes()
    ptr = cache._buf.data_ptr()
    cache.select_rows(torch.arange(5))          # a prefix: a view of the same buffer
    assert cache._buf.data_ptr() == ptr and cache.nbytes() == full and cache.batch == 5
    cache.select_rows(torch.tensor([0, 2, 4]))  # 3 of 6 allocated rows: a buffer of their own
    assert cache.nbytes() == full // 2 and cache.batch == 3
    cache.select_rows(torch.tensor([1]))
    assert cache.nbytes() == full // 6 and cache.lengths.tolist() == [2]


def test_keep_rows_leaves_slots_past_used_finite():
    buf = torch.arange(4 * 5, dtype=torch.float32).view(4, 5)
    out, alloc = keep_rows(buf, torch.tensor([3, 0, 1]), used=2, row_dim=0, slot_dim=1, alloc_rows=4)
    assert alloc == 4 and out.shape == (3, 5)
    assert out[:, :2].tolist() == [[15, 16], [0, 1], [5, 6]]
    assert bool(torch.isfinite(out).all())


def test_fill_holes_order_moves_one_row_per_finished_sequence():
    alive = torch.tensor([True, False, True, True, False, True, True])
    order = fill_holes_order(alive)
    assert order.tolist() == [0, 6, 2, 3, 5]          # holes 1 and 4 take the last live rows
    assert sorted(order.tolist()) == alive.nonzero().flatten().tolist()
    assert fill_holes_order(torch.tensor([True, True, False])).tolist() == [0, 1]
    assert fill_holes_order(torch.tensor([False, False])).tolist() == []


def test_keep_rows_copies_only_rows_that_change_position():
    buf = torch.arange(6 * 4, dtype=torch.float32).view(6, 4)
    before = buf.clone()
    out, alloc = keep_rows(buf, torch.tensor([0, 5, 2, 3]), used=3, row_dim=0, slot_dim=1, alloc_rows=6)
    assert alloc == 6 and out.data_ptr() == buf.data_ptr()        # same allocation
    assert out[:, :3].tolist() == before[[0, 5, 2, 3], :3].tolist()
    assert out[1, 3] == before[1, 3]                              # slots past `used` are not copied


def test_row_runs_groups_consecutive_moves():
    assert row_runs([0, 1, 2, 7, 6], [0, 1, 2, 3, 4]) == [(0, 0, 3), (7, 3, 1), (6, 4, 1)]
    assert row_runs([4, 5], [1, 2]) == [(4, 1, 2)]
    assert row_runs([], []) == []


@pytest.mark.parametrize("seed", range(6))
def test_keep_rows_equals_index_select_on_random_selections(seed):
    """Any order (overlapping moves included), both the in-place and the fresh-buffer path,
    row dim before or after other dims: the first `used` slots equal a plain index_select."""
    g = torch.Generator().manual_seed(seed)
    B = int(torch.randint(2, 12, (1,), generator=g))
    buf = torch.randn(3, B, 2, 9, 4, generator=g)
    n = int(torch.randint(1, B + 1, (1,), generator=g))
    rows = torch.randperm(B, generator=g)[:n]
    if seed % 2:                                   # the engine's order: few moves
        alive = torch.zeros(B, dtype=torch.bool)
        alive[rows] = True
        rows = fill_holes_order(alive)
    expect = buf.index_select(1, rows)[:, :, :, :5].clone()
    out, _ = keep_rows(buf, rows, used=5, row_dim=1, slot_dim=3, alloc_rows=B)
    assert torch.equal(out[:, :, :, :5], expect)


def test_row_range_is_a_view_that_prefills_its_rows():
    cache = _filled_cache(4)
    view = cache.row_range(1, 3)
    assert view.batch == 2 and view.lengths.tolist() == [7, 2]
    view.k[1][0, :, 0] = 42.0
    view.advance(1)
    assert bool((cache.k[1][1, :, 0] == 42.0).all()) and cache.lengths.tolist() == [5, 8, 3, 9]
    for bad in ((2, 2), (-1, 2), (0, 5)):
        with pytest.raises(ValueError, match="row_range"):
            cache.row_range(*bad)


def test_reserve_grows_by_doubling_and_keeps_committed_entries():
    cache = _filled_cache(3, capacity=12)
    before = _committed(cache)
    cache.reserve(10)                      # fits: nothing happens
    assert cache.capacity == 12
    cache.reserve(13)
    assert cache.capacity == 24            # at least doubles
    cache.reserve(30, limit=40)
    assert cache.capacity == 40            # doubling capped by the limit
    cache.reserve(50, limit=40)
    assert cache.capacity == 50            # never below what was asked
    for a, b in zip(_committed(cache), before):
        for x, y in zip(a, b):
            assert torch.equal(x, y)
    assert float(cache.k[0][0, :, 9:].abs().sum()) == 0.0   # new slots are zero
