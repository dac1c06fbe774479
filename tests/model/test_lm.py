"""Reference LM: HF logits parity, KV-cache consistency, HF folder I/O, config errors."""
from __future__ import annotations

import json

import pytest
import torch

from nemo_tlt.model.config import LMConfig
from nemo_tlt.model.hf_io import load_hf_folder, save_hf_folder
from nemo_tlt.model.lm import DecoderLM
from tiny import tiny_config

transformers = pytest.importorskip("transformers")


def _hf_model(cfg: LMConfig):
    hf_cfg = {k: v for k, v in cfg.to_hf_config().items() if k not in ("architectures", "model_type")}
    if cfg.family == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf_cfg)).eval()
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**hf_cfg)).eval()


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("tied", [False, True])
def test_logits_equal_hf(family, tied):
    torch.manual_seed(0)
    cfg = tiny_config(family=family, tie_word_embeddings=tied, rope_theta=5000.0, vocab_size=97)
    model = DecoderLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(std=0.1)  # exercise the Qwen2 biases
    hf = _hf_model(cfg)
    missing, unexpected = hf.load_state_dict(model.state_dict(), strict=False)
    assert not unexpected and set(missing) <= ({"lm_head.weight"} if tied else set())
    ids = torch.randint(0, 97, (3, 17))
    with torch.no_grad():
        ours, theirs = model(ids), hf(ids).logits
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


def test_kv_cache_matches_full_forward(target):
    torch.manual_seed(1)
    ids = torch.randint(3, 32, (2, 12))
    with torch.no_grad():
        full = target.hidden(ids)
        cache = target.new_cache(2, 32)
        h1 = target.hidden(ids[:, :5], cache=cache)
        cache.advance(5)
        steps = [h1]
        for t in range(5, 12):
            steps.append(target.hidden(ids[:, t: t + 1], cache=cache))
            cache.advance(1)
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-4, rtol=1e-4)


def test_kv_compact_keeps_chosen_entries(target):
    cache = target.new_cache(2, 16)
    with torch.no_grad():
        target.hidden(torch.randint(3, 32, (2, 6)), cache=cache)
    block = [k.clone() for k in cache.k]
    cache.compact(torch.tensor([[0, 2, 5], [0, 1, 0]]), torch.tensor([3, 2]))
    assert cache.lengths.tolist() == [3, 2]
    for layer, k in enumerate(cache.k):
        torch.testing.assert_close(k[0, :, :3], block[layer][0, :, [0, 2, 5]])
        torch.testing.assert_close(k[1, :, :2], block[layer][1, :, [0, 1]])


def test_hf_folder_round_trip(tmp_path, target):
    path = save_hf_folder(target, tmp_path / "m")
    loaded = load_hf_folder(path)
    assert loaded.config == target.config
    ids = torch.randint(3, 32, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids), target(ids), atol=0, rtol=0)


def test_hf_folder_loads_into_transformers(tmp_path, target):
    path = save_hf_folder(target, tmp_path / "m")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path)).eval()
    ids = torch.randint(3, 32, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, target(ids), atol=1e-4, rtol=1e-4)


def test_unknown_family_is_refused(tmp_path, target):
    path = save_hf_folder(target, tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"], cfg["model_type"] = ["MistralForCausalLM"], "mistral"
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unknown model family"):
        load_hf_folder(path)


def test_shape_mismatch_is_refused(tmp_path, target):
    path = save_hf_folder(target, tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    cfg["intermediate_size"] = 48
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"mlp\.\w+_proj\.weight has shape"):
        load_hf_folder(path)


@pytest.mark.parametrize("kw,field", [
    (dict(family="gpt2"), "family"), (dict(hidden_size=30, num_heads=4), "hidden_size"),
    (dict(num_heads=4, num_kv_heads=3), "num_heads"), (dict(vocab_size=0), "vocab_size"),
    (dict(family="qwen2", qkv_bias=False), "qkv_bias"), (dict(eos_token_id=99), "eos_token_id"),
])
def test_bad_config_names_field(kw, field):
    with pytest.raises(ValueError, match=field):
        tiny_config(**kw)
