"""The pipelined update's work list: finished GRPO groups, published over the store, each claimed once.

Contract
--------
* One ``GroupBoard`` per rank per RL step, over the run's shared ``torch.distributed.Store``
  and a key prefix of that step (``board_prefix``). ``num_groups`` is the step's group count.
* ``publish(group)``: the rank that decoded a group hands it over as soon as its last row
  is final (from the engine's ``on_finish``): the prompt, the G responses, their rewards and
  generation log-probs, pickled under ``<prefix>/group/<gid>``, then its id appended to the
  publication list ``<prefix>/pub/<n>`` (``n`` from one ``add``: no two groups share a slot).
* ``claim()`` returns the next published group no rank has claimed (``add`` on
  ``<prefix>/claim/<gid>`` returning 1 makes it this rank's), in publication order,
  waiting for the next publication when every published one is taken; None once all
  ``num_groups`` were published and this rank has seen every one (every group is then
  claimed by some rank). A wait past ``timeout_s`` raises ``TimeoutError`` naming the step's
  missing groups (a rank died mid-rollout).
* ``cleanup(store, prefix, num_groups)`` deletes a finished step's keys (rank 0, once
  every rank is past that step).
* Which rank computes which group changes nothing learned: the gradient sum is exact
  (``nemo_tlt.policy.fixed_point``) and each group's gradient a function of its tokens.
"""
from __future__ import annotations

import pickle
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist


@dataclass
class Group:
    """One prompt's G rollouts, ready for its gradient."""

    gid: int                          # the prompt's index in the step (sequence ids gid * G + g)
    prompt: tuple[int, ...]
    responses: list[list[int]]        # in sequence-id order
    rewards: list[float]
    gen_logprobs: list[list[float]]   # the engine's, per response token (the logprob_gap metric)
    owner: int                        # the rank that decoded it


def board_prefix(mode: str, step: int) -> str:
    return f"tlt/{mode}/groups/{step}"


class GroupBoard:
    def __init__(self, store: dist.Store, prefix: str, num_groups: int, timeout_s: float) -> None:
        if num_groups < 1:
            raise ValueError(f"GroupBoard: num_groups must be >= 1, got {num_groups}")
        self.store, self.prefix, self.num_groups, self.timeout_s = store, prefix, num_groups, timeout_s
        self.seen = 0  # publications this rank has looked at

    def publish(self, group: Group) -> None:
        self.store.set(f"{self.prefix}/group/{group.gid}", pickle.dumps(group))
        slot = self.store.add(f"{self.prefix}/published", 1) - 1
        self.store.set(f"{self.prefix}/pub/{slot}", str(group.gid))

    def claim(self) -> Group | None:
        while self.seen < self.num_groups:
            key = f"{self.prefix}/pub/{self.seen}"
            try:
                self.store.wait([key], timedelta(seconds=self.timeout_s))
            except Exception as err:  # the store's own timeout error type differs by store and version
                raise TimeoutError(f"pipelined update: {self.num_groups - self.seen} of {self.num_groups} groups "
                                   f"of {self.prefix} were not published within workers.timeout_s="
                                   f"{self.timeout_s:g}s (did a rank fail mid-rollout?)") from err
            gid = int(self.store.get(key))
            self.seen += 1
            if self.store.add(f"{self.prefix}/claim/{gid}", 1) == 1:
                return pickle.loads(self.store.get(f"{self.prefix}/group/{gid}"))
        return None


def cleanup(store: dist.Store, prefix: str, num_groups: int) -> None:
    """Delete the keys of a finished step's board."""
    keys = [f"{prefix}/published"]
    for i in range(num_groups):
        keys += [f"{prefix}/pub/{i}", f"{prefix}/group/{i}", f"{prefix}/claim/{i}"]
    for key in keys:
        store.delete_key(key)
