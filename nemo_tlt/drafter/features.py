"""The drafter features: what a target forward hands a drafter per position (pure).

One definition for every producer (the torch rollout engine, the torch and Megatron
policy forwards) and consumer (the drafters, their training, the harvest buffer):

* a drafter without ``capture_layers`` (EAGLE-2, Medusa) reads the target's final
  hidden state (after the final norm), ``[H]``;
* a drafter with ``capture_layers`` (EAGLE-3) reads the outputs of those target
  decoder layers in that order (repeats allowed), then the final hidden state,
  ``[(k + 1) * H]``: the first ``k * H`` are the drafter's input, the final state its
  training target (soft labels; nemo_tlt.drafter.ttt).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch


def feature_width(hidden_size: int, capture_layers: Sequence[int] | None) -> int:
    """Width of one position's features for a drafter capturing ``capture_layers``."""
    return (len(capture_layers or ()) + 1) * hidden_size


def join_features(final: torch.Tensor, captured: torch.Tensor | Sequence[torch.Tensor] | None) -> torch.Tensor:
    """The features from the final hidden state ``[..., H]`` and the captured layers
    (``[..., k*H]`` already in capture order, or a sequence of ``[..., H]`` in capture
    order; None or empty: no capture)."""
    if captured is None or (not isinstance(captured, torch.Tensor) and len(captured) == 0):
        return final
    parts = [captured] if isinstance(captured, torch.Tensor) else list(captured)
    return torch.cat([*parts, final], -1)


def split_features(features: torch.Tensor, num_captured: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(captured layers ``[..., k*H]``, final state ``[..., H]``) of EAGLE-3 features
    with ``num_captured`` = k layers."""
    hidden = features.shape[-1] // (num_captured + 1)
    if hidden * (num_captured + 1) != features.shape[-1]:
        raise ValueError(f"split_features: features are {features.shape[-1]} wide, not a multiple of "
                         f"{num_captured + 1} ({num_captured} captured layers and the final state)")
    return features[..., : num_captured * hidden], features[..., num_captured * hidden:]
