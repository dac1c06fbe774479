"""Canonical -> TensorRT-LLM checkpoint: names, shapes and per-rank splits per TensorRT-LLM's convention.

TensorRT-LLM itself cannot be installed on CPU machines, so loading the folder in
TensorRT-LLM is not tested here.
"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from nemo_tlt.model.config import LMConfig
from nemo_tlt.weights.trtllm import canonical_to_trtllm, write_trtllm_checkpoint

from test_megatron_layout import random_canonical


def test_names_shapes_and_splits_qwen2_tp2():
    cfg = LMConfig(family="qwen2", vocab_size=101, num_heads=4, num_kv_heads=2, num_layers=2)
    canonical = random_canonical(cfg)
    config, ranks = canonical_to_trtllm(canonical, cfg, 2)
    assert config["architecture"] == "Qwen2ForCausalLM" and config["mapping"]["tp_size"] == 2
    # QWenDecoderLayer reads qwen_type: "qwen" (Qwen-1) would halve intermediate_size.
    assert config["qwen_type"] == "qwen2" and config["intermediate_size"] == cfg.intermediate_size
    assert config["attn_bias"] is True and config["rotary_base"] == cfg.rope_theta
    hd, src = cfg.head_dim, "model.layers.1."
    for r, sd in enumerate(ranks):
        dst = "transformer.layers.1."
        q = canonical[src + "self_attn.q_proj.weight"].chunk(2)[r]
        k = canonical[src + "self_attn.k_proj.weight"].chunk(2)[r]
        v = canonical[src + "self_attn.v_proj.weight"].chunk(2)[r]
        assert torch.equal(sd[dst + "attention.qkv.weight"], torch.cat([q, k, v]))
        assert sd[dst + "attention.qkv.weight"].shape == ((2 + 1 + 1) * hd, 64)
        bias = torch.cat([canonical[src + f"self_attn.{p}_proj.bias"].chunk(2)[r] for p in "qkv"])
        assert torch.equal(sd[dst + "attention.qkv.bias"], bias)
        assert torch.equal(sd[dst + "attention.dense.weight"], canonical[src + "self_attn.o_proj.weight"].chunk(2, 1)[r])
        # TensorRT-LLM's convention: mlp.fc <- gate_proj (SiLU branch), mlp.gate <- up_proj.
        assert torch.equal(sd[dst + "mlp.fc.weight"], canonical[src + "mlp.gate_proj.weight"].chunk(2)[r])
        assert torch.equal(sd[dst + "mlp.gate.weight"], canonical[src + "mlp.up_proj.weight"].chunk(2)[r])
        assert torch.equal(sd[dst + "mlp.proj.weight"], canonical[src + "mlp.down_proj.weight"].chunk(2, 1)[r])
        assert torch.equal(sd[dst + "post_layernorm.weight"], canonical[src + "post_attention_layernorm.weight"])
        assert torch.equal(sd["transformer.vocab_embedding.weight"], canonical["model.embed_tokens.weight"])
        assert torch.equal(sd["transformer.ln_f.weight"], canonical["model.norm.weight"])
        assert sd["lm_head.weight"].shape == (51, 64)  # 101 padded to 102, split in two
    assert not ranks[1]["lm_head.weight"][-1].any()
    assert torch.equal(torch.cat([r["lm_head.weight"] for r in ranks])[:101], canonical["lm_head.weight"])
    assert "transformer.layers.0.attention.qkv.bias" in ranks[0]


def test_tied_llama_folder(tmp_path):
    cfg = LMConfig(family="llama", tie_word_embeddings=True)
    canonical = random_canonical(cfg)
    out = tmp_path / "trt"
    write_trtllm_checkpoint(canonical, cfg, 1, out)
    config = json.loads((out / "config.json").read_text())
    assert config["architecture"] == "LlamaForCausalLM" and config["dtype"] == "float32"
    sd = load_file(str(out / "rank0.safetensors"))
    assert torch.equal(sd["lm_head.weight"], canonical["model.embed_tokens.weight"])
    assert not any(k.endswith("qkv.bias") for k in sd)
    with pytest.raises(FileExistsError, match="--overwrite"):
        write_trtllm_checkpoint(canonical, cfg, 1, out)


def test_config_fields_are_tensorrt_llm_names():
    """Every key is one TensorRT-LLM's PretrainedConfig / LLaMAConfig / QWenConfig defines (a
    stray key would only become an unused attribute there); Llama carries no qwen_type."""
    known = {"architecture", "dtype", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
             "head_size", "hidden_size", "intermediate_size", "vocab_size", "max_position_embeddings",
             "hidden_act", "norm_epsilon", "position_embedding_type", "rotary_base", "rotary_scaling",
             "attn_bias", "mlp_bias", "tie_word_embeddings", "use_parallel_embedding", "mapping", "qwen_type"}
    llama = canonical_to_trtllm(random_canonical(LMConfig()), LMConfig(), 1)[0]
    qwen = canonical_to_trtllm(random_canonical(LMConfig(family="qwen2")), LMConfig(family="qwen2"), 1)[0]
    assert set(llama) <= known and set(qwen) <= known
    assert "qwen_type" not in llama and llama["rotary_scaling"] is None and llama["attn_bias"] is False


def test_llama_attention_bias_includes_the_output_projection():
    cfg = LMConfig(family="llama", qkv_bias=True, num_heads=4, num_kv_heads=2, num_layers=1)
    canonical = random_canonical(cfg)
    bias = torch.randn(cfg.hidden_size)
    canonical["model.layers.0.self_attn.o_proj.bias"] = bias
    config, ranks = canonical_to_trtllm(canonical, cfg, 2)
    assert config["attn_bias"] is True
    for sd in ranks:  # added once after the row-parallel all-reduce: whole on every rank
        assert torch.equal(sd["transformer.layers.0.attention.dense.bias"], bias)
    del canonical["model.layers.0.self_attn.o_proj.bias"]
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.o_proj\.bias is missing"):
        canonical_to_trtllm(canonical, cfg, 2)
