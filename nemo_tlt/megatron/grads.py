"""Gradient steps of a TP x PP megatron-core ``GPTModel`` between backward and the optimizer.

Contract (both collective over megatron's parallel groups, called on every rank):
* ``allreduce_tied_embedding_grads``: tied embeddings under PP > 1 live on the first and
  the last stage; their grads are summed over the embedding group, as megatron's
  ``finalize_model_grads`` does. A no-op otherwise.
* ``clip_grads``: the global grad norm counts every weight once (a TP-replicated weight
  on TP rank 0 only; a ``shared`` copy not at all), all-reduced over the model-parallel
  group when the model is sharded; grads are scaled by
  ``torch.nn.utils.clip_grad_norm_``'s rule, so the torch and megatron backends clip alike.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist


def allreduce_tied_embedding_grads(model: torch.nn.Module, tied: bool, pp: int) -> None:
    """Sum the two copies' grads of tied embeddings under PP > 1 (see the module docstring)."""
    from megatron.core import parallel_state

    if not (tied and pp > 1) or not parallel_state.is_rank_in_embedding_group(ignore_virtual=True):
        return
    weight = model.shared_embedding_or_output_weight()
    dist.all_reduce(weight.grad, group=parallel_state.get_embedding_group())


def clip_grads(params: Sequence[torch.nn.Parameter], clip: float, sharded: bool, device: torch.device) -> float:
    """Clip by the global grad norm over every weight counted once; returns the norm (``clip`` <= 0: no clip)."""
    from megatron.core import parallel_state

    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    sq = torch.zeros((), dtype=torch.float32, device=device)
    for p in params:
        duplicate = (not getattr(p, "tensor_model_parallel", False) and tp_rank != 0) or getattr(p, "shared", False)
        if not duplicate:
            sq += p.grad.float().pow(2).sum()
    if sharded:
        dist.all_reduce(sq, group=parallel_state.get_model_parallel_group())
    norm = sq.sqrt()
    if clip > 0:
        coef = torch.clamp(clip / (norm + 1e-6), max=1.0)
        for p in params:
            p.grad.mul_(coef.to(p.grad.dtype))
    return float(norm)
