"""`TensorParallel`: the process group a tensor-parallel model splits over, and the
collectives it needs.

Contract
--------
``TensorParallel(group, rank, size)`` names this process's place in a tensor-parallel
group: ``rank`` and ``size`` are its rank in ``group`` and the group's size (checked
against ``torch.distributed`` when a group is given). Size 1 needs no group; a model
built with ``tp=None`` or size 1 runs the plain single-process code path.

The collectives (every rank of the group calls each one, in the same order, with
tensors of the same shape):

* ``all_reduce_(t)``: sum of the ranks' partial outputs, in place (after a
  column-split ``o_proj`` / ``down_proj``, and after the masked vocab-parallel lookup);
* ``gather_vocab(local, vocab)``: the full-vocabulary logits from the ranks' vocab rows
  (``tensor_split`` parts, uneven allowed: each part is padded to the largest, gathered,
  and trimmed), identical on every rank;
* ``broadcast_ints(values)``: small host decisions taken by TP rank 0 (a tree shape);
* ``gather_int(value)``: one 64-bit integer per rank (agreement checks).

Tensor collectives run on the model's device; the host ones on CPU int64 tensors, so
the group needs a backend for each (``nemo_tlt.dist.launch``'s groups carry gloo for
CPU tensors and, on GPUs, NCCL for CUDA ones). The reductions are inference-only
(in-place, not differentiable). A ``TensorParallel`` deep-copies to itself: a group is
a handle, not state (the engine's compute copy of a model shares it).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from nemo_tlt.model.tp_layout import vocab_rows


@dataclass(frozen=True)
class TensorParallel:
    group: Any = None  # torch.distributed.ProcessGroup, or None for size 1
    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        for name, lo in (("size", 1), ("rank", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < lo:
                raise ValueError(f"TensorParallel.{name} must be an int >= {lo}, got {value!r}")
        if self.rank >= self.size:
            raise ValueError(f"TensorParallel.rank={self.rank} must be < size={self.size}")
        if self.group is None:
            if self.size > 1:
                raise ValueError(f"TensorParallel.group is None but size={self.size}: a size > 1 needs the "
                                 "process group of the tensor-parallel ranks")
            return
        if not dist.is_initialized():
            raise ValueError("TensorParallel.group is given but torch.distributed is not initialized")
        actual = (dist.get_rank(self.group), dist.get_world_size(self.group))
        if actual != (self.rank, self.size):
            raise ValueError(f"TensorParallel(rank={self.rank}, size={self.size}) disagrees with its group, where "
                             f"this process is rank {actual[0]} of {actual[1]}")

    @classmethod
    def of_group(cls, group: Any) -> "TensorParallel":
        """This process's place in ``group`` (an initialized process group)."""
        return cls(group, dist.get_rank(group), dist.get_world_size(group))

    def __deepcopy__(self, memo: dict) -> "TensorParallel":
        return self

    def global_rank(self, rank: int) -> int:
        """The global rank of TP rank ``rank`` (itself without a group)."""
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the ranks, in place; returns ``t``."""
        if self.size > 1:
            dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        return t

    def gather_vocab(self, local: torch.Tensor, vocab: int) -> torch.Tensor:
        """[..., vocab] from every rank's [..., rows of `vocab_rows(vocab, size, rank)`]."""
        if self.size == 1:
            return local
        widest = -(-vocab // self.size)
        padded = F.pad(local, (0, widest - local.shape[-1])).contiguous()
        parts = [torch.empty_like(padded) for _ in range(self.size)]
        dist.all_gather(parts, padded, group=self.group)
        widths = [hi - lo for lo, hi in (vocab_rows(vocab, self.size, r) for r in range(self.size))]
        return torch.cat([p[..., :w] for p, w in zip(parts, widths)], -1)

    def broadcast_ints(self, values: list[int]) -> list[int]:
        """TP rank 0's ``values`` (the others pass as many placeholders)."""
        if self.size == 1:
            return list(values)
        t = torch.tensor(values, dtype=torch.int64)
        dist.broadcast(t, group=self.group, group_src=0)
        return t.tolist()

    def gather_int(self, value: int) -> list[int]:
        """Every rank's ``value`` (a signed 64-bit int), in TP rank order."""
        if self.size == 1:
            return [value]
        parts = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
        dist.all_gather(parts, torch.tensor([value], dtype=torch.int64), group=self.group)
        return [int(p) for p in parts]


def active(tp: TensorParallel | None) -> TensorParallel | None:
    """``tp`` if it splits over more than one rank, else None (the single-process path)."""
    return tp if tp is not None and tp.size > 1 else None
