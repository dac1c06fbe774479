"""The reshard plan counts the bytes the real streaming reshard moves through the process
group (counted at torch.distributed's calls) and what its ByteMeter counts (peak, total and
bytes received), rank by rank, and at full 32B / 70B shapes stays within two layers per rank
while every rank receives only about its rollout slice of the model."""
from __future__ import annotations

import pytest

from nemo_tlt.model.config import LMConfig
from nemo_tlt.model.hf_io import read_config
from nemo_tlt.plan.reshard_plan import plan_stream_reshard
from nemo_tlt.weights.layout import ParallelLayout

from test_model_configs import MODELS

QWEN = LMConfig(family="qwen2", vocab_size=96, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4,
                num_kv_heads=2, tie_word_embeddings=True)
LLAMA = LMConfig(family="llama", vocab_size=80, hidden_size=32, intermediate_size=64, num_layers=4, num_heads=8,
                 num_kv_heads=2)
# (cfg, layout, rollout TP, receivers) on a world of 2: PP2 (uneven stages), TP2, DP2.
WORLD = 2
CASES = [
    (QWEN, ParallelLayout(1, 2, num_layers_in_first_stage=1), 1, ()),
    (LLAMA, ParallelLayout(2, 1), 2, ()),
    (LLAMA, ParallelLayout(2, 1), 1, (1,)),
    (LLAMA, ParallelLayout(1, 1), 1, ()),
]


def test_meta_plan_matches_real_stream_reshard_bytes():
    pytest.importorskip("megatron.core")
    from ranks import launch_forked
    from reshard_workers import stream_cases

    per_rank = launch_forked(stream_cases, WORLD, CASES, timeout_s=90)
    for i, (cfg, layout, rtp, receivers) in enumerate(CASES):
        dp = WORLD // (layout.tp * layout.pp)
        plan = plan_stream_reshard(cfg, layout, dp, rtp, receivers, dtype_bytes=4)
        real = [rank[i] for rank in per_rank]
        # what crossed the process group, counted at torch.distributed's calls: each rank receives
        # what the plan says, and nothing travels that no rank receives
        on_wire = [received for _, _, _, received, _ in real]
        assert on_wire == plan.bytes_received_per_rank, (i, on_wire, plan.bytes_received_per_rank)
        assert sum(sent for *_, sent in real) == sum(on_wire), i
        # the meter the planner mirrors (memory as well as bytes received)
        planned = [(c.peak, c.counted, c.received) for c in plan.per_rank]
        assert planned == [r[:3] for r in real], (i, planned, real)
        assert plan.peak_extra_bytes_per_rank == max(r[0] for r in real)


@pytest.mark.parametrize("name,tp,pp,dp,rtp", [("qwen2.5-32b", 8, 2, 2, 4), ("llama3.3-70b-instruct", 8, 4, 2, 8)])
def test_full_size_plan_within_two_layers(name, tp, pp, dp, rtp):
    cfg = read_config(MODELS / name)
    plan = plan_stream_reshard(cfg, ParallelLayout(tp, pp), dp, rtp)
    assert plan.within_two_layers, plan.to_dict()
    # Every rank of a colocated rollout receives its rollout slice of the model (bf16), not the model.
    from nemo_tlt.plan.memory import parameter_count
    assert plan.model_bytes == 2 * parameter_count(cfg)
    assert plan.within_slice_target, plan.to_dict()
    assert max(plan.bytes_received_per_rank) <= 1.1 * plan.model_bytes / rtp
    assert max(plan.bytes_received_per_rank) >= plan.model_bytes / rtp * (1 - 1 / (tp * pp)) * 0.99
