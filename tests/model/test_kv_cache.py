"""KVCache row drops: only committed slots move, memory stays within 2x of the live rows."""
from __future__ import annotations

import torch

from nemo_tlt.model.kv_cache import KVCache, keep_rows


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
