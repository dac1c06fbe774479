"""Prefill plan: which prompts share a forward pass.

A rollout's prompts differ in length, and one right-padded forward over all of them
can spend most of its work on padding. Sorted by
length and cut into contiguous chunks, each chunk pads only to its own longest
prompt; every extra chunk costs one more forward's fixed overhead. `prefill_chunks`
picks the cut that minimises  sum over chunks of (overhead + rows x longest prompt),
exactly, by dynamic programming over the sorted lengths.
"""
from __future__ import annotations

import numpy as np


def prefill_chunks(sorted_lengths: list[int], overhead_tokens: int) -> list[tuple[int, int]]:
    """Contiguous [start, stop) row ranges covering `sorted_lengths` (ascending) with
    the least padded-token cost, a chunk costing `overhead_tokens` plus its rows times
    its longest length."""
    lens = np.asarray(sorted_lengths, dtype=np.int64)
    if lens.ndim != 1 or lens.size == 0:
        raise ValueError("prefill_chunks: sorted_lengths must be a non-empty list of ints")
    if bool((np.diff(lens) < 0).any()):
        raise ValueError("prefill_chunks: sorted_lengths must be in ascending order")
    if overhead_tokens < 0:
        raise ValueError(f"prefill_chunks: overhead_tokens must be >= 0, got {overhead_tokens}")
    n = lens.size
    best = np.zeros(n + 1, dtype=np.int64)   # best[j]: least cost of rows [0, j)
    cut = np.zeros(n + 1, dtype=np.int64)    # start of the last chunk in that plan
    starts = np.arange(n + 1, dtype=np.int64)
    for j in range(1, n + 1):
        # last chunk [i, j) costs overhead + (j - i) * lens[j - 1]
        cost = best[:j] + overhead_tokens + (j - starts[:j]) * lens[j - 1]
        i = int(cost.argmin())
        best[j], cut[j] = cost[i], i
    chunks, j = [], n
    while j > 0:
        chunks.append((int(cut[j]), j))
        j = int(cut[j])
    return chunks[::-1]
