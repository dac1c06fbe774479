"""The streaming reshard's cost at full size, counted from its own schedule (nothing allocated).

Contract: ``plan_stream_reshard(cfg, layout, dp, rollout_tp)`` walks
``nemo_tlt.weights.reshard.reshard_schedule`` (the very list of pieces the streaming
reshard sends; pure, index vectors only) and counts per rank what that code's
``ByteMeter`` counts: in each round (one canonical tensor, one rollout rank) a receiver
holds every piece of its slice, a sender that does not receive holds the piece it cut;
``received`` sums the pieces that came from another rank. The rollout weights being built
are the output, not extra memory. ``model_bytes`` is the canonical model at
``dtype_bytes``; the target is every rank receiving <= 1.1 x model_bytes / rollout_tp.

Ranks follow megatron-core's default order (tp fastest, then dp, then pp); the
sending copy of each (pp, tp) shard is data-parallel replica 0, as in ``stream_reshard``.
Every rank receives by default (a colocated rollout engine on every GPU).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from nemo_tlt.model.config import LMConfig
from nemo_tlt.plan.cluster import ClusterSpec
from nemo_tlt.plan.memory import layer_parameter_count
from nemo_tlt.weights.layout import ParallelLayout
from nemo_tlt.weights.reshard import reshard_schedule
from nemo_tlt.weights.rollout import check_rollout_tp


def megatron_rank(p: int, t: int, d: int, layout: ParallelLayout, dp: int) -> int:
    """Global rank of (pipeline stage, TP rank, DP replica) in megatron-core's default order."""
    return t + layout.tp * (d + dp * p)


@dataclass
class RankCost:
    peak: int = 0       # largest transient byte count (ByteMeter.peak)
    received: int = 0   # bytes of parts received from other ranks
    counted: int = 0    # every byte ByteMeter.add saw (receive buffers + conversion copies)

    def hold(self, nbytes: int) -> None:
        self.peak = max(self.peak, nbytes)


@dataclass(frozen=True)
class ReshardEstimate:
    peak_extra_bytes_per_rank: int
    largest_layer_bytes: int
    bytes_moved_per_rank: int
    seconds: float
    per_rank: tuple[RankCost, ...]
    model_bytes: int = 0
    rollout_tp: int = 1

    @property
    def bytes_received_per_rank(self) -> list[int]:
        return [c.received for c in self.per_rank]

    @property
    def within_slice_target(self) -> bool:
        """Every rank receives at most 1.1 x its rollout slice of the model."""
        return self.bytes_moved_per_rank <= 1.1 * self.model_bytes / self.rollout_tp

    @property
    def within_two_layers(self) -> bool:
        return self.peak_extra_bytes_per_rank <= 2 * self.largest_layer_bytes

    def to_dict(self) -> dict:
        return {"peak_extra_bytes_per_rank": self.peak_extra_bytes_per_rank,
                "largest_layer_bytes": self.largest_layer_bytes,
                "bytes_moved_per_rank": self.bytes_moved_per_rank,
                "bytes_received_per_rank": self.bytes_received_per_rank,
                "model_bytes": self.model_bytes,
                "rollout_tp": self.rollout_tp,
                "received_over_slice": round(self.bytes_moved_per_rank * self.rollout_tp / self.model_bytes, 4),
                "peak_in_layers": round(self.peak_extra_bytes_per_rank / self.largest_layer_bytes, 3),
                "within_two_layers": self.within_two_layers,
                "seconds": round(self.seconds, 3)}


def _nbytes(shape: torch.Size, elem: int) -> int:
    return int(torch.Size(shape).numel()) * elem


def plan_stream_reshard(cfg: LMConfig, layout: ParallelLayout, dp: int, rollout_tp: int,
                        receivers: tuple[int, ...] = (), dtype_bytes: int = 2,
                        cluster: ClusterSpec | None = None) -> ReshardEstimate:
    check_rollout_tp(cfg, rollout_tp)
    world = layout.tp * layout.pp * dp
    recv = list(receivers or range(world))
    by_rank = [[g for i, g in enumerate(recv) if i % rollout_tp == r] for r in range(rollout_tp)]
    owner = {(p, t): megatron_rank(p, t, 0, layout, dp) for p in range(layout.pp) for t in range(layout.tp)}
    cost = [RankCost() for _ in range(world)]
    for item in reshard_schedule(cfg, layout, rollout_tp):
        for r, spec in enumerate(item.slices):
            held = [0] * world
            for piece in spec.pieces:
                nbytes = _nbytes(piece.shape, dtype_bytes)
                src = owner[(item.stage, piece.part)]
                if src not in by_rank[r] and by_rank[r]:
                    held[src] += nbytes  # the sender's cut piece
                for g in by_rank[r]:
                    held[g] += nbytes  # a receiver holds every piece of its slice (its own part's too)
                    if g != src:
                        cost[g].received += nbytes
            for g, nbytes in enumerate(held):
                cost[g].counted += nbytes
                cost[g].hold(nbytes)

    total = sum(_nbytes(s, dtype_bytes) for s in _canonical_shapes(cfg))
    moved = max(c.received for c in cost)
    seconds = 0.0
    if cluster is not None:
        # Each receiver gets only its slice, point to point; the slowest receiver's bytes over
        # the per-GPU link bandwidth (the network's as soon as the world spans nodes).
        seconds = moved / cluster.link_bytes_per_s(world)
    return ReshardEstimate(peak_extra_bytes_per_rank=max(c.peak for c in cost),
                           largest_layer_bytes=layer_parameter_count(cfg) * dtype_bytes,
                           bytes_moved_per_rank=moved, seconds=seconds, per_rank=tuple(cost),
                           model_bytes=total, rollout_tp=rollout_tp)


def _canonical_shapes(cfg: LMConfig) -> list[tuple[int, ...]]:
    from nemo_tlt.model.lm import canonical_shapes

    return list(canonical_shapes(cfg).values())
