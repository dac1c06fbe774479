"""Model families as real checkpoints write them: folders saved by transformers'
own `save_pretrained` load into `DecoderLM` with the same logits (Qwen2 biases and
rope base, Llama GQA with llama3 rope scaling, Llama attention_bias), our folders
load into transformers, and rope settings we do not implement are refused."""
from __future__ import annotations

import json

import pytest
import torch

from nemo_tlt.model.config import LMConfig, RopeScaling
from nemo_tlt.model.hf_io import load_hf_folder, read_config, save_hf_folder
from nemo_tlt.model.lm import DecoderLM
from nemo_tlt.model.rope import default_inv_freq, llama3_inv_freq

transformers = pytest.importorskip("transformers")

VOCAB = 97
# head_dim 16, base 1e4: wavelengths 6.3, 20, 63, ... With original context 32 the
# llama3 bands are (< 8 kept, 8..32 interpolated, > 32 stretched): all three occur.
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}


def _randomize_(model: torch.nn.Module, seed: int) -> None:
    """Weights large enough that attention is sharp (so the rotary frequencies
    matter to the logits), every bias nonzero, norms away from 1."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "norm" in name:
                p.uniform_(0.5, 1.5, generator=gen)
            elif p.dim() == 2:
                p.normal_(0.0, 1.0 / p.shape[1] ** 0.5, generator=gen)
            else:
                p.normal_(0.0, 0.2, generator=gen)


def _hf_folder(tmp_path, hf_config, seed: int = 0):
    model = transformers.AutoModelForCausalLM.from_config(hf_config, attn_implementation="eager").eval()
    _randomize_(model, seed)
    model.save_pretrained(tmp_path / "hf")
    return model, tmp_path / "hf"


def _assert_same_logits(ours: DecoderLM, hf, seq: int) -> None:
    ids = torch.randint(0, VOCAB, (3, seq), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours.eval()(ids), hf(ids).logits, atol=1e-5, rtol=1e-5)


def _llama_config(**kw):
    base = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=8, num_key_value_heads=1, max_position_embeddings=64,
                rope_parameters={**LLAMA3, "rope_theta": 10000.0})
    return transformers.LlamaConfig(**{**base, **kw})


def test_qwen2_folder_biases_tied_odd_head_dim_and_rope_base(tmp_path):
    cfg = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                                   rope_theta=1e6, max_position_embeddings=64)
    hf, path = _hf_folder(tmp_path, cfg)
    written = json.loads((path / "config.json").read_text())
    assert "rope_theta" not in written and written["rope_parameters"]["rope_theta"] == 1e6  # the 5.x form
    ours = load_hf_folder(path)
    assert (ours.config.head_dim, ours.config.rope_theta, ours.config.o_proj_bias) == (12, 1e6, False)
    _assert_same_logits(ours, hf, seq=20)


def test_llama3_rope_gqa_past_original_context(tmp_path):
    hf, path = _hf_folder(tmp_path, _llama_config())
    ours = load_hf_folder(path)
    assert ours.config.rope_scaling == RopeScaling(**LLAMA3)
    assert (ours.config.num_heads, ours.config.num_kv_heads) == (8, 1)
    _assert_same_logits(ours, hf, seq=48)  # positions 32..47 lie past the original context


def test_llama3_inv_freq_is_transformers_bitwise():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    config = _llama_config()
    theirs, attention_scale = ROPE_INIT_FUNCTIONS["llama3"](config)
    ours = llama3_inv_freq(default_inv_freq(16, 10000.0), RopeScaling(**LLAMA3))
    assert attention_scale == 1.0 and torch.equal(ours, theirs)
    wavelen = 2 * torch.pi / default_inv_freq(16, 10000.0)
    assert (wavelen < 8).any() and ((wavelen > 8) & (wavelen < 32)).any() and (wavelen > 32).any()


def test_llama_attention_bias_includes_o_proj(tmp_path):
    hf, path = _hf_folder(tmp_path, _llama_config(attention_bias=True, num_key_value_heads=2))
    ours = load_hf_folder(path)
    assert ours.config.o_proj_bias and ours.model.layers[0].self_attn.o_proj.bias is not None
    _assert_same_logits(ours, hf, seq=20)


def test_our_llama3_folder_loads_into_transformers(tmp_path):
    cfg = LMConfig(family="llama", vocab_size=VOCAB, hidden_size=128, intermediate_size=96, num_heads=8,
                   num_kv_heads=1, max_position_embeddings=64, qkv_bias=True, rope_scaling=RopeScaling(**LLAMA3))
    ours = DecoderLM(cfg)
    _randomize_(ours, seed=3)
    path = save_hf_folder(ours, tmp_path / "ours")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), attn_implementation="eager").eval()
    assert hf.config.rope_parameters == {**LLAMA3, "rope_theta": 10000.0}
    _assert_same_logits(ours, hf, seq=48)
    assert read_config(path) == cfg


def test_transformers_4_and_5_forms_read_alike():
    v5 = _llama_config().to_dict()
    v4 = {k: v for k, v in v5.items() if k != "rope_parameters"}
    v4.update(rope_theta=10000.0, rope_scaling=dict(LLAMA3))
    assert LMConfig.from_hf_config(v4) == LMConfig.from_hf_config(v5)
    assert LMConfig.from_hf_config(v5).rope_scaling == RopeScaling(**LLAMA3)


def test_to_dict_rebuilds_and_omits_absent_scaling():
    scaled = LMConfig(rope_scaling=RopeScaling(**LLAMA3))
    assert LMConfig(**scaled.to_dict()) == scaled
    assert "rope_scaling" not in LMConfig().to_dict()  # dicts (and hashes) of unscaled configs unchanged


def _llama_json(**changes) -> dict:
    cfg = _llama_config().to_dict()
    cfg.update(changes)
    return cfg


@pytest.mark.parametrize("changes, match", [
    (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                           "original_max_position_embeddings": 32}), r"rope_type='yarn'"),
    (dict(rope_parameters=None, rope_scaling={"type": "linear", "factor": 2.0}), r"rope_type='linear'"),
    (dict(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}), r"rope_type='dynamic'"),
    (dict(rope_parameters={**LLAMA3, "rope_theta": 1e4, "attention_factor": 0.5}), r"'attention_factor'"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mscale": 2.0}), r"'mscale'"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}),
     r"partial_rotary_factor=0\.5"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e6}, rope_theta=1e4), r"rope_theta=10000"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4}, rope_scaling=dict(LLAMA3)),
     r"rope_scaling .* and rope_parameters .* disagree"),
    (dict(rope_parameters={**LLAMA3, "factor": 0.5, "rope_theta": 1e4}), r"RopeScaling\.factor"),
    (dict(mlp_bias=True), r"mlp_bias"),
])
def test_unsupported_rope_and_family_settings_are_refused(changes, match):
    with pytest.raises(ValueError, match=rf"^m/config\.json: .*{match}"):
        LMConfig.from_hf_config(_llama_json(**changes), source="m/config.json")


def test_qwen2_sliding_window_is_refused():
    cfg = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, use_sliding_window=True, sliding_window=8).to_dict()
    with pytest.raises(ValueError, match=r"use_sliding_window"):
        LMConfig.from_hf_config(cfg)
