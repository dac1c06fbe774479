"""Values that leave the device: the one counted path for host synchronisations.

Contract
--------
On a GPU, reading a tensor's value on the host (``.item()``, ``.tolist()``,
``int(t)``, ``bool(t)``) waits for every queued kernel: a *host sync*. The engine,
its drafters and the tree / acceptance functions read values only where one must
leave the device (a shape, a stop decision, row bookkeeping, a metric), and only
through the three functions here, each of which counts one sync on the calling
thread. ``host_syncs()`` is that thread's running count, so a caller measures the
syncs of a piece of work as a difference (the rollout engine reports them per
decode step, ``StepTrace.host_syncs``); counts are per thread, so an idle-time
trainer on another thread does not show up in a rollout's figures.
"""
from __future__ import annotations

import threading

import torch

_local = threading.local()


def host_syncs() -> int:
    """Host syncs made through this module on the calling thread so far."""
    return getattr(_local, "count", 0)


def _count() -> None:
    _local.count = host_syncs() + 1


def host_int(t: torch.Tensor) -> int:
    """A one-element tensor's value as an int (one sync)."""
    _count()
    return int(t)


def host_bool(t: torch.Tensor) -> bool:
    """A one-element tensor's value as a bool (one sync)."""
    _count()
    return bool(t)


def host_list(t: torch.Tensor) -> list:
    """A tensor's values as (nested) Python lists (one sync): stack several scalars
    into one tensor first to bring them over in one sync."""
    _count()
    return t.tolist()
