"""Drafter kinds by name: how a kind is saved, loaded, trained and started for a target.

``DRAFTER_KINDS`` maps the ``kind`` of ``drafter.json`` (and a drafter class's ``kind``
attribute) to a `DrafterKind`: the built-in ``eagle`` (EAGLE / EAGLE-2's one-layer drafter),
``eagle3`` and ``medusa``, any registered name, or an import path ``package.module:KIND``,
so a drafter defined outside the package is one file: its class, with ``kind`` set to that
path, and its ``DrafterKind``. Calling a kind builds an untrained drafter from the
``drafter.json`` dict (`nemo_tlt.drafter.io`); ``loss`` is its training loss
(`nemo_tlt.drafter.train.drafter_loss`); ``for_target`` starts one for a target
(``nemo-tlt drafter train``), None for a kind that command does not train.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable

import torch
from torch import nn

from nemo_tlt.drafter.data import EagleBatch
from nemo_tlt.drafter.eagle import EagleConfig, EagleDrafter
from nemo_tlt.drafter.eagle3 import Eagle3Config, Eagle3Drafter
from nemo_tlt.drafter.loss import eagle_loss, medusa_loss
from nemo_tlt.drafter.medusa import MedusaConfig, MedusaDrafter
from nemo_tlt.drafter.ttt import eagle3_loss
from nemo_tlt.model.config import LMConfig
from nemo_tlt.model.lm import DecoderLM
from nemo_tlt.registry import Registry

# (drafter, target, batch, features [B, T, F] (noised), reg_weight, ce_weight) -> (loss, stats)
KindLoss = Callable[[nn.Module, DecoderLM, EagleBatch, torch.Tensor, float, float],
                    tuple[torch.Tensor, dict[str, float]]]


@dataclass(frozen=True)
class DrafterKind:
    """``from_config(drafter.json dict)`` -> an untrained drafter; ``config_dict(drafter)``: what
    ``drafter.json`` holds besides ``kind``; ``loss``; ``input_width(drafter, F)``: how many of a
    position's F feature columns the drafter reads (training noise goes there; the rest are
    labels); ``for_target(target, generator, draft_depth)`` or None."""

    name: str
    from_config: Callable[[dict], nn.Module]
    config_dict: Callable[[nn.Module], dict]
    loss: KindLoss
    input_width: Callable[[nn.Module, int], int] = lambda drafter, width: width
    for_target: Callable[[DecoderLM, torch.Generator, int], nn.Module] | None = None

    def __call__(self, config: dict) -> nn.Module:
        return self.from_config(config)


def _eagle_loss(drafter, target, batch, feat, reg_weight, ce_weight):
    pred = drafter(target, batch.next_tokens, feat, batch.positions, None, batch.new_mask)
    return eagle_loss(pred, batch.target_feat, target.lm_head_weight.detach(), batch.mask, reg_weight, ce_weight)


def _eagle3_loss(drafter, target, batch, feat, reg_weight, ce_weight):
    # cross-entropy against the target's distribution over the drafter's TTT steps; the
    # feature-regression weights do not apply (EAGLE-3 dropped that loss)
    return eagle3_loss(drafter, target, batch, feat)


def _medusa_loss(drafter, target, batch, feat, reg_weight, ce_weight):
    if batch.new_mask is not None:
        # head k at t is scored against t+k+1, which in a packed row may be the next sample
        raise ValueError("drafter_loss: Medusa heads need a padded batch (one sample per row), got a packed one")
    # Medusa reads f_t directly; in_feat holds f_0..f_{n-1} of each sample
    return medusa_loss(drafter(feat), batch.in_feat, target.lm_head_weight.detach(), batch.mask)


def _eagle3_for_target(target: DecoderLM, generator: torch.Generator, draft_depth: int) -> Eagle3Drafter:
    drafter = Eagle3Drafter(Eagle3Config.from_target(target.config, ttt_steps=draft_depth), generator=generator)
    drafter.init_head_from(target)  # its own head starts as the target's
    return drafter


EAGLE = DrafterKind(
    "eagle", lambda c: EagleDrafter(EagleConfig(LMConfig(**c["layer"]))),
    lambda d: {"layer": d.config.layer.to_dict()}, _eagle_loss,
    for_target=lambda target, generator, depth: EagleDrafter(EagleConfig.from_target(target.config),
                                                             generator=generator))
EAGLE3 = DrafterKind(
    "eagle3", lambda c: Eagle3Drafter(Eagle3Config.from_dict(c)), lambda d: d.config.to_dict(), _eagle3_loss,
    # the features end with the final state, a training label only
    input_width=lambda drafter, width: drafter.fc.in_features, for_target=_eagle3_for_target)
MEDUSA = DrafterKind(
    "medusa", lambda c: MedusaDrafter(MedusaConfig(c["hidden_size"], c["vocab_size"], c["num_heads"])),
    lambda d: asdict(d.config), _medusa_loss)

DRAFTER_KINDS = Registry("drafter kind", "drafter kind", {
    "eagle": "nemo_tlt.drafter.kinds:EAGLE",
    "eagle3": "nemo_tlt.drafter.kinds:EAGLE3",
    "medusa": "nemo_tlt.drafter.kinds:MEDUSA",
})
# other names the commands accept for a kind: "eagle2" is EAGLE-2's drafter, kind "eagle"
KIND_ALIASES = {"eagle2": "eagle"}


def kind_named(name: str, source: str = "drafter kind") -> DrafterKind:
    """The ``DrafterKind`` ``name`` stands for (ValueError naming ``source`` otherwise)."""
    try:
        kind = DRAFTER_KINDS.get(name)
    except ValueError as err:
        raise ValueError(f"{source}: {err}") from None
    if not isinstance(kind, DrafterKind):
        raise ValueError(f"{source}: {name!r} is a {type(kind).__name__}, not a DrafterKind")
    return kind


def kind_of(drafter: nn.Module) -> DrafterKind:
    """The kind of a drafter, from its class's ``kind`` attribute."""
    name = getattr(drafter, "kind", None)
    if not isinstance(name, str):
        raise ValueError(f"unsupported drafter type {type(drafter).__name__}: it has no `kind` naming a drafter kind")
    return kind_named(name, f"{type(drafter).__name__}.kind")
