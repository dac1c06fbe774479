"""Rollout batches -> length-sorted, right-padded micro-batches, and back.

Contract: a rollout batch is a list of ``(prompt, response)`` token lists.
``micro_batches(batch, size, max_tokens=0)`` covers every sequence once, in micro-batches of
at most ``size`` sequences (and, with ``max_tokens``, padded tokens) sorted by (length,
index): the order depends only on the tokens, so
two runs that generated the same tokens compute bit-identical log-probs and updates.
Right padding never changes a real token's logits (the model is causal).
``scatter`` puts per-micro-batch ``[b, T-1]`` values back as per-sequence response
values in batch order; ``padded`` is its inverse for one micro-batch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

Sequence2 = tuple[Sequence[int], Sequence[int]]  # (prompt tokens, response tokens)


@dataclass
class MicroBatch:
    index: torch.Tensor       # [b] positions of these sequences in the rollout batch
    input_ids: torch.Tensor   # [b, T]
    mask: torch.Tensor        # [b, T-1] 1 where target input_ids[:, 1:] is a response token


def counted_mask(mb: MicroBatch, counted: torch.Tensor | None) -> torch.Tensor:
    """``mb.mask`` restricted to the counted sequences (``counted[B]`` bool over the whole
    batch; None: all of them, ``mb.mask`` itself)."""
    if counted is None:
        return mb.mask
    return mb.mask * counted.to(mb.mask.device)[mb.index.to(mb.mask.device)].unsqueeze(1).to(mb.mask.dtype)


def plan_micro_batches(lengths: Sequence[int], size: int, max_tokens: int = 0) -> list[list[int]]:
    """The sequence indices of each micro-batch: sorted by (length, index), at most ``size``
    sequences each and, with ``max_tokens > 0``, at most ``max_tokens`` padded tokens
    (rows x longest row) unless a sequence alone is longer. A function of the lengths only."""
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))  # stable: deterministic
    plan: list[list[int]] = []
    for i in order:
        last = plan[-1] if plan else None
        # ascending lengths: the newcomer is the micro-batch's longest row
        if last is not None and len(last) < size and (max_tokens <= 0 or (len(last) + 1) * lengths[i] <= max_tokens):
            last.append(i)
        else:
            plan.append([i])
    return plan


def micro_batches(batch: Sequence[Sequence2], size: int, device: torch.device | str = "cpu",
                  max_tokens: int = 0) -> list[MicroBatch]:
    """Right-padded micro-batches covering every sequence once (``plan_micro_batches``), on ``device``."""
    if not batch:
        raise ValueError("micro_batches: the rollout batch is empty")
    lengths = [len(p) + len(r) for p, r in batch]
    out = []
    for idx in plan_micro_batches(lengths, size, max_tokens):
        T = max(lengths[i] for i in idx)
        # built on the host, moved in one copy each
        ids = torch.zeros(len(idx), T, dtype=torch.long, device="cpu")
        mask = torch.zeros(len(idx), max(T - 1, 1), dtype=torch.float32, device="cpu")
        for row, i in enumerate(idx):
            prompt, response = batch[i]
            seq = list(prompt) + list(response)
            ids[row, : len(seq)] = torch.tensor(seq, dtype=torch.long, device="cpu")
            # target j (= input_ids[j + 1]) is a response token for j in [P-1, P+R-1)
            mask[row, len(prompt) - 1: len(seq) - 1] = 1.0
        out.append(MicroBatch(torch.tensor(idx, device="cpu").to(device), ids.to(device), mask.to(device)))
    return out


def scatter(values: list[torch.Tensor], mbs: list[MicroBatch], n: int) -> list[torch.Tensor]:
    """Per-sequence response values (``[len(response)]`` each) in rollout-batch order."""
    out: list[torch.Tensor | None] = [None] * n
    for mb, lp in zip(mbs, values):
        for row, i in enumerate(mb.index.tolist()):
            out[i] = lp[row][mb.mask[row].bool()]
    return out  # type: ignore[return-value]


def padded(rows: list[torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
    """Per-sequence response values back into the [b, T-1] layout of `mask`."""
    out = torch.zeros_like(mask)
    for r, values in enumerate(rows):
        out[r][mask[r].bool()] = values
    return out


def sequence_length(item: Sequence2) -> int:
    return len(item[0]) + len(item[1])
