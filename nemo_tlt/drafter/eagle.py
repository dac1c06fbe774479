"""EAGLE-style one-layer drafter.

``f_hat[t+1] = norm(layer(fc([embed(x[t+1]) ; f[t]])))``: from the target's final
hidden state at position t and the token that followed, predict the target's
hidden state at t+1; the target's own LM head turns it into a distribution for
x[t+2]. Embedding and LM head are the target's, read through the `target`
argument on every call (never copied, never trained). Trainable parameters: the
fc, one decoder layer shaped like the target's, and a final norm, about 1/N of a
target with N layers.

While drafting, deeper tree nodes are fed the drafter's own predicted feature of
their parent. Tree nodes are written to the drafter's KV cache past the committed
length and forgotten afterwards; after verification the accepted positions are
re-fed with the target's true features (catch-up), which also refreshes the
drafter's cache with exact inputs.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from nemo_tlt.drafter.base import DraftContext, check_same_dims
from nemo_tlt.model.config import LMConfig
from nemo_tlt.model.kv_cache import KVCache
from nemo_tlt.model.layers import DecoderLayer, RMSNorm
from nemo_tlt.model.lm import DecoderLM
from nemo_tlt.speculative.tree import DraftTree, grow_tree
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

    def select_rows(self, rows: torch.Tensor) -> None:
        self.cache.select_rows(rows)


class EagleDrafter(nn.Module):
    kind = "eagle"

    def __init__(self, config: EagleConfig) -> None:
        super().__init__()
        c = config.layer
        self.config = config
        self.fc = nn.Linear(2 * c.hidden_size, c.hidden_size, bias=True)
        self.layers = nn.ModuleList([DecoderLayer(c)])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02)
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
    def forward(self, target: DecoderLM, next_tokens: torch.Tensor, features: torch.Tensor,
                positions: torch.Tensor | None = None, cache: KVCache | None = None,
                new_mask: torch.Tensor | None = None, prefix_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Predicted (normalised) target features [B, T, H] at positions+1."""
        emb = target.model.embed_tokens(next_tokens).detach()  # shared and frozen: no gradient to the target
        x = self.fc(torch.cat((emb, features.to(self.fc.weight.dtype)), -1))
        x = target.run_layers(x, self.layers, positions, cache, new_mask, prefix_mask)
        return self.norm(x)

    def init_state(self, batch: int, capacity: int) -> EagleState:
        c = self.config.layer
        w = self.fc.weight
        return EagleState(KVCache(1, batch, c.num_kv_heads, capacity, c.head_dim, w.dtype, w.device))

    # ---- drafting ------------------------------------------------------------
    def catch_up(self, state: EagleState, ctx: DraftContext) -> torch.Tensor:
        """Feed positions [drafter length, L) with the target's true features; return the
        predicted feature at L (the root's), [B, H]."""
        cache, L = state.cache, ctx.lengths
        count = L - cache.lengths
        if bool((count < 1).any()):
            raise AssertionError("EAGLE catch-up needs at least one new committed position per row")
        T = int(count.max())
        offs = torch.arange(T)
        valid = offs[None, :] < count[:, None]
        pos = torch.where(valid, cache.lengths[:, None] + offs, (L - 1)[:, None])
        b_idx = torch.arange(L.shape[0])[:, None]
        tok = ctx.tokens[b_idx, pos + 1]
        feat = ctx.features[b_idx, pos]
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        new_mask = (causal[None] & valid[:, None, :]) | torch.eye(T, dtype=torch.bool)[None]
        out = self(ctx.target, tok, feat, pos, cache, new_mask)
        cache.advance(count)
        return out[torch.arange(L.shape[0]), count - 1]

    def propose(self, state: EagleState, ctx: DraftContext, shape: TreeShape) -> DraftTree:
        target, cache, L = ctx.target, state.cache, ctx.lengths
        root_feat = self.catch_up(state, ctx)
        B, H = root_feat.shape
        k = shape.topk
        first_logp = F.log_softmax(target.logits(root_feat).float(), -1)
        fed_out = root_feat.new_zeros(B, 0, H)
        anc = torch.zeros(B, 0, 0, dtype=torch.bool)
        slot_of_node = torch.full((B, shape.max_nodes), -1, dtype=torch.long)

        def expand(tokens: torch.Tensor, nodes: torch.Tensor, parents: torch.Tensor, depth: int) -> torch.Tensor:
            nonlocal fed_out, anc
            fed = fed_out.shape[1]
            if depth == 1:
                parent_feat = root_feat[:, None, :].expand(B, k, H)
                anc_parent = torch.zeros(B, k, 0, dtype=torch.bool)
            else:
                pslot = slot_of_node.gather(1, parents)
                parent_feat = fed_out.gather(1, pslot[..., None].expand(B, k, H))
                anc_parent = anc.gather(1, pslot[..., None].expand(B, k, fed))
            P = int(L.max()) + fed
            rel = torch.arange(P)[None, None, :] - L[:, None, None]
            prefix_mask = (rel < 0).expand(B, k, P)
            if fed:
                in_fed = (rel >= 0) & (rel < fed)
                prefix_mask = prefix_mask | (in_fed & anc_parent.gather(2, rel.clamp(0, fed - 1).expand(B, k, P)))
            cache.lengths = L + fed
            positions = (L + depth - 1)[:, None].expand(B, k)
            new_mask = torch.eye(k, dtype=torch.bool).expand(B, k, k)
            out = self(target, tokens, parent_feat, positions, cache, new_mask, prefix_mask)
            slot_of_node.scatter_(1, nodes, fed + torch.arange(k).expand(B, k))
            fed_out = torch.cat((fed_out, out), 1)
            top = torch.cat((anc, torch.zeros(B, fed, k, dtype=torch.bool)), 2)
            bottom = torch.cat((anc_parent, torch.eye(k, dtype=torch.bool).expand(B, k, k)), 2)
            anc = torch.cat((top, bottom), 1)
            return F.log_softmax(target.logits(out).float(), -1)

        try:
            return grow_tree(first_logp, expand, shape)
        finally:
            cache.lengths = L.clone()
