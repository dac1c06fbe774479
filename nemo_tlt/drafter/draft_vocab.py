"""Reduced draft vocabularies and their token maps, as EAGLE-3 checkpoints store them.

A draft vocabulary is a sorted list of target token ids ``ids[0] < ids[1] < ...``.
The maps are those of the EAGLE-3 HF checkpoints (read by vLLM, SGLang and
TensorRT-LLM): ``d2t[i] = ids[i] - i`` (int64 offsets, so target id = i + d2t[i])
and ``t2d[v]`` (bool) marks the target ids in the draft vocabulary. Because the
ids are sorted, the draft index of a kept target id v is ``cumsum(t2d)[v] - 1``.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch


def vocab_maps(ids: torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t [N] int64, t2d [vocab_size] bool) of the draft vocabulary `ids` (sorted, unique)."""
    ids = torch.as_tensor(ids, dtype=torch.long)
    if ids.dim() != 1 or ids.numel() == 0:
        raise ValueError(f"draft vocabulary ids must be a non-empty 1-D list, got shape {tuple(ids.shape)}")
    if bool((ids[1:] <= ids[:-1]).any()):
        raise ValueError("draft vocabulary ids must be sorted ascending without repeats")
    if int(ids[0]) < 0 or int(ids[-1]) >= vocab_size:
        raise ValueError(f"draft vocabulary ids must lie in [0, {vocab_size}) (vocab_size)")
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return ids - torch.arange(ids.numel()), t2d


def draft_ids(d2t: torch.Tensor) -> torch.Tensor:
    """The target id of every draft index, [N]."""
    return torch.arange(d2t.numel(), device=d2t.device) + d2t


def target_to_draft(t2d: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(draft index, kept) of target token ids `tokens`; the index is 0 where not kept."""
    index = torch.cumsum(t2d.long(), 0) - 1
    kept = t2d[tokens]
    return torch.where(kept, index[tokens], 0), kept


def most_frequent(token_lists: Iterable[torch.Tensor], size: int, vocab_size: int,
                  always: tuple[int, ...] = ()) -> torch.Tensor:
    """The `size` most frequent target ids in `token_lists` plus `always` (e.g. EOS),
    sorted; ties go to the lower id. EAGLE-3 picks its draft vocabulary this way."""
    if not 1 <= size <= vocab_size:
        raise ValueError(f"draft vocabulary size must be in [1, {vocab_size}], got {size}")
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for tokens in token_lists:
        counts += torch.bincount(torch.as_tensor(tokens, dtype=torch.long), minlength=vocab_size)
    if always:
        counts[list(always)] = counts.max() + 1
    order = sorted(range(vocab_size), key=lambda v: (-int(counts[v]), v))
    return torch.tensor(sorted(order[:size]))
