"""Decoder building blocks for the Llama / Qwen2 families, named like HF's modules
so that `state_dict()` keys are the project's canonical (HF) names.

Attention takes an optional `KVCache`. With a cache, the new block's keys and
values are first written at their cache slots (`write_idx`), then the block attends
over cache slots [0, S) under a boolean mask [B, 1, T, S] built once per forward by
`cache_attention_mask`: committed slots, plus the new block's own slots as the caller
says (causal for a prompt, ancestor-or-self for a draft tree). That is all tree
verification needs, and nothing is concatenated per layer.

Tensor parallelism (``tp``, a `TensorParallel` of size > 1; None: one process): an
`Attention` holds its rank's heads and kv heads (q/k/v split by output rows), an `MLP`
its rank's intermediate columns (gate/up by rows), and both hold the input columns of
their output projection that match, so each rank's output is a partial sum: one
all-reduce after ``o_proj`` and one after ``down_proj``. Everything else (norms,
residuals, rotary) is replicated. A layer built without ``tp`` (the drafters' layers)
has no collective.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nemo_tlt.model.config import LMConfig
from nemo_tlt.model.kv_cache import KVCache
from nemo_tlt.model.rope import apply_rope
from nemo_tlt.model.tensor_parallel import TensorParallel


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # one fused op; same math as below
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Attention(nn.Module):
    def __init__(self, config: LMConfig, tp: TensorParallel | None = None) -> None:
        super().__init__()
        parts = 1 if tp is None else tp.size
        d, h, kv = config.head_dim, config.num_heads // parts, config.num_kv_heads // parts
        self.tp = tp
        self.num_heads, self.num_kv_heads, self.head_dim = h, kv, d
        self.q_proj = nn.Linear(config.hidden_size, h * d, bias=bool(config.qkv_bias))
        self.k_proj = nn.Linear(config.hidden_size, kv * d, bias=bool(config.qkv_bias))
        self.v_proj = nn.Linear(config.hidden_size, kv * d, bias=bool(config.qkv_bias))
        self.o_proj = nn.Linear(h * d, config.hidden_size, bias=config.o_proj_bias)

    def forward(self,
                x: torch.Tensor,                 # [B, T, H]
                cos: torch.Tensor,               # [B, 1, T, head_dim]
                sin: torch.Tensor,               # [B, 1, T, head_dim]
                cache: KVCache | None,           # k[layer], v[layer]: [B, kv_heads, S, head_dim]
                layer: int,
                mask: torch.Tensor | None,       # [B, 1, T, S] bool, True: attends; None: causal
                write_idx: torch.Tensor | None,  # [B, T] long, the cache slot of each new token
                ) -> torch.Tensor:               # [B, T, H]
        B, T, _ = x.shape
        # three projections, no fused q/k/v copy: one copy of the weights (a concatenated
        # inference copy measured no faster on the CPU, with the same bits: docs/benchmarks.md)
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(B, T, self.num_heads, self.head_dim).transpose(1, 2)
        k = k.view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is None:
            keys, values = k, v
        else:
            idx = write_idx[:, None, :, None].expand(B, self.num_kv_heads, T, self.head_dim)
            cache.k[layer].scatter_(2, idx, k)
            cache.v[layer].scatter_(2, idx, v)
            keys, values = cache.k[layer][:, :, :mask.shape[-1]], cache.v[layer][:, :, :mask.shape[-1]]
        out = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, is_causal=mask is None,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )
        out = self.o_proj(out.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim))
        return out if self.tp is None else self.tp.all_reduce_(out)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: LMConfig, tp: TensorParallel | None = None) -> None:
        super().__init__()
        inner = config.intermediate_size // (1 if tp is None else tp.size)
        self.tp = tp
        self.gate_proj = nn.Linear(config.hidden_size, inner, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, inner, bias=False)
        self.down_proj = nn.Linear(inner, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return out if self.tp is None else self.tp.all_reduce_(out)


class DecoderLayer(nn.Module):
    def __init__(self, config: LMConfig, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config, tp)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache | None,
                layer: int, mask: torch.Tensor | None, write_idx: torch.Tensor | None
                ) -> torch.Tensor:  # [B, T, H] -> [B, T, H]; the rest as Attention.forward's
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, layer, mask, write_idx)
        return x + self.mlp(self.post_attention_layernorm(x))


def cache_attention_mask(lengths: torch.Tensor, write_idx: torch.Tensor, new_mask: torch.Tensor,
                         slots: int) -> torch.Tensor:
    """Boolean mask [B, T, S] over cache slots, S = `slots` (max(write_idx) + 1, or more:
    the extra slots are masked; the caller knows it on the host, so no sync).

    Query t of row b sees slot j < lengths[b] and the new block's slot write_idx[b, t']
    iff new_mask[b, t, t']."""
    B, T, _ = new_mask.shape
    S = slots
    mask = (torch.arange(S, device=lengths.device)[None, :] < lengths[:, None])[:, None, :].repeat(1, T, 1)
    return mask.scatter_(2, write_idx[:, None, :].expand(B, T, T), new_mask)


def padded_causal_mask(lengths: torch.Tensor, T: int) -> torch.Tensor:
    """Causal mask [B, T, T] of a right-padded block whose row b has lengths[b] real
    tokens: padding is never seen, and every query sees itself (so no row is empty)."""
    valid = torch.arange(T, device=lengths.device)[None, :] < lengths[:, None]
    causal = torch.ones(T, T, dtype=torch.bool, device=lengths.device).tril()
    return (causal[None] & valid[:, None, :]) | torch.eye(T, dtype=torch.bool, device=lengths.device)[None]
