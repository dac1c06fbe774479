"""NodeTopology: nodes, leaders, local indices, validation; gather_topology reads Comm.node;
build_node_groups makes groups only for a hierarchical topology, and NodeGroups.all_reduce
(4 gloo ranks as 2 nodes, node ids not in rank order, and 3 + 1) sums and maxes like a
flat all-reduce, with the same bits on every rank."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from nemo_tlt.dist import Comm, NodeTopology, RankContext, build_node_groups, gather_topology
from ranks import launch_forked


def test_nodes_ranks_leaders_and_local_indices():
    t = NodeTopology((1, 1, 0, 0, 0))
    assert t.world == 5 and t.nodes == (0, 1)
    assert t.ranks_on(0) == (2, 3, 4) and t.ranks_on(1) == (0, 1)
    assert t.leader(0) == 2 and t.leader(1) == 0 and t.leaders == (2, 0)
    assert [t.node_of(r) for r in range(5)] == [1, 1, 0, 0, 0]
    assert t.multi_node and t.max_ranks_per_node == 3 and t.hierarchical


@pytest.mark.parametrize("rank_nodes, multi, per_node, hierarchical", [
    ((0,), False, 1, False),
    ((0, 0, 0), False, 3, False),     # one node: nothing crosses the network
    ((0, 1, 2), True, 1, False),      # one rank per node: the flat all-reduce is already per node
    ((0, 0, 1), True, 2, True),
    ((3, 7), True, 1, False),         # node ids need not be dense
])
def test_when_a_reduction_is_hierarchical(rank_nodes, multi, per_node, hierarchical):
    t = NodeTopology(rank_nodes)
    assert (t.multi_node, t.max_ranks_per_node, t.hierarchical) == (multi, per_node, hierarchical)


@pytest.mark.parametrize("bad", [(), [0, 1], (0, -1), (0, 1.0), (True, 0), (0, "1"), None])
def test_invalid_topologies_are_refused_naming_the_field(bad):
    with pytest.raises(ValueError, match="NodeTopology.rank_nodes"):
        NodeTopology(bad)


def test_unknown_nodes_and_ranks_are_refused():
    t = NodeTopology((0, 0, 1))
    with pytest.raises(ValueError, match="no rank runs on node 2"):
        t.leader(2)
    for rank in (-1, 3, True):
        with pytest.raises(ValueError, match=r"rank must be in \[0, 3\)"):
            t.node_of(rank)
    assert t == NodeTopology((0, 0, 1)) and hash(t) == hash(NodeTopology((0, 0, 1)))


def test_gather_topology_of_a_single_rank_reads_its_node():
    assert gather_topology(Comm(0, 1, None, node=4)) == NodeTopology((4,))


def test_a_flat_topology_needs_no_group_and_no_process_group():
    groups = build_node_groups(NodeTopology((0, 1)), 1)
    assert groups.node_group is None and groups.leaders_group is None and groups.leader == 1
    with pytest.raises(RuntimeError, match="needs an initialised"):
        build_node_groups(NodeTopology((0, 0, 1)), 0)
    with pytest.raises(ValueError, match="rank must be in"):
        build_node_groups(NodeTopology((0, 1)), 2)


def _reduce_by_node(ctx: RankContext, rank_nodes: tuple[int, ...]) -> dict:
    # the launcher knows the node (here every local rank is on node 0); the test plays a cluster
    assert gather_topology(Comm(ctx.rank, ctx.world, ctx.store, ctx.node)) == NodeTopology((0,) * ctx.world)
    groups = build_node_groups(NodeTopology(rank_nodes), ctx.rank, timeout_s=60)
    g = torch.Generator().manual_seed(ctx.rank)
    mine = torch.randn(257, generator=g)
    summed = groups.all_reduce(mine.clone())
    # the maximum sits on rank 1, a non-leader in both topologies
    maxed = groups.all_reduce(torch.tensor([[1.0, 9.0, 2.0, 5.0][ctx.rank]], dtype=torch.float64), dist.ReduceOp.MAX)
    return {"mine": mine, "sum": summed, "max": float(maxed[0]),
            "has_node_group": groups.node_group is not None, "has_leaders_group": groups.leaders_group is not None}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("rank_nodes, node_groups, leaders", [
    ((1, 1, 0, 0), [True] * 4, [True, False, True, False]),  # leaders: rank 2 (node 0), rank 0 (node 1)
    ((0, 0, 0, 1), [True, True, True, False], [True, False, False, True]),  # node 1 alone: no node group
])
def test_node_groups_all_reduce_equals_the_flat_sum_with_the_same_bits_everywhere(rank_nodes, node_groups, leaders):
    out = launch_forked(_reduce_by_node, 4, rank_nodes, timeout_s=100)
    expected = sum(o["mine"] for o in out)
    for o in out:
        assert torch.equal(o["sum"], out[0]["sum"])
        assert o["max"] == 9.0
    torch.testing.assert_close(out[0]["sum"], expected, rtol=1e-6, atol=1e-6)
    assert [o["has_node_group"] for o in out] == node_groups
    assert [o["has_leaders_group"] for o in out] == leaders
