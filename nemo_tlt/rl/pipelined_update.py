"""The policy update pipelined into the rollout's tail (``policy.pipelined_update``).

Contract
--------
* ``GroupCollector`` is the engine's ``on_finish`` sink of one rank's rollout (``bind`` the
  rollout's requests and sequence ids first): it collects
  rows by group (sequence id ``gid * G + g``), scores a group once its G rows are final and
  publishes it (``GroupBoard.publish``); ``rewards(ids)`` returns the scores in id order.
* ``group_term(policy, group, ...)`` computes one group's gradient term
  (``accumulate``: log-probs as the non-pipelined update would compute them, group
  advantages, the clipped PG loss) and returns the group's token sums (``STATS``,
  ``tokens``, and the logprob_gap sums when asked).
* ``combine(parts)`` folds every rank's ``{gid: sums}`` into the step's token means, adding
  groups in gid order, so the logged stats do not depend on which rank computed which group.
* With TLT every rank, once its own decoding is done, claims published groups until all are
  claimed (its own first as they were published first, then the still-decoding ranks'
  finished ones), and only then goes idle (drafter training in what remains). The baseline
  computes its own groups, in gid order, after the rollout: the plain synchronous step.
  Both sum in fixed point, so TLT and baseline take bit-identical optimizer steps.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from nemo_tlt.policy.protocol import STATS, HiddenSink
from nemo_tlt.rl.group_board import Group, GroupBoard
from nemo_tlt.rl.grpo import group_advantages
from nemo_tlt.rl.logprob_gap import GAP_SUMS, gap_sums
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


def group_term(policy: Any, group: Group, *, group_size: int, separate_logprob_pass: bool, gap: bool,
               on_hidden: HiddenSink | None = None, capture_layers: tuple[int, ...] | None = None
               ) -> dict[str, float]:
    """One group's gradient term added to ``policy``'s fixed-point sums; its token sums back."""
    batch = [(group.prompt, r) for r in group.responses]
    logp_old, logp_ref = policy.logprobs(batch, separate_logprob_pass)
    advantages = group_advantages(torch.tensor(group.rewards, dtype=torch.float32, device="cpu"), group_size)
    seen: dict[int, torch.Tensor] = {}
    sink = seen.__setitem__ if gap and logp_old is None else None
    sums = policy.accumulate(batch, advantages, logp_old, logp_ref, on_hidden=on_hidden,
                             capture_layers=capture_layers, on_logprobs=sink)
    if gap:
        lps = logp_old if logp_old is not None else [seen[i] for i in range(len(batch))]
        sums.update(gap_sums(group.gen_logprobs, lps))
    return sums


def combine(parts: Sequence[dict[int, dict[str, float]]], global_tokens: int) -> dict[str, float]:
    """The step's token-mean ``STATS`` (and gap sums) from every rank's per-group sums, in gid order."""
    groups = {gid: sums for part in parts for gid, sums in part.items()}
    out = {k: sum(groups[g][k] for g in sorted(groups)) / global_tokens for k in STATS}
    if groups and all(all(k in s for k in GAP_SUMS) for s in groups.values()):
        out.update({k: sum(groups[g][k] for g in sorted(groups)) for k in GAP_SUMS})
    return out


def claim_all(board: GroupBoard, compute: Callable[[Group], dict[str, float]],
              clock: Callable[[], float]) -> tuple[dict[int, dict[str, float]], list[tuple[float, float, str]]]:
    """Claim and compute published groups until every group is claimed: the sums per gid
    and the (start, end, "update") segments of this rank's work on ``clock``."""
    sums, segments = {}, []
    while (group := board.claim()) is not None:
        t0 = clock()
        sums[group.gid] = compute(group)
        segments.append((t0, clock(), "update"))
    return sums, segments
