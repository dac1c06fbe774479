"""The distributed surface the RL loop sees: typed collectives and a stop flag.

Contract
--------
* ``Comm(rank, world, store, node, device)``: collectives of one rank over the default
  process group; every one is a no-op (or the trivial answer) when ``world == 1``, so a
  single rank needs no process group. ``store`` is the rendezvous store (the worker
  coordinator's key-value channel). ``device`` is the ``torch.device`` the launcher bound
  this rank to (``cuda:LOCAL_RANK`` or ``cpu``): what the rank builds lives there. On a
  CUDA rank the group reduces CUDA tensors over NCCL and CPU tensors over gloo, so
  ``sum_`` takes tensors where they live; ``any`` and ``gather`` stay on the CPU (a flag,
  Python objects) and go over gloo.
* ``StopFlag``: SIGINT / SIGTERM / SIGUSR1 never kill a rank mid-step (SIGUSR1 is
  SLURM's warning before a time limit or preemption, ``--signal=USR1@N``, which the
  sbatch scripts forward to their tasks); the flag records the signal (or a launcher's shared ``event``, so a signal that reached the launcher while
  a rank was still starting is not lost) and the loop reads it at step boundaries.
"""
from __future__ import annotations

import signal
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


class StopFlag:
    """Set by SIGINT/SIGTERM/SIGUSR1 (or `request`), or through a shared `event`; read at step boundaries."""

    def __init__(self, event: Any = None) -> None:
        self.signum: int | None = None
        self.event = event
        self._previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None or (self.event is not None and self.event.is_set())

    def request(self, signum: int = signal.SIGTERM) -> None:
        if self.signum is None:
            self.signum = signum

    def install(self) -> "StopFlag":
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, lambda signum, frame: self.request(signum))
        return self

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


@dataclass
class Comm:
    """Collectives of one rank; trivial when ``world == 1``."""

    rank: int
    world: int
    store: Any  # torch.distributed.Store
    node: int = 0  # the node (host) this rank runs on: ranks of one node share its devices
    device: torch.device = torch.device("cpu")  # the device this rank computes on (bound by the launcher)

    @property
    def distributed(self) -> bool:
        return self.world > 1

    def sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place; returns ``tensor``."""
        if self.distributed:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def any(self, flag: bool) -> bool:
        """True on every rank when it is True on one."""
        value = torch.tensor([1.0 if flag else 0.0])
        if self.distributed:
            dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(value.item() > 0)

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order (on every rank)."""
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

