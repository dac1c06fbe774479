"""Sequence packing for drafter training: several samples per row, no cross-talk.

Contract
--------
* `plan_packing(lengths, budget)` is a pure function: first-fit decreasing bin
  packing of item lengths into bins of capacity `budget`. It returns the bins as
  lists of item indices; every index appears exactly once, the items of a bin sum to
  at most `budget`, and the result is deterministic (ties keep input order).
* `pack_eagle_batch(samples, token_budget)` lays the EAGLE pairs of the samples
  (`drafter.data.eagle_pairs`) out in rows of at most `token_budget` pairs, following
  the plan. Each row carries:
    - `positions` restarting at 0 for every sample (RoPE sees what the padded path
      sees: each sample alone, from position 0);
    - `new_mask` [B, T, T] block-diagonal causal: query i sees key j iff both belong to
      the same sample and j <= i. Padding slots see only themselves (the diagonal), so
      no attention row is all-masked (a softmax over nothing is NaN, and NaN * 0 in the
      backward pass would still poison the gradients);
    - `mask` [B, T] marking the valid pairs.
  With this layout every valid pair's prediction equals the one of the plain padded
  layout (`drafter.data.pad_eagle_batch`, the reference), so the token-mean loss and
  its gradients are the same, with far fewer wasted slots on long-tailed lengths.
* Samples with no training pair (fewer than 3 tokens) are dropped, as
  `pad_eagle_batch` drops them.
* A sample with more pairs than `token_budget` is refused with a ValueError naming
  the sample and the budget. It is not split: the second part would lose attention
  to the first, silently changing what is learned and breaking the equality with the
  padded reference. Pass `token_budget=None` to use the longest sample's length.
* The width T is the fullest row's length; `pad_to_budget=True` makes it exactly
  `token_budget` (fixed shapes, e.g. for compiled or graph-captured training steps).
"""
from __future__ import annotations

import torch

from nemo_tlt.drafter.data import DrafterSample, EagleBatch, eagle_pairs


def plan_packing(lengths: list[int], budget: int) -> list[list[int]]:
    """First-fit decreasing: bins (lists of indices into `lengths`) of total length <= budget."""
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
        raise ValueError(f"plan_packing: budget must be a positive int, got {budget!r}")
    for i, n in enumerate(lengths):
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"plan_packing: lengths[{i}] must be a positive int, got {n!r}")
        if n > budget:
            raise ValueError(f"plan_packing: lengths[{i}]={n} exceeds the budget {budget}")
    # Stable sort on -length: equal lengths keep input order, so the plan is deterministic.
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    bins: list[list[int]] = []
    free: list[int] = []
    for i in order:
        n = lengths[i]
        # First fit; a linear scan is plenty for the few hundred samples of one batch.
        for b, room in enumerate(free):
            if n <= room:
                bins[b].append(i)
                free[b] -= n
                break
        else:
            bins.append([i])
            free.append(budget - n)
    return bins


def packed_attention_mask(segments: torch.Tensor) -> torch.Tensor:
    """[B, T] segment ids (-1 = padding) -> [B, T, T] bool block-diagonal causal mask,
    with the diagonal always True so padding rows are never fully masked."""
    B, T = segments.shape
    same = segments[:, :, None] == segments[:, None, :]
    valid = (segments >= 0)[:, :, None]
    causal = torch.ones(T, T, dtype=torch.bool, device=segments.device).tril()
    eye = torch.eye(T, dtype=torch.bool, device=segments.device)
    return (same & valid & causal[None]) | eye[None]


def pack_eagle_batch(samples: list[DrafterSample], token_budget: int | None = None,
                     dtype: torch.dtype = torch.float32, pad_to_budget: bool = False) -> EagleBatch:
    """Pack the samples' EAGLE pairs into rows of at most `token_budget` pairs (see module docstring)."""
    kept = [(i, s) for i, s in enumerate(samples) if s.num_pairs > 0]
    if not kept:
        raise ValueError("pack_eagle_batch: no sample has at least 3 tokens")
    lengths = [s.num_pairs for _, s in kept]
    budget = max(lengths) if token_budget is None else token_budget
    if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1:
        raise ValueError(f"pack_eagle_batch: token_budget must be a positive int or None, got {token_budget!r}")
    H = kept[0][1].hidden.shape[1]
    for (i, s), n in zip(kept, lengths):
        if s.hidden.shape[1] != H:
            raise ValueError(f"pack_eagle_batch: sample {i} has hidden size {s.hidden.shape[1]}, "
                             f"sample {kept[0][0]} has {H}")
        if n > budget:
            raise ValueError(f"pack_eagle_batch: sample {i} has {n} training pairs ({s.tokens.shape[0]} tokens), "
                             f"more than token_budget={budget}; raise the budget (samples are never split)")
    bins = plan_packing(lengths, budget)
    B = len(bins)
    T = budget if pad_to_budget else max(sum(lengths[j] for j in b) for b in bins)
    tok = torch.zeros(B, T, dtype=torch.long)
    fin = torch.zeros(B, T, H, dtype=dtype)
    ftg = torch.zeros(B, T, H, dtype=dtype)
    positions = torch.zeros(B, T, dtype=torch.long)
    segments = torch.full((B, T), -1, dtype=torch.long)
    for row, members in enumerate(bins):
        start = 0
        for seg, j in enumerate(members):
            t, a, b = eagle_pairs(kept[j][1])
            n = t.shape[0]
            span = slice(start, start + n)
            tok[row, span], fin[row, span], ftg[row, span] = t, a.to(dtype), b.to(dtype)
            positions[row, span] = torch.arange(n)
            segments[row, span] = seg
            start += n
    mask = segments >= 0
    return EagleBatch(tok, fin, ftg, positions, mask, packed_attention_mask(segments))


def packing_efficiency(batch: EagleBatch) -> float:
    """Valid pairs / slots computed: 1.0 means no padding at all."""
    return batch.num_tokens / batch.mask.numel()
