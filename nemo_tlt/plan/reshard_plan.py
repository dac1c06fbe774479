"""The streaming reshard's cost at full size, computed on meta tensors (nothing allocated).

Contract: ``plan_stream_reshard(cfg, layout, dp, rollout_tp)`` walks the same global
tensor order as ``nemo_tlt.weights.reshard.stream_reshard`` (stage, local layer, tensor,
TP part; then the final norm and the vocab tensors part by part), with the same shard
shapes (``megatron_shard_shapes``) and the same conversion (``megatron_tensor_to_canonical``
run on meta tensors), and counts per rank what that code's ``ByteMeter`` counts:
receive buffers of parts the rank does not own, plus the canonical tensors a conversion
creates. The rollout weights being built are the output, not extra memory.

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
from nemo_tlt.weights.megatron_layout import megatron_tensor_to_canonical
from nemo_tlt.weights.reshard import megatron_shard_shapes
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

    @property
    def within_two_layers(self) -> bool:
        return self.peak_extra_bytes_per_rank <= 2 * self.largest_layer_bytes

    def to_dict(self) -> dict:
        return {"peak_extra_bytes_per_rank": self.peak_extra_bytes_per_rank,
                "largest_layer_bytes": self.largest_layer_bytes,
                "bytes_moved_per_rank": self.bytes_moved_per_rank,
                "peak_in_layers": round(self.peak_extra_bytes_per_rank / self.largest_layer_bytes, 3),
                "within_two_layers": self.within_two_layers,
                "seconds": round(self.seconds, 3)}


def _meta(shape: torch.Size) -> torch.Tensor:
    return torch.empty(shape, device="meta")


def _nbytes(shape: torch.Size, elem: int) -> int:
    return int(torch.Size(shape).numel()) * elem


def plan_stream_reshard(cfg: LMConfig, layout: ParallelLayout, dp: int, rollout_tp: int,
                        receivers: tuple[int, ...] = (), dtype_bytes: int = 2,
                        cluster: ClusterSpec | None = None) -> ReshardEstimate:
    check_rollout_tp(cfg, rollout_tp)
    world = layout.tp * layout.pp * dp
    recv = set(receivers or range(world))
    owner = {(p, t): megatron_rank(p, t, 0, layout, dp) for p in range(layout.pp) for t in range(layout.tp)}
    shapes = megatron_shard_shapes(cfg, layout)
    counts = layout.stage_layer_counts(cfg.num_layers)
    cost = [RankCost() for _ in range(world)]

    def members(p: int) -> set[int]:
        return {owner[(p, t)] for t in range(layout.tp)} | recv

    def whole_tensor(p: int, name: str, converted: int, times: int) -> None:
        """All TP parts arrive, then the conversion's copies exist beside them."""
        parts = [_nbytes(shapes[(p, t)][name], dtype_bytes) for t in range(layout.tp)]
        for r in members(p):
            foreign = [b for t, b in enumerate(parts) if owner[(p, t)] != r]
            cost[r].received += sum(foreign) * times
            if r in recv:
                cost[r].hold(sum(foreign) + converted)
                cost[r].counted += (sum(foreign) + converted) * times
            else:  # a sender relays the others' parts: each buffer is freed at once
                cost[r].hold(max(foreign, default=0))
                cost[r].counted += sum(foreign) * times

    def part_by_part(p: int, name: str) -> None:
        for t in range(layout.tp):
            nbytes = _nbytes(shapes[(p, t)][name], dtype_bytes)
            for r in members(p):
                if owner[(p, t)] != r:
                    cost[r].received += nbytes
                    cost[r].counted += nbytes
                    cost[r].hold(nbytes)

    for p in range(layout.pp):
        if counts[p] == 0:
            continue
        prefix = "decoder.layers.0."
        for key in sorted(k for k in shapes[(p, 0)] if k.startswith(prefix)):
            mname = key[len(prefix):]
            parts = [_meta(shapes[(p, t)][key]) for t in range(layout.tp)]
            out = megatron_tensor_to_canonical(mname, parts, cfg)
            converted = sum(_nbytes(v.shape, dtype_bytes) for v in out.values() if v is not parts[0])
            whole_tensor(p, key, converted, counts[p])
    last = layout.pp - 1
    whole_tensor(last, "decoder.final_layernorm.weight", 0, 1)
    part_by_part(0, "embedding.word_embeddings.weight")
    if not cfg.tie_word_embeddings:
        part_by_part(last, "output_layer.weight")

    moved = max(c.received for c in cost)
    seconds = 0.0
    if cluster is not None:
        # Every part is broadcast to every receiver: a pipelined broadcast delivers at about
        # the per-GPU link bandwidth, the network's as soon as the group spans nodes.
        seconds = moved / cluster.link_bytes_per_s(world)
    return ReshardEstimate(peak_extra_bytes_per_rank=max(c.peak for c in cost),
                           largest_layer_bytes=layer_parameter_count(cfg) * dtype_bytes,
                           bytes_moved_per_rank=moved, seconds=seconds, per_rank=tuple(cost))
