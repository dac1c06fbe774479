"""Elastic data-parallel averaging of drafter replicas, weighted by samples seen.

Contract
--------
``average_replicas(model, optimizer, samples_seen, group=None, nodes=None)`` is a
collective: every rank of ``group`` (or, with ``nodes``, of the default group) calls it
(at the end-of-rollout meet). Afterwards every rank holds

    theta = sum_r w_r * theta_r / sum_r w_r,        w_r = samples rank r trained on

for every parameter and, for Adam-family optimizers, for the moment buffers
(``exp_avg``, ``exp_avg_sq``), with the optimizer step count set to the maximum over
ranks. A rank that did not train contributes weight 0 and receives the average, so
all replicas start the next rollout with the same drafter. When no rank trained
(total weight 0) nothing changes.

Everything travels in one flat float32 buffer through one sum (plus a one-element
``MAX`` for the step count): the sum's bits are the same on every rank, and each rank
divides by the same total, so the results are bit-identical across ranks. Parameters
of other dtypes (bf16) are averaged in float32 and cast back.

What crosses nodes: without ``nodes`` (or when its topology is one node, or one rank
per node) the buffer is all-reduced over all ranks, so every rank's buffer takes part
in the inter-node exchange. With ``nodes`` (``nemo_tlt.dist.NodeGroups``) of a
topology of several nodes with several ranks on some, both reductions go in three
hops: reduce to each node's leader inside the node, all-reduce among the leaders,
broadcast from the leader inside the node. Only the leaders' all-reduce crosses nodes,
one buffer per node instead of one per rank; the broadcast gives every rank its
leader's bits, which the leaders share. The hierarchical sum adds in another order
than the flat one, so the two agree up to float32 rounding, not bit for bit.
Optimizers other than Adam/AdamW keep their state per rank (only weights are
averaged); AMSGrad's ``max_exp_avg_sq`` is not averaged.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from nemo_tlt.dist import NodeGroups

_MOMENTS = ("exp_avg", "exp_avg_sq")


@dataclass(frozen=True)
class AverageStats:
    total_samples: float  # sum of weights over ranks
    contributing_ranks: int  # ranks with weight > 0
    world_size: int
    nodes: int | None = None  # nodes the ranks run on (None: no topology given)
    hierarchical: bool = False  # reduced through the node leaders


def average_replicas(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    samples_seen: float,
    group: dist.ProcessGroup | None = None,
    nodes: NodeGroups | None = None,
) -> AverageStats:
    """Collective, weighted average of `model` (and Adam moments) over `group`, or over
    every rank through `nodes`. See module docstring."""
    if samples_seen < 0:
        raise ValueError(f"average_replicas: samples_seen must be >= 0, got {samples_seen}")
    if nodes is not None and group is not None:
        raise ValueError("average_replicas: give a group or node groups (which span every rank), not both")
    num_nodes = len(nodes.topology.nodes) if nodes is not None else None
    hierarchical = nodes is not None and nodes.topology.hierarchical
    if not dist.is_available() or not dist.is_initialized():
        return AverageStats(float(samples_seen), int(samples_seen > 0), 1, num_nodes, hierarchical)
    world_size = dist.get_world_size(group)
    if nodes is not None and nodes.topology.world != world_size:
        raise ValueError(f"average_replicas: the node topology holds {nodes.topology.world} ranks, the process "
                         f"group {world_size}")
    params = [p for p in model.parameters()]
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        optimizer = None  # only Adam-family moments are averaged; other state stays per rank
    moments, created = _moment_buffers(optimizer, params)
    weight = float(samples_seen)
    # Layout: [w * params..., w * moments..., w, (w > 0)]
    pieces = [p.detach().float().reshape(-1) * weight for p in params]
    pieces += [m.float().reshape(-1) * weight for m in moments]
    # on the parameters' device: NCCL reduces only device tensors, and the buffer is one
    device = params[0].device if params else torch.device("cpu")
    pieces.append(torch.tensor([weight, float(weight > 0)], dtype=torch.float32, device=device))
    flat = _all_reduce(torch.cat(pieces), dist.ReduceOp.SUM, group, nodes)
    total, contributors = float(flat[-2]), int(round(float(flat[-1])))
    step = _max_step(optimizer, params, group, nodes)
    if total > 0:
        averaged = flat[:-2] / total
        offset = 0
        with torch.no_grad():
            for tensor in [p.data for p in params] + moments:
                n = tensor.numel()
                tensor.copy_(averaged[offset : offset + n].view_as(tensor))
                offset += n
        _set_step(optimizer, params, step)
    else:
        for p in created:  # nobody trained: leave the optimizer exactly as it was
            del optimizer.state[p]
    return AverageStats(total_samples=total, contributing_ranks=contributors, world_size=world_size,
                        nodes=num_nodes, hierarchical=hierarchical)


def _all_reduce(tensor: torch.Tensor, op: dist.ReduceOp.RedOpType, group: dist.ProcessGroup | None,
                nodes: NodeGroups | None) -> torch.Tensor:
    if nodes is not None:
        return nodes.all_reduce(tensor, op)
    dist.all_reduce(tensor, op=op, group=group)
    return tensor


def _moment_buffers(
    optimizer: torch.optim.Optimizer | None, params: list[nn.Parameter]
) -> tuple[list[torch.Tensor], list[nn.Parameter]]:
    """Adam moment tensors in parameter order, created as zeros where a rank has no state
    yet (it never trained), so every rank contributes the same buffer layout. Also
    returns the parameters whose state was created here."""
    if optimizer is None:
        return [], []
    owned = {id(p) for group in optimizer.param_groups for p in group["params"]}
    buffers, created = [], []
    for p in params:
        if id(p) not in owned:
            continue
        if p not in optimizer.state or "exp_avg" not in optimizer.state[p]:
            optimizer.state[p] = {name: torch.zeros_like(p, memory_format=torch.preserve_format) for name in _MOMENTS}
            created.append(p)
        buffers.extend(optimizer.state[p][name] for name in _MOMENTS)
    return buffers, created


def _max_step(optimizer: torch.optim.Optimizer | None, params: list[nn.Parameter], group,
              nodes: NodeGroups | None) -> float:
    if optimizer is None:
        return 0.0
    steps = [float(optimizer.state[p]["step"]) for p in params if "step" in optimizer.state.get(p, {})]
    device = params[0].device if params else torch.device("cpu")
    local = torch.tensor([max(steps, default=0.0)], dtype=torch.float64, device=device)
    return float(_all_reduce(local, dist.ReduceOp.MAX, group, nodes)[0])


def _set_step(optimizer: torch.optim.Optimizer | None, params: list[nn.Parameter], step: float) -> None:
    if optimizer is None:
        return
    for p in params:
        state = optimizer.state.get(p)
        if state is None or "exp_avg" not in state:
            continue
        # Adam keeps `step` as a float32 tensor (a scalar tensor unless capturable).
        if "step" in state and isinstance(state["step"], torch.Tensor):
            state["step"] = torch.full_like(state["step"], step)
        else:
            state["step"] = torch.tensor(step, dtype=torch.float32, device="cpu")  # Adam's host-side step
