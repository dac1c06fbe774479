"""A rollout's drafter features, taken as each row finishes (``drafter.harvest_from: rollout``)."""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from nemo_tlt.rollout.protocol import Request, RequestResult


class InOrderHarvest:
    """Each finished row's features go into a compact host copy at once (``make_sample``: the
    harvest buffer's; None for a row too short to train on), so the engine's copy, on its
    device, is freed as the row finishes, not when the rollout ends; the copies go into the
    buffer (``add``) in request order, each as soon as every earlier row is in, so the host
    holds at most the rows that finished ahead of an earlier one besides the buffer. Rows an
    engine did not hand over through ``on_finish`` are taken from the results (`finish`).
    ``keep(index)`` (default: every row) picks the rows this rank harvests; the others' features
    are dropped as they finish (a tensor-parallel replica's members split its rows:
    ``RolloutReplicas.harvests``)."""

    def __init__(self, requests: Sequence[Request],
                 make_sample: Callable[[list[int], torch.Tensor], Any], add: Callable[[Any], Any],
                 keep: Callable[[int], bool] | None = None) -> None:
        self.requests, self.make_sample, self.add = requests, make_sample, add
        self.keep = keep
        self._next = 0
        self._ready: dict[int, Any] = {}

    def take(self, index: int, result: RequestResult) -> None:
        """Row ``index`` finished (an ``on_finish`` sink): its copy, then every row now in order."""
        if index < self._next or index in self._ready:
            return  # taken already
        self._ready[index] = None
        if result.hidden_states is not None:
            if self.keep is None or self.keep(index):
                self._ready[index] = self.make_sample(list(self.requests[index].prompt) + result.tokens,
                                                      result.hidden_states)
            result.hidden_states = None
        while self._next in self._ready:
            sample = self._ready.pop(self._next)
            if sample is not None:
                self.add(sample)
            self._next += 1

    def finish(self, results: Sequence[RequestResult]) -> None:
        """After ``generate``: every row not handed over yet, in order."""
        for index, result in enumerate(results):
            self.take(index, result)
