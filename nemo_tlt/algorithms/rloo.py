"""RLOO (Ahmadian et al., 2024, "Back to basics: revisiting REINFORCE-style optimization"):
each sample's baseline is the mean reward of the other G - 1 samples of its prompt."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from nemo_tlt.algorithms.grpo import group_advantages
from nemo_tlt.algorithms.loss import clipped_pg_loss
from nemo_tlt.algorithms.protocol import Advantages, Outcomes


def leave_one_out_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """``rewards[P, G]`` (G >= 2) -> ``A[P, G]``, float32: ``A_i = r_i - mean_{j != i} r_j``,
    computed as ``G / (G - 1) * (r_i - mean_j r_j)``; a group of equal rewards gives exactly 0."""
    G = rewards.shape[1]
    if G < 2:
        raise ValueError(f"rloo: a leave-one-out baseline needs grpo.group_size >= 2, got {G}")
    return group_advantages(rewards, G, scale_by_std=False) * (G / (G - 1))


@dataclass(frozen=True)
class RLOO:
    """RLOO's advantages with the clipped surrogate (``policy.clip_eps``; at one optimizer step
    per batch the ratio is 1 and the loss is REINFORCE's); every sequence counts."""

    def advantages(self, outcomes: Outcomes) -> Advantages:
        return Advantages.of(leave_one_out_advantages(outcomes.rewards), torch.ones_like(outcomes.truncated),
                             outcomes)

    def policy_loss(self, logp_new: torch.Tensor, logp_old: torch.Tensor, advantages: torch.Tensor,
                    mask: torch.Tensor, clip_eps: float) -> tuple[torch.Tensor, dict[str, float]]:
        return clipped_pg_loss(logp_new, logp_old, advantages, mask, clip_eps)
