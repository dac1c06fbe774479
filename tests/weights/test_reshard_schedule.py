"""The slice-only reshard's schedule, checked without a process group: every rollout rank's
slice assembled from the pieces the schedule names equals the canonical tensor's rollout
slice bit for bit, and its bytes are 1/rollout-TP of the model (plus the replicated norms).

The distributed execution (point-to-point, bit-exact against ``gather_reshard``) is tested
on real megatron-core shards in tests/megatron/test_megatron_e2e.py.
"""
from __future__ import annotations

import pytest
import torch

from nemo_tlt.model.config import LMConfig
from nemo_tlt.weights.layout import ParallelLayout
from nemo_tlt.weights.megatron_layout import (
    canonical_to_megatron, megatron_tensor_sources, megatron_tensor_to_canonical,
)
from nemo_tlt.weights.reshard import reshard_schedule
from nemo_tlt.weights.rollout import rollout_slice

from test_megatron_layout import random_canonical

QWEN = LMConfig(family="qwen2", vocab_size=90, hidden_size=16, intermediate_size=24, num_layers=3, num_heads=4,
                num_kv_heads=2, tie_word_embeddings=True)
LLAMA = LMConfig(family="llama", vocab_size=80, hidden_size=16, intermediate_size=32, num_layers=4, num_heads=8,
                 num_kv_heads=4)


@pytest.mark.parametrize("cfg", [QWEN, LLAMA], ids=["qwen", "llama"])
@pytest.mark.parametrize("tp", [1, 2])
def test_sources_reproduce_the_conversion(cfg, tp):
    layer = canonical_to_megatron(random_canonical(cfg), cfg, ParallelLayout(tp, 1))
    for name in [k.split(".", 3)[3] for k in layer[(0, 0)] if k.startswith("decoder.layers.0.")]:
        parts = [layer[(0, t)][f"decoder.layers.0.{name}"] for t in range(tp)]
        dim, sources = megatron_tensor_sources(name, tp, cfg)
        converted = megatron_tensor_to_canonical(name, parts, cfg)
        assert set(sources) == set(converted), name
        full = torch.cat(parts, dim)
        for cname, positions in sources.items():
            assert torch.equal(full.index_select(dim, positions), converted[cname]), (name, cname)


@pytest.mark.parametrize("cfg,layout,rtp", [
    (QWEN, ParallelLayout(2, 2, num_layers_in_first_stage=1), 2),
    (QWEN, ParallelLayout(1, 3), 1),
    (LLAMA, ParallelLayout(2, 2), 4),
    (LLAMA, ParallelLayout(4, 1), 2),
    (LLAMA, ParallelLayout(1, 1), 2),
])
def test_schedule_assembles_every_rollout_slice_bit_exact(cfg, layout, rtp):
    canonical = random_canonical(cfg)
    shards = canonical_to_megatron(canonical, cfg, layout)
    schedule = list(reshard_schedule(cfg, layout, rtp))
    assert [t.name for t in schedule] == list(dict.fromkeys(t.name for t in schedule))  # each once
    assert {t.name for t in schedule} == set(canonical)
    model_bytes = sum(v.numel() * v.element_size() for v in canonical.values())
    norm_bytes = sum(v.numel() * v.element_size() for k, v in canonical.items() if k.endswith("norm.weight"))
    for r in range(rtp):
        received = 0
        for item in schedule:
            spec = item.slices[r]
            out = torch.full(spec.shape, float("nan"))
            for piece in spec.pieces:
                part = shards[(item.stage, piece.part)][item.key]
                chunk = part.index_select(item.dim, piece.src)
                assert chunk.shape == piece.shape
                out.index_copy_(item.dim, piece.dst, chunk)
                received += chunk.numel() * chunk.element_size()
            assert torch.equal(out, rollout_slice(item.name, canonical[item.name], rtp, r)), (item.name, r)
        # what rank r needs is its slice of every tensor: 1/rtp of the model, norms whole
        assert received == (model_bytes - norm_bytes) // rtp + norm_bytes
