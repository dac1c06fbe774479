"""gpt_builder: what megatron-core can build exactly is mapped, the rest refused naming the field.

No process group is needed: the refusals come before megatron builds anything, and
RotaryEmbedding is built alone on CPU.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from nemo_tlt.megatron.gpt_builder import transformer_config  # noqa: E402
from nemo_tlt.model.config import LMConfig, RopeScaling  # noqa: E402
from nemo_tlt.model.rope import rope_inv_freq  # noqa: E402
from nemo_tlt.weights.layout import ParallelLayout  # noqa: E402


@pytest.mark.parametrize("scaling", [None, RopeScaling(), RopeScaling(factor=32.0)], ids=["plain", "llama3", "x32"])
def test_megatron_rotary_frequencies_equal_the_reference(scaling):
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from nemo_tlt.megatron.gpt_builder import rope_kwargs

    cfg = LMConfig(num_heads=2, num_kv_heads=2, head_dim=64, hidden_size=32, rope_theta=500_000.0,
                   rope_scaling=scaling)
    kwargs = rope_kwargs(cfg)
    emb = RotaryEmbedding(kv_channels=cfg.head_dim, rotary_percent=1.0, use_cpu_initialization=True, **kwargs)
    assert torch.equal(emb.inv_freq, rope_inv_freq(cfg))


@pytest.mark.parametrize("field,value", [("low_freq_factor", 2.0), ("high_freq_factor", 8.0),
                                         ("original_max_position_embeddings", 4096)])
def test_llama3_values_megatron_fixes_are_refused(field, value):
    cfg = LMConfig(rope_scaling=RopeScaling(**{field: value}))
    with pytest.raises(ValueError, match=rf"LMConfig\.rope_scaling\.{field}={value}.*megatron-core"):
        transformer_config(cfg, ParallelLayout())


def test_o_proj_bias_is_refused():
    cfg = LMConfig(family="llama", qkv_bias=True)
    with pytest.raises(ValueError, match=r"LMConfig\.o_proj_bias .*q/k/v biases only \(Qwen2"):
        transformer_config(cfg, ParallelLayout())
    transformer_config(LMConfig(family="qwen2"), ParallelLayout())  # q/k/v biases alone are fine
