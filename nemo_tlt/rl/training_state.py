"""Where the policy's training state is while the engine decodes (``rollout.training_state``),
and the engine's memory while the policy updates (``rollout.vllm.enable_sleep_mode``).

Contract: ``TrainingState(policy, setting, backend)`` on every rank. With ``resident`` (the
default) its calls do nothing. With ``offload`` the backend must implement
``OffloadsTrainingState`` (``nemo_tlt.policy.protocol``; refused naming the setting and the
backend otherwise): ``offload()`` moves the weights, gradient buffers, optimizer state and KL
reference to host memory before the rollout (the engine serves its own copy of the weights,
so the rollout reads none of it), and ``reload()`` brings them back before the policy is used
again. The loop reloads at the first place its update needs the policy:

* the synchronous update: after the meet, so the idle-time drafter also trains with that
  device memory free;
* the pipelined update (``policy.pipelined_update``): as soon as this rank's own rollout has
  returned and before it claims its first piece (TLT), or before it computes its own groups
  (baseline). The update's pieces never run while this rank's engine decodes, so the
  pipelined update needs no exception and no refusal.

A reload of a resident state does nothing, so the loop calls it at both places. ``seconds()``
is what the step's moves have cost so far; ``times()`` gives the record's ``offload_s``,
``reload_s`` and ``engine_sleep_s`` (counted in ``other_s``: the loop takes them out of
``rollout_s``). The update after a reload is bit for bit the update without the move (the
backends' tests).

The engine: where it implements ``SleepsBetweenRollouts`` (``nemo_tlt.rollout.protocol``) and
``sleeps`` (vLLM built with ``enable_sleep_mode``), the first ``reload()`` of a step, the first
place this rank's rollout is known to be over, puts it to sleep; it wakes by itself at the
weight sync that follows the update (whose seconds then include the wake-up).
"""
from __future__ import annotations

import time
from typing import Any

from nemo_tlt.policy.protocol import OffloadsTrainingState, require
from nemo_tlt.rollout.protocol import SleepsBetweenRollouts


class TrainingState:
    def __init__(self, policy: Any, setting: str, backend: str, engine: Any = None) -> None:
        self.policy = policy if setting == "offload" else None
        if self.policy is not None:
            require(policy, OffloadsTrainingState, backend, "rollout.training_state=offload")
        self.engine = engine if isinstance(engine, SleepsBetweenRollouts) and engine.sleeps else None
        self.offload_s = self.reload_s = self.engine_sleep_s = 0.0
        self.away = self.awake = False

    def offload(self) -> None:
        """Before the rollout; starts the step's seconds at 0."""
        self.offload_s = self.reload_s = self.engine_sleep_s = 0.0
        self.awake = self.engine is not None
        if self.policy is None:
            return
        t0 = time.perf_counter()
        self.policy.offload_training_state()
        self.offload_s, self.away = time.perf_counter() - t0, True

    def reload(self) -> None:
        """Before the policy's next use (this rank's rollout is over): the engine sleeps, the
        state comes back; nothing when both are done."""
        if self.awake:
            t0 = time.perf_counter()
            self.engine.sleep()
            self.engine_sleep_s, self.awake = time.perf_counter() - t0, False
        if not self.away:
            return
        t0 = time.perf_counter()
        self.policy.reload_training_state()
        self.reload_s, self.away = time.perf_counter() - t0, False

    def seconds(self) -> float:
        return self.offload_s + self.reload_s + self.engine_sleep_s

    def times(self) -> dict[str, float]:
        return {"offload_s": self.offload_s, "reload_s": self.reload_s, "engine_sleep_s": self.engine_sleep_s}
