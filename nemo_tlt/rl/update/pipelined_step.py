"""One rank's side of the pipelined update (``policy.pipelined_update``), step after step.

Contract: ``PipelinedStep`` holds what the loop's pipelined path needs (the policy backend's
``begin_accumulation`` / ``accumulate`` / ``apply_accumulated`` / ``num_parts``, the run's
store, the task's reward) and runs the pieces ``nemo_tlt.rl.update.pipelined_update`` defines:
``board`` / ``collector`` for a step's rollout, ``claim(step, board)`` (TLT: pieces computed
before this rank goes idle), ``finish(...)`` (the baseline's own pieces, the exact sum over
ranks and the one optimizer step) and ``cleanup(step)`` (rank 0, two steps later).

With rollout replicas (``rollout.tensor_parallel`` > 1, ``nemo_tlt.rl.rollout_replicas``)
every member of a replica decodes the same rows: only the leader publishes the replica's
groups (each group once on the board), any rank may claim any piece (TLT), the baseline's
members split their replica's groups (member m computes the groups at places i with
i % tp == m), and the step's token count counts each replica once. The fixed-point sum makes
the result independent of who computed which piece.
"""
from __future__ import annotations

import time
from functools import partial
from typing import Any, Callable

import torch

from nemo_tlt.algorithms.grpo import GRPO
from nemo_tlt.algorithms.protocol import Advantages, advantages_of
from nemo_tlt.policy.protocol import STATS, HiddenSink
from nemo_tlt.rl.update.group_board import Group, GroupBoard, board_prefix, cleanup
from nemo_tlt.rl.reporting.logprob_gap import comparable
from nemo_tlt.rl.update.pipelined_update import GroupCollector, claim_all, combine, group_term
from nemo_tlt.rl.reporting.records import Rollout
from nemo_tlt.rl.rollout_replicas import RolloutReplicas

Sums = dict[tuple[int, int], dict[str, float]]


class PipelinedStep:
    def __init__(self, cfg: Any, mode: str, policy: Any, comm: Any, task: Any,
                 harvest: Callable[[int], HiddenSink] | None = None,
                 capture_layers: tuple[int, ...] | None = None, replicas: RolloutReplicas | None = None,
                 advantages: Callable[[list, list], Advantages] | None = None) -> None:
        """``advantages(rewards, responses)``: the run's algorithm's (None: GRPO's)."""
        self.cfg, self.mode, self.policy, self.comm, self.task = cfg, mode, policy, comm, task
        g = cfg.grpo
        self._advantages = advantages or partial(advantages_of, GRPO(), group_size=g.group_size,
                                                 max_new_tokens=g.max_new_tokens, eos_id=task.tokenizer.eos_id)
        self.harvest, self.capture_layers = harvest, capture_layers
        self.replicas = replicas if replicas is not None else RolloutReplicas(comm.rank, comm.world)

    def board(self, step: int) -> GroupBoard:
        return GroupBoard(self.comm.store, board_prefix(self.mode, step), self.cfg.grpo.prompts_per_step,
                          self.cfg.workers.timeout_s, parts_of=self.parts)

    def parts(self, group: Group) -> int:
        """The pieces (micro-batches) of a group's gradient."""
        return self.policy.num_parts([(group.prompt, r) for r in group.responses])

    def collector(self, prompts: list, board: GroupBoard | None) -> GroupCollector:
        task = self.task
        return GroupCollector(self.cfg.grpo.group_size,
                              lambda gid, tokens: task.reward(prompts[gid], task.tokenizer.decode(tokens)),
                              self.comm.rank, board.publish if board is not None and self.replicas.leader else None)

    def begin(self) -> None:
        g = self.cfg.grpo
        self.policy.begin_accumulation(g.prompts_per_step * g.group_size * g.max_new_tokens)

    def sink(self, step: int) -> HiddenSink | None:
        """Drafter data from the policy's forward (every sequence of the pieces this rank
        computes), or None; made once per step (it moves the harvest buffer to ``step``)."""
        return self.harvest(step) if self.harvest is not None else None

    def advantages(self, group: Group) -> Advantages:
        """The algorithm's advantages of one group (the same on whichever rank computes them)."""
        return self._advantages(group.rewards, group.responses)

    def term(self, group: Group, part: int | None = None, on_hidden: HiddenSink | None = None) -> dict[str, float]:
        return group_term(self.policy, group, self.advantages(group), part,
                          separate_logprob_pass=self.cfg.policy.separate_logprob_pass,
                          gap=comparable(self.cfg.grpo.acceptance, self.cfg.grpo.temperature),
                          on_hidden=on_hidden, capture_layers=self.capture_layers if on_hidden else None)

    def claim(self, step: int, board: GroupBoard, clock: Callable[[], float]
              ) -> tuple[Sums, list[tuple[float, float, str]], float]:
        """TLT: published pieces until every piece is claimed; their sums, the (start, end,
        "update") segments on ``clock`` and the seconds of work (not of waiting)."""
        self.begin()
        sums, segments = claim_all(board, partial(self.term, on_hidden=self.sink(step)), clock)
        return sums, segments, sum(b - a for a, b, _ in segments)

    def finish(self, step: int, collector: GroupCollector, rollout: Rollout, early: Sums, own_groups: bool
               ) -> tuple[dict[str, float], float, float]:
        """This rank's own groups first when they were not pipelined (the baseline), then the
        exact sum over ranks and the one optimizer step. Returns the update's dict, its
        seconds, and the seconds of its work alone (pieces and step, not the wait for the
        other ranks: the report's control)."""
        t0 = time.perf_counter()
        sums = dict(early)
        if own_groups:
            self.begin()
            on_hidden = self.sink(step)
            tp, local = self.replicas.tp, self.replicas.local
            for group in collector.own_groups()[local::tp]:  # piece by piece as TLT's ranks claim them
                for part in range(self.parts(group)):
                    sums[(group.gid, part)] = self.term(group, part, on_hidden)
        t_groups = time.perf_counter() - t0
        # the response tokens the algorithm counts, each replica's once
        own_tokens = self.replicas.counted_tokens(sum(self.advantages(g).tokens for g in collector.own_groups()))
        global_tokens = int(self.comm.sum_(torch.tensor([float(own_tokens)], device="cpu")).item())
        t1 = time.perf_counter()
        # (a step whose every sequence is dropped steps on a zero gradient: a mean over at least 1)
        out = self.policy.apply_accumulated(max(1, global_tokens))
        t_step = time.perf_counter() - t1
        parts = self.comm.gather(sums)
        # rank 0 logs the step's totals (the record sums the ranks' shares)
        stats = combine(parts, max(1, global_tokens)) if self.comm.rank == 0 else dict.fromkeys(STATS, 0.0)
        return {**stats, **out, "loss_tokens": global_tokens}, time.perf_counter() - t0, t_groups + t_step

    def cleanup(self, step: int) -> None:
        """Delete the board of ``step`` (rank 0, once every rank is past it)."""
        cleanup(self.comm.store, board_prefix(self.mode, step), self.cfg.grpo.prompts_per_step,
                self.cfg.grpo.group_size)  # at most a piece per sequence
