"""MegatronPolicy built from a lazily read HF folder (real megatron-core, gloo, TP2 x PP2).

Every rank's model and KL reference must hold exactly today's shard
(``canonical_to_megatron`` of the whole canonical model, cast to the weights dtype),
and the rank must have read its own slices once: the reference copies the policy's
weights instead of reading the folder again.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")
transformers = pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).parent))

from lazy_load_workers import build_from_folder  # noqa: E402

from ranks import launch_forked  # noqa: E402
from nemo_tlt.policy import PolicyConfig  # noqa: E402


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    config = transformers.Qwen2Config(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.copy_(torch.randn(p.shape))
    folder = tmp_path_factory.mktemp("qwen2")
    model.save_pretrained(folder, max_shard_size="100KB")
    policy = PolicyConfig(backend="megatron", tensor_parallel=2, pipeline_parallel=2, kl_coef=0.1)
    return launch_forked(build_from_folder, 4, str(folder), policy, torch.bfloat16, timeout_s=90)[0]


def test_every_rank_holds_todays_shard_in_its_model_and_reference(ranks):
    assert sorted(r["coords"] for r in ranks) == [(p, t) for p in range(2) for t in range(2)]
    for r in ranks:
        assert sorted(r["model"]) == sorted(r["want"]) == sorted(r["reference"]), r["coords"]
        for name, want in r["want"].items():
            assert torch.equal(r["model"][name], want), (r["coords"], name)
            assert torch.equal(r["reference"][name], want), (r["coords"], name)


def test_an_uninitialised_model_carries_megatrons_tensor_parallel_attributes(ranks):
    """Without them megatron's grad norm counts a TP-split weight once per TP group, not per shard."""
    for r in ranks:
        initialised, loaded = r["attributes"][True], r["attributes"][False]
        assert sorted(loaded) == sorted(initialised)
        assert any(a.get("tensor_model_parallel") for a in initialised.values())
        for name, attrs in initialised.items():
            assert loaded[name] == attrs, (r["coords"], name)


def test_each_rank_reads_its_shard_once(ranks):
    for r in ranks:
        # the folder is fp32 (4 bytes); Megatron's zero padding rows of the vocabulary are never read
        padding = sum(int((w == 0).all(dim=1).sum()) * w.shape[1] for k, w in r["want"].items()
                      if k in ("embedding.word_embeddings.weight", "output_layer.weight"))
        own = sum(w.numel() for w in r["want"].values()) - padding
        assert r["bytes_read"] == 4 * own, r["coords"]
