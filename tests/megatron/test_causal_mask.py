"""The explicit causal mask megatron's local attention gets: True means masked out."""
from __future__ import annotations

from nemo_tlt.megatron.pipeline_forward import causal_attention_mask


def test_causal_mask_masks_the_future():
    mask = causal_attention_mask(3, batch=2)
    assert mask.shape == (2, 1, 3, 3)
    assert mask[0, 0].tolist() == [[False, True, True], [False, False, True], [False, False, False]]
