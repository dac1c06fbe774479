"""Worker functions for tests/policy/test_megatron_sharded_checkpoint.py (gloo processes)."""
from __future__ import annotations

import multiprocessing
from pathlib import Path

import torch
import torch.distributed as dist

from nemo_tlt.dist import RankContext
from nemo_tlt.policy import build_policy_backend


def _step(trainer, batch: list, advantages: torch.Tensor) -> dict:
    """One GRPO update; data-parallel replica d takes the sequences i with i % DP == d."""
    from megatron.core import parallel_state

    d, dps = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    mine = [i for i in range(len(batch)) if i % dps == d]
    part = [batch[i] for i in mine]
    old, ref = trainer.logprobs(part)
    return trainer.update(part, advantages[mine], old, ref, sum(len(r) for _, r in batch))


def _result(trainer, stats: dict) -> dict | None:
    from megatron.core import parallel_state

    first_of_replica = parallel_state.get_model_parallel_group().rank() == 0
    box = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object((stats if first_of_replica else None), box, dst=0)
    canonical = trainer.canonical_state_dict()
    parallel_state.destroy_model_parallel()
    if dist.get_rank() != 0:
        return None
    stats = [s for s in box if s is not None]
    # each replica reports its share of the global token mean; the grad norm is global already
    return {"loss": sum(s["loss"] for s in stats), "grad_norm": stats[0]["grad_norm"], "canonical": canonical}


def checkpoint_then_continue(ctx: RankContext, cfg, canonical: dict, policy, batches: list, ckpt_dir: str,
                             placement=None) -> dict | None:
    """Step 1, sharded save, step 2: the uninterrupted run (and the checkpoint it leaves)."""
    kwargs = {"placement": placement} if placement is not None else {}
    trainer = build_policy_backend(policy, canonical, cfg, temperature=1.0, seed=1234, **kwargs)
    _step(trainer, *batches[0])
    trainer.save_sharded(ckpt_dir)
    # megatron's write-results queue server does not outlive the save (an orphan would hold stdout)
    assert not multiprocessing.active_children(), multiprocessing.active_children()
    return _result(trainer, _step(trainer, *batches[1]))


def resume_and_continue(ctx: RankContext, cfg, canonical: dict, policy, batches: list, ckpt_dir: str,
                        placement=None, refused_policy=None) -> dict | None:
    """A fresh policy (initial weights) loads the checkpoint and takes step 2; then, with
    ``refused_policy``, a policy of that layout must refuse the same checkpoint."""
    kwargs = {"placement": placement} if placement is not None else {}
    trainer = build_policy_backend(policy, canonical, cfg, temperature=1.0, seed=1234, **kwargs)
    trainer.load_sharded(ckpt_dir)
    out = _result(trainer, _step(trainer, *batches[1]))
    if refused_policy is not None:
        other = build_policy_backend(refused_policy, canonical, cfg, temperature=1.0, seed=1234, **kwargs)
        try:
            other.load_sharded(ckpt_dir)
            refusal = None
        except ValueError as err:
            refusal = str(err)
        if out is not None:
            out["refusal"] = refusal
    return out


def save_then_die(ctx: RankContext, cfg, canonical: dict, policy, batches: list, root: str, reference: str) -> None:
    """Step 1 committed as a sharded run checkpoint; step 2's save loses rank 1 to SIGKILL after
    its shard files are written, before the commit."""
    import os
    import signal

    from nemo_tlt.spot.sharded_checkpoint import ShardedCheckpoints

    trainer = build_policy_backend(policy, canonical, cfg, temperature=1.0, seed=1234)
    ckpts = ShardedCheckpoints(root, keep_last=2)
    _step(trainer, *batches[0])
    ckpts.save(1, lambda folder: trainer.save_sharded(str(folder / "policy")))
    weights = trainer.canonical_state_dict()
    if ctx.rank == 0:
        torch.save(weights, reference)
    _step(trainer, *batches[1])

    def write_and_die(folder):
        trainer.save_sharded(str(folder / "policy"))
        if ctx.rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)

    ckpts.save(2, write_and_die)


def load_latest(ctx: RankContext, cfg, canonical: dict, policy, root: str) -> dict | None:
    from megatron.core import parallel_state

    from nemo_tlt.spot.sharded_checkpoint import ShardedCheckpoints

    trainer = build_policy_backend(policy, canonical, cfg, temperature=1.0, seed=1234)
    ckpts = ShardedCheckpoints(root)
    step = ckpts.latest(verify=True)
    trainer.load_sharded(str(ckpts.path(step) / "policy"))
    weights = trainer.canonical_state_dict()
    parallel_state.destroy_model_parallel()
    return {"step": step, "weights": weights, "policy_step": trainer.step} if ctx.rank == 0 else None


def async_checkpoint_during_step(ctx: RankContext, cfg, canonical: dict, policy, batches: list,
                                 ckpt_dir: str) -> dict | None:
    """Step 1, an asynchronous sharded save started, step 2 taken while it is written, then the
    save completed: the checkpoint must hold the state of when it started."""
    trainer = build_policy_backend(policy, canonical, cfg, temperature=1.0, seed=1234)
    _step(trainer, *batches[0])
    pending = trainer.start_save_sharded(ckpt_dir)
    stats = _step(trainer, *batches[1])
    # the step waited for the writers before rewriting the state they share: the save was
    # finalised (rank 0 writes .metadata then) before the update returned
    finished_by_step = Path(ckpt_dir, ".metadata").is_file()
    pending.wait()
    # neither the forked writers nor the results-queue server outlive the completed save
    assert not multiprocessing.active_children(), multiprocessing.active_children()
    result = _result(trainer, stats)
    return {**result, "finished_by_step": finished_by_step} if result is not None else None
