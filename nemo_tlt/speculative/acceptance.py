"""Which drafted tokens the target accepts, as pure functions over a verified tree.

Both rules walk from the root: at the current node, the target's own choice is
made, and if a child of the node carries that token the walk moves to it; the
walk ends with one token produced by the target itself (the bonus token), so every
verify step yields between 1 and depth+1 tokens.

* `accept_greedy` serves the ``greedy`` and ``coupled`` modes: the target's choice
  at every node is a deterministic function of the node's context (argmax, or
  Gumbel-argmax with noise keyed by sequence and position), so the accepted tokens
  are exactly those plain decoding would have produced.
* `accept_rejection` serves ``rejection``: multi-candidate rejection sampling with
  deterministic (top-k) candidates. At a node with target distribution p, candidate
  c is accepted with probability r(c) under the current residual r (initially p);
  on rejection c is removed from r and r renormalised. If no candidate is accepted
  the bonus token is drawn from r. Token x is thus produced with probability
  p(x), whatever the drafter proposed (this is SpecInfer's rule with the draft
  distribution a point mass on each candidate).

Tensors are made on the tree's device. Greedy acceptance of a tree that carries its
depth bound and distinct siblings (every grown tree) reads nothing back from the
device; rejection reads one flag per depth (whether any row is still accepting).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from nemo_tlt.model.host import host_bool, host_int
from nemo_tlt.speculative.tree import DraftTree, tree_block_mask


@dataclass
class Acceptance:
    path: torch.Tensor          # [B, D] block indices of accepted draft nodes, -1 padded
    num_accepted: torch.Tensor  # [B] number of accepted draft tokens (0..D)
    bonus: torch.Tensor         # [B] the target's own token after the accepted path

    def tokens(self, tree: DraftTree) -> torch.Tensor:
        """[B, D+1] emitted tokens: accepted drafts then the bonus, -1 padded."""
        B, D = self.path.shape
        pad = torch.full((B, 1), -1, dtype=torch.long, device=self.path.device)
        node_tok = torch.cat((pad, tree.tokens), dim=1)
        out = torch.where(self.path >= 0, node_tok.gather(1, self.path.clamp(min=0)), -1)
        out = torch.cat((out, pad), dim=1)
        out.scatter_(1, self.num_accepted[:, None], self.bonus[:, None])
        return out

    def kept_block_offsets(self) -> torch.Tensor:
        """[B, D+1]: block offsets whose KV entries survive (root, then the path)."""
        B = self.path.shape[0]
        return torch.cat((torch.zeros(B, 1, dtype=torch.long, device=self.path.device), self.path.clamp(min=0)),
                         dim=1)


def _child_at(tree: DraftTree, cur: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Block index of the rank-th child (creation order) of each row's current node."""
    is_child = tree.parents == cur[:, None]
    nth = (is_child.cumsum(1) - 1 == rank) & is_child
    return nth.any(1), nth.float().argmax(1) + 1


def accept_greedy(tree: DraftTree,                         # N nodes per row
                  target_choice: torch.Tensor,             # [B, N+1] long
                  ancestors: torch.Tensor | None = None,   # [B, N+1, N+1] bool
                  ) -> Acceptance:
    """target_choice: [B, N+1] the target's deterministic token at each block node;
    `ancestors` the tree's ancestor-or-self mask (`tree_block_mask`) if at hand.

    Vectorised walk: a node *matches* if its token is its parent's choice, and lies on
    the accepted path iff it and all its ancestors match. Siblings carry distinct
    tokens (each parent's children are its top-k), so the path has one node per
    depth; a tree that breaks that falls back to the step-by-step walk (checked on the
    host only for a tree that does not declare `distinct_siblings`)."""
    B, N = tree.tokens.shape
    dev = tree.tokens.device
    depth = tree.max_depth
    if ancestors is None:
        ancestors = tree_block_mask(tree)
    match = torch.cat((torch.ones(B, 1, dtype=torch.bool, device=dev),
                       tree.tokens == target_choice.gather(1, tree.parents)), 1)
    on_path = ~(ancestors & ~match[:, None, :]).any(-1)                     # [B, N+1], root included
    node_depth = torch.cat((torch.zeros(B, 1, dtype=torch.long, device=dev), tree.depths), 1)
    num = on_path.sum(1) - 1
    last = torch.where(on_path, node_depth, -1).argmax(1)                  # deepest node on the path
    if not tree.distinct_siblings and not host_bool((node_depth.gather(1, last[:, None]).squeeze(1) == num).all()):
        return _accept_greedy_walk(tree, target_choice)
    # the path's depth-d node goes to column d-1, every other node to a spare column
    col = torch.where(on_path[:, 1:], tree.depths - 1, depth)
    path = torch.full((B, depth + 1), -1, dtype=torch.long, device=dev)
    path.scatter_(1, col, torch.arange(1, N + 1, device=dev).expand(B, N))
    return Acceptance(path[:, :depth], num, target_choice.gather(1, last[:, None]).squeeze(1))


def _accept_greedy_walk(tree: DraftTree, target_choice: torch.Tensor) -> Acceptance:
    B, _ = tree.tokens.shape
    depth, dev = tree.max_depth, tree.tokens.device
    cur = torch.zeros(B, dtype=torch.long, device=dev)
    alive = torch.ones(B, dtype=torch.bool, device=dev)
    path = torch.full((B, depth), -1, dtype=torch.long, device=dev)
    for step in range(depth):
        want = target_choice.gather(1, cur[:, None])
        match = (tree.parents == cur[:, None]) & (tree.tokens == want) & alive[:, None]
        found = match.any(1)
        nxt = match.float().argmax(1) + 1
        path[:, step] = torch.where(found, nxt, -1)
        cur = torch.where(found, nxt, cur)
        alive &= found
    num = (path >= 0).sum(1)
    return Acceptance(path, num, target_choice.gather(1, cur[:, None]).squeeze(1))


ResidualUpdate = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def remove_candidate(residual: torch.Tensor, tok: torch.Tensor) -> torch.Tensor:
    """r <- normalise(r with r[tok] = 0): the residual after rejecting a point-mass draft."""
    r = residual.scatter(1, tok[:, None], 0.0)
    total = r.sum(1, keepdim=True)
    # total is 0 only if every token of p was proposed and rejected, which has
    # probability 0; keep the old residual rather than divide by zero.
    return torch.where(total > 0, r / total.clamp(min=1e-30), residual)


def _max_children(tree: DraftTree) -> int:
    """The most children a node has: the tree's host-known `fanout_bound`, else read from it."""
    N = tree.num_nodes
    if not N:
        return 0
    if tree.fanout_bound is not None:
        return min(N, tree.fanout_bound)
    per_parent = tree.parents[:, :, None] == torch.arange(N + 1, device=tree.parents.device)[None, None, :]
    return host_int(per_parent.sum(1).max())


def accept_rejection(tree: DraftTree,                     # N nodes per row
                     target_probs: torch.Tensor,          # [B, N+1, V] float32
                     generator: torch.Generator | None,
                     residual_update: ResidualUpdate = remove_candidate) -> Acceptance:
    """target_probs: [B, N+1, V] processed target distribution at each block node."""
    B, N = tree.tokens.shape
    depth, dev = tree.max_depth, tree.tokens.device
    max_children = _max_children(tree)
    cur = torch.zeros(B, dtype=torch.long, device=dev)
    alive = torch.ones(B, dtype=torch.bool, device=dev)
    residual = target_probs[:, 0].clone()
    path = torch.full((B, depth), -1, dtype=torch.long, device=dev)
    b_idx = torch.arange(B, device=dev)
    for step in range(depth):
        moved = torch.zeros(B, dtype=torch.bool, device=dev)
        for rank in range(max_children):
            has, child = _child_at(tree, cur, rank)
            trying = alive & ~moved & has
            tok = tree.tokens[b_idx, (child - 1).clamp(min=0)]
            u = torch.rand(B, generator=generator, device=dev)
            ok = trying & (u < residual[b_idx, tok])
            rejected = trying & ~ok
            residual = torch.where(rejected[:, None], residual_update(residual, tok), residual)
            residual = torch.where(ok[:, None], target_probs[b_idx, child], residual)
            path[:, step] = torch.where(ok, child, path[:, step])
            cur = torch.where(ok, child, cur)
            moved |= ok
        alive &= moved
        if not host_bool(alive.any()):
            break
    bonus = torch.multinomial(residual, 1, generator=generator).squeeze(1)
    return Acceptance(path, (path >= 0).sum(1), bonus)
