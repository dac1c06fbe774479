"""The step record's per-node drafter fields: samples trained per node beside the seconds,
and whether the average went through the node leaders."""
from __future__ import annotations

from nemo_tlt.rl.reporting.records import IdleResult, RankState, RankStep, step_record

TIMES = {"step_s": 1.0, "rollout_s": 0.5, "logprob_s": 0.1, "update_s": 0.1, "weight_sync_s": 0.1}


def _rank(k: int, node: int, idle: IdleResult) -> RankStep:
    return RankStep(rank=k, node=node, ids=[k], tokens=[[1, 2]], rewards=[1.0], gen_s=1.0, sd_steps=0,
                    plain_steps=2, accept_lengths=[], segments=[], idle=idle,
                    update={**{u: 0.0 for u in ("loss", "pg_loss", "kl", "clip_frac", "approx_kl")}, "grad_norm": 0.0, "loss_tokens": 2},
                    state=RankState(), weights="w")


def test_samples_per_node_and_hierarchy():
    ranks = [_rank(0, 0, IdleResult(train_s=1.0, drafter_samples=8, sync_hierarchical=True)),
             _rank(3, 1, IdleResult(train_s=0.5, drafter_samples=0, sync_hierarchical=True)),
             _rank(1, 0, IdleResult(train_s=2.0, drafter_samples=16, sync_hierarchical=True)),
             _rank(2, 1, IdleResult(train_s=0.5, drafter_samples=4, sync_hierarchical=True))]
    rec = step_record(0, "tlt", 4, ranks, TIMES, [], 0.0, 1.0)
    assert rec["drafter_samples_per_node"] == {"0": 24, "1": 4}
    assert all(isinstance(v, int) for v in rec["drafter_samples_per_node"].values())
    assert rec["drafter_train_s_per_node"] == {"0": 3.0, "1": 1.0}
    assert rec["drafter_sync_hierarchical"] is True


def test_a_flat_average_says_so():
    rec = step_record(0, "tlt", 2, [_rank(0, 0, IdleResult(drafter_samples=3)), _rank(1, 0, IdleResult())],
                      TIMES, [], 0.0, 1.0)
    assert rec["drafter_sync_hierarchical"] is False and rec["drafter_samples_per_node"] == {"0": 3}
