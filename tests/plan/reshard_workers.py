"""Gloo worker for tests/plan/test_plan_reshard.py: runs the real streaming reshard and
reports what its ByteMeter saw on each rank, and the bytes that crossed the process group
(tests/wire_bytes.py: counted at torch.distributed's calls, not by the reshard's meter)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from nemo_tlt.dist import RankContext


@dataclass
class CountingMeter:
    """A ByteMeter that also sums every byte it was told about."""
    current: int = 0
    peak: int = 0
    total: int = 0
    received: int = 0

    def receive(self, *tensors: torch.Tensor) -> None:
        self.received += sum(t.numel() * t.element_size() for t in tensors)

    def add(self, *tensors: torch.Tensor) -> None:
        n = sum(t.numel() * t.element_size() for t in tensors)
        self.current += n
        self.total += n
        self.peak = max(self.peak, self.current)

    def sub(self, *tensors: torch.Tensor) -> None:
        self.current -= sum(t.numel() * t.element_size() for t in tensors)


def stream_cases(ctx: RankContext, cases: list) -> list[tuple[int, int, int, int, int]]:
    """For each (cfg, layout, rollout_tp, receivers): this rank's (meter peak, meter total, meter bytes
    received, bytes received on the wire, bytes sent on the wire)."""
    import torch.distributed as dist

    from megatron_patches.cpu_shims import cpu_shims
    from nemo_tlt.megatron.parallel import init_model_parallel
    from nemo_tlt.megatron.live import rank_coords
    from nemo_tlt.weights.reshard import ReshardPlan, megatron_shard_shapes, stream_reshard
    from wire_bytes import WireBytes

    out = []
    with cpu_shims():
        for cfg, layout, rollout_tp, receivers in cases:
            from megatron.core import parallel_state

            parallel_state.destroy_model_parallel()
            init_model_parallel(layout.tp, layout.pp)
            shard = {k: torch.randn(s) for k, s in megatron_shard_shapes(cfg, layout)[rank_coords()].items()}
            meter = CountingMeter()
            with WireBytes() as wire:
                stream_reshard(shard, ReshardPlan(cfg, layout, rollout_tp, receivers, meter=meter))
            dist.barrier()
            out.append((meter.peak, meter.total, meter.received, wire.received, wire.sent))
    return out
