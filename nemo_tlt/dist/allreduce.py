"""``allreduce_flat``: reduce many tensors over a process group through one flat float32 buffer.

Contract: ``allreduce_flat(tensors, group=None, op="sum")`` is a collective (every rank
of ``group`` calls it with tensors of the same shapes, in the same order). The tensors
are concatenated into one float32 buffer, reduced with one ``all_reduce``, and copied
back in place (cast to each tensor's dtype); the reduced buffer is returned. ``None``
entries are skipped. One buffer means one collective, and its bits are the same on
every rank, so replicas that apply the result stay bit-identical. ``op="avg"`` divides
the sum by the group size (gloo has no AVG). Without an initialised process group, or
in a group of one, the tensors are left as they are.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

OPS = ("sum", "avg")


def allreduce_flat(tensors: Sequence[torch.Tensor | None], group: dist.ProcessGroup | None = None,
                   op: str = "sum") -> torch.Tensor:
    if op not in OPS:
        raise ValueError(f"allreduce_flat: op must be one of {OPS}, got {op!r}")
    present = [t for t in tensors if t is not None]
    flat = torch.cat([t.detach().float().reshape(-1) for t in present]) if present else torch.zeros(0)
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return flat
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    if op == "avg":
        flat /= dist.get_world_size(group)
    offset = 0
    with torch.no_grad():
        for t in present:
            n = t.numel()
            t.copy_(flat[offset: offset + n].view_as(t))
            offset += n
    return flat
