"""allreduce_flat: one flat float32 reduce, copied back in place; sum and average; None skipped."""
from __future__ import annotations

import pytest
import torch

from nemo_tlt.dist import RankContext, allreduce_flat
from ranks import launch_forked


def _reduce(ctx: RankContext, op: str) -> tuple[list[torch.Tensor], torch.Tensor]:
    r = float(ctx.rank + 1)
    tensors = [torch.full((2, 2), r), None, torch.full((3,), 10 * r, dtype=torch.bfloat16)]
    flat = allreduce_flat(tensors, op=op)
    return [tensors[0], tensors[2]], flat


@pytest.mark.timeout(120)
def test_sum_and_average_over_two_ranks():
    (a, b), flat = launch_forked(_reduce, 2, "sum", timeout_s=90)[1]
    assert torch.equal(a, torch.full((2, 2), 3.0)) and torch.equal(b, torch.full((3,), 30.0, dtype=torch.bfloat16))
    assert flat.dtype == torch.float32 and flat.numel() == 7
    (a, b), _ = launch_forked(_reduce, 2, "avg", timeout_s=90)[0]
    assert torch.equal(a, torch.full((2, 2), 1.5)) and torch.equal(b, torch.full((3,), 15.0, dtype=torch.bfloat16))


def test_without_a_process_group_nothing_changes_and_bad_ops_are_refused():
    t = torch.ones(3)
    assert torch.equal(allreduce_flat([t]), torch.ones(3)) and torch.equal(t, torch.ones(3))
    with pytest.raises(ValueError, match="op must be one of"):
        allreduce_flat([t], op="max")
