"""The pipelined update's work list: finished GRPO groups, published over the store, each claimed once.

Contract
--------
* One ``GroupBoard`` per rank per RL step, over the run's shared ``torch.distributed.Store``
  and a key prefix of that step (``board_prefix``). ``num_groups`` is the step's group count.
* ``publish(group)``: the rank that decoded a group hands it over as soon as its last row
  is final (from the engine's ``on_finish``): the prompt, the G responses, their rewards and
  generation log-probs, pickled under ``<prefix>/group/<gid>``, then its id appended to the
  publication list ``<prefix>/pub/<n>`` (``n`` from one ``add``: no two groups share a slot).
* A group's work is ``parts_of(group)`` pieces (its micro-batches: the finer the pieces,
  the better the ranks share the tail's last groups), a count published with it. ``claim()`` returns the next published
  ``(group, part)`` no rank has claimed (``add`` on ``<prefix>/claim/<gid>/<part>``
  returning 1 makes it this rank's), in publication order, waiting for the next
  publication when every published piece is taken; None once all ``num_groups`` were
  published and this rank has tried every piece (each is then claimed by some rank). A wait past ``timeout_s`` raises ``TimeoutError`` naming the step's
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
from typing import Callable

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
    def __init__(self, store: dist.Store, prefix: str, num_groups: int, timeout_s: float,
                 parts_of: Callable[[Group], int] = lambda group: 1) -> None:
        if num_groups < 1:
            raise ValueError(f"GroupBoard: num_groups must be >= 1, got {num_groups}")
        self.store, self.prefix, self.num_groups, self.timeout_s = store, prefix, num_groups, timeout_s
        self.parts_of = parts_of
        self.seen = 0  # publications this rank has looked at
        self._current: tuple[int, int, int] | None = None  # (gid, next part to try, parts) of the last one seen
        self._loaded: Group | None = None

    def publish(self, group: Group) -> None:
        parts = int(self.parts_of(group))
        if parts < 1:
            raise ValueError(f"GroupBoard.publish: group {group.gid} has {parts} parts; it needs >= 1")
        self.store.set(f"{self.prefix}/group/{group.gid}", pickle.dumps(group))
        slot = self.store.add(f"{self.prefix}/published", 1) - 1
        self.store.set(f"{self.prefix}/pub/{slot}", f"{group.gid}/{parts}")

    def claim(self) -> tuple[Group, int] | None:
        """The next unclaimed (group, part) in publication order, waiting for publications;
        None once every part of every group has been claimed by some rank."""
        while True:
            if self._current is not None:
                gid, part, parts = self._current
                self._current = (gid, part + 1, parts) if part + 1 < parts else None
                if self.store.add(f"{self.prefix}/claim/{gid}/{part}", 1) == 1:
                    if self._loaded is None or self._loaded.gid != gid:
                        self._loaded = pickle.loads(self.store.get(f"{self.prefix}/group/{gid}"))
                    return self._loaded, part
                continue
            if self.seen == self.num_groups:
                return None
            key = f"{self.prefix}/pub/{self.seen}"
            try:
                self.store.wait([key], timedelta(seconds=self.timeout_s))
            except Exception as err:  # the store's own timeout error type differs by store and version
                raise TimeoutError(f"pipelined update: {self.num_groups - self.seen} of {self.num_groups} groups "
                                   f"of {self.prefix} were not published within workers.timeout_s="
                                   f"{self.timeout_s:g}s (did a rank fail mid-rollout?)") from err
            gid, parts = (int(x) for x in self.store.get(key).decode().split("/"))
            self._current = (gid, 0, parts)
            self.seen += 1


def cleanup(store: dist.Store, prefix: str, num_groups: int, parts: int = 1) -> None:
    """Delete the keys of a finished step's board (``parts``: at least any group's part count)."""
    keys = [f"{prefix}/published"]
    for i in range(num_groups):
        keys += [f"{prefix}/pub/{i}", f"{prefix}/group/{i}"] + [f"{prefix}/claim/{i}/{k}" for k in range(parts)]
    for key in keys:
        store.delete_key(key)
