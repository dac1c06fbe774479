"""The policy update pipelined into the rollout's tail (``policy.pipelined_update``).

Contract
--------
* ``GroupCollector`` is the engine's ``on_finish`` sink of one rank's rollout (``bind`` the
  rollout's requests and sequence ids first): it collects
  rows by group (sequence id ``gid * G + g``), scores a group once its G rows are final and
  publishes it (``GroupBoard.publish``); ``rewards(ids)`` returns the scores in id order.
* ``group_term(policy, group, advantages, part, ...)`` computes one group's gradient term, or
  that of its micro-batch ``part`` (``accumulate``: log-probs as the non-pipelined update would
  compute them, the algorithm's advantages of the whole group, its policy loss) and
  returns its token sums (``STATS``, ``tokens``, and the logprob_gap sums when asked).
* ``combine(parts)`` folds every rank's ``{(gid, part): sums}`` into the step's token means,
  adding pieces in key order, so the logged stats do not depend on which rank computed what.
* With TLT every rank, once its own decoding is done, claims published pieces (a group's
  micro-batches) until all are claimed (its own groups first as they were published first,
  then the still-decoding ranks' finished ones), and only then goes idle (drafter training
  in what remains). The baseline computes its own groups, in gid order, after the rollout:
  the plain synchronous step.
  Both sum in fixed point, so TLT and baseline take bit-identical optimizer steps.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from nemo_tlt.algorithms.protocol import Advantages, counted_kwarg
from nemo_tlt.policy.protocol import STATS, HiddenSink
from nemo_tlt.rl.update.group_board import Group, GroupBoard
from nemo_tlt.rl.reporting.logprob_gap import GAP_SUMS, gap_sums
from nemo_tlt.rollout.protocol import Request, RequestResult


class GroupCollector:
    """``on_finish`` sink: rows -> complete groups -> rewards -> ``publish`` (None: keep them only)."""

    def __init__(self, group_size: int, reward: Callable[[int, list[int]], float], rank: int,
                 publish: Callable[[Group], None] | None = None) -> None:
        self.G, self.reward, self.rank, self.publish = group_size, reward, rank, publish
        self.requests: Sequence[Request] = ()
        self.ids: list[int] = []
        self.rows: dict[int, dict[int, RequestResult]] = {}
        self.scores: dict[int, float] = {}
        self.groups: dict[int, Group] = {}

    def bind(self, requests: Sequence[Request], ids: Sequence[int]) -> None:
        """The rollout's requests and their sequence ids (before ``generate``)."""
        self.requests, self.ids = requests, list(ids)

    def __call__(self, index: int, result: RequestResult) -> None:
        seq = self.ids[index]
        gid = seq // self.G
        rows = self.rows.setdefault(gid, {})
        rows[seq] = result
        self.scores[seq] = float(self.reward(gid, result.tokens))
        if len(rows) < self.G:
            return
        order = sorted(rows)
        group = Group(gid, tuple(self.requests[index].prompt), [rows[s].tokens for s in order],
                      [self.scores[s] for s in order], [list(rows[s].logprobs) for s in order], self.rank)
        self.groups[gid] = group
        if self.publish is not None:
            self.publish(group)

    def rewards(self, ids: Sequence[int]) -> list[float]:
        return [self.scores[i] for i in ids]

    def own_groups(self) -> list[Group]:
        """This rank's groups in gid order (every one complete after ``generate``)."""
        return [self.groups[g] for g in sorted(self.groups)]


def group_term(policy: Any, group: Group, advantages: Advantages, part: int | None = None, *,
               separate_logprob_pass: bool, gap: bool, on_hidden: HiddenSink | None = None,
               capture_layers: tuple[int, ...] | None = None) -> dict[str, float]:
    """One group's gradient term (or of its micro-batch ``part`` alone) added to ``policy``'s
    fixed-point sums, with the algorithm's ``advantages`` of the group; its token sums back."""
    batch = [(group.prompt, r) for r in group.responses]
    logp_old, logp_ref = policy.logprobs(batch, separate_logprob_pass, part=part)
    seen: dict[int, torch.Tensor] = {}
    sink = seen.__setitem__ if gap and logp_old is None else None
    sums = policy.accumulate(batch, advantages.values, logp_old, logp_ref, on_hidden=on_hidden,
                             capture_layers=capture_layers, on_logprobs=sink, part=part,
                             **counted_kwarg(advantages))
    if gap:
        rows = sorted(seen) if logp_old is None else [i for i, lp in enumerate(logp_old) if lp is not None]
        lps = [seen[i] if logp_old is None else logp_old[i] for i in rows]
        sums.update(gap_sums([group.gen_logprobs[i] for i in rows], lps))
    return sums


def combine(parts: Sequence[dict[Any, dict[str, float]]], global_tokens: int) -> dict[str, float]:
    """The step's token-mean ``STATS`` (and gap sums) from every rank's sums per work piece
    (keys ``(gid, part)``), added in key order."""
    pieces = {key: sums for part in parts for key, sums in part.items()}
    order = sorted(pieces)
    out = {k: sum(pieces[g][k] for g in order) / global_tokens for k in STATS}
    if pieces and all(all(k in s for k in GAP_SUMS) for s in pieces.values()):
        out.update({k: sum(pieces[g][k] for g in order) for k in GAP_SUMS})
    return out


def claim_all(board: GroupBoard, compute: Callable[[Group, int], dict[str, float]],
              clock: Callable[[], float]) -> tuple[dict[tuple[int, int], dict[str, float]],
                                                   list[tuple[float, float, str]]]:
    """Claim and compute published pieces until every piece is claimed: the sums per
    ``(gid, part)`` and the (start, end, "update") segments of this rank's work on ``clock``."""
    sums, segments = {}, []
    while (claimed := board.claim()) is not None:
        group, part = claimed
        t0 = clock()
        sums[(group.gid, part)] = compute(group, part)
        segments.append((t0, clock(), "update"))
    return sums, segments
