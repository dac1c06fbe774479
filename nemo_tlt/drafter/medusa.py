"""Medusa-style drafter: K residual heads on the target's final hidden state.

Head k maps the hidden state h_t (which, through the LM head, predicts x[t+1]) to
``h_t + silu(W_k h_t)`` and through the target's LM head predicts x[t+k+2]. Heads
start as the identity (W_k = 0). Each head's distribution does not depend on the
tokens drafted before it, so a tree of depth d uses heads 0..d-1 and the EAGLE-2
growth rule picks which of the candidates to verify.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from nemo_tlt.drafter.base import DraftContext, NoDraftState, check_same_dims
from nemo_tlt.model.lm import DecoderLM
from nemo_tlt.speculative.tree import DraftTree, grow_tree
from nemo_tlt.speculative.tree_shape import TreeShape


@dataclass(frozen=True)
class MedusaConfig:
    hidden_size: int
    vocab_size: int
    num_heads: int = 4

    def __post_init__(self) -> None:
        for name in ("hidden_size", "vocab_size", "num_heads"):
            if getattr(self, name) < 1:
                raise ValueError(f"MedusaConfig.{name} must be >= 1, got {getattr(self, name)}")


class MedusaDrafter(nn.Module):
    kind = "medusa"

    def __init__(self, config: MedusaConfig) -> None:
        super().__init__()
        self.config = config
        self.heads = nn.ModuleList(nn.Linear(config.hidden_size, config.hidden_size) for _ in range(config.num_heads))
        for head in self.heads:
            nn.init.zeros_(head.weight)
            nn.init.zeros_(head.bias)

    def check_target(self, target: DecoderLM) -> None:
        check_same_dims("Medusa", self.config.hidden_size, self.config.vocab_size, target)

    def check_shape(self, shape: TreeShape) -> None:
        if shape.depth > self.config.num_heads:
            raise ValueError(f"TreeShape.depth={shape.depth} exceeds the Medusa drafter's "
                             f"num_heads={self.config.num_heads}")

    def forwards_per_draft(self, shape: TreeShape) -> int:
        return 1

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] -> per-head features [..., K, H]."""
        return torch.stack([hidden + F.silu(head(hidden)) for head in self.heads], dim=-2)

    def init_state(self, batch: int, capacity: int) -> NoDraftState:
        return NoDraftState()

    def propose(self, state: NoDraftState, ctx: DraftContext, shape: TreeShape) -> DraftTree:
        self.check_shape(shape)
        B = ctx.lengths.shape[0]
        last = ctx.features[torch.arange(B, device=ctx.lengths.device), ctx.lengths - 1]
        head_dtype = ctx.target.lm_head_weight.dtype  # see nemo_tlt.drafter.base: dtypes
        logits = ctx.target.logits(self(last.to(self.heads[0].weight.dtype)).to(head_dtype))  # [B, K, V]
        logp = torch.stack([ctx.score(logits[:, d], d + 1) for d in range(shape.depth)], 1)
        k = shape.topk

        def expand(tokens: torch.Tensor, nodes: torch.Tensor, parents: torch.Tensor, depth: int) -> torch.Tensor:
            return logp[:, depth][:, None, :].expand(B, k, logp.shape[-1])

        return grow_tree(logp[:, 0], expand, shape)
