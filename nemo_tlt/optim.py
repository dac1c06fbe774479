"""The one optimizer + learning-rate schedule every trainer builds (policy, SFT, drafters).

Contract
--------
* ``OptimConfig`` holds AdamW's hyperparameters, gradient clipping and the schedule:
  linear warmup over ``warmup_steps`` (step 0 already gets ``lr / warmup_steps``), then
  cosine decay from ``lr`` to ``lr * min_lr_ratio`` over ``decay_steps``, flat afterwards.
  ``decay_steps=None`` keeps ``lr`` after warmup (``min_lr_ratio`` must then be 1);
  ``warmup_steps=0, min_lr_ratio=1`` is a constant LR.
* Error messages name the YAML key: a subclass sets the class variable ``KEY`` (e.g.
  ``"policy.optim"``) and every message reads ``<KEY>.<field> must be ...``. ``KEY`` is
  a ``ClassVar``, not a field, so OmegaConf structured configs never see it.
* ``build_optimizer(params_or_groups, cfg)`` returns ``(AdamW, LRSchedule)``; the schedule
  sets every param group's LR to exactly ``warmup_cosine_lr(step, ...)`` (not a factor
  times the base LR, which would round differently) when ``apply(step)`` is called, once
  before each optimizer step. The caller owns the step counter and the gradient clip.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterable, List, Optional

import torch

from nemo_tlt.checks import check_float, check_int


def warmup_cosine_lr(step: int, peak: float, warmup_steps: int, decay_steps: int, min_ratio: float) -> float:
    """Linear warmup over `warmup_steps` (step 0 already gets peak / warmup_steps), then
    cosine decay from `peak` to `peak * min_ratio` over `decay_steps`, flat afterwards."""
    if step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    progress = min((step - warmup_steps) / max(decay_steps, 1), 1.0)
    return peak * (min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress)))


@dataclass(frozen=True)
class OptimConfig:
    KEY: ClassVar[str] = "optim"

    lr: float = 5e-5
    weight_decay: float = 0.0
    betas: List[float] = field(default_factory=lambda: [0.9, 0.99])
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping
    warmup_steps: int = 0
    decay_steps: Optional[int] = None
    min_lr_ratio: float = 1.0

    def __post_init__(self) -> None:
        key = self.KEY
        check_float(f"{key}.lr", self.lr, 0, lo_open=True)
        check_float(f"{key}.weight_decay", self.weight_decay, 0)
        check_float(f"{key}.grad_clip", self.grad_clip, 0)
        if len(self.betas) != 2:
            raise ValueError(f"{key}.betas must be two numbers [beta1, beta2], got {list(self.betas)!r}")
        for i, beta in enumerate(self.betas):
            check_float(f"{key}.betas[{i}]", beta, 0, 1, hi_open=True)
        check_int(f"{key}.warmup_steps", self.warmup_steps, 0)
        if self.decay_steps is not None:
            check_int(f"{key}.decay_steps", self.decay_steps, 0)
        check_float(f"{key}.min_lr_ratio", self.min_lr_ratio, 0, 1)
        if self.decay_steps is None and self.min_lr_ratio != 1.0:
            raise ValueError(f"{key}.min_lr_ratio={self.min_lr_ratio!r} needs {key}.decay_steps "
                             "(the steps over which the LR decays), got None")

    def lr_at(self, step: int) -> float:
        """The learning rate of 0-based optimizer step ``step``."""
        if self.decay_steps is None and step >= self.warmup_steps:
            return self.lr
        return warmup_cosine_lr(step, self.lr, self.warmup_steps, self.decay_steps or 0, self.min_lr_ratio)


class LRSchedule:
    """Sets the LR of every param group of ``optimizer`` for a given step (see the module contract)."""

    def __init__(self, optimizer: torch.optim.Optimizer, config: OptimConfig) -> None:
        self.optimizer, self.config = optimizer, config

    def apply(self, step: int) -> float:
        lr = self.config.lr_at(step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr


def build_optimizer(params_or_groups: Iterable[Any], config: OptimConfig, *, foreach: bool | None = None
                    ) -> tuple[torch.optim.AdamW, LRSchedule]:
    """AdamW over parameters (or param groups; a group's own ``weight_decay`` wins) and its schedule.

    ``foreach`` is passed to AdamW (None: torch's default for the device)."""
    optimizer = torch.optim.AdamW(params_or_groups, lr=config.lr, betas=(config.betas[0], config.betas[1]),
                                  weight_decay=config.weight_decay, foreach=foreach)
    return optimizer, LRSchedule(optimizer, config)
