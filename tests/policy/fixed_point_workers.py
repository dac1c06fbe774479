"""Worker function for the fixed-point sum's background reduction test
(tests/policy/test_fixed_point.py), run inside gloo processes (launch_local)."""
from __future__ import annotations

import threading

import torch
import torch.distributed as dist

from nemo_tlt.dist import RankContext
from nemo_tlt.policy.fixed_point import FixedPointGrads


def reduce_in_background(ctx: RankContext, terms: list[list[torch.Tensor]], owner: list[int]) -> dict:
    """This rank's terms (``owner[i] == rank``), ``start_reduce``, another collective from another
    thread while the sum runs (the pipelined update's drafter meet), then ``reduce``."""
    acc = FixedPointGrads(terms[0], 1000)
    for term, rank in zip(terms, owner):
        if rank == ctx.rank:
            acc.add(term, 100)
    acc.start_reduce()
    try:
        acc.add(terms[0], 100)
        refused = False
    except RuntimeError:
        refused = True
    other = torch.tensor([float(ctx.rank + 1)])
    side = threading.Thread(target=dist.all_reduce, args=(other,))
    side.start()
    side.join()
    acc.reduce()
    return {"result": acc.result(1.0), "other": float(other), "refused": refused}
