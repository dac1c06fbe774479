"""Canonical -> rollout-engine TP shards: exact splits that reassemble to the canonical weights."""
from __future__ import annotations

import pytest
import torch

from nemo_tlt.model.config import LMConfig
from nemo_tlt.weights.rollout import canonical_to_rollout, rollout_slice

from test_megatron_layout import random_canonical


def test_tp1_is_the_canonical_state_dict():
    cfg = LMConfig(family="qwen2")
    canonical = random_canonical(cfg)
    (only,) = canonical_to_rollout(canonical, cfg, 1)
    assert set(only) == set(canonical) and all(torch.equal(only[k], canonical[k]) for k in canonical)


def test_tp2_splits_by_heads_rows_and_columns():
    cfg = LMConfig(family="qwen2", vocab_size=101, num_heads=4, num_kv_heads=2)
    canonical = random_canonical(cfg)
    shards = canonical_to_rollout(canonical, cfg, 2)
    p = "model.layers.1."
    for name, dim in [("self_attn.q_proj.weight", 0), ("self_attn.k_proj.bias", 0), ("mlp.up_proj.weight", 0),
                      ("self_attn.o_proj.weight", 1), ("mlp.down_proj.weight", 1)]:
        assert torch.equal(torch.cat([s[p + name] for s in shards], dim=dim), canonical[p + name]), name
    # k/v split by whole kv heads: rank 1 holds kv head 1 (rows head_dim..2*head_dim).
    hd = cfg.head_dim
    assert torch.equal(shards[1][p + "self_attn.k_proj.weight"], canonical[p + "self_attn.k_proj.weight"][hd:])
    assert torch.equal(shards[0][p + "input_layernorm.weight"], canonical[p + "input_layernorm.weight"])
    # 101 vocab rows over 2 ranks: 51 + 50, no padding.
    assert [s["lm_head.weight"].shape[0] for s in shards] == [51, 50]


def test_errors():
    cfg = LMConfig(num_heads=4, num_kv_heads=2)
    with pytest.raises(ValueError, match="rollout TP=4 does not divide num_kv_heads"):
        canonical_to_rollout(random_canonical(cfg), cfg, 4)
    with pytest.raises(ValueError, match="no TP rule"):
        rollout_slice("model.layers.0.mystery.weight", torch.zeros(2, 2), 2, 0)
