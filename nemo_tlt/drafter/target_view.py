"""The parts of the target a drafter reads, without the target's decoder layers.

Contract
--------
A drafter (EAGLE, Medusa) reads the target's token embedding, final norm, LM head,
rotary tables and config, never its decoder layers. ``TargetView`` is a
``DecoderLM`` of the target's own config whose layer list is empty: it costs the
embedding and head only, so whoever trains a drafter (the RL loop's idle-time
trainer) needs no second copy of the policy and no access to the rollout engine's
model. ``update(name, tensor)`` takes canonical (HF-named) tensors from a weight
stream and keeps the ones the view holds; the others are ignored. The view is
frozen: nothing trains it. ``placement`` (keyword; default CPU fp32) is the device
and dtype of its tensors (a streamed tensor is copied in and cast); its rotary
tables are computed in fp32 and cast like the target's.
"""
from __future__ import annotations

from typing import Iterable, Mapping

import torch
from torch import nn

from nemo_tlt.device import Placement
from nemo_tlt.model.config import LMConfig
from nemo_tlt.model.lm import DecoderLM
from nemo_tlt.model.rope import rope_tables_for


class TargetView(DecoderLM):
    """A layer-less ``DecoderLM``: embedding, final norm, LM head and rope of a target."""

    def __init__(self, config: LMConfig, *, placement: Placement = Placement()) -> None:
        with torch.device("meta"):
            super().__init__(config)
        self.model.layers = nn.ModuleList()
        self.to_empty(device=placement.device).to(placement.dtype)
        cos, sin = rope_tables_for(config)
        self.rope_cos = cos.to(placement.device, placement.dtype)
        self.rope_sin = sin.to(placement.device, placement.dtype)
        self.requires_grad_(False).eval()
        self._names = set(self.state_dict())
        self._seen: set[str] = set()

    @property
    def names(self) -> frozenset[str]:
        """The canonical tensor names this view holds."""
        return frozenset(self._names)

    @torch.no_grad()
    def update(self, name: str, tensor: torch.Tensor) -> None:
        """Copy ``tensor`` in if ``name`` is one of the view's tensors (shape checked)."""
        if name not in self._names:
            return
        own = self.get_parameter(name)
        if tuple(tensor.shape) != tuple(own.shape):
            raise ValueError(f"TargetView: {name} has shape {tuple(tensor.shape)}, the target's config implies "
                             f"{tuple(own.shape)}")
        own.copy_(tensor)
        self._seen.add(name)

    def load(self, weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> "TargetView":
        """Fill the view from a complete canonical state dict or stream; every tensor the
        view holds must be in it."""
        self._seen = set()
        for name, tensor in (weights.items() if isinstance(weights, Mapping) else weights):
            self.update(name, tensor)
        self.check_complete()
        return self

    def check_complete(self) -> None:
        missing = sorted(self._names - self._seen)
        if missing:
            raise ValueError(f"TargetView: the weights lack {missing}")
