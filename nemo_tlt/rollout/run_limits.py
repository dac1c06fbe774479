"""What a training run asks of its rollout engine, checked against the engine's declared
``EngineLimits`` before any work (pure: nothing is loaded).

``unsupported_settings(engine, limits, asks)``: one line per setting the engine cannot run,
naming the key, the engine and the engine's declared reason:

* ``grpo.acceptance`` outside ``limits.modes``;
* TLT mode (``rollout.sd_enabled`` or ``drafter.train_on_idle``) where the engine takes no torch
  drafter module (``limits.takes_drafter_modules``): the RL loop loads and retrains them;
* ``drafter.harvest_from=rollout`` with drafter training, where the engine returns no hidden
  states (``limits.hidden_states``).
"""
from __future__ import annotations

from dataclasses import dataclass

from nemo_tlt.rollout.protocol import EngineLimits


@dataclass(frozen=True)
class TrainRunAsks:
    """The settings of a training run that an engine is checked against."""

    acceptance: str           # grpo.acceptance
    sd_enabled: bool          # rollout.sd_enabled
    train_on_idle: bool       # drafter.train_on_idle
    harvest_from: str         # drafter.harvest_from

    @classmethod
    def of(cls, config) -> "TrainRunAsks":
        """From a run's ``TLTConfig``."""
        return cls(config.grpo.acceptance, config.rollout.sd_enabled, config.drafter.train_on_idle,
                   config.drafter.harvest_from)


def unsupported_settings(engine: str, limits: EngineLimits, asks: TrainRunAsks) -> list[str]:
    lines = []
    if asks.acceptance not in limits.modes:
        lines.append(f"grpo.acceptance={asks.acceptance} with rollout.engine={engine}: {limits.reason('modes')}")
    if (asks.sd_enabled or asks.train_on_idle) and not limits.takes_drafter_modules:
        lines.append(f"rollout.sd_enabled / drafter.train_on_idle (TLT mode) with rollout.engine={engine}: "
                     f"{limits.reason('drafter_modules')}")
    if asks.train_on_idle and asks.harvest_from == "rollout" and not limits.hidden_states:
        lines.append(f"drafter.harvest_from=rollout with rollout.engine={engine}: {limits.reason('hidden_states')}")
    return lines
