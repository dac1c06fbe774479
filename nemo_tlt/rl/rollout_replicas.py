"""Rollout replicas: the ranks that decode one share of a step's prompts together, and which
of those rollouts each policy replica trains on.

Contract
--------
* ``RolloutReplicas(rank, world, tp)`` (``tp`` = ``rollout.tensor_parallel``): consecutive ranks
  form a replica, ``[replica * tp, (replica + 1) * tp)``, whose engine is tensor-parallel over
  them. The replica takes the prompts p with p % replicas == replica (whole GRPO groups);
  every member decodes them and gets the same tokens. The member with ``local == 0`` leads:
  its SD policy decides for the replica (the engine broadcasts the choice) and its rollout
  is the one the step record counts.
* ``training_share(groups, rank, tp)`` maps the policy's training groups (every rank's
  ``PolicyBackend.train_ranks``: the ranks of one model replica) onto rollout replicas:
  - a training group made of whole rollout replicas trains on the union of their rollouts,
    replica by replica in rank order, each once (the megatron backend at policy TP >= rollout
    TP: its TP ranks must see the same batch);
  - a training group inside one rollout replica trains on its part of that replica's GRPO
    groups: with k training groups in the replica, the one at place j (by lowest rank)
    takes groups i with i % k == j (the torch backend, or a policy TP below the rollout TP:
    each model replica computes its own part, nothing twice);
  - any other overlap is refused, naming both layouts.
* The step's token count (the GRPO loss's global token mean) counts each replica's rollout
  once: ``counted_tokens`` is the leader's own count and 0 on the other members.
* Drafter features: the members of a replica see the same sequences' features (each decodes the
  replica's rollout; with whole replicas in a training group each runs the forward of the same
  batch), so member ``local`` keeps sequences i with i % tp == local (``harvests``); the ranks of
  a training group inside a replica run the forward of the same part, and split it alike
  (``harvested``): every sequence is in one rank's harvest buffer.
"""
from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Collection
from typing import Sequence, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class RolloutReplicas:
    rank: int
    world: int
    tp: int = 1

    def __post_init__(self) -> None:
        if self.tp < 1 or self.world % self.tp:
            raise ValueError(f"rollout.tensor_parallel={self.tp} must divide the world size {self.world}")
        if not 0 <= self.rank < self.world:
            raise ValueError(f"rank {self.rank} is outside the world of {self.world}")

    @property
    def replica(self) -> int:
        return self.rank // self.tp

    @property
    def replicas(self) -> int:
        return self.world // self.tp

    @property
    def local(self) -> int:
        return self.rank % self.tp

    @property
    def leader(self) -> bool:
        return self.local == 0

    def members(self, replica: int | None = None) -> range:
        r = self.replica if replica is None else replica
        return range(r * self.tp, (r + 1) * self.tp)

    def prompts(self, num_prompts: int) -> list[int]:
        """This replica's prompt indices (whole groups; p % replicas == replica)."""
        return [p for p in range(num_prompts) if p % self.replicas == self.replica]

    def counted_tokens(self, tokens: int) -> int:
        return tokens if self.leader else 0

    def harvests(self, index: int) -> bool:
        """Whether this member keeps the drafter features of sequence ``index`` of a batch that
        every member of the replica sees alike (its rollout, or the policy forward's share of it):
        ``index % tp == local``, so the members split the sequences and each is harvested, and
        trained on, by one rank only (every sequence at ``tp`` 1)."""
        return index % self.tp == self.local


@dataclass(frozen=True)
class TrainShare:
    """What one rank's policy replica trains on: the rollouts of ``replicas`` (in this order,
    each once), then GRPO groups i with i % parts == part of them."""

    replicas: tuple[int, ...]
    part: int = 0
    parts: int = 1

    def select(self, per_replica: dict[int, tuple[list, list[float]]], own_replica: int, group_size: int
               ) -> tuple[list, list[float], range]:
        """(batch, rewards, own): the training batch from each replica's (batch, rewards), and
        where this rank's own replica's sequences sit in it (all of them with ``parts > 1``)."""
        batch: list = []
        rewards: list[float] = []
        own = range(0)
        for r in self.replicas:
            seqs, rew = per_replica[r]
            if r == own_replica:
                own = range(len(batch), len(batch) + len(seqs))
            batch.extend(seqs)
            rewards.extend(rew)
        if self.parts == 1:
            return batch, rewards, own
        keep = self.indices(len(batch), group_size)
        return [batch[i] for i in keep], [rewards[i] for i in keep], range(len(keep))

    def indices(self, num_seqs: int, group_size: int) -> list[int]:
        """The sequence indices of this part: whole groups i with i % parts == part."""
        if num_seqs % group_size:
            raise ValueError(f"{num_seqs} sequences are not whole groups of grpo.group_size={group_size}")
        return [i for i in range(num_seqs) if (i // group_size) % self.parts == self.part]


def harvested(own: Collection[int], replicas: RolloutReplicas, share: TrainShare, train_ranks: Sequence[int],
              rank: int) -> Collection[int]:
    """Which of ``own`` (the sequences of the policy forward this rank hands to the drafter) it
    keeps. The ranks that run that forward over the same ``own`` split it, the one at place j of
    n keeping i % n == j: with whole rollout replicas in the training group (``share.parts`` 1),
    the members of this rank's rollout replica (`RolloutReplicas.harvests`); inside one rollout
    replica (``parts`` > 1), the ranks of this rank's training group (``train_ranks``: the
    policy's TP x PP ranks, each of which runs its part's forward)."""
    if share.parts == 1:
        return own if replicas.tp == 1 else frozenset(i for i in own if replicas.harvests(i))
    group = sorted(train_ranks)
    if len(group) == 1:
        return own
    place = group.index(rank)
    return frozenset(i for i in own if i % len(group) == place)


def training_share(groups: Sequence[Sequence[int]], rank: int, tp: int) -> TrainShare:
    """This rank's ``TrainShare`` from every rank's training group (``groups[r]``: rank r's
    ``train_ranks``) and the rollout TP (see the module docstring)."""
    world = len(groups)
    mine = tuple(sorted(groups[rank]))
    replicas = sorted({r // tp for r in mine})
    whole = all(set(range(q * tp, (q + 1) * tp)) <= set(mine) for q in replicas)
    if whole:
        return TrainShare(tuple(replicas))
    if len(replicas) == 1:
        q = replicas[0]
        inside = sorted({tuple(sorted(groups[r])) for r in range(q * tp, min(world, (q + 1) * tp))})
        if all(r // tp == q for g in inside for r in g):
            return TrainShare((q,), inside.index(mine), len(inside))
    raise ValueError(f"the policy's training group {list(mine)} (policy.tensor_parallel x pipeline_parallel) and "
                     f"the rollout replicas of rollout.tensor_parallel={tp} overlap partly: a training group must "
                     "hold whole rollout replicas (policy TP a multiple of the rollout TP) or lie inside one")


def rollout_tp_group(replicas: RolloutReplicas):
    """The engine's ``TensorParallel`` of this rank's replica, or None at ``tp == 1``. Collective:
    every rank creates every replica's process group, in replica order (torch.distributed's rule)."""
    if replicas.tp == 1:
        return None
    import torch.distributed as dist

    from nemo_tlt.model.tensor_parallel import TensorParallel

    mine = None
    for q in range(replicas.replicas):
        group = dist.new_group(list(replicas.members(q)))
        if q == replicas.replica:
            mine = group
    return TensorParallel(group=mine, rank=replicas.local, size=replicas.tp)


def by_replica(values: Sequence[T], tp: int, replicas: Sequence[int]) -> dict[int, T]:
    """Rank-indexed ``values`` (e.g. an all-gather) -> one per replica, its leader's."""
    return {q: values[q * tp] for q in replicas}
