"""A KV-memory budget counted in cache slots: the one rule by which the embedded engine
(``nemo_tlt.rollout.torch_engine``) admits rows and caps the growth of its caches, and by which
the planner (``nemo_tlt.plan.memory``) prices a rollout replica's KV cache.

A batch's caches hold one number of slots (positions) for every row (``nemo_tlt.model.kv_cache``),
each slot ``slot_bytes`` on this rank: K and V of every cached layer over the rank's KV heads,
the target's and the drafter's together (``kv_slot_bytes`` per model). ``rows`` rows of
``slots`` slots hold rows x slots x slot_bytes bytes, so within a budget of B bytes

    slots_within(B, rows, slot_bytes) = floor(B / (rows x slot_bytes))    slots per row
    rows_within(B, slots, slot_bytes) = floor(B / (slots x slot_bytes))   rows of that many slots

and ``admission_waves`` cuts rows, taken in a given order, into consecutive waves that each fit:
a wave of n rows whose largest need is s slots holds n x s x slot_bytes <= B. Pure integers:
nothing is allocated.
"""
from __future__ import annotations

from collections.abc import Sequence

from nemo_tlt.checks import check_float

GIB = 2 ** 30


def check_budget_keys(gib: float | None, fraction: float | None) -> None:
    """``rollout.kv_cache_gib`` (> 0) and ``rollout.kv_cache_fraction`` (in (0, 1]), each None when
    unset and at most one set: a ValueError naming the key otherwise (the run's and the plan's
    ``rollout`` blocks, and the planner's rollout shape, check them alike)."""
    if gib is not None:
        check_float("rollout.kv_cache_gib", gib, 0, lo_open=True)
    if fraction is not None:
        check_float("rollout.kv_cache_fraction", fraction, 0, 1, lo_open=True)
        if gib is not None:
            raise ValueError(f"rollout.kv_cache_gib={gib} and rollout.kv_cache_fraction={fraction} are two budgets "
                             "for one KV cache: set one of them")


def budget_bytes(gib: float) -> int:
    """A budget in GiB as whole bytes (as vLLM's ``kv_cache_memory_bytes`` is set from
    ``rollout.vllm.kv_cache_gib``)."""
    return int(gib * GIB)


def kv_slot_bytes(num_layers: int, kv_heads: int, head_dim: int, elem_bytes: int) -> int:
    """K and V of one position of ``num_layers`` cached layers, ``kv_heads`` heads each."""
    return 2 * num_layers * kv_heads * head_dim * elem_bytes


def slots_within(budget: int, rows: int, slot_bytes: int) -> int:
    """The most slots per row that ``rows`` rows may hold within ``budget`` bytes."""
    if rows < 1 or slot_bytes < 1:
        raise ValueError(f"slots_within: rows and slot_bytes must be >= 1, got {rows} and {slot_bytes}")
    return budget // (rows * slot_bytes)


def rows_within(budget: int, slots: int, slot_bytes: int) -> int:
    """The most rows of ``slots`` slots each that fit within ``budget`` bytes."""
    if slots < 1 or slot_bytes < 1:
        raise ValueError(f"rows_within: slots and slot_bytes must be >= 1, got {slots} and {slot_bytes}")
    return budget // (slots * slot_bytes)


def admission_waves(needs: Sequence[int], budget: int, slot_bytes: int) -> list[tuple[int, int]]:
    """Consecutive ``[start, stop)`` ranges covering the rows, in order, ``needs[i]`` the slots
    row i needs: each wave takes the next rows while all of them hold the largest need among them
    within the budget (``slots_within``). A row that does not fit alone is a ValueError naming it."""
    waves: list[tuple[int, int]] = []
    start, largest = 0, 0
    for i, need in enumerate(needs):
        if need > slots_within(budget, 1, slot_bytes):
            raise ValueError(f"admission_waves: row {i} needs {need} slots of {slot_bytes} B, more than a budget "
                             f"of {budget} B holds for one row")
        largest = max(largest, need)
        if largest > slots_within(budget, i + 1 - start, slot_bytes):
            waves.append((start, i))
            start, largest = i, need
    if needs:
        waves.append((start, len(needs)))
    return waves
