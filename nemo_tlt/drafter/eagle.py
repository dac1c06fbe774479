"""EAGLE-style one-layer drafter.

``f_hat[t+1] = norm(layer(fc([embed(x[t+1]) ; f[t]])))``: from the target's final
hidden state at position t and the token that followed, predict the target's
hidden state at t+1; the target's own LM head turns it into a distribution for
x[t+2]. Embedding and LM head are the target's, read through the `target`
argument on every call (never copied, never trained). Trainable parameters: the
fc, one decoder layer shaped like the target's, and a final norm, about 1/N of a
target with N layers.

While drafting, deeper tree nodes are fed the drafter's own predicted feature of
their parent (tree growth and catch-up: nemo_tlt.drafter.eagle_tree).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from nemo_tlt.drafter.base import DraftContext, check_same_dims
from nemo_tlt.drafter.eagle_tree import catch_up, propose_tree
from nemo_tlt.model.config import LMConfig
from nemo_tlt.model.kv_cache import KVCache
from nemo_tlt.model.layers import DecoderLayer, RMSNorm
from nemo_tlt.model.lm import DecoderLM
from nemo_tlt.speculative.tree import DraftTree
from nemo_tlt.speculative.tree_shape import TreeShape


@dataclass(frozen=True)
class EagleConfig:
    """The drafter's decoder layer is shaped like one of the target's layers."""
    layer: LMConfig

    def __post_init__(self) -> None:
        if self.layer.num_layers != 1:
            raise ValueError(f"EagleConfig.layer.num_layers must be 1, got {self.layer.num_layers}")

    @classmethod
    def from_target(cls, target: LMConfig) -> "EagleConfig":
        return cls(replace(target, num_layers=1))


class EagleState:
    def __init__(self, cache: KVCache) -> None:
        self.cache = cache

    def select_rows(self, rows: torch.Tensor | list[int]) -> None:
        self.cache.select_rows(rows)

    def reserve(self, slots: int, limit: int) -> None:
        self.cache.reserve(slots, limit)


class EagleDrafter(nn.Module):
    kind = "eagle"

    def __init__(self, config: EagleConfig, generator: torch.Generator | None = None) -> None:
        """`generator` seeds the initial weights (N(0, 0.02), zero biases); without one
        the global RNG does."""
        super().__init__()
        c = config.layer
        self.config = config
        self.fc = nn.Linear(2 * c.hidden_size, c.hidden_size, bias=True)
        self.layers = nn.ModuleList([DecoderLayer(c)])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02, generator=generator)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)

    # ---- checks ------------------------------------------------------------
    def check_target(self, target: DecoderLM) -> None:
        c = self.config.layer
        check_same_dims("EAGLE", c.hidden_size, c.vocab_size, target)
        t = target.config
        if (c.num_heads, c.num_kv_heads, c.head_dim) != (t.num_heads, t.num_kv_heads, t.head_dim):
            raise ValueError(f"EAGLE drafter attention (heads={c.num_heads}, kv_heads={c.num_kv_heads}, "
                             f"head_dim={c.head_dim}) does not match the target's (heads={t.num_heads}, "
                             f"kv_heads={t.num_kv_heads}, head_dim={t.head_dim})")

    def check_shape(self, shape: TreeShape) -> None:
        if shape.topk > self.config.layer.vocab_size:
            raise ValueError(f"TreeShape.topk={shape.topk} exceeds the vocabulary size")

    def forwards_per_draft(self, shape: TreeShape) -> int:
        return shape.depth  # one catch-up, then depth-1 expansions

    # ---- forward -------------------------------------------------------------
    def forward(self,
                target: DecoderLM,
                next_tokens: torch.Tensor,                 # [B, T] long, the token after each feature
                features: torch.Tensor,                    # [B, T, H] the target's (or earlier outputs)
                positions: torch.Tensor | None = None,     # [B, T] long
                cache: KVCache | None = None,              # the drafter's own, one layer
                new_mask: torch.Tensor | None = None,      # [B, T, T] bool
                cache_mask: torch.Tensor | None = None,    # [B, T, S] bool
                rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                ) -> torch.Tensor:                         # [B, T, H]
        """Predicted (normalised) target features at positions+1."""
        emb = target.model.embed_tokens(next_tokens).detach()  # shared and frozen: no gradient to the target
        dtype = self.fc.weight.dtype  # the drafter's own (see nemo_tlt.drafter.base: dtypes)
        x = self.fc(torch.cat((emb.to(dtype), features.to(dtype)), -1))
        x = target.run_layers(x, self.layers, positions, cache, new_mask, cache_mask, rope)
        return self.norm(x)

    def init_state(self, batch: int, capacity: int) -> EagleState:
        c = self.config.layer
        w = self.fc.weight
        return EagleState(KVCache(1, batch, c.num_kv_heads, capacity, c.head_dim, w.dtype, w.device))

    # ---- drafting (see nemo_tlt.drafter.eagle_tree) --------------------------
    def feed_committed(self, target: DecoderLM, tokens: torch.Tensor, features: torch.Tensor,
                       positions: torch.Tensor, cache: KVCache, new_mask: torch.Tensor) -> torch.Tensor:
        return self(target, tokens, features, positions, cache, new_mask)

    def feed_nodes(self, target: DecoderLM, tokens: torch.Tensor, parent_out: torch.Tensor, cache: KVCache,
                   cache_mask: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self(target, tokens, parent_out, None, cache, None, cache_mask, rope)

    def draft_logits(self, target: DecoderLM, out: torch.Tensor) -> torch.Tensor:
        return target.logits(out.to(target.lm_head_weight.dtype))

    def catch_up(self, state: EagleState, ctx: DraftContext) -> torch.Tensor:
        """Feed positions [drafter length, L) with the target's true features; return the
        predicted feature at L (the root's), [B, H]."""
        return catch_up(self, state.cache, ctx)[0]

    def propose(self, state: EagleState, ctx: DraftContext, shape: TreeShape) -> DraftTree:
        return propose_tree(self, state.cache, ctx, shape)
