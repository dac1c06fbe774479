"""One rank's pipelined step: with TLT, once every piece is claimed the exact sum over
ranks starts in the background (before the rank goes idle, so the all-reduce overlaps the
drafter's meet); the baseline's update reduces only at its step, after its own groups."""
from __future__ import annotations

from types import SimpleNamespace

import torch.distributed as dist

from nemo_tlt.rl.group_board import Group
from nemo_tlt.rl.pipelined_step import PipelinedStep


class RecordingPolicy:
    """The calls the pipelined step makes, in order; one piece per group."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def num_parts(self, batch) -> int:
        return 1

    def begin_accumulation(self, token_budget: int) -> None:
        self.calls.append("begin")

    def logprobs(self, batch, separate, part=None):
        return None, None

    def accumulate(self, batch, advantages, logp_old, logp_ref, **kw) -> dict[str, float]:
        self.calls.append("accumulate")
        return dict.fromkeys(("loss", "pg_loss", "kl", "clip_frac", "approx_kl", "tokens"), 0.0)

    def start_reduction(self) -> None:
        self.calls.append("start_reduction")

    def apply_accumulated(self, global_tokens: int) -> dict[str, float]:
        self.calls.append("apply")
        return {"grad_norm": 0.0, "lr": 0.0}


def _step(policy: RecordingPolicy) -> PipelinedStep:
    cfg = SimpleNamespace(grpo=SimpleNamespace(prompts_per_step=2, group_size=2, max_new_tokens=8,
                                               acceptance="greedy", temperature=0.7),
                          policy=SimpleNamespace(separate_logprob_pass=False),
                          workers=SimpleNamespace(timeout_s=5.0))
    comm = SimpleNamespace(store=dist.HashStore(), rank=0, world=1, sum_=lambda t: t, gather=lambda x: [x])
    return PipelinedStep(cfg, "tlt", policy, comm, task=None)


def _group(gid: int) -> Group:
    return Group(gid, (1, 2), [[3, 4], [5]], [1.0, 0.0], [[-0.5, -0.25], [-1.0]], owner=0)


def test_tlt_claims_every_piece_then_starts_the_reduction():
    policy = RecordingPolicy()
    step = _step(policy)
    board = step.board(0)
    for gid in (1, 0):
        board.publish(_group(gid))
    sums, segments, _ = step.claim(0, board, clock=lambda: 0.0)
    assert sorted(sums) == [(0, 0), (1, 0)] and len(segments) == 2
    assert policy.calls == ["begin", "accumulate", "accumulate", "start_reduction"]


def test_the_baseline_reduces_at_its_step_only():
    policy = RecordingPolicy()
    step = _step(policy)
    collector = SimpleNamespace(own_groups=lambda: [_group(0), _group(1)])
    rollout = SimpleNamespace(out=SimpleNamespace(results=[SimpleNamespace(tokens=[3, 4]), SimpleNamespace(tokens=[5])]))
    update, _, _ = step.finish(0, collector, rollout, early={}, own_groups=True)
    assert policy.calls == ["begin", "accumulate", "accumulate", "apply"] and update["grad_norm"] == 0.0
