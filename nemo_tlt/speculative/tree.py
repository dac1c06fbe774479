"""Draft trees as tensors: growing (EAGLE-2 style), selecting, masks and positions.

A tree for a batch of B rows is stored in *creation order* so that a parent always
precedes its children. The verify block fed to the target is
``[root, node_0, ..., node_{N-1}]``: block index 0 is the root (the last token the
target produced, not yet in its KV cache) and node i sits at block index i + 1.
`parents` holds block indices (0 for children of the root).

Growth: depth-1 candidates are the top-k tokens of the first draft distribution.
At each further depth, the k frontier nodes each propose their top-k children,
scored by cumulative draft log-probability; the best k of those k*k become the next
frontier. Finally the best `num_verify` of all candidates are kept. Because a
child's cumulative score never exceeds its parent's and ties are broken by
creation order (stable sort), the kept set is always a connected tree.

Every tensor is made on the device of its inputs. A tree grown here carries its depth
bound and the fact that siblings carry distinct tokens as host values, so verifying
it needs no read of the device (nemo_tlt.model.host).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from nemo_tlt.model.host import host_int
from nemo_tlt.speculative.tree_shape import TreeShape

# expand(tokens [B,k], nodes [B,k], parent_nodes [B,k], depth) -> child log-probs [B,k,V]
# `nodes` index the candidates created so far; `parent_nodes` is -1 for depth-1 nodes.
ExpandFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]


@dataclass
class DraftTree:
    tokens: torch.Tensor   # [B, N] long
    parents: torch.Tensor  # [B, N] long, block index of the parent (0 = root)
    depths: torch.Tensor   # [B, N] long, 1..depth
    scores: torch.Tensor   # [B, N] float, cumulative draft log-probability
    depth_bound: int | None = None   # host-known bound on depths (None: read them)
    distinct_siblings: bool = False  # no two children of a node carry the same token
    fanout_bound: int | None = None  # host-known bound on the children of a node (None: read them)

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]

    @property
    def max_depth(self) -> int:
        """The depth of the deepest node, or the tree's `depth_bound` (paths are padded to it)."""
        if not self.num_nodes:
            return 0
        return self.depth_bound if self.depth_bound is not None else host_int(self.depths.max())


def grow_tree(first_logp: torch.Tensor,  # [B, V] the root's draft scores
              expand: ExpandFn, shape: TreeShape,
              ) -> DraftTree:          # [B, N] fields, N <= shape.num_verify
    """Grow an EAGLE-2 tree from the root's draft log-probs."""
    B, V = first_logp.shape
    k = shape.topk
    if k > V:
        raise ValueError(f"TreeShape.topk={k} exceeds the vocabulary size {V}")
    dev = first_logp.device
    scores, tokens = first_logp.topk(k, dim=-1)
    nodes = torch.arange(k, device=dev).expand(B, k)
    parents = torch.full((B, k), -1, dtype=torch.long, device=dev)
    all_tok, all_score, all_parent = [tokens], [scores], [parents]
    all_depth = [torch.ones(B, k, dtype=torch.long, device=dev)]
    count = k
    f_tok, f_node, f_score, f_parent = tokens, nodes, scores, parents
    for depth in range(1, shape.depth):
        child_logp = expand(f_tok, f_node, f_parent, depth)
        c_score, c_tok = child_logp.topk(k, dim=-1)                  # [B, k, k]
        cum = (f_score[:, :, None] + c_score).flatten(1)             # [B, k*k]
        c_tok = c_tok.flatten(1)
        c_parent = f_node[:, :, None].expand(B, k, k).flatten(1)
        all_tok.append(c_tok)
        all_score.append(cum)
        all_parent.append(c_parent)
        all_depth.append(torch.full((B, k * k), depth + 1, dtype=torch.long, device=dev))
        f_score, pick = cum.topk(k, dim=-1)
        f_tok = c_tok.gather(1, pick)
        f_parent = c_parent.gather(1, pick)
        f_node = count + pick
        count += k * k
    tree = select_tree(torch.cat(all_tok, 1), torch.cat(all_parent, 1), torch.cat(all_depth, 1),
                       torch.cat(all_score, 1), shape.num_verify)
    # every node's children are one top-k: at most k of them, with distinct tokens
    tree.depth_bound, tree.distinct_siblings, tree.fanout_bound = shape.depth, True, k
    return tree


def select_tree(tokens: torch.Tensor, parent_nodes: torch.Tensor, depths: torch.Tensor,
                scores: torch.Tensor, num_verify: int) -> DraftTree:
    """Keep the `num_verify` best candidates (in creation order) and re-index parents
    to block indices."""
    B, N = tokens.shape
    order = torch.sort(-scores, dim=1, stable=True).indices[:, :num_verify]
    keep = order.sort(dim=1).values                                   # creation order
    block_of = torch.full((B, N), -1, dtype=torch.long, device=tokens.device)
    block_of.scatter_(1, keep, torch.arange(1, num_verify + 1, device=tokens.device).expand(B, num_verify))
    par = parent_nodes.gather(1, keep)
    par_block = torch.where(par < 0, torch.zeros_like(par), block_of.gather(1, par.clamp(min=0)))
    # checked on the device (no host sync): raises here on a CPU, as a device assert on a GPU
    torch._assert_async((par_block >= 0).all(), "select_tree kept a node without its parent")
    return DraftTree(tokens.gather(1, keep), par_block, depths.gather(1, keep), scores.gather(1, keep))


def chain_tree(tokens: torch.Tensor, scores: torch.Tensor | None = None) -> DraftTree:
    """A single path (depth = length) as a DraftTree, e.g. for a chain drafter."""
    B, D = tokens.shape
    dev = tokens.device
    parents = torch.arange(D, device=dev).expand(B, D).clone()
    depths = torch.arange(1, D + 1, device=dev).expand(B, D).clone()
    return DraftTree(tokens, parents, depths, scores if scores is not None else torch.zeros(B, D, device=dev),
                     depth_bound=D, distinct_siblings=True, fanout_bound=1)


def tree_block_mask(tree: DraftTree) -> torch.Tensor:
    """Ancestor-or-self mask of the verify block, [B, N+1, N+1] bool (row attends to column)."""
    B, N = tree.tokens.shape
    dev = tree.tokens.device
    parent = torch.cat((torch.zeros(B, 1, dtype=torch.long, device=dev), tree.parents), dim=1)  # root's: itself
    mask = torch.eye(N + 1, dtype=torch.bool, device=dev).expand(B, N + 1, N + 1).clone()
    anc = parent
    for _ in range(tree.max_depth):
        mask.scatter_(2, anc[:, :, None], True)
        anc = parent.gather(1, anc)
    return mask


def tree_block_positions(tree: DraftTree, base: torch.Tensor) -> torch.Tensor:
    """Absolute positions of the verify block [B, N+1]: base (the root's position) + depth."""
    depth = torch.cat((torch.zeros_like(tree.depths[:, :1]), tree.depths), dim=1)
    return base[:, None] + depth


def block_tokens(tree: DraftTree, roots: torch.Tensor) -> torch.Tensor:
    return torch.cat((roots[:, None], tree.tokens), dim=1)
