"""Reshard live Megatron TP x PP shards to rollout-engine shards at TP ``t``, streamed, slice by slice.

Contract: ``stream_reshard(shard, plan)`` (or the generator ``iter_reshard``) is called
on every rank of the world with that rank's Megatron shard (``local_shard(model)``).
Receiver ``i`` of ``plan.receivers`` gets rollout TP rank ``i % plan.rollout_tp`` and
returns its shard in canonical names (see ``nemo_tlt.weights.rollout``); other ranks
return None (``iter_reshard`` yields nothing there).

How: every Megatron -> canonical conversion is a permutation along one dimension
(``megatron_tensor_sources``) and every rollout split cuts along that same dimension, so
the rows (or columns) a rollout rank keeps of a canonical tensor are known positions in
known TP parts. ``reshard_schedule`` (``nemo_tlt.weights.reshard_schedule``: pure, no
process group) lists, canonical tensor by
canonical tensor in a fixed global order, the pieces each rollout rank needs from each
part; the owner of a part (data-parallel replica 0) cuts each piece (``index_select``)
and sends it point to point to the receivers of that rollout rank only, which place the
pieces in their slice (``index_copy_``). Copies only: the result is bit-exact with the
gather-then-convert reference. Each receiver therefore receives about model bytes /
rollout TP (plus the replicated norms), and its extra memory is the pieces of one slice
of one tensor; a sender holds one piece at a time.

``gather_reshard`` is the reference: receivers first collect every shard of the model
(broadcasts), then convert it whole. Both count their transient bytes in a ``ByteMeter``
(and the bytes each rank received) so the benchmark can report them per rank.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from nemo_tlt.model.config import LMConfig
from nemo_tlt.weights.layout import ParallelLayout
from nemo_tlt.weights.megatron_layout import (
    StateDict, check_megatron_biases, check_tp, megatron_layer_to_canonical, megatron_to_canonical_ends,
)
# the schedule's names stay importable from here (this module's API, ``__all__``)
from nemo_tlt.weights.reshard_schedule import Piece, SliceSpec, Transfer, megatron_shard_shapes, reshard_schedule
from nemo_tlt.weights.rollout import check_rollout_tp, rollout_slice


@dataclass
class ByteMeter:
    """Counts bytes of transient tensors; ``peak`` is the high-water mark."""
    current: int = 0
    peak: int = 0
    received: int = 0  # bytes that arrived from other ranks

    def receive(self, *tensors: torch.Tensor) -> None:
        self.received += sum(t.numel() * t.element_size() for t in tensors)

    def add(self, *tensors: torch.Tensor) -> None:
        self.current += sum(t.numel() * t.element_size() for t in tensors)
        self.peak = max(self.peak, self.current)

    def sub(self, *tensors: torch.Tensor) -> None:
        self.current -= sum(t.numel() * t.element_size() for t in tensors)


@dataclass(frozen=True)
class ReshardPlan:
    cfg: LMConfig
    layout: ParallelLayout
    rollout_tp: int
    receivers: tuple[int, ...] = ()  # global ranks; empty means every rank
    dtype: torch.dtype = torch.float32
    device: str = "cpu"  # where buffers live: "cpu" under gloo, "cuda" under NCCL
    meter: ByteMeter = field(default_factory=ByteMeter, compare=False)

    def __post_init__(self) -> None:
        check_megatron_biases(self.cfg)
        check_tp(self.cfg, self.layout.tp)
        check_rollout_tp(self.cfg, self.rollout_tp)
        if len(set(self.receivers)) != len(self.receivers):
            raise ValueError(f"ReshardPlan.receivers has duplicates: {self.receivers}")


def _rank_table() -> dict[tuple[int, int], int]:
    """(pp, tp) -> the global rank that sends it (the data-parallel replica 0)."""
    from megatron.core import parallel_state

    mine = (parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_data_parallel_rank(), dist.get_rank())
    table: list = [None] * dist.get_world_size()
    dist.all_gather_object(table, mine)
    return {(p, t): g for p, t, d, g in table if d == 0}


# Process groups of the movers, made once per world and reused by every later call
# (the RL loop reshards after every step; gloo groups hold sockets and threads).
# new_group is collective: every rank asks for the same member lists in the same
# order, so every rank hits or misses alike. The default group is kept with them: a
# re-initialised world gets new groups.
_GROUPS: dict[tuple[int, ...], object] = {}
_GROUPS_WORLD: list = [None]
_GROUPS_MADE = [0]


def _group(members: list[int]):
    world = dist.group.WORLD
    if _GROUPS_WORLD[0] is not world:
        _GROUPS.clear()
        _GROUPS_WORLD[0] = world
    key = tuple(members)
    if key not in _GROUPS:
        _GROUPS[key] = dist.new_group(members)
        _GROUPS_MADE[0] += 1
    return _GROUPS[key]


_NCCL_WARM: list = [None]


def _warm_nccl(device: str) -> None:
    """One all-reduce of the whole world on its CUDA backend before the first batched
    point-to-point call (every rank calls; a no-op on the CPU and after the first time per
    world): NCCL requires the first collective of a group to involve all its ranks, and
    ``batch_isend_irecv`` involves only the ranks of one tensor's pieces. Not run on a GPU
    here."""
    world = dist.group.WORLD
    if device != "cuda" or _NCCL_WARM[0] is world:
        return
    dist.all_reduce(torch.zeros(1, device=torch.device("cuda", torch.cuda.current_device())))
    _NCCL_WARM[0] = world


def groups_created() -> int:
    """How many mover process groups this process has created (for tests and logs)."""
    return _GROUPS_MADE[0]


class _Mover:
    """Broadcasts one (pp, tp) tensor from its owner to the receivers, counting bytes."""

    def __init__(self, shard: StateDict, plan: ReshardPlan) -> None:
        self.shard, self.plan = shard, plan
        self.owner = _rank_table()
        self.me = dist.get_rank()
        world = dist.get_world_size()
        self.receivers = plan.receivers or tuple(range(world))
        self.shapes = megatron_shard_shapes(plan.cfg, plan.layout)
        # One group per pipeline stage: its senders plus all receivers (see _group).
        self.groups = {}
        for p in range(plan.layout.pp):
            members = sorted({self.owner[(p, t)] for t in range(plan.layout.tp)} | set(self.receivers))
            self.groups[p] = (members, _group(members))

    @property
    def receiving(self) -> bool:
        return self.me in self.receivers

    def fetch(self, p: int, name: str) -> list[torch.Tensor] | None:
        """All TP parts of ``name`` at stage ``p`` on receivers (counted in the meter), None elsewhere."""
        parts = [self.fetch_part(p, name, t) for t in range(self.plan.layout.tp)]
        return parts if self.receiving else None

    def fetch_part(self, p: int, name: str, t: int) -> torch.Tensor | None:
        """TP part ``t`` of ``name``; on ranks that only relay it, the buffer is freed at once."""
        members, group = self.groups[p]
        if self.me not in members:
            return None
        src = self.owner[(p, t)]
        if self.me == src:
            buf = self.shard[name].to(self.plan.device, self.plan.dtype).contiguous()
        else:
            buf = torch.empty(self.shapes[(p, t)][name], dtype=self.plan.dtype, device=self.plan.device)
            self.plan.meter.add(buf)
            self.plan.meter.receive(buf)
        dist.broadcast(buf, src=src, group=group)
        if not self.receiving:
            self.release_part(p, t, buf)
            return None
        return buf

    def release_part(self, p: int, t: int, buf: torch.Tensor) -> None:
        if self.owner[(p, t)] != self.me:
            self.plan.meter.sub(buf)

    def _release(self, p: int, parts: list[torch.Tensor]) -> None:
        for t, buf in enumerate(parts):
            self.release_part(p, t, buf)

    def rollout_rank(self) -> int:
        return self.receivers.index(self.me) % self.plan.rollout_tp


# ---- executing it: point-to-point, slice by slice ---------------------------------------

class _Exchange:
    """Who sends what to whom: the owners of each (pp, tp) part (data-parallel replica 0) and the
    receivers of each rollout rank."""

    def __init__(self, shard: StateDict, plan: ReshardPlan) -> None:
        self.shard, self.plan = shard, plan
        self.owner = _rank_table()
        self.me = dist.get_rank()
        _warm_nccl(plan.device)
        receivers = plan.receivers or tuple(range(dist.get_world_size()))
        self.by_rank = [[g for i, g in enumerate(receivers) if i % plan.rollout_tp == r]
                        for r in range(plan.rollout_tp)]
        self.rank = next((r for r, group in enumerate(self.by_rank) if self.me in group), None)

    def _piece(self, item: Transfer, piece: Piece) -> torch.Tensor:
        part = self.shard[item.key]
        src = piece.src.to(part.device)
        return part.index_select(item.dim, src).to(self.plan.device, self.plan.dtype)

    def round(self, item: Transfer, r: int) -> torch.Tensor | None:
        """Rollout rank ``r``'s slice of ``item``: assembled on its receivers, None elsewhere."""
        spec, meter = item.slices[r], self.plan.meter
        receiving = self.me in self.by_rank[r]
        ops, held = [], []
        got: dict[int, torch.Tensor] = {}
        targets = [g for g in self.by_rank[r] if g != self.me]
        for piece in spec.pieces:
            src = self.owner[(item.stage, piece.part)]
            if src == self.me:
                if not (targets or receiving):
                    continue
                buf = self._piece(item, piece)
                ops += [dist.P2POp(dist.isend, buf, g) for g in targets]
            elif receiving:
                buf = torch.empty(piece.shape, dtype=self.plan.dtype, device=self.plan.device)
                ops.append(dist.P2POp(dist.irecv, buf, src))
                meter.receive(buf)
            else:
                continue
            meter.add(buf)
            held.append(buf)
            got[piece.part] = buf
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        out = None
        if receiving:
            out = torch.empty(spec.shape, dtype=self.plan.dtype, device=self.plan.device)
            for piece in spec.pieces:
                out.index_copy_(item.dim, piece.dst.to(out.device), got[piece.part])
        meter.sub(*held)
        return out


def iter_reshard(shard: StateDict, plan: ReshardPlan) -> Iterator[tuple[str, torch.Tensor]]:
    """The streaming reshard as a generator: (canonical name, this rank's rollout slice) on receivers,
    nothing elsewhere. Collective: every rank of the world must run it to the end."""
    ex = _Exchange(shard, plan)
    for item in reshard_schedule(plan.cfg, plan.layout, plan.rollout_tp):
        mine = None
        for r in range(plan.rollout_tp):
            got = ex.round(item, r)
            if got is not None:
                mine = got
        if mine is not None:
            yield item.name, mine


def stream_reshard(shard: StateDict, plan: ReshardPlan) -> StateDict | None:
    """``iter_reshard`` collected: this rank's rollout shard on receivers, None elsewhere."""
    out = dict(iter_reshard(shard, plan))
    receivers = plan.receivers or tuple(range(dist.get_world_size()))
    return out if dist.get_rank() in receivers else None


def gather_reshard(shard: StateDict, plan: ReshardPlan) -> StateDict | None:
    """Reference: receivers first hold every shard of the model at once, then convert.

    Conversion then consumes the gathered shards layer by layer (freeing each as it
    goes), so the peak is the whole gathered model, as for any gather-then-convert
    sync, without a second full copy on top.
    """
    mover = _Mover(shard, plan)
    layout, cfg = plan.layout, plan.cfg
    gathered: dict[tuple[int, int], StateDict] = {(p, t): {} for p in range(layout.pp) for t in range(layout.tp)}
    for p in range(layout.pp):
        for name in sorted(mover.shapes[(p, 0)]):
            parts = mover.fetch(p, name)
            for t, part in enumerate(parts or []):
                gathered[(p, t)][name] = part
    if not mover.receiving:
        return None
    rank = mover.rollout_rank()
    out: StateDict = {}
    counts, offsets = layout.stage_layer_counts(cfg.num_layers), layout.stage_layer_offsets(cfg.num_layers)
    for p in range(layout.pp):
        for local in range(counts[p]):
            prefix = f"decoder.layers.{local}."
            tp_layers = [{k[len(prefix):]: gathered[(p, t)].pop(k) for k in list(gathered[(p, t)])
                          if k.startswith(prefix)} for t in range(layout.tp)]
            for cname, full in megatron_layer_to_canonical(tp_layers, cfg).items():
                out[f"model.layers.{offsets[p] + local}.{cname}"] = rollout_slice(
                    cname, full, plan.rollout_tp, rank).clone()
            for name in tp_layers[0]:
                mover._release(p, [tl[name] for tl in tp_layers])
    rest = {(p, t): sd for (p, t), sd in gathered.items()}
    ends = megatron_to_canonical_ends(rest, cfg, layout)
    for cname, full in ends.items():
        out[cname] = rollout_slice(cname, full, plan.rollout_tp, rank).clone()
    for p in range(layout.pp):
        for name in list(gathered[(p, 0)]):
            mover._release(p, [gathered[(p, t)].pop(name) for t in range(layout.tp)])
    return out


__all__ = ["ByteMeter", "Piece", "ReshardPlan", "SliceSpec", "Transfer", "gather_reshard", "iter_reshard",
           "megatron_shard_shapes", "reshard_schedule", "stream_reshard"]
