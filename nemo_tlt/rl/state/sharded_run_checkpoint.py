"""Checkpoint and resume of an RL run whose policy state is sharded over ranks (the megatron backend).

Contract
--------
* ``ShardedRunCheckpointer`` keeps the run's checkpoints in ``<checkpoint_dir>/sharded``.
  ``save(state, policy)`` is collective over the world, called by every rank at the same
  step: every rank writes its own shard of the policy (weights and distributed-optimizer
  state, ``policy.save_sharded`` into ``policy/``; nothing is gathered on any rank) and rank
  0 writes the rest of the ``RunState`` into ``run/`` (``state.json``: step, mode, world,
  every rank's private state, the records; with TLT ``drafter.safetensors`` and
  ``drafter_trainer.pt``). One atomic commit covers both (``nemo_tlt.spot.sharded_checkpoint``:
  hidden partial folder, manifest of size and SHA-256 per file, rename), so a rank killed
  before the commit leaves the previous step's checkpoint the newest loadable one. The
  policy's write is asynchronous (``policy.start_save_sharded``, megatron-core's async
  save): ``save`` returns while a process forked from each rank writes its shard, and the
  next step's rollout and forward / backward passes run meanwhile; on the CPU the policy's
  next optimizer step waits for the writers first (``MegatronPolicy.finish_writes``: a step
  rewrites every host page the writers share). The commit runs at the next ``save`` or at
  ``close()`` (both collective), after every rank's write ended (``finish``). So step N's
  checkpoint becomes loadable only then: a run killed in between resumes from the checkpoint
  before it.
* ``load_latest(world, mode)`` (collective) returns the newest valid checkpoint's
  ``RunState`` with ``policy_dir`` set (no full weights in it) or None. Another mode is
  refused; another world size is not: the policy reshards over the data-parallel size when
  ``restore_sharded`` loads it (another TP / PP is refused there, naming both layouts).
  A checkpoint of the other kind (``RunCheckpointer``'s, in ``checkpoint_dir`` itself) is
  refused by name rather than ignored.
* ``restore_sharded`` (collective) loads this rank's slice of the policy, then streams the
  policy's canonical weights (``policy.canonical_weights()``) into the rollout engine and
  the drafter's view of the target: no rank reads or holds the saved full weights.
  Per-rank private states at another world size: rank r takes saved rank ``r % old_world``'s
  SD-policy state and drafter-trainer generator. They steer only speculation (which the
  ``coupled`` / ``greedy`` acceptance keeps from changing any token) and the drafter's
  training samples, so the policy, rewards and rollouts (functions of seed, step and
  sequence id) stay those of the uninterrupted run; the drafter and SD timings may differ,
  as after any resume (the harvest buffer is not saved either).
"""
from __future__ import annotations

import json
import logging
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from nemo_tlt.rl.reporting.records import RankState
from nemo_tlt.rl.state.run_checkpoint import RunState, sharded_dir
from nemo_tlt.rl.weight_stream import WeightStream, stream_tp
from nemo_tlt.spot.sharded_checkpoint import ShardedCheckpoints

log = logging.getLogger(__name__)

POLICY, RUN = "policy", "run"
STATE_FILE, DRAFTER_FILE, TRAINER_FILE = "state.json", "drafter.safetensors", "drafter_trainer.pt"


class ShardedRunCheckpointer:
    """Every rank constructs one; ``save`` and ``load_latest`` are collective (see the module docstring)."""

    def __init__(self, checkpoint_dir: str | Path, keep_last: int, rank: int) -> None:
        self.checkpoint_dir, self.rank = Path(checkpoint_dir), rank
        self._ckpts = ShardedCheckpoints(sharded_dir(checkpoint_dir), keep_last=keep_last)
        self._pending = None  # (step, the policy's pending save): written, not committed yet

    def save(self, state: RunState, policy) -> Path:
        """Commits the previous save (``finish``), then starts this one: returns once this
        rank's shard is being written in the background and rank 0's run part is written."""
        self.finish()
        folder = self._ckpts.begin(state.step)
        pending = policy.start_save_sharded(str(folder / POLICY))
        self._pending = (state.step, pending)
        if self.rank == 0:
            _write_run_part(folder / RUN, state)
        return self._ckpts.path(state.step)

    def finish(self) -> Path | None:
        """Collective: wait for every rank's write of the last save, then commit it atomically."""
        if self._pending is None:
            return None
        (step, pending), self._pending = self._pending, None
        pending.wait()
        return self._ckpts.commit(step)

    def load_latest(self, world: int, mode: str) -> RunState | None:
        step = self._ckpts.latest()
        if step is None:
            if any(self.checkpoint_dir.glob("step-*")):
                raise ValueError(f"resume: {self.checkpoint_dir} holds a checkpoint of an unsharded policy state "
                                 "(the torch backend, or one worker); this run's policy state is sharded")
            return None
        path = self._ckpts.path(step)
        meta = json.loads((path / RUN / STATE_FILE).read_text())
        if meta["mode"] != mode:
            raise ValueError(f"resume: {path} is a {meta['mode']} run's checkpoint; this run is {mode}")
        if meta["world"] != world:
            log.info("resume: %s was written by %d workers; continuing at %d (rank r takes saved rank r %% %d's "
                     "private state; the policy reshards over the data-parallel size)", path, meta["world"], world,
                     meta["world"])
        drafter = path / RUN / DRAFTER_FILE
        return RunState(step=meta["step"], mode=meta["mode"], world=meta["world"], policy_weights=None,
                        policy_states=[], ranks=[RankState(**r) for r in meta["ranks"]], records=list(meta["records"]),
                        drafter_weights=load_file(str(drafter)) if drafter.is_file() else None,
                        drafter_trainer=(torch.load(path / RUN / TRAINER_FILE, weights_only=True)
                                         if drafter.is_file() else None),
                        policy_dir=path / POLICY)

    def close(self) -> None:
        """Collective: commits the last save (``finish``)."""
        self.finish()


def _write_run_part(folder: Path, state: RunState) -> None:
    folder.mkdir(parents=True)
    meta = {"step": state.step, "mode": state.mode, "world": state.world,
            "ranks": [asdict(r) for r in state.ranks], "records": state.records}
    (folder / STATE_FILE).write_text(json.dumps(meta))
    if state.drafter_weights is not None:
        save_file({k: v.detach().cpu().contiguous() for k, v in state.drafter_weights.items()},
                  str(folder / DRAFTER_FILE))
        torch.save(state.drafter_trainer, folder / TRAINER_FILE)


def rank_state_for(state: RunState, rank: int) -> RankState:
    """This rank's private state: saved rank ``rank % saved world``'s (see the module docstring)."""
    return state.ranks[rank % len(state.ranks)]


def restore_sharded(state: RunState, rank: int, policy, engine, sd_policy, drafter, tp=None) -> None:
    """Collective: this rank's slice of the policy from ``state.policy_dir``, the engine's and the
    drafter view's weights from the policy's canonical stream (``tp``: the rollout replica's
    ``TensorParallel``; this rank's slices where the engine takes them, `stream_tp`), the SD
    policy and drafter side."""
    policy.load_sharded(str(state.policy_dir))
    # the same stream as every step's weight sync: the view was filled whole at build
    engine.load_policy_weights(WeightStream(policy.canonical_weights(rollout_tp=stream_tp(engine, tp)),
                                            view=drafter.view if drafter else None, tp=tp, digest=False))
    mine = rank_state_for(state, rank)
    if sd_policy is not None and mine.sd_policy is not None:
        sd_policy.load_state_dict(mine.sd_policy)
    if drafter is not None:
        drafter.restore(None, state.drafter_weights, state.drafter_trainer, mine.generator, next_step=state.step + 1)
        engine.load_drafter(drafter.served())
