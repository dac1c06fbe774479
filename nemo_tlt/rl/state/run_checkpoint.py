"""Checkpoint and resume of an RL run.

Contract
--------
* ``RunState`` is everything a run needs to continue exactly: the synced policy's
  canonical weights, the policy backend's optimizer state (one: this module's
  policies are not sharded over ranks), the drafter and its trainer (TLT runs),
  every rank's private state (SD policy, sampling generator), and the step records
  logged so far.
* Rank 0 writes (``save``: snapshot on the caller's thread, atomic write in the
  background, the newest ``keep_last`` kept: nemo_tlt.spot.checkpoint); every rank
  reads (``load_latest``). A crash mid-write leaves the previous checkpoint valid.
* A checkpoint written by another number of workers is refused: its per-rank
  states (and the prompts each rank owns) would not line up. So is one of the other
  mode (TLT / baseline).
* A policy whose state is sharded over ranks (the megatron backend on more than one
  worker) is checkpointed by ``nemo_tlt.rl.state.sharded_run_checkpoint`` instead (every rank
  writes its shard; another data-parallel size resumes); this module refuses to resume
  from such a checkpoint, naming it.
* The harvest buffer is not saved (it may hold hundreds of MB per rank): after a
  resume the drafter trains only on data harvested from then on, so the drafter (and
  with it SD's acceptance and timings) may differ from an uninterrupted run's. The
  policy, rewards and rollouts do not: they never depend on the drafter.
"""
from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping

import torch

from nemo_tlt.rl.reporting.records import RankState
from nemo_tlt.spot.checkpoint import CheckpointManager

log = logging.getLogger(__name__)


SHARDED_SUBDIR = "sharded"


def sharded_dir(checkpoint_dir: str | Path) -> Path:
    """Where a sharded policy state's run checkpoints live (``nemo_tlt.rl.state.sharded_run_checkpoint``)."""
    return Path(checkpoint_dir) / SHARDED_SUBDIR


@dataclass
class RunState:
    step: int
    mode: str
    world: int
    policy_weights: Mapping[str, torch.Tensor] | None  # None: a sharded checkpoint (``policy_dir``)
    policy_states: list[dict]
    ranks: list[RankState]
    records: list[dict[str, Any]]
    drafter_weights: Mapping[str, torch.Tensor] | None = None
    drafter_trainer: dict | None = None
    policy_dir: Path | None = None  # the policy's shards (``nemo_tlt.rl.state.sharded_run_checkpoint``)


class RunCheckpointer:
    """Writes (rank 0, ``writer=True``) and reads a run's checkpoints in ``directory``."""

    def __init__(self, directory: str | Path, keep_last: int = 2, writer: bool = False) -> None:
        self.directory = Path(directory)
        self._manager = CheckpointManager(self.directory, keep_last=keep_last) if writer else None

    def save(self, state: RunState) -> None:
        if self._manager is None:
            raise RuntimeError("RunCheckpointer.save: this rank is not the run's checkpoint writer")
        tensors = {f"policy/{k}": v for k, v in state.policy_weights.items()}
        extra: dict[str, Any] = {"policy": state.policy_states}
        if state.drafter_weights is not None:
            tensors.update({f"drafter/{k}": v for k, v in state.drafter_weights.items()})
            extra["drafter_trainer"] = state.drafter_trainer
        meta = {"step": state.step, "mode": state.mode, "world": state.world,
                "ranks": [asdict(r) for r in state.ranks], "records": state.records}
        self._manager.save_async(state.step, tensors, extra, json.loads(json.dumps(meta)))

    def load_latest(self, world: int, mode: str) -> RunState | None:
        """The newest valid checkpoint, or None when there is none; refuses another world
        size or another mode (a baseline checkpoint holds no drafter)."""
        if self._manager is not None:
            ck = self._manager.load() if self._manager.latest() is not None else None
        else:
            with CheckpointManager(self.directory) as reader:
                ck = reader.load() if reader.latest() is not None else None
        if ck is None:
            if any(sharded_dir(self.directory).glob("step-*")):
                raise ValueError(f"resume: {sharded_dir(self.directory)} holds a checkpoint of a sharded policy state "
                                 "(the megatron backend on more than one worker); this run's policy state is not "
                                 "sharded")
            return None
        meta = ck.json_state
        if meta["mode"] != mode:
            raise ValueError(f"resume: {ck.path} is a {meta['mode']} run's checkpoint; this run is {mode}")
        if meta["world"] != world:
            raise ValueError(f"resume: {ck.path} was written by {meta['world']} workers; "
                             f"workers.num_workers={world} cannot continue it exactly")

        def part(prefix: str) -> dict[str, torch.Tensor]:
            return {k[len(prefix):]: v for k, v in ck.tensors.items() if k.startswith(prefix)}

        drafter = part("drafter/")
        return RunState(step=ck.step, mode=meta["mode"], world=meta["world"], policy_weights=part("policy/"),
                        policy_states=ck.extra_state["policy"], ranks=[RankState(**r) for r in meta["ranks"]],
                        records=list(meta["records"]), drafter_weights=drafter or None,
                        drafter_trainer=ck.extra_state.get("drafter_trainer"))

    def close(self) -> None:
        if self._manager is not None:
            self._manager.close()


def restore(state: RunState, rank: int, policy, engine, sd_policy, drafter) -> None:
    """Put the live components of rank ``rank`` back to ``state``: the policy backend
    (weights, its optimizer state or this rank's shard of it), the rollout engine's
    weights and drafter, the SD policy, and the drafter side (``IdleDrafter.restore``)."""
    policy.load_canonical(state.policy_weights)
    policy.load_state_dict(state.policy_states[0])
    engine.load_policy_weights(state.policy_weights)
    mine = state.ranks[rank]
    if sd_policy is not None and mine.sd_policy is not None:
        sd_policy.load_state_dict(mine.sd_policy)
    if drafter is not None:
        drafter.restore(state.policy_weights, state.drafter_weights, state.drafter_trainer, mine.generator,
                        next_step=state.step + 1)
        engine.load_drafter(drafter.served())
