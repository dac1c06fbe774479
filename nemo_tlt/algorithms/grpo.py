"""GRPO: group-normalised advantages and the clipped policy-gradient loss (the default
``algorithm``). ``group_advantages`` is the pure math DAPO shares."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from nemo_tlt.algorithms.loss import clipped_pg_loss
from nemo_tlt.algorithms.protocol import Advantages, Outcomes


def group_advantages(
    rewards: torch.Tensor, group_size: int, eps: float = 1e-6, scale_by_std: bool = True
) -> torch.Tensor:
    """Group-normalised advantages of GRPO.

    ``rewards`` is ``[P * G]`` (the G responses of a prompt are contiguous) or
    ``[P, G]``; the result has the same shape. For response j of group i:

        A_ij = (r_ij - mean_i) / (std_i + eps)      (scale_by_std=True)
        A_ij =  r_ij - mean_i                        (scale_by_std=False, Dr. GRPO)

    with ``std_i`` the unbiased sample standard deviation of the group. A group
    whose rewards are all identical carries no learning signal: its advantages are
    exactly 0 (not rounding noise divided by eps). ``group_size == 1`` therefore
    gives all zeros.
    """
    if group_size < 1:
        raise ValueError(f"group_advantages: group_size must be >= 1, got {group_size}")
    if eps < 0:
        raise ValueError(f"group_advantages: eps must be >= 0, got {eps}")
    if rewards.dim() == 1:
        if rewards.numel() % group_size:
            raise ValueError(
                f"group_advantages: {rewards.numel()} rewards are not a multiple of group_size={group_size}"
            )
        groups = rewards.reshape(-1, group_size)
    elif rewards.dim() == 2:
        if rewards.shape[1] != group_size:
            raise ValueError(f"group_advantages: rewards[P, G] has G={rewards.shape[1]}, expected {group_size}")
        groups = rewards
    else:
        raise ValueError(f"group_advantages: rewards must be [P*G] or [P, G], got shape {tuple(rewards.shape)}")
    groups = groups.to(torch.float32)
    centred = groups - groups.mean(dim=1, keepdim=True)
    if scale_by_std and group_size > 1:
        centred = centred / (groups.std(dim=1, keepdim=True) + eps)
    constant = groups.amax(dim=1, keepdim=True) == groups.amin(dim=1, keepdim=True)
    advantages = torch.where(constant, torch.zeros_like(centred), centred)
    return advantages.reshape(rewards.shape)


@dataclass(frozen=True)
class GRPO:
    """GRPO (Shao et al., 2024) with the token-mean loss: every sequence counts, advantages
    ``group_advantages`` (std-scaled; ``scale_by_std=false``: Dr. GRPO's centred rewards), the
    symmetric clip ``policy.clip_eps``."""

    scale_by_std: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.scale_by_std, bool):
            raise ValueError(f"algorithm_options.scale_by_std must be a bool, got {self.scale_by_std!r}")

    def advantages(self, outcomes: Outcomes) -> Advantages:
        values = group_advantages(outcomes.rewards, outcomes.group_size, scale_by_std=self.scale_by_std)
        return Advantages.of(values, torch.ones_like(outcomes.truncated), outcomes)

    def policy_loss(self, logp_new: torch.Tensor, logp_old: torch.Tensor, advantages: torch.Tensor,
                    mask: torch.Tensor, clip_eps: float) -> tuple[torch.Tensor, dict[str, float]]:
        return clipped_pg_loss(logp_new, logp_old, advantages, mask, clip_eps)
