"""`ClusterSpec`: the GPUs a plan is made for (count, memory, peak FLOP/s, bandwidths).

Contract: a spec is built from a preset (``PRESETS``) and overrides; every field is
validated at construction. Peak numbers are datasheet values; ``flops_efficiency``
and ``hbm_efficiency`` are the achieved fractions a roofline model multiplies them by.
They are assumptions of the plan (stated in its output), not measurements.
"""
from __future__ import annotations

from dataclasses import dataclass

from nemo_tlt.checks import check_float, check_int

GIB = 1024 ** 3


@dataclass(frozen=True)
class GPUPreset:
    memory_gib: float
    peak_tflops: float      # dense bf16 tensor-core peak, TFLOP/s
    hbm_tbps: float         # HBM bandwidth, TB/s
    intra_node_gbps: float  # per-GPU NVLink bandwidth, one direction, GB/s
    inter_node_gbps: float  # per-GPU network bandwidth, one direction, GB/s
    pcie_gbps: float        # host <-> GPU bandwidth, one direction, GB/s


# H100 SXM5 80GB datasheet: 989 TFLOP/s dense BF16, 3.35 TB/s HBM3, NVLink 4 900 GB/s
# bidirectional (450 GB/s each way); the usable memory is what the driver reports
# (81559 MiB = 79.6 GiB); one 400 Gb/s NDR InfiniBand adapter per GPU = 50 GB/s; PCIe Gen5
# x16 = 64 GB/s each way.
PRESETS = {
    "h100-80gb-sxm": GPUPreset(memory_gib=79.6, peak_tflops=989.0, hbm_tbps=3.35, intra_node_gbps=450.0,
                               inter_node_gbps=50.0, pcie_gbps=64.0),
}


@dataclass(frozen=True)
class ClusterSpec:
    """``nodes`` x ``gpus_per_node`` GPUs of one kind. Zero-valued GPU fields take the preset's value."""

    preset: str = "h100-80gb-sxm"
    nodes: int = 1
    gpus_per_node: int = 8
    memory_gib: float = 0.0
    peak_tflops: float = 0.0
    hbm_tbps: float = 0.0
    intra_node_gbps: float = 0.0
    inter_node_gbps: float = 0.0
    pcie_gbps: float = 0.0
    # Achieved fractions of the peaks (assumptions, see the module docstring).
    flops_efficiency: float = 0.5
    hbm_efficiency: float = 0.7
    forward_overhead_ms: float = 1.0  # fixed cost of one forward pass of a rollout replica (launches, sampling, host sync)
    draft_overhead_ms: float = 0.2  # fixed cost of one drafter pass (one layer + LM head, CUDA-graphed)
    allreduce_latency_us: float = 10.0  # latency of one TP all-reduce (two per layer in a TP forward)

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise ValueError(f"cluster.preset must be one of {sorted(PRESETS)}, got {self.preset!r}")
        check_int("cluster.nodes", self.nodes, 1)
        check_int("cluster.gpus_per_node", self.gpus_per_node, 1)
        base = PRESETS[self.preset]
        for name in ("memory_gib", "peak_tflops", "hbm_tbps", "intra_node_gbps", "inter_node_gbps", "pcie_gbps"):
            value = getattr(self, name)
            check_float(f"cluster.{name}", value, 0.0)
            if value == 0.0:
                object.__setattr__(self, name, float(getattr(base, name)))
        check_float("cluster.flops_efficiency", self.flops_efficiency, 0.0, 1.0, lo_open=True)
        check_float("cluster.hbm_efficiency", self.hbm_efficiency, 0.0, 1.0, lo_open=True)
        check_float("cluster.forward_overhead_ms", self.forward_overhead_ms, 0.0)
        check_float("cluster.draft_overhead_ms", self.draft_overhead_ms, 0.0)
        check_float("cluster.allreduce_latency_us", self.allreduce_latency_us, 0.0)

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def flops(self) -> float:
        """Achieved FLOP/s of one GPU."""
        return self.peak_tflops * 1e12 * self.flops_efficiency

    @property
    def hbm(self) -> float:
        """Achieved HBM bytes/s of one GPU."""
        return self.hbm_tbps * 1e12 * self.hbm_efficiency

    def link_bytes_per_s(self, group_size: int) -> float:
        """Per-GPU bandwidth of a collective over ``group_size`` consecutive ranks."""
        inside = group_size <= self.gpus_per_node
        return (self.intra_node_gbps if inside else self.inter_node_gbps) * 1e9
