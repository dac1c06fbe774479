"""``RLAlgorithm``: what an RL algorithm decides in a step (advantages, which sequences count,
the policy loss), apart from how the step runs.

Contract
--------
* ``advantages(outcomes) -> Advantages``: from whole groups' outcomes (``Outcomes``: rewards,
  response lengths and truncation, ``[P, G]``) the per-sequence advantages ``values[P * G]``
  (float32, sequence order ``p * G + g``) and ``counted[P * G]`` (bool): the sequences whose
  tokens enter the step's loss and its token mean. A sequence not counted has advantage 0.
  Pure and deterministic, a function of the group alone: the synchronous update computes it
  over a rank's groups, the pipelined update group by group, with the same values.
  A group size the algorithm cannot use raises a ValueError naming ``grpo.group_size``.
* ``policy_loss(logp_new[B, T], logp_old[B, T], advantages[B], mask[B, T], clip_eps)
  -> (loss, stats)``: the token mean over ``mask`` of the per-token policy loss (a scalar
  with gradient to ``logp_new`` only) and float stats ``clip_frac``, ``approx_kl``. Both
  policy backends call it on each micro-batch, with ``mask`` already restricted to counted
  sequences, and scale it to its share of the step's token mean.

The step's token mean is over counted tokens only (``Advantages.tokens``), so a sequence an
algorithm drops changes neither the gradient nor the mean of the others.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence, runtime_checkable

import torch


@dataclass(frozen=True)
class Outcomes:
    """Whole groups' results, host tensors. ``rewards[P, G]`` float32, ``lengths[P, G]`` int64
    (response tokens), ``truncated[P, G]`` bool (stopped by ``max_new_tokens``, without EOS)."""

    rewards: torch.Tensor
    lengths: torch.Tensor
    truncated: torch.Tensor
    max_new_tokens: int

    @classmethod
    def of(cls, rewards: Sequence[float], responses: Sequence[Sequence[int]], group_size: int,
           max_new_tokens: int, eos_id: int) -> "Outcomes":
        """From a flat list of rewards and responses (the G of a prompt contiguous)."""
        if len(rewards) != len(responses):
            raise ValueError(f"Outcomes.of: {len(rewards)} rewards for {len(responses)} responses")
        if group_size < 1 or len(rewards) % group_size:
            raise ValueError(f"Outcomes.of: {len(rewards)} sequences are not whole groups of {group_size}")
        shape = (len(rewards) // group_size, group_size)
        lengths = [len(r) for r in responses]
        truncated = [len(r) >= max_new_tokens and (not r or r[-1] != eos_id) for r in responses]
        host = dict(device="cpu")  # host values: the advantages are computed where the rewards are
        return cls(torch.tensor(rewards, dtype=torch.float32, **host).reshape(shape),
                   torch.tensor(lengths, dtype=torch.int64, **host).reshape(shape),
                   torch.tensor(truncated, dtype=torch.bool, **host).reshape(shape), max_new_tokens)

    @property
    def group_size(self) -> int:
        return self.rewards.shape[1]


@dataclass(frozen=True)
class Advantages:
    """``values[P * G]`` float32 (0 where not counted), ``counted[P * G]`` bool, ``tokens``:
    the counted sequences' response tokens."""

    values: torch.Tensor
    counted: torch.Tensor
    tokens: int

    @classmethod
    def of(cls, values: torch.Tensor, counted: torch.Tensor, outcomes: Outcomes) -> "Advantages":
        values, counted = values.reshape(-1), counted.reshape(-1)
        values = torch.where(counted, values, torch.zeros_like(values))
        return cls(values, counted, int(outcomes.lengths.reshape(-1)[counted].sum()))


def advantages_of(algorithm: "RLAlgorithm", rewards: Sequence[float], responses: Sequence[Sequence[int]], *,
                  group_size: int, max_new_tokens: int, eos_id: int) -> Advantages:
    """``algorithm``'s advantages of whole groups given as flat rewards and responses."""
    return algorithm.advantages(Outcomes.of(rewards, responses, group_size, max_new_tokens, eos_id))


def counted_kwarg(advantages: Advantages) -> dict[str, torch.Tensor]:
    """``counted=`` for a backend's ``update`` / ``accumulate`` when the algorithm drops
    sequences, nothing when every one counts (the plain path, which any backend takes)."""
    return {} if bool(advantages.counted.all()) else {"counted": advantages.counted}


@runtime_checkable
class RLAlgorithm(Protocol):
    def advantages(self, outcomes: Outcomes) -> Advantages: ...

    def policy_loss(self, logp_new: torch.Tensor, logp_old: torch.Tensor, advantages: torch.Tensor,
                    mask: torch.Tensor, clip_eps: float) -> tuple[torch.Tensor, dict[str, float]]: ...
