"""The embedded engine's KV budget setting, and the byte budget it gives one ``generate`` call.

Two forms, at most one set (neither: unbounded):

* ``gib`` (``rollout.kv_cache_gib``): a fixed budget per rank, in GiB.
* ``fraction`` (``rollout.kv_cache_fraction``, in (0, 1]): that fraction of the memory free on
  the engine's device when the call starts (``nemo_tlt.model.free_memory.free_bytes``), read
  anew every call, so memory released before the rollout (the training state offloaded,
  ``rollout.training_state=offload``) is the engine's to use. The engine holds no cache between
  calls, so what it reads excludes only what others hold. Under tensor parallelism every rank of
  the replica takes the smallest free memory of the group (one all-gather of an int per call):
  the ranks decode the same waves in lockstep, so they must agree on one budget. Like vLLM's
  ``gpu_memory_utilization``, the fraction leaves the rest for what decoding allocates beside
  the caches (logits, activations, kernel workspaces), which the engine does not count.

`KVBudget` is the resolved budget: bytes and the setting it came from, for error messages.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from nemo_tlt.checks import check_float
from nemo_tlt.model.free_memory import check_device, free_bytes
from nemo_tlt.model.kv_budget import GIB, budget_bytes

OWNER = "TorchRolloutEngine"


class KVBudget(NamedTuple):
    """One call's budget in bytes per rank; ``source`` says which setting gave it (and the free
    memory it was a fraction of), ``key`` the setting a user raises."""
    bytes: int
    source: str
    key: str


@dataclass(frozen=True)
class KVLimit:
    gib: float | None = None
    fraction: float | None = None

    def __post_init__(self) -> None:
        if self.gib is not None and not (isinstance(self.gib, (int, float)) and not isinstance(self.gib, bool)
                                         and self.gib > 0):
            raise ValueError(f"{OWNER}.kv_cache_gib (rollout.kv_cache_gib) must be > 0 or None, got {self.gib!r}")
        if self.fraction is not None:
            check_float(f"{OWNER}.kv_cache_fraction (rollout.kv_cache_fraction)", self.fraction, 0, 1, lo_open=True)
            if self.gib is not None:
                raise ValueError(f"{OWNER}: kv_cache_gib={self.gib} and kv_cache_fraction={self.fraction} are "
                                 "two budgets for one cache (rollout.kv_cache_gib, rollout.kv_cache_fraction): "
                                 "set one of them")

    @property
    def bounded(self) -> bool:
        return self.gib is not None or self.fraction is not None

    def check_device(self, device: torch.device) -> None:
        """A ValueError at construction where a fraction cannot be read on ``device``."""
        if self.fraction is not None:
            check_device(device, f"{OWNER}.kv_cache_fraction (rollout.kv_cache_fraction)")

    def budget(self, device: torch.device, tp: Any = None) -> KVBudget | None:
        """This call's budget (None: unbounded). ``tp``: the engine's TensorParallel (its
        ``gather_int``) or None; with a fraction and a group of size > 1 this is a collective
        every rank of the group makes."""
        if self.gib is not None:
            return KVBudget(budget_bytes(self.gib), f"rollout.kv_cache_gib={self.gib}", "rollout.kv_cache_gib")
        if self.fraction is None:
            return None
        free = free_bytes(device)
        where = f"{free / GIB:.4g} GiB free on {device}"
        if tp is not None and tp.size > 1:
            free = min(tp.gather_int(free))
            where = f"{free / GIB:.4g} GiB free on the fullest {device.type} device of the TP group"
        return KVBudget(int(self.fraction * free), f"rollout.kv_cache_fraction={self.fraction} of {where}",
                        "rollout.kv_cache_fraction")
