"""Memory a device could give a new tensor now: what ``rollout.kv_cache_fraction`` takes a
fraction of.

Contract: ``free_bytes(device)`` -> bytes, read at the call (nothing is allocated).

* CUDA: the bytes the driver reports free on that device (``torch.cuda.mem_get_info``: what
  other processes and this one's CUDA context hold is not free) plus the bytes PyTorch's caching
  allocator has reserved there but not allocated (``memory_reserved - memory_allocated``), which
  a new tensor reuses before asking the driver. Fragmentation of that cache is not modelled.
* CPU: the host's available memory (``psutil.virtual_memory().available``: the kernel's
  ``MemAvailable`` on Linux, free memory plus the caches it can drop).
* Any other device type is a ValueError naming it (`check_device`).
"""
from __future__ import annotations

import psutil
import torch

DEVICE_TYPES = ("cuda", "cpu")


def check_device(device: torch.device | str, key: str) -> None:
    """A ValueError naming ``key`` unless free memory can be read on ``device``."""
    kind = torch.device(device).type
    if kind not in DEVICE_TYPES:
        raise ValueError(f"{key}: free memory is read on {' or '.join(DEVICE_TYPES)} devices, not on {kind!r}")


def free_bytes(device: torch.device | str) -> int:
    """Bytes a new allocation could take on ``device`` now (see the module docstring)."""
    device = torch.device(device)
    check_device(device, "free_bytes")
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        driver_free, _ = torch.cuda.mem_get_info(index)
        cached = torch.cuda.memory_reserved(index) - torch.cuda.memory_allocated(index)
        return int(driver_free) + int(cached)
    return int(psutil.virtual_memory().available)
