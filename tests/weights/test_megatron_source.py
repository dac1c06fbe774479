"""The per-rank lazy loader: a Megatron rank's shard read straight from an HF folder.

Folders are written by transformers' own ``save_pretrained`` (sharded, with an index
file); every rank's shard must equal today's path (``load_hf_folder`` ->
``canonical_to_megatron``) bit for bit, and each rank must read exactly its own bytes.
"""
from __future__ import annotations

import pytest
import torch

from nemo_tlt.model.hf_io import load_hf_folder, read_config
from nemo_tlt.weights.hf_source import INDEX, SafetensorsFolder
from nemo_tlt.weights.layout import ParallelLayout
from nemo_tlt.weights.megatron_layout import canonical_to_megatron
from nemo_tlt.weights.megatron_source import megatron_shard
from nemo_tlt.weights.sources import MappingSource

transformers = pytest.importorskip("transformers")

VOCAB = 300  # padded to 256 * tp rows at TP2: the second TP rank's vocab part ends in zero rows
LAYOUTS = [ParallelLayout(2, 2, make_vocab_size_divisible_by=128), ParallelLayout(1, 1),
           ParallelLayout(2, 3, num_layers_in_first_stage=2)]


def _hf_folder(path, family: str, tied: bool, dtype: torch.dtype):
    """GQA (8 heads, 2 KV heads), 4 layers; Qwen2 adds q/k/v biases. Saved in small shards + index."""
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=64,
                  tie_word_embeddings=tied)
    config = (transformers.LlamaConfig(**common) if family == "llama" else transformers.Qwen2Config(**common))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:  # norms away from 1, biases away from 0: a swap must show
                p.copy_(torch.randn(p.shape))
    model.save_pretrained(path, max_shard_size="100KB")
    return path


@pytest.fixture(scope="module", params=[("llama", False, torch.float32), ("qwen2", True, torch.bfloat16)],
                ids=["llama-gqa-untied-fp32", "qwen2-bias-tied-bf16"])
def folder(request, tmp_path_factory):
    family, tied, dtype = request.param
    return _hf_folder(tmp_path_factory.mktemp(family), family, tied, dtype)


def test_folder_is_sharded_with_an_index(folder):
    assert (folder / INDEX).is_file() and len(list(folder.glob("*.safetensors"))) > 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=["tp2pp2", "tp1pp1", "tp2pp3uneven"])
def test_every_rank_equals_canonical_to_megatron_bit_for_bit(folder, layout, dtype):
    cfg = read_config(folder)
    old = canonical_to_megatron(load_hf_folder(folder).state_dict(), cfg, layout)
    for coords, shard in old.items():
        new = megatron_shard(SafetensorsFolder(folder), cfg, layout, coords, dtype)
        assert sorted(new) == sorted(shard), coords
        for name, tensor in shard.items():
            assert new[name].dtype == dtype and new[name].is_contiguous(), (coords, name)
            assert torch.equal(new[name], tensor.to(dtype)), (coords, name)


def test_each_rank_reads_only_its_own_bytes_once(folder):
    cfg, layout = read_config(folder), LAYOUTS[0]
    canonical = load_hf_folder(folder).state_dict()
    element = _stored_element_size(folder)
    part = layout.padded_vocab_size(cfg.vocab_size) // layout.tp
    total = sum(v.numel() for v in canonical.values()) * element
    for (stage, t), shard in canonical_to_megatron(canonical, cfg, layout).items():
        source = SafetensorsFolder(folder)
        megatron_shard(source, cfg, layout, (stage, t), torch.float32)
        padding_rows = max(0, (t + 1) * part - max(cfg.vocab_size, t * part))  # zeros, never read
        own = sum(v.numel() - (padding_rows * cfg.hidden_size if k in VOCAB_TENSORS else 0)
                  for k, v in shard.items())
        assert source.bytes_read == own * element, (stage, t)
        assert source.bytes_read < 0.5 * total


VOCAB_TENSORS = ("embedding.word_embeddings.weight", "output_layer.weight")


def _stored_element_size(folder) -> int:
    """Bytes per element in the folder's files (save_pretrained writes one dtype throughout)."""
    from safetensors import safe_open

    with safe_open(str(next(folder.glob("*.safetensors"))), framework="pt") as f:
        return f.get_tensor(next(iter(f.keys()))).element_size()


def test_mapping_source_gives_the_same_shards(folder):
    cfg, layout = read_config(folder), LAYOUTS[0]
    canonical = load_hf_folder(folder).state_dict()
    for coords, shard in canonical_to_megatron(canonical, cfg, layout).items():
        new = megatron_shard(MappingSource(canonical), cfg, layout, coords, torch.float32)
        assert all(torch.equal(new[k], v) for k, v in shard.items()) and sorted(new) == sorted(shard)


def test_pickled_weights_are_refused_with_how_to_convert(tmp_path):
    torch.save({"model.norm.weight": torch.ones(4)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="not safetensors.*save_pretrained"):
        SafetensorsFolder(tmp_path)
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        SafetensorsFolder(tmp_path / "missing")


def test_weights_that_do_not_match_the_config_are_refused(folder):
    cfg = read_config(folder)
    wrong = type(cfg)(**{**cfg.to_dict(), "num_layers": 5})
    with pytest.raises(ValueError, match="missing \\['model.layers.4"):
        megatron_shard(SafetensorsFolder(folder), wrong, ParallelLayout(1, 1), (0, 0), torch.float32)
    wider = type(cfg)(**{**cfg.to_dict(), "intermediate_size": 128})
    with pytest.raises(ValueError, match="gate_proj.weight has shape \\(96, 64\\), config.json implies \\(128, 64\\)"):
        megatron_shard(SafetensorsFolder(folder), wider, ParallelLayout(1, 1), (0, 0), torch.float32)
