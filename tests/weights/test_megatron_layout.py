"""Pure Megatron <-> canonical adapters: hand-checked layouts, round trips over TP/PP, clear errors.

The real-megatron checks (these layouts against a live GPTModel) are in
tests/megatron/test_megatron_e2e.py.
"""
from __future__ import annotations

import pytest
import torch

from nemo_tlt.model.config import LMConfig
from nemo_tlt.weights.layout import ParallelLayout
from nemo_tlt.weights.megatron_layout import (
    canonical_layer_to_megatron, canonical_to_megatron, megatron_layer_to_canonical, megatron_to_canonical,
)


def random_canonical(cfg: LMConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    from nemo_tlt.model.lm import DecoderLM

    g = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in DecoderLM(cfg).state_dict().items()}
    return {k: torch.randn(s, generator=g) for k, s in shapes.items()}


def _labelled_layer(cfg: LMConfig) -> dict[str, torch.Tensor]:
    """hidden=1-column weights whose values name their row: q 100+i, k 200+i, v 300+i, gate 400+i, up 500+i."""
    h = 1
    q, kv, f = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    rows = lambda base, n: (base + torch.arange(n, dtype=torch.float32)).view(n, h)  # noqa: E731
    return {"input_layernorm.weight": torch.ones(h), "post_attention_layernorm.weight": torch.ones(h),
            "self_attn.q_proj.weight": rows(100, q), "self_attn.k_proj.weight": rows(200, kv),
            "self_attn.v_proj.weight": rows(300, kv), "self_attn.o_proj.weight": torch.arange(q).view(h, q) * 1.0,
            "mlp.gate_proj.weight": rows(400, f), "mlp.up_proj.weight": rows(500, f),
            "mlp.down_proj.weight": torch.arange(f).view(h, f) * 1.0}


def test_layer_layout_matches_megatron_by_hand():
    # 4 heads in 2 query groups, head_dim 2: Megatron interleaves [q q k v] per group, TP splits groups.
    # hidden_size 1: one-column weights keep the row labels readable.
    cfg = LMConfig(hidden_size=1, num_heads=4, num_kv_heads=2, head_dim=2, intermediate_size=4)
    shards = canonical_layer_to_megatron(_labelled_layer(cfg), cfg, tp=2)
    qkv0 = shards[0]["self_attention.linear_qkv.weight"].flatten().tolist()
    qkv1 = shards[1]["self_attention.linear_qkv.weight"].flatten().tolist()
    assert qkv0 == [100, 101, 102, 103, 200, 201, 300, 301]  # group 0: heads 0,1 then k0, v0
    assert qkv1 == [104, 105, 106, 107, 202, 203, 302, 303]
    assert shards[0]["mlp.linear_fc1.weight"].flatten().tolist() == [400, 401, 500, 501]  # [gate_r; up_r]
    assert shards[1]["mlp.linear_fc1.weight"].flatten().tolist() == [402, 403, 502, 503]
    assert shards[1]["self_attention.linear_proj.weight"].flatten().tolist() == [4, 5, 6, 7]  # columns
    assert shards[1]["mlp.linear_fc2.weight"].flatten().tolist() == [2, 3]
    back = megatron_layer_to_canonical(shards, cfg)
    for name, tensor in _labelled_layer(cfg).items():
        assert torch.equal(back[name], tensor), name


@pytest.mark.parametrize("family,tied", [("llama", False), ("qwen2", True), ("qwen2", False)])
@pytest.mark.parametrize("layout", [ParallelLayout(1, 1), ParallelLayout(2, 1), ParallelLayout(2, 2),
                                    ParallelLayout(4, 3, num_layers_in_first_stage=2),
                                    ParallelLayout(1, 2, num_layers_in_last_stage=1)],
                         ids=["tp1pp1", "tp2pp1", "tp2pp2", "tp4pp3uneven", "tp1pp2uneven"])
def test_round_trip_is_bit_exact(family, tied, layout):
    cfg = LMConfig(family=family, vocab_size=100, num_layers=4, num_heads=8,
                   num_kv_heads=4, tie_word_embeddings=tied)
    if layout.pp == 2 and layout.num_layers_in_last_stage:
        cfg = LMConfig(**{**cfg.to_dict(), "num_layers": 3})
    canonical = random_canonical(cfg)
    shards = canonical_to_megatron(canonical, cfg, layout)
    assert len(shards) == layout.tp * layout.pp
    padded = layout.padded_vocab_size(100) // layout.tp
    assert shards[(0, 0)]["embedding.word_embeddings.weight"].shape == (padded, 64)
    has_output = (layout.pp - 1, 0) in shards and "output_layer.weight" in shards[(layout.pp - 1, 0)]
    assert has_output == (not tied or layout.pp > 1)
    back = megatron_to_canonical(shards, cfg, layout)
    assert set(back) == set(canonical)
    for name in canonical:
        assert torch.equal(back[name], canonical[name]), name


def test_extra_state_and_te_norm_names_are_accepted():
    cfg = LMConfig(num_layers=2)
    canonical = random_canonical(cfg)
    shards = canonical_to_megatron(canonical, cfg, ParallelLayout(2, 1))
    for shard in shards.values():
        shard["decoder.layers.0.self_attention.linear_qkv._extra_state"] = torch.empty(0)
        # Transformer-Engine specs fuse the norms into the next linear.
        shard["decoder.layers.1.self_attention.linear_qkv.layer_norm_weight"] = shard.pop(
            "decoder.layers.1.input_layernorm.weight")
        shard["decoder.layers.1.mlp.linear_fc1.layer_norm_weight"] = shard.pop(
            "decoder.layers.1.pre_mlp_layernorm.weight")
    back = megatron_to_canonical(shards, cfg, ParallelLayout(2, 1))
    for name in canonical:
        assert torch.equal(back[name], canonical[name]), name


def test_clear_errors():
    cfg = LMConfig(num_heads=4, num_kv_heads=2)
    canonical = random_canonical(cfg)
    with pytest.raises(ValueError, match="TP=4 does not divide .*num_kv_heads"):
        canonical_to_megatron(canonical, cfg, ParallelLayout(4, 1))
    bad = dict(canonical)
    bad["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(8, 64)
    with pytest.raises(ValueError, match="k_proj.weight: expected shape"):
        canonical_to_megatron(bad, cfg, ParallelLayout(2, 1))
    shards = canonical_to_megatron(canonical, cfg, ParallelLayout(2, 1))
    with pytest.raises(ValueError, match="need shards for every"):
        megatron_to_canonical({(0, 0): shards[(0, 0)]}, cfg, ParallelLayout(2, 1))
    shards[(0, 0)]["decoder.layers.0.mlp.experts.weight"] = torch.zeros(1)
    shards[(0, 1)]["decoder.layers.0.mlp.experts.weight"] = torch.zeros(1)
    with pytest.raises(ValueError, match="unknown megatron layer tensor"):
        megatron_to_canonical(shards, cfg, ParallelLayout(2, 1))


def test_o_proj_bias_is_refused_not_dropped():
    # A Llama with attention_bias=true has an o_proj bias megatron-core cannot hold without MLP
    # biases; converting it either way must fail, not lose the bias.
    cfg = LMConfig(family="llama", qkv_bias=True, num_heads=4, num_kv_heads=2)
    canonical = random_canonical(cfg)
    assert "model.layers.0.self_attn.o_proj.bias" in canonical
    layout = ParallelLayout(2, 1)
    with pytest.raises(ValueError, match=r"LMConfig\.o_proj_bias .*q/k/v biases only"):
        canonical_to_megatron(canonical, cfg, layout)
    # Megatron shards with q/k/v biases (as Qwen2 has) read under that config: also refused.
    qkv_only = LMConfig(**{**cfg.to_dict(), "family": "qwen2"})
    shards = canonical_to_megatron(random_canonical(qkv_only), qkv_only, layout)
    with pytest.raises(ValueError, match=r"LMConfig\.o_proj_bias"):
        megatron_to_canonical(shards, cfg, layout)


def test_a_canonical_tensor_without_a_megatron_place_is_refused():
    cfg = LMConfig(num_heads=4, num_kv_heads=2)
    layer = {k.removeprefix("model.layers.0."): v for k, v in random_canonical(cfg).items()
             if k.startswith("model.layers.0.")}
    layer["self_attn.o_proj.bias"] = torch.zeros(cfg.hidden_size)
    with pytest.raises(ValueError, match=r"cannot hold: \['self_attn.o_proj.bias'\]"):
        canonical_layer_to_megatron(layer, cfg, tp=2)
