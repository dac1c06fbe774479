"""Reshard bookkeeping that needs no process group: shard shapes, the byte meter, plan validation.

The distributed streaming / gather reshard itself is tested bit-exact on real
megatron-core shards in tests/megatron/test_megatron_e2e.py.
"""
from __future__ import annotations

import pytest
import torch

from nemo_tlt.model.config import LMConfig
from nemo_tlt.weights.layout import ParallelLayout
from nemo_tlt.weights.megatron_layout import canonical_to_megatron
from nemo_tlt.weights.reshard import ByteMeter, ReshardPlan, megatron_shard_shapes

from test_megatron_layout import random_canonical


@pytest.mark.parametrize("cfg,layout", [
    (LMConfig(family="qwen2", num_layers=3, tie_word_embeddings=True), ParallelLayout(2, 2, num_layers_in_first_stage=1)),
    (LMConfig(family="llama", num_layers=4, num_heads=8, num_kv_heads=4), ParallelLayout(4, 2)),
    (LMConfig(family="llama", tie_word_embeddings=True), ParallelLayout(2, 1)),
])
def test_meta_shapes_match_real_shards(cfg, layout):
    real = canonical_to_megatron(random_canonical(cfg), cfg, layout)
    shapes = megatron_shard_shapes(cfg, layout)
    assert set(shapes) == set(real)
    for coords, shard in real.items():
        assert shapes[coords] == {k: v.shape for k, v in shard.items()}, coords


def test_byte_meter_tracks_peak():
    meter = ByteMeter()
    a, b = torch.zeros(10), torch.zeros(5, dtype=torch.float64)
    meter.add(a)
    meter.add(b)
    meter.sub(a)
    meter.add(a)
    meter.sub(a, b)
    assert (meter.current, meter.peak) == (0, 80)


def test_plan_validation():
    cfg = LMConfig(num_heads=4, num_kv_heads=2)
    with pytest.raises(ValueError, match="rollout TP=4"):
        ReshardPlan(cfg, ParallelLayout(2, 1), rollout_tp=4)
    with pytest.raises(ValueError, match="receivers has duplicates"):
        ReshardPlan(cfg, ParallelLayout(2, 1), rollout_tp=1, receivers=(0, 0))


def test_o_proj_bias_is_refused():
    # Megatron shards never hold an o_proj bias: the reshard must not plan without it.
    cfg = LMConfig(family="llama", qkv_bias=True)
    with pytest.raises(ValueError, match=r"LMConfig\.o_proj_bias"):
        megatron_shard_shapes(cfg, ParallelLayout(2, 1))
    with pytest.raises(ValueError, match=r"LMConfig\.o_proj_bias"):
        ReshardPlan(cfg, ParallelLayout(2, 1), rollout_tp=1)
