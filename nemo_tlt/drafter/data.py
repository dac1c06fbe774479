"""Drafter training samples and the padded batch (the reference layout).

A sample is one rollout sequence: token ids x_0..x_{m-1} (prompt + response) and
the target's final hidden states f_0..f_{m-2} (f_t predicted x_{t+1}), exactly what
`RequestResult.hidden_states` holds. EAGLE trains on the pairs
(x_{t+1}, f_t) -> f_{t+1} for t = 0..m-3.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DrafterSample:
    tokens: torch.Tensor   # [m] long
    hidden: torch.Tensor   # [m-1, H]

    def __post_init__(self) -> None:
        if self.tokens.dim() != 1 or self.hidden.dim() != 2:
            raise ValueError(f"DrafterSample: tokens must be 1-D and hidden 2-D, got shapes "
                             f"{tuple(self.tokens.shape)} and {tuple(self.hidden.shape)}")
        if self.hidden.shape[0] != self.tokens.shape[0] - 1:
            raise ValueError(f"DrafterSample: hidden has {self.hidden.shape[0]} rows, expected "
                             f"len(tokens) - 1 = {self.tokens.shape[0] - 1}")

    @property
    def num_pairs(self) -> int:
        return max(self.hidden.shape[0] - 1, 0)


@dataclass
class EagleBatch:
    next_tokens: torch.Tensor   # [B, T] x_{t+1}
    in_feat: torch.Tensor       # [B, T, H] f_t
    target_feat: torch.Tensor   # [B, T, H] f_{t+1}
    positions: torch.Tensor     # [B, T] t
    mask: torch.Tensor          # [B, T] bool, valid pairs
    new_mask: torch.Tensor | None = None  # [B, T, T] attention mask (None: plain causal)

    @property
    def num_tokens(self) -> int:
        return int(self.mask.sum())


def eagle_pairs(sample: DrafterSample) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n = sample.num_pairs
    return sample.tokens[1: n + 1], sample.hidden[:n], sample.hidden[1: n + 1]


def pad_eagle_batch(samples: list[DrafterSample], dtype: torch.dtype = torch.float32,
                    device: torch.device | str | None = None) -> EagleBatch:
    """One row per sample, right-padded; plain causal attention. Built where the samples
    are (the host, for harvested ones) and moved to `device` (None: stay) in one copy
    per tensor."""
    samples = [s for s in samples if s.num_pairs > 0]
    if not samples:
        raise ValueError("pad_eagle_batch: no sample has at least 3 tokens")
    B, T = len(samples), max(s.num_pairs for s in samples)
    H = samples[0].hidden.shape[1]
    home = samples[0].hidden.device
    tok = torch.zeros(B, T, dtype=torch.long, device=home)
    fin = torch.zeros(B, T, H, dtype=dtype, device=home)
    ftg = torch.zeros(B, T, H, dtype=dtype, device=home)
    mask = torch.zeros(B, T, dtype=torch.bool, device=home)
    for i, s in enumerate(samples):
        t, a, b = eagle_pairs(s)
        n = t.shape[0]
        tok[i, :n], fin[i, :n], ftg[i, :n], mask[i, :n] = t, a.to(dtype), b.to(dtype), True
    dev = home if device is None else torch.device(device)
    positions = torch.arange(T, device=dev).expand(B, T)
    return EagleBatch(tok.to(dev), fin.to(dev), ftg.to(dev), positions, mask.to(dev))
