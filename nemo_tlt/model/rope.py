"""Rotary position embeddings, HF Llama convention (rotate-half, not interleaved).

Inverse frequencies are plain (HF ``rope_type: default``) or Llama-3.1 scaled
(``llama3``), written op for op like transformers' ``modeling_rope_utils``
(``_compute_llama3_parameters``) so that the tables are bitwise the ones HF uses;
both types leave the attention scale at 1. cos/sin tables are computed once in
fp32 and gathered by absolute position, so a batch whose rows sit at different
positions (ragged prompts, tree nodes at different depths) is rotated in one op.
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
    (as apply_rope expects)."""
    positions = torch.arange(config.max_position_embeddings, dtype=torch.float32)
    freqs = torch.outer(positions, rope_inv_freq(config))
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, heads, T, D]; cos/sin: [B, 1, T, D] (already gathered by position). The result is
    in x's dtype: a bf16 drafter runs on the tables of an fp32 target (computed in fp32, rounded
    once); where x's dtype is the wider or the same, the cast is a no-op."""
    return (x * cos + rotate_half(x) * sin).to(x.dtype)
