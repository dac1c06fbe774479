"""Tree drafting shared by the EAGLE-family drafters (EAGLE-2 style and EAGLE-3).

Both drafters are one decoder layer with a KV cache of its own that maps
(token x[t+1], a feature of position t) to an output feature o[t+1], and read a
token distribution off that output. They differ in the feature fed at a committed
position (the target's final hidden state; or the fc-fused captured layers) and in
how logits are read (the target's head; or the drafter's own head over a draft
vocabulary). An `EagleSteps` supplies exactly those three pieces; the functions
here do the cache bookkeeping and grow the tree:

* `catch_up` feeds committed positions [drafter length, L) with the target's
  features and returns the root's output (the one that predicts depth 1);
* `propose_tree` grows the tree: deeper nodes are fed their parent's *output*
  (the drafter's own feature, as in training-time test). Tree nodes are written to
  the drafter's cache past the committed length and forgotten afterwards; after
  verification the accepted positions are re-fed with the target's true features.

Everything is made on the device of the context's tensors. A draft reads the device
once (the catch-up's longest gap and the longest committed row, in one transfer;
nemo_tlt.model.host).
"""
from __future__ import annotations

from typing import Protocol

import torch

from nemo_tlt.drafter.base import DraftContext
from nemo_tlt.model.host import host_list
from nemo_tlt.model.kv_cache import KVCache
from nemo_tlt.model.layers import padded_causal_mask
from nemo_tlt.model.lm import DecoderLM
from nemo_tlt.speculative.tree import DraftTree, grow_tree
from nemo_tlt.speculative.tree_shape import TreeShape


class EagleSteps(Protocol):
    def feed_committed(self, target: DecoderLM, tokens: torch.Tensor, features: torch.Tensor,
                       positions: torch.Tensor, cache: KVCache, new_mask: torch.Tensor) -> torch.Tensor:
        """Outputs [B, T, H] for committed positions: `features` are rows of
        `DraftContext.features` (the target's)."""
        ...

    def feed_nodes(self, target: DecoderLM, tokens: torch.Tensor, parent_out: torch.Tensor, cache: KVCache,
                   cache_mask: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Outputs [B, k, H] for tree nodes fed with their parents' outputs."""
        ...

    def draft_logits(self, target: DecoderLM, out: torch.Tensor) -> torch.Tensor:
        """Logits over the target's vocabulary [..., V] read off outputs [..., H]."""
        ...


def catch_up(steps: EagleSteps, cache: KVCache, ctx: DraftContext) -> tuple[torch.Tensor, int]:
    """Feed positions [drafter length, L) with the target's true features; return the
    output at L - 1 (the root's, which predicts depth 1), [B, H], and max(L)."""
    L = ctx.lengths
    count = L - cache.lengths
    fewest, T, longest, fed = host_list(torch.stack((count.min(), count.max(), L.max(), cache.lengths.max())))
    if fewest < 1:
        raise AssertionError("EAGLE catch-up needs at least one new committed position per row")
    cache.note_max_length(fed)
    dev = L.device
    offs = torch.arange(T, device=dev)
    valid = offs[None, :] < count[:, None]
    pos = torch.where(valid, cache.lengths[:, None] + offs, (L - 1)[:, None])
    b_idx = torch.arange(L.shape[0], device=dev)
    out = steps.feed_committed(ctx.target, ctx.tokens[b_idx[:, None], pos + 1], ctx.features[b_idx[:, None], pos],
                               pos, cache, padded_causal_mask(count, T))
    cache.set_lengths(L.clone(), longest)
    return out[b_idx, count - 1], longest


def propose_tree(steps: EagleSteps, cache: KVCache, ctx: DraftContext, shape: TreeShape) -> DraftTree:
    target, L = ctx.target, ctx.lengths
    root_out, longest = catch_up(steps, cache, ctx)
    B, H = root_out.shape
    dev = L.device
    k, n_fed = shape.topk, (shape.depth - 1) * shape.topk
    first = ctx.score(steps.draft_logits(target, root_out), 1)
    if n_fed == 0:
        return grow_tree(first, _no_expand, shape)
    # The frontier of expansion d (1-based) is fed at drafter-cache slots
    # L + (d-1)k + i, past the committed length; those slots are forgotten after
    # verification. A fed node sees the committed prefix, its fed ancestors and
    # itself: its parent's visibility row plus its own slot. Every expansion
    # attends over the same S slots; unwritten ones are masked.
    S = longest + n_fed
    committed = (torch.arange(S, device=dev)[None, :] < L[:, None])[:, None, :]       # [B, 1, S]
    own_slot = torch.zeros(B, n_fed, S, dtype=torch.bool, device=dev).scatter_(
        2, (L[:, None] + torch.arange(n_fed, device=dev))[..., None], True)           # [B, n_fed, S]
    cos, sin = target.rope(L[:, None] + torch.arange(shape.depth - 1, device=dev),
                           longest + shape.depth - 2)                                   # [B, 1, d-1, D]
    prev: dict[str, torch.Tensor] = {}

    def expand(tokens: torch.Tensor, nodes: torch.Tensor, parents: torch.Tensor, depth: int) -> torch.Tensor:
        j0 = (depth - 1) * k
        if depth == 1:
            parent_out, parent_vis = root_out[:, None, :].expand(B, k, H), committed
        else:  # position of each parent in the previous frontier
            pos = (parents[:, :, None] == prev["nodes"][:, None, :]).float().argmax(-1)
            parent_out = prev["out"].gather(1, pos[..., None].expand(B, k, H))
            parent_vis = prev["vis"].gather(1, pos[..., None].expand(B, k, S))
        vis = parent_vis | own_slot[:, j0:j0 + k]
        cache.set_lengths(L + j0, longest + j0)
        rope = (cos[:, :, depth - 1:depth], sin[:, :, depth - 1:depth])
        out = steps.feed_nodes(target, tokens, parent_out, cache, vis, rope)
        prev.update(nodes=nodes, out=out, vis=vis)
        return ctx.score(steps.draft_logits(target, out), depth + 1)

    try:
        return grow_tree(first, expand, shape)
    finally:
        cache.set_lengths(L.clone(), longest)


def _no_expand(tokens: torch.Tensor, nodes: torch.Tensor, parents: torch.Tensor, depth: int) -> torch.Tensor:
    raise AssertionError("a depth-1 tree needs no expansion")
