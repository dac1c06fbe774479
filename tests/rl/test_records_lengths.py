"""The step record keeps what `nemo-tlt plan --measured` reads: every sequence's response
length (in sequence-id order) and, per tree shape, the tokens and row-steps of its SD steps."""
from __future__ import annotations

from nemo_tlt.rl.reporting.records import IdleResult, RankState, RankStep, arm_accept_counts, step_record
from nemo_tlt.rollout.protocol import StepTrace

TIMES = {"step_s": 1.0, "rollout_s": 0.5, "logprob_s": 0.1, "update_s": 0.1, "weight_sync_s": 0.1}
UPDATE = {**{u: 0.0 for u in ("loss", "pg_loss", "kl", "clip_frac", "approx_kl")}, "grad_norm": 0.0, "loss_tokens": 0}


def _rank(k: int, ids: list[int], tokens: list[list[int]], arms: dict) -> RankStep:
    return RankStep(rank=k, node=0, ids=ids, tokens=tokens, rewards=[0.0] * len(ids), gen_s=1.0, sd_steps=1,
                    plain_steps=1, accept_lengths=[], segments=[], idle=IdleResult(), update=UPDATE,
                    state=RankState(), weights="w", arm_accept=arms)


def test_arm_accept_counts_from_the_trace():
    trace = [StepTrace(8, None, 8, 1.0, 0.1), StepTrace(4, "4_1_4", 12, 3.0, 0.1),
             StepTrace(2, "4_1_4", 10, 5.0, 0.1), StepTrace(2, "8_2_16", 14, 7.0, 0.1)]
    assert arm_accept_counts(trace) == {"4_1_4": [22, 6], "8_2_16": [14, 2]}


def test_record_keeps_lengths_per_sequence_and_accepts_per_arm():
    ranks = [_rank(1, [1, 3], [[5] * 7, [5] * 2], {"4_1_4": [9, 3]}),
             _rank(0, [0, 2], [[5] * 4, [5] * 11], {"4_1_4": [6, 2], "6_1_6": [10, 2]})]
    rec = step_record(0, "tlt", 4, ranks, TIMES, [], 0.0, 1.0)
    assert rec["resp_lens"] == [4, 7, 11, 2]
    assert rec["accept_by_arm"] == {"4_1_4": [15, 5], "6_1_6": [10, 2]}


def test_replicas_are_compared_only_where_their_weights_were_hashed():
    hashed = [_rank(0, [0], [[5]], {}), _rank(1, [1], [[5]], {})]
    assert step_record(0, "tlt", 2, hashed, TIMES, [], 0.0, 1.0)["replicas_identical"] is True
    hashed[1].weights = "other"
    assert step_record(0, "tlt", 2, hashed, TIMES, [], 0.0, 1.0)["replicas_identical"] is False
    for r in hashed:
        r.weights = None  # debug.weight_digests off at this step
    assert step_record(0, "tlt", 2, hashed, TIMES, [], 0.0, 1.0)["replicas_identical"] is None



def test_the_record_counts_the_prompt_tokens_of_the_leaders():
    ranks = [_rank(0, [0], [[5] * 3], {}), _rank(1, [1], [[5] * 2], {})]
    ranks[0].prompt_tokens, ranks[1].prompt_tokens = 7, 4
    assert step_record(0, "tlt", 2, ranks, TIMES, [], 0.0, 1.0)["prompt_tokens"] == 11
