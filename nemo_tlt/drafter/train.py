"""Offline drafter training on the target's own generations.

`drafter_loss` is the one loss entry point (EAGLE, EAGLE-3 or Medusa, padded or
packed batch) that the idle-time spot trainer reuses; `train_drafter` is a minimal AdamW
loop over padded batches for a drafter trained once, e.g. for the benchmark, built on
`drafter_step` (one optimizer step), which `nemo-tlt drafter train` drives with packing
and checkpoints.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from tqdm.auto import tqdm

from nemo_tlt.checks import check_float, check_int
from nemo_tlt.drafter.data import DrafterSample, EagleBatch, pad_eagle_batch
from nemo_tlt.drafter.kinds import kind_of
from nemo_tlt.model.lm import DecoderLM
from nemo_tlt.optim import OptimConfig, build_optimizer


@dataclass(frozen=True)
class DrafterTrainConfig:
    steps: int = 300
    batch_size: int = 16
    lr: float = 3e-3
    weight_decay: float = 0.0
    warmup_steps: int = 20
    grad_clip: float = 1.0
    feature_noise: float = 0.05   # uniform noise on input features (EAGLE's robustness trick)
    reg_weight: float = 1.0
    ce_weight: float = 0.1
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size"):
            check_int(f"DrafterTrainConfig.{name}", getattr(self, name), 1)
        check_int("DrafterTrainConfig.warmup_steps", self.warmup_steps, 0)
        check_int("DrafterTrainConfig.seed", self.seed)
        check_float("DrafterTrainConfig.lr", self.lr, 0, lo_open=True)
        for name in ("weight_decay", "grad_clip", "feature_noise", "reg_weight", "ce_weight"):
            check_float(f"DrafterTrainConfig.{name}", getattr(self, name), 0)


def drafter_loss(drafter: nn.Module, target: DecoderLM, batch: EagleBatch, reg_weight: float = 1.0,
                 ce_weight: float = 0.1, noise: float = 0.0, generator: torch.Generator | None = None
                 ) -> tuple[torch.Tensor, dict[str, float]]:
    kind = kind_of(drafter)
    feat = batch.in_feat
    if noise > 0:
        # only the columns the drafter reads (EAGLE-3's features end with a label: the final state)
        width = kind.input_width(drafter, feat.shape[-1])
        jitter = (torch.rand((*feat.shape[:-1], width), generator=generator) * 2 - 1).to(feat.dtype) * noise
        feat = torch.cat((feat[..., :width] + jitter, feat[..., width:]), -1)
    return kind.loss(drafter, target, batch, feat, reg_weight, ce_weight)


def optim_config(config: DrafterTrainConfig) -> OptimConfig:
    """AdamW (torch's default betas) with linear warmup then cosine decay to 10% of the peak."""
    return OptimConfig(lr=config.lr, weight_decay=config.weight_decay, betas=[0.9, 0.999],
                       grad_clip=config.grad_clip, warmup_steps=config.warmup_steps,
                       decay_steps=max(0, config.steps - config.warmup_steps), min_lr_ratio=0.1)


def lr_at(step: int, config: DrafterTrainConfig) -> float:
    return optim_config(config).lr_at(step)


def train_drafter(drafter: nn.Module, target: DecoderLM, samples: list[DrafterSample],
                  config: DrafterTrainConfig, progress: bool = True) -> list[dict[str, float]]:
    if not samples:
        raise ValueError("train_drafter: no samples")
    drafter.train()
    gen = torch.Generator().manual_seed(config.seed)
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt, schedule = build_optimizer(params, optim_config(config))
    history = []
    bar = tqdm(range(config.steps), desc=f"train {getattr(drafter, 'kind', 'drafter')} drafter",
               disable=not progress, leave=False)
    for step in bar:
        schedule.apply(step)
        stats = drafter_step(drafter, target, samples, pad_eagle_batch, opt, config, gen)
        history.append(stats)
        bar.set_postfix(loss=f"{stats['loss']:.3f}")
    drafter.eval()
    return history


def drafter_step(drafter: nn.Module, target: DecoderLM, samples: list[DrafterSample],
                 make_batch: Callable[[list[DrafterSample]], EagleBatch], opt: torch.optim.Optimizer,
                 config: DrafterTrainConfig, gen: torch.Generator) -> dict[str, float]:
    """One optimizer step on ``config.batch_size`` samples drawn with replacement from
    ``gen``, laid out by ``make_batch`` (``pad_eagle_batch``, or a packing of
    nemo_tlt.drafter.packing); the caller sets the step's learning rate first."""
    idx = torch.randint(len(samples), (config.batch_size,), generator=gen).tolist()
    batch = make_batch([samples[i] for i in idx])
    loss, stats = drafter_loss(drafter, target, batch, config.reg_weight, config.ce_weight,
                               config.feature_noise, gen)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if config.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], config.grad_clip)
    opt.step()
    stats["loss"] = float(loss.detach())
    return stats
