"""Tree growth, selection, masks and positions; greedy acceptance walk."""
from __future__ import annotations

import pytest
import torch

from nemo_tlt.speculative.acceptance import _accept_greedy_walk, accept_greedy
from nemo_tlt.speculative.tree import (DraftTree, chain_tree, grow_tree, tree_block_mask,
                                       tree_block_positions)
from nemo_tlt.speculative.tree_shape import TreeShape


def _random_expand(V, seed):
    g = torch.Generator().manual_seed(seed)

    def expand(tokens, nodes, parents, depth):
        B, k = tokens.shape
        return torch.randn(B, k, V, generator=g).log_softmax(-1)
    return expand


@pytest.mark.parametrize("shape", [TreeShape(1, 1, 1), TreeShape(3, 2, 6), TreeShape(4, 3, 20), TreeShape(5, 4, 64)])
def test_grown_tree_is_connected_and_ordered(shape):
    V, B = 11, 3
    first = torch.randn(B, V).log_softmax(-1)
    tree = grow_tree(first, _random_expand(V, 0), shape)
    assert tree.tokens.shape == (B, shape.num_verify)
    idx = torch.arange(1, shape.num_verify + 1)
    assert bool((tree.parents < idx).all()), "parents precede children"
    par_depth = torch.cat((torch.zeros(B, 1, dtype=torch.long), tree.depths), 1).gather(1, tree.parents)
    assert torch.equal(par_depth + 1, tree.depths)
    par_score = torch.cat((torch.zeros(B, 1), tree.scores), 1).gather(1, tree.parents)
    assert bool((tree.scores <= par_score + 1e-6).all())
    # siblings carry distinct tokens
    for b in range(B):
        pairs = list(zip(tree.parents[b].tolist(), tree.tokens[b].tolist()))
        assert len(set(pairs)) == len(pairs)


def test_selection_keeps_best_scores():
    shape = TreeShape(3, 3, 7)
    first = torch.randn(2, 9).log_softmax(-1)
    tree = grow_tree(first, _random_expand(9, 1), shape)
    full = grow_tree(first, _random_expand(9, 1), TreeShape(3, 3, shape.max_nodes))
    best = full.scores.sort(1, descending=True).values[:, : shape.num_verify]
    torch.testing.assert_close(tree.scores.sort(1, descending=True).values, best)


def test_mask_and_positions():
    # root -> a(1) -> c(3); root -> b(2)
    tree = DraftTree(torch.tensor([[5, 6, 7]]), torch.tensor([[0, 0, 1]]), torch.tensor([[1, 1, 2]]),
                     torch.zeros(1, 3))
    mask = tree_block_mask(tree)[0].int().tolist()
    assert mask == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]
    assert tree_block_positions(tree, torch.tensor([10]))[0].tolist() == [10, 11, 11, 12]


def test_greedy_walk_accepts_longest_matching_path():
    tree = DraftTree(torch.tensor([[5, 6, 7], [5, 6, 7]]), torch.tensor([[0, 0, 1], [0, 0, 1]]),
                     torch.tensor([[1, 1, 2], [1, 1, 2]]), torch.zeros(2, 3))
    # block: root, a=5, b=6, c=7 (child of a). Row 0: target picks 5 at root, 7 at a, 9 at c.
    choice = torch.tensor([[5, 7, 0, 9], [6, 1, 2, 3]])
    acc = accept_greedy(tree, choice)
    assert acc.num_accepted.tolist() == [2, 1]
    assert acc.tokens(tree)[0].tolist() == [5, 7, 9]
    assert acc.tokens(tree)[1].tolist()[:2] == [6, 2]
    assert acc.kept_block_offsets()[0].tolist() == [0, 1, 3]


@pytest.mark.parametrize("shape", [TreeShape(1, 1, 1), TreeShape(4, 2, 8), TreeShape(6, 3, 14)])
def test_vectorised_greedy_acceptance_equals_the_walk(shape):
    V, B = 5, 64
    g = torch.Generator().manual_seed(3)
    tree = grow_tree(torch.randn(B, V, generator=g).log_softmax(-1), _random_expand(V, 2), shape)
    # the target mostly agrees with the drafter's best child so that long paths occur
    node_tok = torch.cat((torch.zeros(B, 1, dtype=torch.long), tree.tokens), 1)
    first_child = torch.full((B, shape.num_verify + 1), -1, dtype=torch.long)
    for b in range(B):
        for n in reversed(range(shape.num_verify)):
            first_child[b, tree.parents[b, n]] = node_tok[b, n + 1]
    noise = torch.randint(0, V, first_child.shape, generator=g)
    agree = torch.rand(first_child.shape, generator=g) < 0.8
    choice = torch.where(agree & (first_child >= 0), first_child, noise)
    fast, walk = accept_greedy(tree, choice), _accept_greedy_walk(tree, choice)
    assert torch.equal(fast.path, walk.path) and torch.equal(fast.bonus, walk.bonus)
    assert torch.equal(fast.num_accepted, walk.num_accepted)
    assert int(fast.num_accepted.max()) >= min(2, shape.depth)


def test_greedy_acceptance_with_duplicate_siblings_falls_back_to_the_walk():
    # two children of the root carry token 5; the walk takes the first
    tree = DraftTree(torch.tensor([[5, 5, 7]]), torch.tensor([[0, 0, 2]]), torch.tensor([[1, 1, 2]]),
                     torch.zeros(1, 3))
    choice = torch.tensor([[5, 1, 7, 2]])
    acc = accept_greedy(tree, choice)
    assert acc.path.tolist() == [[1, -1]] and acc.bonus.tolist() == [1]


def test_chain_tree():
    tree = chain_tree(torch.tensor([[4, 5, 6]]))
    assert tree.parents.tolist() == [[0, 1, 2]]
    assert tree_block_mask(tree)[0].int().tril().sum() == 10


@pytest.mark.parametrize("text", ["8_4", "a_b_c", "8_4_1000", "0_1_1", "", "8_4_32_1"])
def test_malformed_shape_strings(text):
    with pytest.raises(ValueError, match="shape"):
        TreeShape.parse(text, field="tree shape")


def test_num_verify_too_large_is_refused():
    with pytest.raises(ValueError, match="num_verify"):
        TreeShape(2, 2, 7)
