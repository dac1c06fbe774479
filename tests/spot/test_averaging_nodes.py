"""Hierarchical averaging of drafter replicas (4 gloo ranks playing 2 nodes x 2, and 3 + 1):
equal to the flat weighted average (weights, Adam moments; step count the maximum, which
sits on a non-leader), the same bits on every rank, a rank with 0 samples receives the
average. Every collective is intercepted and named by its group: only the leaders'
all-reduce spans nodes, so one buffer per node enters the inter-node exchange, half of
what the flat all-reduce sends. One rank per node keeps the flat all-reduce."""
from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.distributed as dist

from nemo_tlt.dist import NodeTopology, RankContext, build_node_groups
from ranks import launch_forked
from nemo_tlt.spot.averaging import average_replicas

from ._toys import H, toy_model

pytestmark = pytest.mark.timeout(150)


@pytest.fixture(autouse=True)
def _optimizer_imported():
    """Building an optimizer imports torch._dynamo lazily: once here, not in every forked rank."""
    torch.optim.AdamW(toy_model().parameters())
SAMPLES_PER_STEP = 4
COLLECTIVES = ("all_reduce", "reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter",
               "reduce_scatter_tensor", "gather", "scatter", "all_to_all", "all_to_all_single", "send", "recv",
               "isend", "irecv", "barrier", "all_gather_object", "broadcast_object_list", "new_group")


@contextlib.contextmanager
def recorded_collectives(log: list):
    """Every torch.distributed collective (and new_group) called inside, as (name, ranks of
    its group, elements)."""
    saved = {name: getattr(dist, name) for name in COLLECTIVES}

    def wrap(name, fn):
        def call(*args, **kwargs):
            group = kwargs.get("group")
            ranks = tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
            tensor = args[0] if args and isinstance(args[0], torch.Tensor) else None
            log.append((name, ranks, tensor.numel() if tensor is not None else 0))
            return fn(*args, **kwargs)
        return call

    for name, fn in saved.items():
        setattr(dist, name, wrap(name, fn))
    try:
        yield log
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def _train(model: torch.nn.Module, steps: int, seed: int) -> torch.optim.AdamW:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(SAMPLES_PER_STEP, H, generator=g)).pow(2).mean().backward()
        opt.step()
    return opt


def _state(model, opt) -> dict:
    params = list(model.parameters())
    moments = [opt.state[p][k] if "exp_avg" in opt.state.get(p, {}) else torch.zeros_like(p)
               for p in params for k in ("exp_avg", "exp_avg_sq")]
    steps = [float(opt.state[p]["step"]) for p in params if "step" in opt.state.get(p, {})]
    return {"params": torch.cat([p.detach().reshape(-1) for p in params]).clone(),
            "moments": torch.cat([m.reshape(-1) for m in moments]).clone(), "step": max(steps, default=0.0)}


def _average(ctx: RankContext, rank_nodes: tuple[int, ...], steps: list[int]) -> dict:
    model = toy_model(seed=ctx.rank)  # replicas that differ
    opt = _train(model, steps[ctx.rank], seed=100 + ctx.rank)
    flat_model = copy.deepcopy(model)
    flat_opt = torch.optim.AdamW(flat_model.parameters(), lr=1e-2)
    flat_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    samples = float(SAMPLES_PER_STEP * steps[ctx.rank])
    before = _state(model, opt)
    with recorded_collectives([]) as made:
        nodes = build_node_groups(NodeTopology(rank_nodes), ctx.rank, timeout_s=60)
    with recorded_collectives([]) as hier_log:
        stats = average_replicas(model, opt, samples, nodes=nodes)
    with recorded_collectives([]) as flat_log:
        flat_stats = average_replicas(flat_model, flat_opt, samples)
    return {"samples": samples, "before": before, "after": _state(model, opt), "flat": _state(flat_model, flat_opt),
            "stats": stats, "flat_stats": flat_stats, "hier_log": hier_log, "flat_log": flat_log,
            "groups_made": len(made)}


def _cross_node(log: list, topology: NodeTopology) -> list:
    return [entry for entry in log if len({topology.node_of(r) for r in entry[1]}) > 1]


@pytest.mark.parametrize("rank_nodes, steps", [
    ((0, 0, 1, 1), [2, 0, 1, 3]),  # rank 1 (a non-leader) trained nothing; the step maximum is on rank 3
    ((0, 0, 0, 1), [1, 3, 0, 2]),  # node 1 is one rank (no node group); the maximum is on rank 1
])
def test_hierarchical_average_equals_the_flat_one_and_only_leaders_cross_nodes(rank_nodes, steps):
    topology = NodeTopology(rank_nodes)
    out = launch_forked(_average, 4, rank_nodes, steps, timeout_s=90, collective_timeout_s=60)
    w = torch.tensor([o["samples"] for o in out])
    for key in ("params", "moments"):
        expected = sum(wr * o["before"][key] for wr, o in zip(w, out)) / w.sum()
        for o in out:  # the same bits everywhere, the untrained rank included
            assert torch.equal(o["after"][key], out[0]["after"][key]), key
        torch.testing.assert_close(out[0]["after"][key], expected, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(out[0]["after"][key], out[0]["flat"][key], rtol=1e-6, atol=1e-7)
    zero = steps.index(0)
    assert not torch.equal(out[zero]["after"]["params"], out[zero]["before"]["params"])
    assert [o["after"]["step"] for o in out] == [float(max(steps))] * 4
    for o in out:
        s = o["stats"]
        assert (s.total_samples, s.contributing_ranks, s.world_size) == (float(w.sum()), 3, 4)
        assert s.nodes == 2 and s.hierarchical and o["flat_stats"].nodes is None
    # what crosses nodes: only the leaders' all-reduce (buffer and step count), on the leaders alone
    buffer = out[0]["after"]["params"].numel() + out[0]["after"]["moments"].numel() + 2
    for rank, o in enumerate(out):
        crossing = _cross_node(o["hier_log"], topology)
        if rank in topology.leaders:
            assert crossing == [("all_reduce", topology.leaders, buffer), ("all_reduce", topology.leaders, 1)]
        else:
            assert crossing == [] and o["hier_log"], o["hier_log"]
    hier = sum(n for o in out for _, _, n in _cross_node(o["hier_log"], topology))
    flat = sum(n for o in out for _, _, n in _cross_node(o["flat_log"], topology))
    assert hier == 2 * (buffer + 1) and flat == 4 * (buffer + 1)
    assert out[0]["groups_made"] == len([n for n in topology.nodes if len(topology.ranks_on(n)) > 1]) + 1


def _flat_only(ctx: RankContext) -> tuple:
    model = toy_model(seed=ctx.rank)
    opt = _train(model, 1, seed=ctx.rank)
    with recorded_collectives([]) as made:
        nodes = build_node_groups(NodeTopology((0, 1, 2, 3)), ctx.rank)
    with recorded_collectives([]) as log:
        stats = average_replicas(model, opt, 1.0, nodes=nodes)
    return made, [(name, ranks) for name, ranks, _ in log], stats


@pytest.mark.timeout(120)
def test_one_rank_per_node_keeps_the_single_all_reduce():
    for made, log, stats in launch_forked(_flat_only, 4, timeout_s=100, collective_timeout_s=60):
        assert made == [] and log == [("all_reduce", (0, 1, 2, 3))] * 2
        assert stats.nodes == 4 and not stats.hierarchical
