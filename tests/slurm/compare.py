"""One check shared by the launch-mode tests (SLURM, torchrun): a run launched another way
equals the same tiny run launched by the local spawn launcher, bit for bit."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from rl.test_loop_e2e import _final_policy as final_policy


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def assert_same_runs(a_run: Path, b_run: Path, steps: int) -> tuple[list[dict], list[dict]]:
    """The two runs (folders holding metrics.jsonl and checkpoints/) made the same rollouts
    and rewards at every step and ended with the same policy; returns their records."""
    a, b = metrics(a_run), metrics(b_run)
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(steps))
    assert [r["rollout_digest"] for r in a] == [r["rollout_digest"] for r in b]
    assert [r["rewards"] for r in a] == [r["rewards"] for r in b]
    pa, pb = final_policy(a_run), final_policy(b_run)
    assert pa.keys() == pb.keys() and pa
    for k in pa:
        assert torch.equal(pa[k], pb[k]), k
    return a, b
