"""Sharded checkpoints of a megatron policy: weights and distributed-optimizer state, per rank.

Contract (every function collective over the whole world, megatron's parallel state set up):
* ``policy_sharded_state(model, optimizer, common, is_loading)`` is megatron-core's sharded
  state dict of the policy: the model's own ``sharded_state_dict()`` (global tensors, layers
  stacked, so the file layout does not depend on TP / PP / DP) and megatron's
  ``DistributedOptimizer.sharded_state_dict`` over it in the ``dp_reshardable`` form: each
  rank's slice of its fp32 main-param and Adam-moment buckets (one global tensor per bucket
  of its TP x PP domain, padding to a DP multiple left out), so nothing is gathered and any
  data-parallel size reads them back. Our ``common`` (model config, layout, dtype, schedule
  step) is stored beside it.
* ``save_policy_shards(...)`` writes it with ``dist_checkpointing.save`` (torch_dist
  format): each rank writes the tensors it is the main replica of (data-parallel copies of
  the weights are written once), rank 0 the small common state.
* ``load_policy_shards(...)`` reads back this rank's slice at the *current* TP / PP / DP:
  a different data-parallel size always works; another TP / PP is refused, naming the saved
  and current layouts (the optimizer's buckets are laid out per TP x PP domain; and Megatron
  pads the vocabulary to a multiple of 128 x TP, so the embedding's global shape depends on
  TP). Another dtype or model config is refused too. ``restore_policy_shards`` puts the loaded
  weights and optimizer state into the live model and optimizer.

Before the first update torch's AdamW holds no state, and megatron's sharded state dict
needs its step; ``ensure_adam_state`` gives it the zero moments and step 0 a fresh AdamW
starts from (the next step then computes exactly what it would have).
"""
from __future__ import annotations

import os
import torch

from nemo_tlt.model.config import LMConfig
from nemo_tlt.weights.layout import ParallelLayout
from nemo_tlt.megatron.results_server import PickledQueue, results_queue_dying_with_rank

COMMON = "nemo_tlt"


# megatron-core 0.16.1's "fully_sharded_model_space" cannot save ("ShardedTensor.flattened_range
# is not supported"); "fully_reshardable" gathers each bucket on data-parallel rank 0 while saving.
SHARDING = {"distrib_optim_sharding_type": "dp_reshardable"}


def ensure_adam_state(optimizer: torch.optim.Optimizer) -> None:
    """Give every parameter without state AdamW's initial state (step 0, zero moments): what a
    torch AdamW creates at its first step, so the next step computes exactly as without it."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state[p]
            if not state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def policy_sharded_state(model: torch.nn.Module, optimizer, common: dict, is_loading: bool) -> dict:
    """The sharded state dict (see the module docstring)."""
    from nemo_tlt.megatron.ddp_optimizer import distributed_optimizers

    for opt in distributed_optimizers(optimizer):
        # megatron reads the Adam step from the state of torch's AdamW (no TE / apex), which a
        # fresh AdamW does not have yet
        ensure_adam_state(opt.optimizer)
    model_state = model.sharded_state_dict()
    return {"model": model_state,
            "optimizer": optimizer.sharded_state_dict(model_state, is_loading=is_loading, metadata=SHARDING),
            COMMON: dict(common)}


def restore_policy_shards(model: torch.nn.Module, optimizer, loaded: dict) -> None:
    """Weights and optimizer state of ``load_policy_shards``'s result into the live policy."""
    with torch.no_grad():
        result = model.load_state_dict({k: v for k, v in loaded["model"].items() if isinstance(v, torch.Tensor)},
                                       strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    if missing or result.unexpected_keys:
        raise ValueError(f"load_sharded: missing {missing}, unexpected {result.unexpected_keys}")
    from nemo_tlt.megatron.ddp_optimizer import distributed_optimizers

    with torch.no_grad():  # fp32 weights are their own main params: megatron copies into views of them
        optimizer.load_state_dict(loaded["optimizer"])
    for opt in distributed_optimizers(optimizer):
        # megatron-core 0.16.1 with torch's AdamW (no TE / apex) restores the Adam step wrongly: it
        # hands every parameter's state one shared step tensor (torch's AdamW would then increment it
        # once per parameter), and its parameter-state load then overwrites that tensor with the
        # template's step. The saved step is in the param groups: each parameter gets its own copy.
        for group in opt.optimizer.param_groups:
            for p in group["params"]:
                opt.optimizer.state[p]["step"] = torch.tensor(float(group["step"]))


def layout_common(cfg: LMConfig, layout: ParallelLayout, dtype: torch.dtype, step: int) -> dict:
    return {"lm_config": cfg.to_dict(), "tp": layout.tp, "pp": layout.pp,
            "padded_vocab": layout.padded_vocab_size(cfg.vocab_size), "dtype": str(dtype), "step": step}


def save_policy_shards(state: dict, directory: str | os.PathLike) -> None:
    from megatron.core import dist_checkpointing

    os.makedirs(directory, exist_ok=True)
    _install_write_results_queue()
    try:
        dist_checkpointing.save(state, str(directory))
    finally:
        _shutdown_write_results_queue()


class PendingPolicySave:
    """A ``start_policy_save`` under way: this rank's shard is being written by a process forked
    from the rank. ``wait()`` (collective) waits until every rank's write ended, then
    finalizes the checkpoint (write results to rank 0, which writes ``.metadata``; megatron's
    config file) and stops the results-queue server: only then is the folder complete. A write
    that failed on any rank raises on every rank. Safe to call twice."""

    def __init__(self, calls, context) -> None:
        self._calls, self._context = calls, context

    def wait(self) -> None:
        if self._calls is None:
            return
        calls, self._calls = self._calls, None
        try:
            with self._context():
                calls.maybe_finalize_async_calls(blocking=True)
        finally:
            _shutdown_write_results_queue()


def start_policy_save(state: dict, directory: str | os.PathLike, context) -> PendingPolicySave:
    """``save_policy_shards``, asynchronous (collective): the plan is made and the common state
    written now; this rank's shard files are written by a forked process while the caller goes
    on; ``PendingPolicySave.wait()`` completes it. ``context`` is the rank's device context
    (megatron's async calls use ``torch.cuda``). The results queue's server dies with its rank
    (Linux), so a rank killed before ``wait()`` leaves no server behind; its forked writer
    outlives it until its write ends."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    os.makedirs(directory, exist_ok=True)
    _install_write_results_queue()
    try:
        with context():
            request = dist_checkpointing.save(state, str(directory), async_sharded_save=True)
            calls = AsyncCallsQueue(persistent=False)
            calls.schedule_async_request(request)
    except BaseException:
        _shutdown_write_results_queue()
        raise
    return PendingPolicySave(calls, context)


def _install_write_results_queue() -> None:
    """Give megatron-core's torch_dist writer (``FileSystemWriterAsync``, synchronous saves
    included) this save's results queue: ``results_server.results_queue_dying_with_rank``, whose
    server dies with the rank and need not import torch, instead of the spawned manager megatron-core
    would create on its first save and keep for the life of the process."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    _shutdown_write_results_queue()
    filesystem_async._results_queue = results_queue_dying_with_rank()


def _shutdown_write_results_queue() -> None:
    """Stop the server process behind megatron-core's write-results queue.

    megatron-core 0.16.1's ``FileSystemWriterAsync`` (what a torch_dist save writes with,
    synchronous saves included) creates a spawned ``multiprocessing.Manager`` for its results
    queue on the first save and keeps it for the life of the process. A rank that is killed or
    terminated leaves that server behind, orphaned and holding the rank's stdout open (a test
    runner or CI job reading that pipe would wait on it). So it lives for one save only; the
    next save starts another (a process start per save, beside writing the shard)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    queue = getattr(filesystem_async, "_results_queue", None)
    if queue is None:
        return
    filesystem_async._results_queue = None
    if isinstance(queue, PickledQueue):
        queue.shutdown()
    elif getattr(queue, "_manager", None) is not None:  # megatron-core's own (a save outside these functions)
        queue._manager.shutdown()


def check_compatible(saved: dict, current: dict, where: str) -> None:
    """Refuse a checkpoint this policy cannot continue, naming what differs."""
    if saved["lm_config"] != current["lm_config"]:
        diff = sorted(k for k in set(saved["lm_config"]) | set(current["lm_config"])
                      if saved["lm_config"].get(k) != current["lm_config"].get(k))
        raise ValueError(f"resume: {where} holds another model (config fields differ: {diff})")
    if saved["dtype"] != current["dtype"]:
        raise ValueError(f"resume: {where} holds {saved['dtype']} weights; this run trains {current['dtype']} "
                         "(model.dtype)")
    if saved["padded_vocab"] != current["padded_vocab"]:
        raise ValueError(
            f"resume: {where} was written at TP={saved['tp']} x PP={saved['pp']}, whose padded vocabulary has "
            f"{saved['padded_vocab']} rows; at TP={current['tp']} x PP={current['pp']} it has "
            f"{current['padded_vocab']} (Megatron pads to a multiple of 128 x TP), so the embedding cannot be "
            "resharded; resume at a TP with the same padded vocabulary")
    if (saved["tp"], saved["pp"]) != (current["tp"], current["pp"]):
        raise ValueError(
            f"resume: {where} was written at TP={saved['tp']} x PP={saved['pp']}; this run is TP={current['tp']} x "
            f"PP={current['pp']}: megatron's distributed optimizer state (dp_reshardable) reshards over the "
            "data-parallel size only; resume at the same TP x PP")


def load_policy_shards(state: dict, directory: str | os.PathLike) -> dict:
    """Fill ``state`` (a ``policy_sharded_state`` of the live policy) from ``directory``; returns the
    loaded dict (plain tensors where ``state`` had sharded ones, the saved common state under COMMON)."""
    from megatron.core import dist_checkpointing

    saved = dist_checkpointing.load_common_state_dict(str(directory))[COMMON]
    check_compatible(saved, state[COMMON], str(directory))
    return dist_checkpointing.load(state, str(directory))
