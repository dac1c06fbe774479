"""Rotary position embeddings, HF Llama convention (rotate-half, not interleaved).

cos/sin tables are computed once in fp32 and gathered by absolute position, so a
batch whose rows sit at different positions (ragged prompts, tree nodes at
different depths) is rotated in one op.
"""
from __future__ import annotations

import torch


def rope_tables(head_dim: int, max_positions: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (cos, sin), each [max_positions, head_dim] fp32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, heads, T, D]; cos/sin: [B, 1, T, D] (already gathered by position)."""
    return x * cos + rotate_half(x) * sin
