"""Rollout replicas and training shares (nemo_tlt.rl.rollout_replicas): which prompts a replica
decodes, which rollouts each policy replica trains on, and the layouts that are refused."""
from __future__ import annotations

import pytest

from nemo_tlt.config import load_config
from nemo_tlt.rl.rollout_replicas import RolloutReplicas, TrainShare, by_replica, training_share


def test_replicas_are_consecutive_ranks_with_whole_prompt_groups():
    reps = [RolloutReplicas(r, 8, 2) for r in range(8)]
    assert [r.replica for r in reps] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [r.leader for r in reps] == [True, False] * 4
    assert list(reps[5].members()) == [4, 5]
    assert reps[2].prompts(10) == reps[3].prompts(10) == [1, 5, 9]
    # every prompt decoded by exactly one replica
    assert sorted(p for r in reps[::2] for p in r.prompts(10)) == list(range(10))
    assert [r.counted_tokens(7) for r in reps[:2]] == [7, 0]
    assert RolloutReplicas(3, 4).prompts(6) == [3]  # tp 1: each rank is a replica (today's sharding)


def test_replicas_refuse_a_tp_that_does_not_divide_the_world():
    with pytest.raises(ValueError, match=r"rollout.tensor_parallel=3 must divide the world size 4"):
        RolloutReplicas(0, 4, 3)


def _torch_groups(world):  # the torch backend: every rank is its own model replica
    return [(r,) for r in range(world)]


def _megatron_groups(world, tp, pp):  # megatron-core's rank order tp-dp-pp: model-parallel groups
    dp = world // (tp * pp)
    return [tuple(sorted(p * tp * dp + d * tp + t for p in range(pp) for t in range(tp)))
            for r in range(world) for d in [(r // tp) % dp]]


def test_torch_backend_splits_a_replica_by_groups():
    shares = [training_share(_torch_groups(4), r, 2) for r in range(4)]
    assert shares == [TrainShare((0,), 0, 2), TrainShare((0,), 1, 2), TrainShare((1,), 0, 2), TrainShare((1,), 1, 2)]
    batch, rewards = [f"s{i}" for i in range(8)], [float(i) for i in range(8)]  # 4 groups of G=2
    parts = [s.select({0: (batch, rewards)}, 0, 2) for s in shares[:2]]
    assert parts[0][0] == ["s0", "s1", "s4", "s5"] and parts[1][0] == ["s2", "s3", "s6", "s7"]
    assert parts[1][1] == [2.0, 3.0, 6.0, 7.0] and parts[1][2] == range(4)
    assert training_share(_torch_groups(4), 3, 1) == TrainShare((3,))  # rollout tp 1: its own rollout


def test_megatron_tp_over_whole_replicas_joins_them_once():
    groups = _megatron_groups(8, 2, 2)  # TP2 x PP2 x DP2: model-parallel groups {0,1,4,5}, {2,3,6,7}
    assert groups[0] == (0, 1, 4, 5) and groups[2] == (2, 3, 6, 7)
    share = training_share(groups, 4, 2)
    assert share == TrainShare((0, 2))
    batch, rewards, own = share.select({0: (["a", "b"], [1.0, 0.0]), 2: (["c", "d"], [0.0, 1.0])}, 2, 2)
    assert batch == ["a", "b", "c", "d"] and rewards == [1.0, 0.0, 0.0, 1.0] and own == range(2, 4)
    # policy TP 8 over two rollout replicas of 4 (the shipped 32B layout)
    assert training_share(_megatron_groups(32, 8, 1), 13, 4) == TrainShare((2, 3))
    # policy TP 2 inside a rollout replica of 4: two model replicas share its groups
    assert [training_share(_megatron_groups(8, 2, 1), r, 4) for r in (0, 2, 5)] == [
        TrainShare((0,), 0, 2), TrainShare((0,), 1, 2), TrainShare((1,), 0, 2)]


def test_partly_overlapping_layouts_are_refused():
    with pytest.raises(ValueError, match=r"training group \[0, 1, 4, 5\].*rollout.tensor_parallel=4 overlap partly"):
        training_share(_megatron_groups(8, 2, 2), 0, 4)


def test_indices_refuse_partial_groups_and_by_replica_takes_leaders():
    with pytest.raises(ValueError, match=r"5 sequences are not whole groups of grpo.group_size=2"):
        TrainShare((0,), 0, 2).indices(5, 2)
    assert by_replica(["r0", "r1", "r2", "r3"], 2, (0, 1)) == {0: "r0", 1: "r2"}


def test_config_refuses_what_rollout_tp_cannot_run():
    with pytest.raises(ValueError, match=r"rollout.tensor_parallel=3 must divide workers.num_workers=2"):
        load_config(None, ["rollout.tensor_parallel=3"])
    with pytest.raises(ValueError, match=r"rollout.tensor_parallel=2 with rollout.engine=trtllm is not built"):
        load_config(None, ["rollout.tensor_parallel=2", "rollout.engine=trtllm"])
    with pytest.raises(ValueError, match=r"rollout.tensor_parallel must be >= 1, got 0"):
        load_config(None, ["rollout.tensor_parallel=0"])
    with pytest.raises(ValueError, match=r"grpo.prompts_per_step=1 leaves a rollout replica without prompts"):
        load_config(None, ["workers.num_workers=4", "rollout.tensor_parallel=2", "grpo.prompts_per_step=1"])
    assert load_config(None, ["rollout.tensor_parallel=2"]).rollout.tensor_parallel == 2
    assert load_config(None, ["rollout.tensor_parallel=2", "policy.pipelined_update=true"]).policy.pipelined_update
