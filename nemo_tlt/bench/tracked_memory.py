"""Tracked tensor memory of a CPU process per phase: the bytes of live tensor storages at the
phase's start plus the peak of what the phase allocates and frees, from the allocator's own
events. What ``nemo-tlt bench memory`` compares with the plan.

Contract: ``PhaseMemory.phase(name)`` is a context manager. At its start, after a
``gc.collect()``, ``live_tensor_bytes()`` sums the storages of every tensor the garbage
collector can reach, each storage once (a view counts its whole storage; a storage released in
place, ``resize_(0)``, counts 0). During the phase the torch profiler records every allocation
and free of the CPU allocator with its size (``profile_memory=True``); the running sum of those
events, in time order, is the phase's change. ``peaks[name]`` = start bytes + the largest
running sum; ``parts[name]`` keeps the start bytes, that peak change and the change at the end.

Counted: tensor storages (parameters, gradient and optimizer buffers, KV caches, logits,
autograd's saved activations, the temporaries of every op) allocated by PyTorch's CPU allocator
on the thread that runs the phase and on threads that start inside it. Not counted: host-side
Python objects, memory of other libraries, allocator and ``malloc`` fragmentation and cached
free blocks, pages of forked processes (a checkpoint writer), allocations on threads started
before the phase; a storage allocated before the profiler first ran and freed during a phase
is not seen freed (the profiler does not know its size), which can only raise the figure.
"""
from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Iterator

import torch


def live_tensor_bytes() -> int:
    """Bytes of the distinct CPU storages of the tensors the garbage collector reaches."""
    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor) and obj.device.type == "cpu" and not obj.is_meta:
            try:
                storage = obj.untyped_storage()
            except (RuntimeError, NotImplementedError):  # tensors without storage (sparse, wrappers)
                continue
            if storage.nbytes():
                seen[storage.data_ptr()] = max(seen.get(storage.data_ptr(), 0), storage.nbytes())
    return sum(seen.values())


def peak_change(events: list[tuple[int, int]]) -> tuple[int, int]:
    """(largest running sum, final sum) of ``(time, signed bytes)`` allocator events in time order."""
    running = peak = 0
    for _, nbytes in sorted(events, key=lambda e: e[0]):  # stable: ties keep their recorded order
        running += nbytes
        peak = max(peak, running)
    return peak, running


def _allocator_events(prof: torch.profiler.profile) -> list[tuple[int, int]]:
    return [(e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
            if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU]


class PhaseMemory:
    """Per-phase peaks of tracked tensor memory (see the module docstring)."""

    def __init__(self) -> None:
        self.peaks: dict[str, int] = {}
        self.parts: dict[str, dict[str, int]] = {}

    @contextmanager
    def phase(self, name: str, measure: bool = True) -> Iterator[None]:
        """Run the body as phase ``name``; ``measure=False`` runs it untracked (a warm-up)."""
        if not measure:
            yield
            return
        gc.collect()
        start = live_tensor_bytes()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
            yield
        peak, end = peak_change(_allocator_events(prof))
        self.peaks[name] = start + peak
        self.parts[name] = {"start_bytes": start, "peak_change_bytes": peak, "end_change_bytes": end}
