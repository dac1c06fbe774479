"""The ``drafter:`` block: drafter training on idle workers (TLT runs only).

``trainer`` is the idle-time trainer's own config (:class:`SpotTrainerConfig`);
the fields beside it say whether and when workers train, where the training data
comes from, and how the training thread yields to busy work.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from nemo_tlt.checks import check_int
from nemo_tlt.device import DTYPES
from nemo_tlt.spot.trainer import DrafterOptimConfig, SpotTrainerConfig

HARVEST_SOURCES = ("rollout", "policy")


@dataclass(frozen=True)
class IdleDrafterConfig:
    train_on_idle: bool = True
    min_idle_workers: int = 1  # idle workers needed before any starts training
    # Where the (tokens, hidden states) the drafter learns from come from: "rollout" (the
    # rollout engine's own forward, trained on in the same step's idle time) or "policy"
    # (the policy backend's log-prob / update forward, e.g. megatron-core's, for engines
    # that cannot return hidden states; trained on in the next step's idle time).
    harvest_from: str = "rollout"
    harvest_max_mb: int = 256
    # OS niceness of the thread that trains on idle time (0: same as rollout). Where
    # workers share CPU cores, a busy worker's tail rollout must win every contention.
    nice: int = 19
    # The dtype the rollout engine serves the drafter in: float32 serves the trained module
    # itself; bfloat16 a copy rounded from the fp32 master weights (which the trainer keeps
    # either way) whenever the engine is handed the drafter, after every training round. It
    # changes the proposals, never the emitted tokens (verification is the target's).
    serve_dtype: str = "float32"
    trainer: SpotTrainerConfig = field(
        default_factory=lambda: SpotTrainerConfig(optim=DrafterOptimConfig(warmup_steps=5, decay_steps=9_995)))

    def __post_init__(self) -> None:
        if not isinstance(self.train_on_idle, bool):
            raise ValueError(f"IdleDrafterConfig.train_on_idle must be a bool, got {self.train_on_idle!r}")
        check_int("IdleDrafterConfig.min_idle_workers", self.min_idle_workers, 1)
        if self.harvest_from not in HARVEST_SOURCES:
            raise ValueError(f"IdleDrafterConfig.harvest_from must be one of {', '.join(HARVEST_SOURCES)}, "
                             f"got {self.harvest_from!r}")
        check_int("IdleDrafterConfig.harvest_max_mb", self.harvest_max_mb, 1)
        check_int("IdleDrafterConfig.nice", self.nice, 0, 19)
        if self.serve_dtype not in DTYPES:
            raise ValueError(f"IdleDrafterConfig.serve_dtype must be one of {', '.join(DTYPES)}, "
                             f"got {self.serve_dtype!r}")
