"""DAPO (Yu et al., 2025, "DAPO: an open-source LLM reinforcement learning system at scale"):
GRPO's group advantages with clip-higher, overlong filtering or soft overlong punishment, and
dynamic sampling as a filter. The token-level loss (a token mean over the step) is the
project's convention for every algorithm (``nemo_tlt.algorithms.loss``)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from nemo_tlt.algorithms.grpo import group_advantages
from nemo_tlt.algorithms.loss import clipped_pg_loss
from nemo_tlt.algorithms.protocol import Advantages, Outcomes
from nemo_tlt.checks import check_float, check_int


def overlong_penalty(lengths: torch.Tensor, max_new_tokens: int, buffer: int, factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment (its eq. 13), float32 like ``lengths``: 0 up to
    ``max_new_tokens - buffer`` tokens, then falling linearly to ``-factor`` at ``max_new_tokens``
    (a response cannot be longer here: generation stops there). ``buffer`` 0: all zeros."""
    if buffer == 0:
        return torch.zeros(lengths.shape, dtype=torch.float32, device=lengths.device)
    start = max_new_tokens - buffer
    over = (lengths.to(torch.float32) - start).clamp(min=0.0)
    return -factor * (over / buffer).clamp(max=1.0)


@dataclass(frozen=True)
class DAPO:
    """``clip_eps_high``: the upper ratio clip (the lower one is ``policy.clip_eps``).
    ``overlong_filter``: truncated responses do not count (no gradient, not in the token mean).
    ``overlong_buffer`` > 0 (tokens): the soft overlong punishment over the last that many
    tokens of ``grpo.max_new_tokens``, scaled by ``overlong_penalty``, added to the rewards the
    advantages are computed from (the logged rewards stay the task's).
    ``dynamic_sampling``: a group whose (shaped) rewards are all equal does not count. DAPO
    then samples more prompts to fill the batch; here the step's prompts are fixed by
    (seed, step), so the step trains on the groups that carry a signal and its token mean is
    over theirs. A step with no counted sequence still takes its optimizer step, on a zero
    gradient (AdamW's momentum and weight decay still move the weights; the schedule advances)."""

    clip_eps_high: float = 0.28
    overlong_filter: bool = True
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0
    dynamic_sampling: bool = True

    def __post_init__(self) -> None:
        check_float("algorithm_options.clip_eps_high", self.clip_eps_high, 0.0, lo_open=True)
        for name in ("overlong_filter", "dynamic_sampling"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"algorithm_options.{name} must be a bool, got {getattr(self, name)!r}")
        check_int("algorithm_options.overlong_buffer", self.overlong_buffer, 0)
        check_float("algorithm_options.overlong_penalty", self.overlong_penalty, 0.0)

    def advantages(self, outcomes: Outcomes) -> Advantages:
        if self.overlong_buffer > outcomes.max_new_tokens:
            raise ValueError(f"algorithm_options.overlong_buffer={self.overlong_buffer} is longer than "
                             f"grpo.max_new_tokens={outcomes.max_new_tokens}")
        rewards = outcomes.rewards + overlong_penalty(outcomes.lengths, outcomes.max_new_tokens,
                                                      self.overlong_buffer, self.overlong_penalty)
        values = group_advantages(rewards, outcomes.group_size)
        counted = torch.ones_like(outcomes.truncated)
        if self.overlong_filter:
            counted &= ~outcomes.truncated
        if self.dynamic_sampling:
            uniform = rewards.amax(dim=1, keepdim=True) == rewards.amin(dim=1, keepdim=True)
            counted &= ~uniform
        return Advantages.of(values, counted, outcomes)

    def policy_loss(self, logp_new: torch.Tensor, logp_old: torch.Tensor, advantages: torch.Tensor,
                    mask: torch.Tensor, clip_eps: float) -> tuple[torch.Tensor, dict[str, float]]:
        return clipped_pg_loss(logp_new, logp_old, advantages, mask, clip_eps, self.clip_eps_high)
