"""Which ranks share a node, and the process groups that reduce within and across nodes.

Contract
--------
* ``NodeTopology(rank_nodes)``: pure and frozen; ``rank_nodes[r]`` is the node of rank
  ``r`` (a non-empty tuple of ints >= 0, anything else raises ``ValueError``). A node's
  *leader* is its lowest rank. ``hierarchical`` is True when a reduction gains from
  going through the leaders: more than one node and a node with more than one rank.
* ``gather_topology(comm)``: collective; one all-gather of every rank's ``Comm.node``
  (filled by the launcher: SLURM_NODEID, or 0 for a local launch), so every rank holds
  the same topology.
* ``build_node_groups(topology, rank, timeout_s=None)``: collective; every rank of the
  default group calls ``torch.distributed.new_group`` for the same groups in the same
  order: one group per node of more than one rank (ascending node id), then the
  leaders' group. A topology that is not ``hierarchical`` needs no group, and none is
  made (no collective either).
* ``NodeGroups.all_reduce(tensor, op)``: collective over the whole default group, in
  place. Hierarchical: three hops, reduce to the node's leader over the node group,
  all-reduce among the leaders, broadcast from the leader inside the node; only the
  leaders' hop crosses nodes (one tensor per node instead of one per rank), and every
  rank ends with its leader's bits, which the leaders share. Otherwise one all-reduce
  over the default group (whose bits are the same on every rank too).
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from nemo_tlt.dist.comm import Comm


@dataclass(frozen=True)
class NodeTopology:
    """The node of each rank, by rank. See the module docstring."""

    rank_nodes: tuple[int, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.rank_nodes, tuple) or not self.rank_nodes:
            raise ValueError(f"NodeTopology.rank_nodes must be a non-empty tuple, got {self.rank_nodes!r}")
        bad = [n for n in self.rank_nodes if isinstance(n, bool) or not isinstance(n, int) or n < 0]
        if bad:
            raise ValueError(f"NodeTopology.rank_nodes must hold node ids (ints >= 0), got {bad[0]!r} "
                             f"in {self.rank_nodes!r}")

    @property
    def world(self) -> int:
        return len(self.rank_nodes)

    @property
    def nodes(self) -> tuple[int, ...]:
        """Node ids, ascending."""
        return tuple(sorted(set(self.rank_nodes)))

    def ranks_on(self, node: int) -> tuple[int, ...]:
        """Ranks of `node`, ascending."""
        ranks = tuple(r for r, n in enumerate(self.rank_nodes) if n == node)
        if not ranks:
            raise ValueError(f"NodeTopology: no rank runs on node {node!r} (nodes: {self.nodes})")
        return ranks

    def leader(self, node: int) -> int:
        return self.ranks_on(node)[0]

    @property
    def leaders(self) -> tuple[int, ...]:
        """The leader of every node, in node order."""
        return tuple(self.leader(n) for n in self.nodes)

    def node_of(self, rank: int) -> int:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world:
            raise ValueError(f"NodeTopology: rank must be in [0, {self.world}), got {rank!r}")
        return self.rank_nodes[rank]

    @property
    def multi_node(self) -> bool:
        return len(self.nodes) > 1

    @property
    def max_ranks_per_node(self) -> int:
        return max(len(self.ranks_on(n)) for n in self.nodes)

    @property
    def hierarchical(self) -> bool:
        return self.multi_node and self.max_ranks_per_node > 1


def gather_topology(comm: "Comm") -> NodeTopology:
    """Collective: every rank's node, in rank order (one all-gather)."""
    return NodeTopology(tuple(int(n) for n in comm.gather(comm.node)))


@dataclass(frozen=True)
class NodeGroups:
    """This rank's view of the groups of a hierarchical reduction."""

    topology: NodeTopology
    rank: int
    node_group: dist.ProcessGroup | None  # None when this rank is alone on its node
    leaders_group: dist.ProcessGroup | None  # None on a rank that is not its node's leader

    @property
    def leader(self) -> int:
        return self.topology.leader(self.topology.node_of(self.rank))

    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> torch.Tensor:
        """Collective over every rank, in place (see the module docstring); returns `tensor`."""
        if not self.topology.hierarchical:
            dist.all_reduce(tensor, op=op)
            return tensor
        if self.node_group is not None:
            dist.reduce(tensor, dst=self.leader, op=op, group=self.node_group)
        if self.leaders_group is not None:
            dist.all_reduce(tensor, op=op, group=self.leaders_group)
        if self.node_group is not None:
            dist.broadcast(tensor, src=self.leader, group=self.node_group)
        return tensor


def build_node_groups(topology: NodeTopology, rank: int, timeout_s: float | None = None) -> NodeGroups:
    """Collective: the node groups and the leaders' group (none when not ``hierarchical``)."""
    topology.node_of(rank)  # names a rank outside the topology
    if not topology.hierarchical:
        return NodeGroups(topology, rank, None, None)
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("build_node_groups: needs an initialised torch.distributed process group")
    if dist.get_world_size() != topology.world:
        raise ValueError(f"build_node_groups: the topology holds {topology.world} ranks, the process group "
                         f"{dist.get_world_size()}")
    timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
    mine = topology.node_of(rank)
    node_group = None
    for node in topology.nodes:  # same groups, same order, on every rank (new_group is collective)
        ranks = topology.ranks_on(node)
        if len(ranks) > 1:
            group = dist.new_group(list(ranks), timeout=timeout)
            if node == mine:
                node_group = group
    leaders = dist.new_group(list(topology.leaders), timeout=timeout)
    is_leader = rank == topology.leader(mine)
    return NodeGroups(topology, rank, node_group, leaders if is_leader else None)
