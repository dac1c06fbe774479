"""Rotary inverse frequencies for `LMConfig`: plain (HF ``rope_type: default``) or
Llama-3.1 scaled (``llama3``), and the cos/sin tables built from them.

Pure functions, fp32, written op for op like transformers' ``modeling_rope_utils``
(``_compute_llama3_parameters``) so that the tables are bitwise the ones HF uses.
Both types leave the attention scale at 1, so only the frequencies differ.
"""
from __future__ import annotations

import math

import torch

from nemo_tlt.model.config import LMConfig, RopeScaling


def default_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    """theta^(-2i/head_dim) for i in [0, head_dim/2), [head_dim // 2] fp32."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def llama3_inv_freq(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    """Llama-3.1 scaling of plain inverse frequencies: wavelengths above
    original_max_position_embeddings / low_freq_factor are stretched by `factor`,
    those below original_max_position_embeddings / high_freq_factor are kept, and
    those between are interpolated linearly in original_max_position_embeddings /
    wavelength."""
    factor, low, high = scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor
    old_context_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_context_len / low
    high_freq_wavelen = old_context_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_inv_freq(config: LMConfig) -> torch.Tensor:
    """The inverse frequencies `config` rotates q and k with, [head_dim // 2] fp32."""
    inv_freq = default_inv_freq(config.head_dim, config.rope_theta)
    return inv_freq if config.rope_scaling is None else llama3_inv_freq(inv_freq, config.rope_scaling)


def rope_tables_for(config: LMConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each [max_position_embeddings, head_dim] fp32, rotate-half layout
    (as nemo_tlt.model.rope.apply_rope expects)."""
    positions = torch.arange(config.max_position_embeddings, dtype=torch.float32)
    freqs = torch.outer(positions, rope_inv_freq(config))
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()
