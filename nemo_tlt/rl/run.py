"""A run's identity and the functions of (seed, step) every rank agrees on.

Nothing the policy learns may depend on SD or on the order ranks finish: the
prompts of a step, its sampling seed and its sequence ids are functions of
(seed, step) only, and each rank's share of the prompts is a function of its rank.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from nemo_tlt.config import TLTConfig

MODES = ("tlt", "baseline")


@dataclass(frozen=True)
class RunSpec:
    """One run: the config, TLT or baseline, its folder, and the resolved model folders."""

    config: TLTConfig
    mode: str
    out_dir: str
    target_dir: str
    drafter_dir: str

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"RunSpec.mode must be one of {MODES}, got {self.mode!r}")

    @property
    def tlt(self) -> bool:
        return self.mode == "tlt"

    @property
    def checkpoint_dir(self) -> Path:
        d = Path(self.config.checkpoint.dir)
        return d if d.is_absolute() else Path(self.out_dir) / d


def prepare_run_dir(spec: RunSpec) -> Path:
    """Create the run's folder and checkpoint folder; refuse one we cannot write."""
    ckpt = spec.checkpoint_dir
    try:
        Path(spec.out_dir).mkdir(parents=True, exist_ok=True)
        ckpt.mkdir(parents=True, exist_ok=True)
        probe = ckpt / ".write-probe"
        probe.write_text("ok")
        probe.unlink()
    except OSError as err:
        raise ValueError(f"checkpoint.dir={spec.config.checkpoint.dir!r}: cannot write checkpoints to {ckpt} "
                         f"({err.strerror or err})") from None
    return ckpt


def step_seed(seed: int, step: int) -> int:
    """Sampling seed of an RL step: a function of (seed, step) only."""
    return (seed * 1_000_003 + step * 7919 + 17) % (2**62)


def step_rng(seed: int, step: int) -> np.random.Generator:
    """The generator a task source draws the step's prompts from."""
    return np.random.default_rng([seed, step, 0x71])


def shard_prompts(num_prompts: int, rank: int, world: int) -> list[int]:
    """Whole prompt groups per rank (p % world == rank), so group advantages stay local."""
    return [p for p in range(num_prompts) if p % world == rank]


def digest(token_lists: list[list[int]]) -> str:
    return hashlib.sha256(json.dumps(token_lists).encode()).hexdigest()[:16]
