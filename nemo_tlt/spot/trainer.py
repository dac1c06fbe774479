"""`SpotTrainer`: preemptible drafter training on a worker's idle time.

Contract
--------
* ``SpotTrainer(model, loss_fn, config, rank=0, seed=0)`` trains ``model`` with AdamW, linear warmup
  then cosine decay (``lr_schedule``), and gradient-norm clipping.
  ``loss_fn(model, samples: list[HarvestSample])`` returns the loss tensor, or
  ``(loss, stats: dict[str, float])``; ``spot.losses.eagle_loss_fn`` builds one for
  the EAGLE drafter.
* ``run(coordinator, buffer)`` trains on recency-weighted batches from a
  ``HarvestBuffer`` until ``coordinator.preempt_requested()``, checked before every
  micro-step. A preemption in the middle of gradient accumulation drops the partial
  gradients. So the device is handed back within one micro-step (plus an optimizer
  step), whatever the round length; no sleeping anywhere.
* Only samples whose gradients reached the weights count as "seen"; they are the
  weights of the elastic averaging ``synchronize`` performs when all ranks meet.
* ``train_while_idle`` is the whole idle-time protocol of one rank for one RL step:
  mark idle, wait for enough idle workers, train until preempted, meet, average
  (through the node leaders when given a multi-node ``NodeGroups``).
  Every rank calls it once its rollout share is done, whether or not it will train.
* The model's trainable parameters are its fp32 master weights (a ValueError
  otherwise), on whatever device they live; the optimizer state follows them. A
  bf16 target is read through casts at the drafter's boundary (nemo_tlt.drafter.base).
* All randomness (batch sampling from the host-resident buffer) comes from a CPU
  ``torch.Generator`` seeded by ``(seed, rank)``; ``state_dict`` / ``load_state_dict`` cover optimizer,
  step, generator and counters for exact resume through ``CheckpointManager``.
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Callable, ClassVar, List, Optional

import torch
import torch.distributed as dist
from torch import nn

from nemo_tlt.checks import check_int
from nemo_tlt.dist import NodeGroups
from nemo_tlt.optim import OptimConfig, build_optimizer
from nemo_tlt.spot.averaging import AverageStats, average_replicas
from nemo_tlt.spot.coordinator import WorkerCoordinator, WorkerState, idle_utilization
from nemo_tlt.spot.harvest import HarvestBuffer, HarvestSample

LossResult = torch.Tensor | tuple[torch.Tensor, dict[str, float]]
LossFn = Callable[[nn.Module, list[HarvestSample]], LossResult]


@dataclass(frozen=True)
class DrafterOptimConfig(OptimConfig):
    """The drafter's AdamW and schedule (``drafter.trainer.optim``): warmup, then cosine
    decay to 10% over ``decay_steps`` optimizer steps, counted over the whole run (not per
    idle round)."""

    KEY: ClassVar[str] = "drafter.trainer.optim"
    lr: float = 3e-4
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    warmup_steps: int = 10
    decay_steps: Optional[int] = 9_990
    min_lr_ratio: float = 0.1


@dataclass(frozen=True)
class SpotTrainerConfig:
    """batch_size: samples per micro-step; grad_accum: micro-steps per optimizer step.
    max_steps_per_round: cap on optimizer steps in one idle window (None: until preempted).
    optim: AdamW, gradient clip and LR schedule (``nemo_tlt.optim``)."""

    batch_size: int = 8
    grad_accum: int = 1
    max_steps_per_round: Optional[int] = None
    optim: DrafterOptimConfig = field(default_factory=DrafterOptimConfig)

    def __post_init__(self) -> None:
        for name in ("batch_size", "grad_accum"):
            check_int(f"SpotTrainerConfig.{name}", getattr(self, name), 1)
        if self.max_steps_per_round is not None:
            check_int("SpotTrainerConfig.max_steps_per_round", self.max_steps_per_round, 1)
        if not isinstance(self.optim, OptimConfig):
            raise ValueError(f"SpotTrainerConfig.optim must be an OptimConfig, got {type(self.optim).__name__}")


def lr_schedule(step: int, config: SpotTrainerConfig) -> float:
    """The learning rate of optimizer step ``step`` (warmup, then cosine decay)."""
    return config.optim.lr_at(step)


@dataclass
class RoundStats:
    """One idle window of one rank."""

    optimizer_steps: int = 0
    micro_steps: int = 0
    samples: int = 0  # samples whose gradients reached the weights
    tokens: int = 0
    loss_sum: float = 0.0
    preempted: bool = False
    train_seconds: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)  # last loss_fn stats

    @property
    def mean_loss(self) -> float:
        return self.loss_sum / self.micro_steps if self.micro_steps else float("nan")


class SpotTrainer:
    """Holds the drafter's optimizer and schedule across idle windows. See the module docstring."""

    def __init__(self, model: nn.Module, loss_fn: LossFn, config: SpotTrainerConfig, rank: int = 0,
                 seed: int = 0) -> None:
        self.model = model
        self.loss_fn = loss_fn
        self.config = config
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise ValueError("SpotTrainer: the model has no trainable parameters")
        low = sorted({str(p.dtype) for p in params if p.dtype != torch.float32})
        if low:
            raise ValueError(f"SpotTrainer: the model's trainable parameters are {low}; the trainer keeps fp32 "
                             "master weights (train the fp32 drafter, serve it as it is or a cast copy)")
        self.params = params
        self.optimizer, self.schedule = build_optimizer(params, config.optim)
        self.generator = torch.Generator(device="cpu").manual_seed(seed * 100_003 + rank)
        self.step = 0  # optimizer steps over the whole run (drives the schedule)
        self.samples_since_sync = 0
        self.tokens_trained = 0

    def run(self, coordinator: WorkerCoordinator, buffer: HarvestBuffer) -> RoundStats:
        """Train until preempted (or the round cap); returns within one micro-step of a request."""
        stats = RoundStats()
        if len(buffer) == 0:
            return stats
        start = time.perf_counter()
        self.model.train()
        cap = self.config.max_steps_per_round
        while cap is None or stats.optimizer_steps < cap:
            if not self._optimizer_step(coordinator, buffer, stats):
                stats.preempted = True
                break
        self.model.eval()
        stats.train_seconds = time.perf_counter() - start
        return stats

    def _optimizer_step(self, coordinator: WorkerCoordinator, buffer: HarvestBuffer, stats: RoundStats) -> bool:
        """One optimizer step of `grad_accum` micro-steps; False (and no update) when preempted."""
        cfg = self.config
        self.optimizer.zero_grad(set_to_none=True)
        samples = tokens = 0
        for _ in range(cfg.grad_accum):
            if coordinator.preempt_requested():
                self.optimizer.zero_grad(set_to_none=True)  # drop the partial accumulation
                return False
            batch = buffer.sample_batch(cfg.batch_size, self.generator)
            loss = self._loss(batch, stats)
            (loss / cfg.grad_accum).backward()
            samples += len(batch)
            tokens += sum(s.length for s in batch)
        self.schedule.apply(self.step)
        if cfg.optim.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, cfg.optim.grad_clip)
        self.optimizer.step()
        self.step += 1
        stats.optimizer_steps += 1
        stats.samples += samples
        stats.tokens += tokens
        self.samples_since_sync += samples
        self.tokens_trained += tokens
        return True

    def _loss(self, batch: list[HarvestSample], stats: RoundStats) -> torch.Tensor:
        result = self.loss_fn(self.model, batch)
        loss, extra = result if isinstance(result, tuple) else (result, {})
        if not torch.isfinite(loss):
            raise FloatingPointError(f"SpotTrainer: non-finite drafter loss {float(loss)} at step {self.step}")
        stats.micro_steps += 1
        stats.loss_sum += float(loss.detach())
        stats.extra = dict(extra)
        return loss

    def synchronize(self, group: dist.ProcessGroup | None = None, nodes: NodeGroups | None = None) -> AverageStats:
        """Collective: average replicas weighted by samples seen since the last sync (over
        `group`, or over every rank through the node groups `nodes`: ``average_replicas``)."""
        result = average_replicas(self.model, self.optimizer, float(self.samples_since_sync), group, nodes)
        self.step = max(self.step, int(self._optimizer_step_count()))
        self.samples_since_sync = 0
        return result

    def _optimizer_step_count(self) -> float:
        steps = [float(s["step"]) for s in self.optimizer.state.values() if "step" in s]
        return max(steps, default=0.0)

    def state_dict(self) -> dict:
        return {
            "optimizer": self.optimizer.state_dict(),
            "step": self.step,
            "samples_since_sync": self.samples_since_sync,
            "tokens_trained": self.tokens_trained,
            "generator": self.generator.get_state(),
        }

    def load_state_dict(self, state: dict) -> None:
        # Optimizer.load_state_dict keeps same-device tensors by reference; copy them so the
        # source (another live trainer, a cached checkpoint) cannot alias our moments.
        self.optimizer.load_state_dict(copy.deepcopy(state["optimizer"]))
        self.step = int(state["step"])
        self.samples_since_sync = int(state["samples_since_sync"])
        self.tokens_trained = int(state["tokens_trained"])
        self.generator.set_state(state["generator"])


@dataclass(frozen=True)
class IdleRoundReport:
    """Per-rank metrics of one RL step's idle window."""

    step: int
    rank: int
    round: RoundStats
    sync: AverageStats
    idle_seconds: float  # IDLE, not training
    training_seconds: float
    utilization: float  # training / (idle + training)
    stop_latency_s: float | None  # preemption requested -> trainer returned (None when not preempted)


def train_while_idle(
    step: int,
    coordinator: WorkerCoordinator,
    trainer: SpotTrainer,
    buffer: HarvestBuffer,
    group: dist.ProcessGroup | None = None,
    wait_timeout_s: float | None = None,
    nodes: NodeGroups | None = None,
) -> IdleRoundReport:
    """One rank's idle-time protocol for RL step `step` (a collective over all ranks).

    Call when this rank's rollout share is done. Trains only if the buffer has data and
    enough workers are idle; always meets the others and joins the averaging, so ranks
    that never became idle (they call this last) cannot deadlock the ones that did.
    The averaging runs over `group`, or over every rank through the node groups `nodes`.
    """
    window_start = coordinator.timeline[-1].time
    coordinator.mark_idle()
    stats, stop_latency = RoundStats(), None
    if len(buffer) > 0 and coordinator.wait_for_work(wait_timeout_s):
        coordinator.start_training()
        stats = trainer.run(coordinator, buffer)
        requested_at = coordinator.preempt_requested_at
        if stats.preempted and requested_at is not None:
            stop_latency = max(0.0, coordinator.now() - requested_at)
        coordinator.stop_training()
    coordinator.meet(step)
    sync = trainer.synchronize(group, nodes)
    durations = coordinator.durations(window_start)
    return IdleRoundReport(
        step=step,
        rank=coordinator.rank,
        round=stats,
        sync=sync,
        idle_seconds=durations[WorkerState.IDLE],
        training_seconds=durations[WorkerState.TRAINING],
        utilization=idle_utilization(durations),
        stop_latency_s=stop_latency,
    )

