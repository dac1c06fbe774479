"""One rank's drafter side of TLT: the drafter, its harvest buffer and its idle-time trainer.

Contract
--------
* The drafter reads the target's embedding, final norm and LM head through a
  :class:`~nemo_tlt.drafter.target_view.TargetView` that follows every weight sync
  (``view.update`` on the canonical stream), never through the rollout engine.
* ``placement`` (keyword; default CPU fp32) is the rank's device: the drafter and its
  optimizer state live there in fp32 (master weights, whatever ``placement.dtype``,
  the target view's dtype), the harvest buffer on the host; the view must be on the
  same device.
* ``served()`` is the drafter the rollout engine is handed (``drafter.serve_dtype``): with
  float32 the trained module itself; otherwise one copy of it in the serve dtype, rounded
  from the fp32 masters at each call (the loop calls it at every hand-over to the engine,
  so after every training round and restore), kept and rewritten in place.
* ``harvest(step, tokens, hidden)`` stores one sequence's tokens and hidden states
  (hidden row t predicts token t+1: ``[len(tokens) - 1, H]``), from whichever forward
  produced them; a sequence shorter than ``min_length`` tokens (no training pair) is skipped.
* ``idle_time(step, coord)`` is called when this rank's rollout share is done: the
  idle-time protocol (train until the last rank finishes, then meet and average the
  drafter, weighted by samples trained) runs on a thread of lowered OS priority
  (``drafter.nice``) so a busy worker's tail rollout never waits for an idle
  worker's training where they share CPU cores. It is a collective over all ranks.
  Given the run's ``NodeGroups`` (``nodes``), the average of a multi-node run goes
  through the node leaders (``nemo_tlt.spot.averaging``): one buffer per node crosses
  the network.
"""
from __future__ import annotations

import copy
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Collection, Mapping

import torch

from nemo_tlt.dist import NodeGroups
from nemo_tlt.device import DTYPES, Placement
from nemo_tlt.drafter.features import feature_width
from nemo_tlt.drafter.io import load_drafter
from nemo_tlt.drafter.target_view import TargetView
from nemo_tlt.rl.reporting.records import IdleResult
from nemo_tlt.spot.config import IdleDrafterConfig
from nemo_tlt.spot.coordinator import WorkerCoordinator
from nemo_tlt.drafter.base import CapturesLayers
from nemo_tlt.spot.harvest import HarvestBuffer, HarvestConfig, HarvestSample
from nemo_tlt.spot.losses import eagle_loss_fn
from nemo_tlt.spot.trainer import SpotTrainer, train_while_idle

log = logging.getLogger(__name__)


class IdleDrafter:
    def __init__(self, config: IdleDrafterConfig, drafter_dir: str, view: TargetView, rank: int, seed: int,
                 nodes: NodeGroups | None = None, *, placement: Placement = Placement()) -> None:
        if view.lm_head_weight.device != torch.device(placement.device):
            raise ValueError(f"IdleDrafter: the target view is on {view.lm_head_weight.device}, the placement on "
                             f"{placement.device}; build the view with the same placement")
        self.config, self.view, self.nodes, self.placement = config, view, nodes, placement
        self.drafter = load_drafter(drafter_dir, view, device=placement.device).float()
        serve_dtype = DTYPES[config.serve_dtype]
        self._served = (None if serve_dtype == torch.float32 else
                        copy.deepcopy(self.drafter).to(serve_dtype).requires_grad_(False))
        width = feature_width(view.config.hidden_size,
                              self.drafter.capture_layers if isinstance(self.drafter, CapturesLayers) else None)
        self.buffer = HarvestBuffer(HarvestConfig(width, max_bytes=config.harvest_max_mb << 20))
        self.trainer = SpotTrainer(self.drafter, eagle_loss_fn(view), config.trainer, rank=rank, seed=seed)
        self._thread = ThreadPoolExecutor(1, "tlt-idle", initializer=_init_idle_thread,
                                          initargs=(config.nice, torch.get_num_threads(), placement.device))

    def served(self) -> torch.nn.Module:
        """The drafter the engine serves: the fp32 module the trainer trains, or (``drafter.serve_dtype``
        bfloat16) its copy in the serve dtype, rewritten now from the fp32 master weights."""
        if self._served is None:
            return self.drafter
        masters = self.drafter.state_dict()
        with torch.no_grad():
            for name, tensor in self._served.state_dict().items():
                tensor.copy_(masters[name])
        return self._served

    @property
    def min_length(self) -> int:
        return self.buffer.config.min_length

    def harvest(self, step: int, tokens: list[int], hidden: torch.Tensor) -> None:
        sample = self.sample(step, tokens, hidden)
        if sample is not None:
            self.buffer.add_sample(sample)

    def policy_sink(self, step: int, own: Collection[int] | None) -> Callable:
        """An ``on_hidden`` sink for drafter data from the policy's own forward
        (``drafter.harvest_from=policy``): this rank's sequences ``own`` of the batch (None: all)."""
        self.buffer.advance_step(step)

        def on_hidden(index: int, tokens: torch.Tensor, hidden: torch.Tensor) -> None:
            if own is None or index in own:
                self.harvest(step, tokens.tolist(), hidden[:-1])
        return on_hidden

    def sample(self, step: int, tokens: list[int], hidden: torch.Tensor) -> HarvestSample | None:
        """The buffer's compact host copy of one sequence's features (None: too short to train on)."""
        if len(tokens) < self.min_length:
            return None
        return self.buffer.make_sample(torch.tensor(tokens, dtype=torch.long, device="cpu"), hidden, step)

    def idle_time(self, step: int, coord: WorkerCoordinator) -> IdleResult:
        report = self._thread.submit(train_while_idle, step, coord, self.trainer, self.buffer,
                                     nodes=self.nodes).result()
        rnd = report.round
        return IdleResult(idle_s=report.idle_seconds, train_s=report.training_seconds, drafter_samples=rnd.samples,
                          drafter_steps=rnd.optimizer_steps,
                          drafter_loss=rnd.mean_loss if rnd.micro_steps else None,
                          stop_latency_s=report.stop_latency_s, sync_hierarchical=report.sync.hierarchical)

    def restore(self, policy_weights: Mapping[str, torch.Tensor] | None, drafter_weights: Mapping[str, torch.Tensor],
                trainer_state: dict, generator: list[int], next_step: int) -> None:
        """Back to a checkpoint: the view of the synced policy, the drafter, its trainer
        (optimizer, schedule step, this rank's sampling generator) and an empty buffer
        whose first step is ``next_step``. ``policy_weights`` None: the caller has streamed
        them into the view (``WeightStream(..., view=self.view)``)."""
        if policy_weights is not None:
            self.view.load(policy_weights)
        self.drafter.load_state_dict(dict(drafter_weights), strict=True)
        self.trainer.load_state_dict(trainer_state)
        self.trainer.generator.set_state(torch.tensor(generator, dtype=torch.uint8, device="cpu"))
        self.buffer = HarvestBuffer(self.buffer.config, start_step=next_step)

    def close(self) -> None:
        self._thread.shutdown(wait=True)


def _init_idle_thread(nice: int, num_threads: int, device: torch.device) -> None:
    """Make the calling thread yield the CPU to rollout and policy work (Linux: per
    thread) and keep its math to the worker's thread budget: torch's intra-op thread
    count is per thread, and a new thread would otherwise use every core, slowing the
    busy workers it shares them with. The current CUDA device is
    per thread: the thread binds the rank's own (a new thread starts on cuda:0)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.set_num_threads(num_threads)
    if nice > 0 and hasattr(os, "setpriority"):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
        except OSError as err:  # a sandbox may forbid it; training still works, just unprioritised
            log.warning("drafter.nice=%d could not be applied: %s", nice, err)


def idle_without_training(coord: WorkerCoordinator, step: int) -> IdleResult:
    """The idle window of a rank that does not train the drafter: mark IDLE, meet."""
    start = coord.timeline[-1].time
    coord.mark_idle()
    coord.meet(step)
    d = coord.durations(start)
    return IdleResult(idle_s=sum(v for k, v in d.items() if k.value != "busy"))



