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
  the caches (logits, activations, kernel workspaces), which the engine does not count. On the
  CPU every process of a host reads the same available memory, so the fraction is per process:
  N ranks on one host may take N x f of it between them (use f <= 1/N there). A rank that cannot
  read its free memory fails the call on every rank of its group (none is left waiting).

`KVBudget` is the resolved budget: bytes and the setting it came from, for error messages.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from nemo_tlt.checks import check_float
from nemo_tlt.model.free_memory import check_device, free_bytes
from nemo_tlt.model.kv_budget import GIB, budget_bytes

OWNER = "TorchRolloutEngine"


class KVBudget(NamedTuple):
    """One call's budget in bytes per rank; ``source`` says which setting gave it (and the free
    memory it was a fraction of), ``key`` the setting a user raises, ``free`` the free bytes a
    fraction was taken of (None for a fixed budget)."""
    bytes: int
    source: str
    key: str
    free: int | None = None

    def advice(self, need: int) -> str:
        """What would hold ``need`` bytes: the setting's value, or that the device has not the room."""
        if self.free is None:
            return f"raise {self.key} to at least {need / GIB:.6g}"
        if need <= self.free:
            return f"raise {self.key} to at least {round_up(need / self.free)}"
        return f"no {self.key} holds it: {need} B is more than the {self.free} B free; free memory first"


def round_up(x: float, digits: int = 4) -> float:
    """``x`` > 0 rounded up to ``digits`` significant digits (a setting that holds at least ``x``)."""
    scale = 10.0 ** (digits - 1 - math.floor(math.log10(x)))
    return math.ceil(x * scale) / scale


@dataclass(frozen=True)
class KVLimit:
    gib: float | None = None
    fraction: float | None = None

    def __post_init__(self) -> None:
        if self.gib is not None:
            check_float(f"{OWNER}.kv_cache_gib (rollout.kv_cache_gib)", self.gib, 0, lo_open=True)
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
        if tp is None or tp.size == 1:
            free = free_bytes(device)
            where = f"{free / GIB:.4g} GiB free on {device}"
        else:
            free = self._group_free(device, tp)
            where = f"{free / GIB:.4g} GiB free on the fullest {device.type} device of the TP group"
        return KVBudget(int(self.fraction * free), f"rollout.kv_cache_fraction={self.fraction} of {where}",
                        "rollout.kv_cache_fraction", free)

    @staticmethod
    def _group_free(device: torch.device, tp: Any) -> int:
        """The smallest free memory of the group's ranks; a rank that cannot read its own sends -1
        and every rank raises."""
        try:
            mine, error = free_bytes(device), None
        except Exception as err:  # re-raised below, after the collective every rank makes
            mine, error = -1, err
        gathered = tp.gather_int(mine)
        if error is not None:
            raise error
        failed = [r for r, v in enumerate(gathered) if v < 0]
        if failed:
            raise RuntimeError(f"rollout.kv_cache_fraction: TP ranks {failed} could not read their free memory "
                               "(see their errors); this rank stops with them")
        return min(gathered)
