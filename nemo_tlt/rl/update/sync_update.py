"""The synchronous policy update (``policy.pipelined_update: false``): after the rollout, one
rank's log-probs and its one optimizer step on its training share of the step's rollouts.

Contract: ``SyncUpdate(step, batch, rewards, gen_logprobs)`` on every rank, with this rank's
rollout (``batch`` of ``(prompt, response)``, ``rewards``, whole groups): the run's algorithm's
counted response tokens are summed over ranks (each rollout replica once), the rank selects
its training share (``nemo_tlt.rl.rollout_replicas.training_share``: the rollouts its model
replica trains on, gathered when that spans replicas), and ``policy.update`` takes the step.
Returns the update's dict (with ``loss_tokens`` and, with ``gen_logprobs``, the logprob_gap
sums: one member per replica reports), and the seconds of the log-prob pass and of the update.
"""
from __future__ import annotations

import time
from collections.abc import Collection
from typing import Any, Callable

import torch

from nemo_tlt.algorithms.protocol import Advantages, counted_kwarg
from nemo_tlt.policy.protocol import HiddenSink
from nemo_tlt.rl.reporting.logprob_gap import comparable, gap_sums
from nemo_tlt.rl.rollout_replicas import RolloutReplicas, TrainShare, by_replica, harvested


class SyncUpdate:
    """``harvest(step, own)``: the drafter's sink for the policy forward's hidden states of the
    sequences ``own`` (None: no harvest from the policy): this rank's sequences, split among the
    ranks that run the same forward over them (``rollout_replicas.harvested``)."""

    def __init__(self, cfg: Any, policy: Any, comm: Any, advantages: Callable[[list, list], Advantages],
                 replicas: RolloutReplicas, share: TrainShare,
                 harvest: Callable[[int, Collection[int]], HiddenSink] | None = None,
                 capture_layers: tuple[int, ...] | None = None) -> None:
        self.cfg, self.policy, self.comm, self._advantages = cfg, policy, comm, advantages
        self.replicas, self.share, self.harvest, self.capture_layers = replicas, share, harvest, capture_layers

    def advantages(self, batch: list, rewards: list[float]) -> Advantages:
        """The algorithm's advantages of whole groups (``batch``'s responses, ``rewards``)."""
        return self._advantages(rewards, [r for _, r in batch])

    def global_tokens(self, batch: list, rewards: list[float]) -> int:
        """Every response token of the step the algorithm counts, once (each replica's leader
        counts its rollout)."""
        counted = self.replicas.counted_tokens(self.advantages(batch, rewards).tokens)
        return int(self.comm.sum_(torch.tensor([float(counted)], device="cpu")).item())

    def __call__(self, step: int, batch: list, rewards: list[float], gen_logprobs: list | None = None
                 ) -> tuple[dict[str, float], float, float]:
        replicas, share, G = self.replicas, self.share, self.cfg.grpo.group_size
        global_tokens = self.global_tokens(batch, rewards)
        shares = (by_replica(self.comm.gather((batch, rewards)), replicas.tp, share.replicas)
                  if len(share.replicas) > 1 else {replicas.replica: (batch, rewards)})
        if gen_logprobs is not None and share.parts > 1:
            gen_logprobs = [gen_logprobs[i] for i in share.indices(len(batch), G)]
        batch, rewards, own = share.select(shares, replicas.replica, G)
        if share.parts == 1 and not replicas.leader:
            gen_logprobs = None  # the leader reports the replica's logprob_gap sums
        on_hidden = None
        if self.harvest is not None:  # the ranks that run this forward over `own` split its rows
            on_hidden = self.harvest(step, harvested(own, replicas, share, self.policy.train_ranks, self.comm.rank))
        t0 = time.perf_counter()
        logp_old, logp_ref = self.policy.logprobs(batch, self.cfg.policy.separate_logprob_pass)
        t_logprob, t0 = time.perf_counter() - t0, time.perf_counter()
        advantages = self.advantages(batch, rewards)
        # health metric (nemo_tlt.rl.reporting.logprob_gap): the policy's log-probs of this rank's own
        # sequences, from the separate pass or else from the update forward (before its step)
        policy_lp: dict[int, torch.Tensor] = {}
        wanted = gen_logprobs is not None and comparable(self.cfg.grpo.acceptance, self.cfg.grpo.temperature)
        sink = policy_lp.__setitem__ if wanted and logp_old is None else None
        # (a step whose every sequence is dropped steps on a zero gradient: a mean over at least 1)
        update = self.policy.update(batch, advantages.values, logp_old, logp_ref, max(1, global_tokens),
                                    on_hidden=on_hidden,
                                    capture_layers=self.capture_layers if on_hidden is not None else None,
                                    on_logprobs=sink, **counted_kwarg(advantages))
        if wanted and logp_old is not None:
            policy_lp = {i: logp_old[i] for i in own}
        if wanted and all(i in policy_lp for i in own):  # a megatron rank off the last stage has none
            update = {**update, **gap_sums(gen_logprobs, [policy_lp[i] for i in own])}
        return {**update, "loss_tokens": global_tokens}, t_logprob, time.perf_counter() - t0
