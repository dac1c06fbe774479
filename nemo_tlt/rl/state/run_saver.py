"""One rank's side of a run's checkpoints: what is kept between steps for them, the save, the resume.

Contract
--------
* A policy whose state is sharded over ranks (``policy.sharded_state``: the megatron backend)
  is checkpointed by every rank together, each writing its shard
  (``nemo_tlt.rl.state.sharded_run_checkpoint``); otherwise rank 0 writes everything (async).
* ``after_step(states)`` keeps the policy state (unsharded) and, on rank 0, every rank's
  private state gathered at the end of the step; ``synced`` holds what the engine serves
  (rank 0, unsharded), filled by the step's weight sync.
* ``save(step, final, records, drafter)`` is called by every rank at the same point; it
  saves every ``checkpoint.every`` steps and at ``final``, once per step.
* ``resume(engine, sd_policy, drafter, tp)`` restores from the newest valid checkpoint (every
  rank) and returns ``(records, start_step)``; ``(None, 0)`` when there is none.
"""
from __future__ import annotations

import logging
from typing import Any

import torch

from nemo_tlt.policy.protocol import ShardedCheckpoints, require
from nemo_tlt.rl.reporting.records import RankState
from nemo_tlt.rl.state.run_checkpoint import RunCheckpointer, RunState, restore
from nemo_tlt.rl.state.sharded_run_checkpoint import ShardedRunCheckpointer, rank_state_for, restore_sharded

log = logging.getLogger(__name__)


class RunSaver:
    def __init__(self, spec: Any, comm: Any, policy: Any) -> None:
        cfg = spec.config
        self.spec, self.comm, self.policy, self.every = spec, comm, policy, cfg.checkpoint.every
        self.sharded = policy.sharded_state
        if self.sharded:
            require(policy, ShardedCheckpoints, cfg.policy.backend, "a sharded policy state (sharded_state)")
        self.ckpt = (ShardedRunCheckpointer(spec.checkpoint_dir, cfg.checkpoint.keep_last, comm.rank) if self.sharded
                     else RunCheckpointer(spec.checkpoint_dir, cfg.checkpoint.keep_last, writer=comm.rank == 0))
        self.synced: dict[str, torch.Tensor] = {}
        self.policy_states: list[dict] = [] if self.sharded else [policy.state_dict()]
        self.rank_states: list[RankState] = []
        self.saved_step: int | None = None

    def after_step(self, states: list[RankState] | None) -> None:
        """The policy state (unsharded: a sharded one stays where it is until the save) and, on
        rank 0, every rank's private state of the step (``states``)."""
        if not self.sharded:
            self.policy_states = [self.policy.state_dict()]
        if states is not None:
            self.rank_states = states

    def save(self, step: int, final: bool, records: list[dict], drafter: Any) -> None:
        if self.saved_step == step or (not final and (step + 1) % self.every):
            return
        if self.sharded or self.comm.rank == 0:
            d = drafter if self.comm.rank == 0 else None  # the drafter is identical on every rank
            state = RunState(step, self.spec.mode, self.comm.world, self.synced, self.policy_states,
                             self.rank_states, records,
                             d.drafter.state_dict() if d is not None else None,
                             d.trainer.state_dict() if d is not None else None)
            if self.sharded:
                self.ckpt.save(state, self.policy)
            else:
                self.ckpt.save(state)
        self.saved_step = step

    def resume(self, engine: Any, sd_policy: Any, drafter: Any, tp: Any) -> tuple[list[dict] | None, int]:
        state = self.ckpt.load_latest(self.comm.world, self.spec.mode)
        if state is None:
            log.info("resume=true but %s holds no checkpoint: starting at step 0", self.spec.checkpoint_dir)
            return None, 0
        if self.sharded:  # this rank's slice of the policy; the engine and view from its stream
            restore_sharded(state, self.comm.rank, self.policy, engine, sd_policy, drafter, tp=tp)
        else:
            restore(state, self.comm.rank, self.policy, engine, sd_policy, drafter)
            self.synced = dict(state.policy_weights)
        self.rank_states = [rank_state_for(state, r) for r in range(self.comm.world)]
        self.saved_step = state.step
        return (list(state.records) if self.comm.rank == 0 else []), state.step + 1

    def close(self) -> None:
        self.ckpt.close()


def close_all(*closables: Any) -> None:
    """Close each (None skipped), every one even when one raises (a sharded checkpointer's
    close is collective and fails when a peer died); then re-raise the first error."""
    first: BaseException | None = None
    for closable in closables:
        if closable is None:
            continue
        try:
            closable.close()
        except BaseException as err:  # noqa: BLE001 - re-raised below, after the others closed
            log.error("closing %s failed: %s", type(closable).__name__, err)
            first = first or err
    if first is not None:
        raise first
