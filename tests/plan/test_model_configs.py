"""The published configs in conf/models load into LMConfig with their real shapes, and a
tiny model of each family (same rope, bias, tying and GQA ratio, scaled down) gives
HF transformers' logits when saved by transformers and loaded by nemo_tlt."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from nemo_tlt.model.hf_io import load_hf_folder, read_config
from nemo_tlt.plan.memory import parameter_count

transformers = pytest.importorskip("transformers")

MODELS = Path(__file__).resolve().parents[2] / "conf" / "models"

# (folder, family, layers, hidden, heads, kv heads, ffn, vocab, rope_theta, llama3 rope, params)
# Parameter counts: the published totals (Qwen2.5-7B 7.61B, Qwen2.5-32B 32.5B... as exact
# sums of the tensor shapes these configs imply).
FACTS = [
    ("qwen2.5-7b", "qwen2", 28, 3584, 28, 4, 18944, 152064, 1e6, False, 7_615_616_512),
    ("qwen2.5-32b", "qwen2", 64, 5120, 40, 8, 27648, 152064, 1e6, False, 32_763_876_352),
    ("deepseek-r1-distill-qwen-7b", "qwen2", 28, 3584, 28, 4, 18944, 152064, 1e4, False, 7_615_616_512),
    ("llama3.1-8b", "llama", 32, 4096, 32, 8, 14336, 128256, 5e5, True, 8_030_261_248),
    ("llama3.3-70b-instruct", "llama", 80, 8192, 64, 8, 28672, 128256, 5e5, True, 70_553_706_496),
]


@pytest.mark.parametrize("fact", FACTS, ids=[f[0] for f in FACTS])
def test_published_config_loads(fact):
    name, family, layers, hidden, heads, kv, ffn, vocab, theta, llama3, params = fact
    cfg = read_config(MODELS / name)
    assert (cfg.family, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads,
            cfg.intermediate_size, cfg.vocab_size, cfg.rope_theta) == (family, layers, hidden, heads, kv, ffn,
                                                                       vocab, theta)
    assert cfg.head_dim == 128 and not cfg.tie_word_embeddings
    assert (cfg.rope_scaling is not None) == llama3
    if llama3:
        assert (cfg.rope_scaling.factor, cfg.rope_scaling.low_freq_factor, cfg.rope_scaling.high_freq_factor,
                cfg.rope_scaling.original_max_position_embeddings) == (8.0, 1.0, 4.0, 8192)
    assert parameter_count(cfg) == params


def _tiny_hf_config(published: dict) -> dict:
    """The published config scaled down: every rotary, bias, tying and GQA setting kept,
    widths and depth shrunk (head_dim 16, GQA ratio unchanged)."""
    ratio = published["num_attention_heads"] // published["num_key_value_heads"]
    tiny = dict(published)
    tiny.update(num_hidden_layers=2, num_key_value_heads=2, num_attention_heads=2 * ratio, head_dim=16,
                hidden_size=32 * ratio, intermediate_size=48, vocab_size=96, bos_token_id=1, eos_token_id=2,
                torch_dtype="float32")
    for key in ("max_window_layers",):
        if key in tiny:
            tiny[key] = 2
    return tiny


@pytest.mark.parametrize("name", [f[0] for f in FACTS])
def test_tiny_same_family_logits_match_transformers(tmp_path, name):
    published = json.loads((MODELS / name / "config.json").read_text())
    tiny = _tiny_hf_config(published)
    hf_cfg = transformers.AutoConfig.for_model(tiny.pop("model_type"), **tiny)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(hf_cfg).eval()
    hf.save_pretrained(tmp_path)
    ours = load_hf_folder(tmp_path).eval()
    assert (ours.config.rope_scaling is not None) == ("rope_scaling" in published)
    # Positions up to 300: the llama3 scaling changes the low rotary frequencies at any position.
    ids = torch.randint(0, 96, (2, 300), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(ids).logits
        got = ours(ids)
    got = got.logits if hasattr(got, "logits") else got
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
