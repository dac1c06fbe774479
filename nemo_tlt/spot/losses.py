"""Loss adapters: `SpotTrainer` loss functions built from the drafter's own losses.

`eagle_loss_fn(target, ...)` returns ``loss_fn(drafter, samples)`` for the trainer:
harvested samples -> the drafter's padded EAGLE batch (``drafter.data``) -> the one
drafter loss entry point (``drafter.train.drafter_loss``). The target is only read
(its embedding and LM head); the trainer never updates it.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from nemo_tlt.drafter.data import pad_eagle_batch
from nemo_tlt.drafter.train import drafter_loss
from nemo_tlt.model.lm import DecoderLM
from nemo_tlt.spot.harvest import HarvestSample


def eagle_loss_fn(
    target: DecoderLM,
    reg_weight: float = 1.0,
    ce_weight: float = 0.1,
    dtype: torch.dtype = torch.float32,
) -> Callable[[nn.Module, list[HarvestSample]], tuple[torch.Tensor, dict[str, float]]]:
    """Loss for `SpotTrainer` over harvested samples (hidden states are upcast to `dtype`,
    the drafter's master dtype, and moved to the target's device batch by batch)."""
    device = target.lm_head_weight.device

    def loss_fn(drafter: nn.Module, samples: list[HarvestSample]) -> tuple[torch.Tensor, dict[str, float]]:
        batch = pad_eagle_batch([s.to_drafter_sample() for s in samples], dtype=dtype, device=device)
        loss, stats = drafter_loss(drafter, target, batch, reg_weight=reg_weight, ce_weight=ce_weight)
        return loss, {**stats, "tokens": float(batch.num_tokens)}

    return loss_fn
